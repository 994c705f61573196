"""CUDA graphs and Transformer Engine's userbuffers: memory, counted
(docs/validation.md, "CUDA graphs and TE userbuffers: memory, counted").

Hand counts on a small model: the userbuffers' bytes (12 buffers of seq x
micro-batch / context_par x hidden, bf16 or, under an fp8 recipe, 8 of them
fp8), the static outputs TE's chained whole-layer graphs hold, the output
layer's op held beside the graphs' pool, and the recipe cells' mapping."""
from __future__ import annotations

import dataclasses

import pytest
from conftest import one_proc_execution

from autopar.io.errors import SpecError
from autopar.io.frameworks import load_framework, with_framework
from autopar.io.specs import load_execution, load_model, load_system
from autopar.model import evaluate_one
from autopar.studies.recipe_table import cuda_graph_mode

GIB = 1024 ** 3
BRIDGE = load_framework("megatron-bridge")


@pytest.fixture(scope="module")
def setup(repo_root):
    model = load_model(repo_root / "models/megatron-126M.json")
    system = with_framework(load_system(repo_root / "systems/b200_nvl8.json"), BRIDGE)
    return model, system


def need(model, system, **kw):
    ex = one_proc_execution(**{"datatype": "bfloat16", "num_procs": 2, "tensor_par": 2,
                               "batch_size": 2, "microbatch_size": 1,
                               "tensor_par_comm_type": "rs_ag", **kw})
    s = evaluate_one(model, system, load_execution(ex, system=system, model=model))
    assert s["feasible"], s
    return s["proc_mem_tier1_cap_req"]


def with_overhead(system, **kw):
    return dataclasses.replace(system, memory_overhead=dataclasses.replace(
        system.memory_overhead, **kw))


def test_userbuffers_hand_count(setup):
    model, system = setup
    plain = with_overhead(system, te_userbuffers=False)
    tokens_x_hidden = 2048 * 1 * 768             # seq x micro-batch / cp x hidden

    def ub(**kw):
        return need(model, system, tensor_par_overlap="ring", **kw) \
            - need(model, plain, tensor_par_overlap="ring", **kw)
    assert ub() == 12 * 2 * tokens_x_hidden                # 12 bf16 buffers: 36 MiB
    # fp8 mode: the 8 all-gather-side buffers one byte, the 4 others bf16
    assert ub(fp8_recipe="tensorwise") == (8 * 1 + 4 * 2) * tokens_x_hidden
    # ... and an unquantized set beside them where the first blocks stay bf16
    assert ub(fp8_recipe="tensorwise", bf16_first_blocks=1) == (16 + 24) * tokens_x_hidden
    # an fp4 recipe leaves Megatron's config.fp8 unset: bf16 buffers
    assert ub(fp8_recipe="nvfp4") == 24 * tokens_x_hidden
    # a Bridge overlap config's output-projection reduce-scatters: ring
    # exchange, (2 tp - 1) / tp of the shape each (tp 2: 3/2), bf16 ...
    ring = with_overhead(system, te_userbuffers_rs="ring_exchange")
    assert need(model, ring, tensor_par_overlap="ring") \
        - need(model, plain, tensor_par_overlap="ring") == (10 * 2 + 2 * 2 * 1.5) * tokens_x_hidden
    assert need(model, ring, tensor_par_overlap="ring", fp8_recipe="tensorwise") \
        - need(model, plain, tensor_par_overlap="ring", fp8_recipe="tensorwise") \
        == (8 * 1 + 2 * 2 + 2 * 2 * 1.5) * tokens_x_hidden
    # ... or Bridge's PipelineOverlapCfg: fp8 buffers in fp8 mode (its
    # fp8_buf default (False,) reads true), bf16 otherwise
    pipe8 = with_overhead(system, te_userbuffers_rs="pipeline_fp8")
    assert need(model, pipe8, tensor_par_overlap="ring", fp8_recipe="tensorwise") \
        - need(model, plain, tensor_par_overlap="ring", fp8_recipe="tensorwise") \
        == (8 * 1 + 2 * 2 + 2 * 1) * tokens_x_hidden
    assert need(model, pipe8, tensor_par_overlap="ring") \
        - need(model, plain, tensor_par_overlap="ring") == 24 * tokens_x_hidden
    # no overlap, or one tensor-parallel rank: none
    assert need(model, system) == need(model, plain)
    assert need(model, system, num_procs=1, tensor_par=1, tensor_par_comm_type="ar",
                tensor_par_overlap="none") == \
        need(model, plain, num_procs=1, tensor_par=1, tensor_par_comm_type="ar",
             tensor_par_overlap="none")


def test_cuda_graph_terms_hand_count(setup):
    model, system = setup
    base = need(model, system)
    assert need(model, with_overhead(system, cuda_graphs="full_iteration")) == base
    layers = need(model, with_overhead(system, cuda_graphs="layers"))
    te_layers = need(model, with_overhead(system, cuda_graphs="te_layers"))
    scoped = need(model, with_overhead(system, cuda_graphs="scoped"))
    # te_layers: a static output per block (12) per micro-batch in flight
    # (one stage: 1), the block input's sequence-parallel shard in bf16
    assert te_layers - layers == 12 * 1 * (2048 // 2) * 768 * 2
    # scoped: the attention's and the MLP's largest backward op both held
    assert scoped > base
    # layers: the output layer's op (its input gradient, tokens x hidden in
    # bf16, only where the model has a vocabulary) beside the blocks'
    assert layers >= base


def test_cuda_graph_output_layer_op_with_a_vocabulary(setup, repo_root):
    model, system = setup
    model = dataclasses.replace(model, vocab_size=51200)
    base = need(model, system)
    layers = need(model, with_overhead(system, cuda_graphs="layers"))
    # the output layer's op in backward (tokens x hidden, bf16) is smaller than
    # the blocks' largest, so the maximum took the blocks' and the sum adds it
    assert layers - base == 2048 * 768 * 2


def test_recipe_overlap_configs_map_to_the_reduce_scatter_buffers():
    from autopar.studies.recipe_table import userbuffers_rs
    key = "comm_overlap.tp_comm_overlap_cfg."
    assert userbuffers_rs({}) == "pipeline"
    assert userbuffers_rs({key + "proj_fprop": "PipelineOverlapCfg",
                           key + "fc2_fprop": "PipelineOverlapCfg"}) == "pipeline_fp8"
    assert userbuffers_rs({key + "proj_fprop": "RingExchangeOverlapCfg",
                           key + "fc2_fprop": "RingExchangeOverlapCfg"}) == "ring_exchange"
    assert userbuffers_rs({key + "fc2_fprop": "RingExchangeOverlapCfg"}) == "ring_exchange"


def test_recipe_cells_map_to_the_graph_modes():
    assert cuda_graph_mode("") == "none"
    assert cuda_graph_mode("local:full_iteration") == "full_iteration"
    assert cuda_graph_mode("full_iteration") == "full_iteration"
    assert cuda_graph_mode("local") == "layers"
    assert cuda_graph_mode("transformer_engine:") == "te_layers"
    assert cuda_graph_mode("transformer_engine:attn;moe_router;moe_preprocess") == "scoped"
    assert cuda_graph_mode("transformer_engine:mlp") == "scoped"
    assert cuda_graph_mode("transformer_engine:mamba;attn") == "scoped"
    assert cuda_graph_mode("transformer_engine:moe_router;moe_preprocess") == "none"
    assert cuda_graph_mode("transformer_engine:[CudaGraphScope[name] for name in "
                           "module_names]") == "none"


def test_a_bad_cuda_graphs_value_names_the_field():
    data = {"name": "x", "memory_overhead": {"cuda_graphs": "sometimes"}}
    with pytest.raises(SpecError) as e:
        load_framework(data)
    assert "memory_overhead.cuda_graphs" in str(e.value)
    with pytest.raises(SpecError) as e:
        load_framework({"name": "x", "memory_overhead": {"te_userbuffers": "yes"}})
    assert "memory_overhead.te_userbuffers" in str(e.value)


def test_the_recipe_tables_name_every_scope():
    """benchmarks/write_recipe_table.py evaluates Bridge's
    set_cuda_graph_modules / clear_cuda_graph_modules (a list built from the
    module names), so no cell is left as the comprehension's text: the
    Llama 3 70B nvfp4 recipe on 64 GB200 captures whole layers with TE (its
    comment: 'An empty module list captures the whole Transformer layer'),
    Nemotron 3 Nano its attention, Mamba, router and preprocessing."""
    from autopar.studies.recipe_table import CSVS, read
    rows = read(CSVS[0]).set_index("recipe")
    assert not rows.cuda_graph.str.contains(r"\[").any()
    assert rows.loc["llama3_70b_pretrain_64gpu_gb200_nvfp4_config", "cuda_graph"] == \
        "transformer_engine:"
    assert cuda_graph_mode(rows.loc["llama3_70b_pretrain_64gpu_gb200_nvfp4_config",
                                    "cuda_graph"]) == "te_layers"
    assert rows.loc["nemotron_3_nano_pretrain_8gpu_b200_bf16_config", "cuda_graph"] == \
        "transformer_engine:attn;mamba;moe_router;moe_preprocess"


def test_scoped_graphs_add_the_eager_part_s_op_to_the_pool_s(setup, repo_root):
    """``scoped``: the stage holds the largest op of the mixer part and of
    the rest, added; so the need rises by the smaller of the two (sum less
    maximum), which the block sums report.  On a hybrid model the mixer
    layers (Mamba, attention) and the MLP layers are apart blocks: the
    largest of each kind's part over the stage."""
    from autopar.io.layouts import to_columns
    from autopar.model.block import block
    from autopar.model.context import LayoutContext
    from autopar.model.speedups import distinct_codes
    model, system = setup
    scoped = with_overhead(system, cuda_graphs="scoped")
    ex = one_proc_execution(datatype="bfloat16", num_procs=2, tensor_par=2, batch_size=2,
                            microbatch_size=1, tensor_par_comm_type="rs_ag")
    full = load_execution(ex, system=scoped, model=model)
    cols = to_columns([full])
    sums = block(LayoutContext(model, scoped, cols, distinct_codes(cols["datatype"])), cols)
    mixer, rest = float(sums.op_grads_mixer[0]), float(sums.op_grads_rest[0])
    assert mixer > 0 and rest > 0
    assert float(sums.op_grads[0]) == max(mixer, rest)
    assert need(model, scoped) - need(model, system) == min(mixer, rest)
    hybrid = load_model(repo_root / "models/nemotron-h-8B.json")
    hybrid = dataclasses.replace(hybrid, seq_size=2048)
    assert need(hybrid, scoped) > need(hybrid, system)
