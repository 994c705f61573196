"""Explicit pipeline layouts: ``pipeline_layout`` as Megatron-Core's
``pipeline_model_parallel_layout`` string (docs/validation.md, "Explicit
pipeline layouts (Megatron-Core pipeline_model_parallel_layout), counted"):
blocks per stage counted by hand, the typed layer's one-line errors, the
model's grouping of many layouts in one table, the launch formats' round
trip, and the grammar against Megatron-Core's own parser where the mirror is
at hand."""
from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from autopar.io.errors import SpecError
from autopar.io.launch import get
from autopar.io.layouts import (CHOICES, explicit_layout, layout_code, layout_problem,
                                parse_layout, to_columns)
from autopar.io.specs import load_execution, load_model, load_system
from autopar.model import evaluate_one
from autopar.model.evaluate import evaluate_columns, reason_text
from autopar.model.moe import stage_counts
from autopar.model.pipeline import chunk_spans, chunk_split, stage_split

ROOT = Path(__file__).resolve().parents[1]
LLAMA70 = load_model(ROOT / "models" / "llama3-70B.json")
QWEN_NEXT = load_model(ROOT / "models" / "qwen3-next-80B-A3B.json")
MEGATRON = Path("/work/.mirror/NVIDIA+Megatron-LM/repo")

# Megatron-Bridge's Llama 3 70B H100 fp8 recipe (bridge_dense.csv): pp 8 x vp 5
LLAMA_LAYOUT = "Et*2|(t*2|)*34,t*3|(t*2|)*3,tL"
# Megatron-Bridge's Qwen3-Next GB200 / GB300 recipes (bridge_moe.csv): pp 2 x vp 4
QWEN_LAYOUT = "Et*4|(t*7|)*5t*8|tmL"

EX = {"num_procs": 64, "tensor_par": 4, "pipeline_par": 8, "data_par": 2,
      "tensor_par_net": 0, "pipeline_par_net": 1, "data_par_net": 1,
      "batch_size": 64, "microbatch_size": 1, "datatype": "bfloat16",
      "fused_activation": True, "attention_type": "multihead",
      "activation_recompute": "full", "pipeline_interleaving": 5,
      "optimizer_sharding": True, "tensor_par_comm_type": "rs_ag",
      "tensor_par_overlap": "none", "seq_par_ag_redo": False, "data_par_overlap": True,
      "weight_offload": False, "activations_offload": False, "optimizer_offload": False,
      "training": True, "attention_impl": "flash_v2", "fused_norm": True,
      "unsharded_grads": True, "fp32_grads": True}


def test_llama_layout_blocks_per_stage_by_hand():
    # "Ett|" + 34 x "tt|" + "ttt|" + 3 x "tt|" + "tL": 40 virtual stages,
    # 2 + 68 + 3 + 6 + 1 = 80 layers; virtual stage 35 (3 layers) is chunk 4
    # of rank 35 % 8 = 3, virtual stage 39 (1 layer) chunk 4 of rank 7
    stages = parse_layout(LLAMA_LAYOUT)
    assert len(stages) == 40 and stages[0] == "Ett" and stages[35] == "ttt"
    assert stages[-1] == "tL" and sum(s.count("t") for s in stages) == 80
    code = layout_code(LLAMA_LAYOUT)
    assert code >= 2 and CHOICES["pipeline_layout"][code] == LLAMA_LAYOUT
    assert explicit_layout(code) == stages
    chunks = chunk_split(80, 8, 5, 0, 0, False, False, code)
    assert chunks[3] == [2, 2, 2, 2, 3] and chunks[7] == [2, 2, 2, 2, 1]
    assert all(chunks[s] == [2] * 5 for s in (0, 1, 2, 4, 5, 6))
    assert stage_split(80, 8, 5, 0, 0, False, False, code) == [10, 10, 10, 11, 10, 10, 10, 9]
    # rank 3's last chunk: blocks 70..72 (35 virtual stages of 2 before it)
    assert chunk_spans(chunks)[3][-1] == (70, 73)


def test_hybrid_layout_counts_decoder_layers_of_two_pattern_blocks():
    # Qwen3-Next: 48 decoder layers (t), each a mixer and its MoE in the
    # pattern's 96 blocks.  Virtual stages hold 4, 7, 7, 7, 7, 7, 8, 1 layers;
    # rank 0 holds virtual stages 0, 2, 4, 6 (4 + 7 + 7 + 8 = 26 layers, 52
    # blocks), rank 1 stages 1, 3, 5, 7 (7 + 7 + 7 + 1 = 22 layers, 44 blocks).
    code = layout_code(QWEN_LAYOUT)
    chunks = chunk_split(96, 2, 4, 0, 0, False, False, code)
    assert chunks == [[8, 14, 14, 16], [14, 14, 14, 2]]
    spans = chunk_spans(chunks)
    assert spans[0] == [(0, 8), (22, 36), (50, 64), (78, 94)]
    assert spans[1] == [(8, 22), (36, 50), (64, 78), (94, 96)]
    # attention is every 4th layer (layers 3, 7, 11, ...): rank 0 holds
    # layers 3 | 11, 15 | 27, 31 | 39, 43 = 7, rank 1 holds 7 | 19, 23 | 35 | 47 = 5
    cols = {"pipeline_par": np.array([2]), "pipeline_interleaving": np.array([4]),
            "first_stage_blocks": np.zeros(1, int), "last_stage_blocks": np.zeros(1, int),
            "embedding_in_split": np.zeros(1, bool), "loss_in_split": np.zeros(1, bool),
            "pipeline_layout": np.array([code])}
    c = stage_counts(QWEN_NEXT, np.array([2]), cols)
    assert (c["first_attention"][0], c["first_gdn"][0], c["first_moe"][0]) == (7, 19, 26)
    assert (c["last_attention"][0], c["last_gdn"][0], c["last_moe"][0]) == (5, 17, 22)
    # the pair reading is the hybrid pattern's alone: on Llama 3 70B a layout
    # of 40 layers is refused by the typed layer
    with pytest.raises(SpecError) as err:
        load_execution({**EX, "pipeline_layout": "Et|(t|)*38tL"}, model=LLAMA70)
    assert err.value.field == "pipeline_layout" and "must match num_layers" in str(err.value)


@pytest.mark.parametrize("text,words", [
    ("Et*2|tX|tL", "invalid layer character 'X'"),
    ("(Et|t*2|tL", "invalid layer character '('"),
])
def test_malformed_layout_strings_are_one_line_errors(text, words):
    with pytest.raises(SpecError) as err:
        load_execution({**EX, "pipeline_layout": text}, model=LLAMA70, source="run.json")
    assert err.value.field == "pipeline_layout" and err.value.source == "run.json"
    assert words in str(err.value) and len(str(err.value).splitlines()) == 1


@pytest.mark.parametrize("change,words", [
    ({"pipeline_interleaving": 4}, "virtual_pipeline_model_parallel_size conflicts"),
    ({"pipeline_par": 3, "num_procs": 24}, "not divisible by pipeline_par 3"),
    ({"pipeline_layout": LLAMA_LAYOUT.replace("tL", "ttL")}, "must match num_layers"),
    ({"pipeline_layout": "tEt" + LLAMA_LAYOUT[4:]}, "the first layer must be embedding"),
    ({"pipeline_layout": LLAMA_LAYOUT.replace("tL", "tmL")}, "must match mtp_num_layers"),
    ({"embedding_in_split": True}, "other pipeline layout arguments"),
    ({"first_stage_blocks": 10}, "a layout fixes every stage"),
])
def test_layouts_megatron_refuses_name_the_field(change, words):
    with pytest.raises(SpecError) as err:
        load_execution({**EX, "pipeline_layout": LLAMA_LAYOUT, **change}, model=LLAMA70)
    assert err.value.field in ("pipeline_layout", "first_stage_blocks")
    assert words in str(err.value)


def test_cli_reports_a_malformed_layout_in_one_line(tmp_path):
    import json
    path = tmp_path / "run.json"
    path.write_text(json.dumps({**EX, "pipeline_layout": "Et*2|(t*2|)*34,t*3|tQ|tL"}))
    out = subprocess.run([sys.executable, "-m", "autopar.cli", "estimate",
                          str(ROOT / "models" / "llama3-70B.json"),
                          str(ROOT / "systems" / "h100_80g_nvl8.json"), str(path)],
                         capture_output=True, text=True, env={"PYTHONPATH": str(ROOT)})
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "pipeline_layout" in lines[0] and "'Q'" in lines[0]


def _system():
    return load_system(ROOT / "systems" / "h100_80g_nvl8.json")


def test_a_layout_equal_to_balanced_is_evaluated_alike():
    # balanced with the embedding and loss counted on 8 x 5: 82 layers over
    # 40 virtual stages, 3 in the first two, 2 after, the embedding in the
    # first and the loss in the last; written out as a layout string it is
    # the same split, so every figure of the model agrees
    sy = _system()
    bal = load_execution({**EX, "pipeline_layout": "balanced", "embedding_in_split": True,
                          "loss_in_split": True}, model=LLAMA70, system=sy)
    text = "Ett|ttt|" + "tt|" * 37 + "tL"
    assert stage_split(80, 8, 5, 0, 0, True, True, 1) == \
        stage_split(80, 8, 5, 0, 0, False, False, layout_code(text))
    exp = load_execution({**EX, "pipeline_layout": text}, model=LLAMA70, system=sy)
    a, b = evaluate_one(LLAMA70, sy, bal), evaluate_one(LLAMA70, sy, exp)
    assert a["feasible"] and b["feasible"]
    for k in a:
        assert a[k] == pytest.approx(b[k], rel=1e-12, abs=1e-12), k


def test_many_layouts_in_one_table_each_as_alone():
    sy = _system()
    other = "Et*3|(t*2|)*38,tL"
    rows = [dict(EX), {**EX, "pipeline_layout": LLAMA_LAYOUT},
            {**EX, "pipeline_layout": other},
            {**EX, "pipeline_layout": LLAMA_LAYOUT, "microbatch_size": 2},
            # 40 virtual stages on pp 4 x vp 5: refused by the rules
            {**EX, "pipeline_layout": LLAMA_LAYOUT, "pipeline_par": 4, "data_par": 4}]
    out = evaluate_columns(LLAMA70, sy, to_columns(rows))
    reasons = reason_text(out, sy)
    for i, r in enumerate(rows[:4]):
        one = evaluate_one(LLAMA70, sy, r)
        assert one["feasible"] and bool(out["feasible"][i])
        assert out["total_time"][i] == pytest.approx(one["total_time"], rel=1e-12)
    assert out["total_time"][1] != out["total_time"][0]
    # both layouts have a stage of 11 blocks (rank 3 / rank 0) pacing the
    # pipeline: the same time; the second's is the first stage, which holds
    # the most micro-batches in flight: more memory
    assert out["total_time"][1] == pytest.approx(out["total_time"][2], rel=1e-12)
    mem = out["proc_mem_tier1_cap_req"]
    assert mem[2] > mem[1]
    assert not out["feasible"][4]
    assert reasons[4] == ("invalid: an explicit pipeline_layout's virtual stages must number "
                          "pipeline_par x pipeline_interleaving")


@pytest.mark.parametrize("fmt", ["megatron", "bridge"])
def test_launch_formats_write_and_read_the_layout(fmt):
    F = get(fmt)
    ex = load_execution({**EX, "pipeline_layout": LLAMA_LAYOUT}, model=LLAMA70)
    assert F.refuse_layout(LLAMA70, ex) is None, F.refuse_layout(LLAMA70, ex)
    text = F.write(LLAMA70, ex)
    key = "--pipeline-model-parallel-layout" if fmt == "megatron" else \
        "model.pipeline_model_parallel_layout="
    assert key in text and LLAMA_LAYOUT in text
    # (Megatron-LM's arguments.py takes at most one of the layout and the
    # virtual-stage arguments; the virtual size is the layout's)
    assert "--num-virtual-stages-per-pipeline-rank" not in text
    assert "virtual_pipeline_model_parallel_size=5" not in text
    back = F.read(text, f"run.{fmt}").execution
    assert back["pipeline_layout"] == LLAMA_LAYOUT
    assert (back["pipeline_par"], back["pipeline_interleaving"]) == (8, 5)
    assert not back.get("embedding_in_split") and not back.get("loss_in_split")


def test_the_reader_refuses_a_layout_megatron_refuses():
    F = get("bridge")
    ex = load_execution({**EX, "pipeline_layout": LLAMA_LAYOUT}, model=LLAMA70)
    text = F.write(LLAMA70, ex)
    with pytest.raises(SpecError) as err:
        F.read(text.replace(LLAMA_LAYOUT, "Et*2|(t*2|)*34,t*3|(t*2|)*3,Lt"), "run.bridge")
    assert err.value.field == "model.pipeline_model_parallel_layout"
    assert "the last layer must be loss" in str(err.value)


def test_torchtitan_and_deepspeed_refuse_it():
    ex = load_execution({**EX, "pipeline_layout": LLAMA_LAYOUT}, model=LLAMA70)
    for fmt in ("torchtitan", "deepspeed"):
        why = get(fmt).refuse_layout(LLAMA70, ex)
        assert why and why.startswith(f"{fmt}: "), (fmt, why)


def _megatron_layout_class():
    """Megatron-Core's PipelineParallelLayerLayout at the commit Bridge pins,
    read from the mirror, with its imports of torch-bound modules stubbed
    (parse and validation are pure Python)."""
    if not MEGATRON.is_dir():
        pytest.skip("no Megatron-LM mirror at /work/.mirror")
    try:
        src = subprocess.run(
            ["git", f"--git-dir={MEGATRON}", "show",
             "2a75ac1:megatron/core/transformer/pipeline_parallel_layer_layout.py"],
            capture_output=True, text=True, check=True).stdout
    except (subprocess.CalledProcessError, FileNotFoundError) as err:
        pytest.skip(f"mirror unreadable: {err}")
    import enum
    stubs = {}
    for name in ("megatron", "megatron.core", "megatron.core._rank_utils",
                 "megatron.core.transformer", "megatron.core.transformer.enums"):
        stubs[name] = types.ModuleType(name)
    stubs["megatron.core"].parallel_state = types.ModuleType("parallel_state")
    stubs["megatron.core._rank_utils"].safe_get_rank = lambda: 0
    stubs["megatron.core.transformer.enums"].LayerType = enum.Enum(
        "LayerType", "encoder decoder embedding loss mtp")
    saved = {k: sys.modules.get(k) for k in stubs}
    sys.modules.update(stubs)
    try:
        ns: dict = {"__name__": "megatron_layout_under_test"}
        exec(compile(src, "pipeline_parallel_layer_layout.py", "exec"), ns)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return ns["PipelineParallelLayerLayout"]


@pytest.mark.parametrize("text,pp,layers,mtp", [
    (LLAMA_LAYOUT, 8, 80, None), (QWEN_LAYOUT, 2, 48, 1), ("Et|(tt|)*30mL", 8, 61, 1),
    ("Et|t||tttt|tttt||ttt|L", 4, 13, None),         # empty virtual stages
    ("Et*2|tX|tL", 3, 4, None), ("Et|tt|L", 2, 3, None), ("Et|tt|tL", 3, 3, None),
    ("tE|tt|tL", 3, 4, None), ("Et|tmt|tL", 3, 4, 1), ("Et|tm|tmL", 3, 3, 2),
    ("ELt|tt", 2, 3, None), ("Et|tt|tL", 3, 4, 1),
])
def test_grammar_and_checks_agree_with_megatron_core(text, pp, layers, mtp):
    Layout = _megatron_layout_class()
    try:
        lay = Layout(text, pp)
        lay.validate_layer_layout(layers, mtp)
        megatron_ok = True
        megatron_t = [[s.count(lay.flatten_layout[0].__class__["decoder"]) for s in row]
                      for row in lay.layout]
    except (AssertionError, ValueError, KeyError):
        megatron_ok = False
    try:
        stages = parse_layout(text)
        why = layout_problem(stages, pp, len(stages) // pp, layers, mtp)
    except ValueError as e:
        why = str(e)
    assert (why is None) == megatron_ok, (text, why)
    if megatron_ok:
        # the same decoder layers on each rank's chunks
        ours = chunk_split(layers, pp, len(stages) // pp, 0, 0, False, False, layout_code(text))
        assert ours == megatron_t


NEMOTRON_H = load_model(ROOT / "models" / "nemotron-h-8B.json")


@pytest.mark.parametrize("fmt", ["megatron", "bridge"])
def test_a_hybrid_models_layout_is_written_as_pattern_segments(fmt):
    # Nemotron-H 8B (52 blocks): Megatron-Core's hybrid model takes the split
    # as '|' segments of the pattern (arguments.py refuses the layout string
    # beside --hybrid-layer-pattern): 20, 10, 12, 10 blocks, read back as the
    # same layout
    F = get(fmt)
    layout = "Et*20|t*10|t*12|t*10L"
    run = {**EX, "num_procs": 8, "tensor_par": 1, "pipeline_par": 2, "data_par": 4,
           "pipeline_interleaving": 2, "activation_recompute": "none"}
    ex = load_execution({**run, "pipeline_layout": layout}, model=NEMOTRON_H)
    assert F.refuse_layout(NEMOTRON_H, ex) is None, F.refuse_layout(NEMOTRON_H, ex)
    text = F.write(NEMOTRON_H, ex)
    pat = NEMOTRON_H.hybrid_pattern
    segs = "|".join((pat[:20], pat[20:30], pat[30:42], pat[42:]))
    assert segs in text and "layout" not in text.replace("hybrid_layer_pattern", "")
    back = F.read(text, f"run.{fmt}").execution
    assert (back["pipeline_layout"], back["pipeline_interleaving"]) == \
        ("Et*20|t*10|t*12|t*10L", 2)
    assert chunk_split(52, 2, 2, 0, 0, False, False, layout_code(layout)) == \
        [[20, 12], [10, 10]]
    # its pattern is not mixer + MLP pairs ("M*-" puts attention at an odd
    # position): a t is one block, 26 of them are refused
    with pytest.raises(SpecError) as err:
        load_execution({**run, "pipeline_layout": "Et*10|t*5|t*6|t*5L"}, model=NEMOTRON_H)
    assert "holds 26 decoder layers t, the model has 52" in str(err.value)


def test_a_space_searches_an_explicit_layout_on_its_pipeline_sizes():
    """A space may list layout strings among pipeline_layout's values: they
    are proposed only on the pipeline sizes they were written for (four
    virtual stages, 40 blocks), with the embedding / loss / stage fields
    pinned, and come back by name."""
    import json

    import yaml
    from autopar.search.exhaustive import exhaustive
    shape = json.loads((ROOT / "models" / "llama2-13B.json").read_text())
    assert shape["num_blocks"] == 40
    layout = "Et*9|t*10|t*11|t*10L"
    space = yaml.safe_load((ROOT / "search_spaces" / "small.yaml").read_text())
    space["name"] = "small-explicit"
    space["params"]["pipeline_layout"] = ["even", layout]
    table, found = exhaustive(shape, ROOT / "systems" / "a100_80g.json", 8, 32, "bfloat16",
                              space=space, keep_all=True, progress=False)
    explicit = table[table.pipeline_layout == layout]
    assert len(explicit) > 0
    # its four virtual stages: pp 4, or pp 2 x vp 2 (Megatron takes both)
    assert set(zip(explicit.pipeline_par, explicit.pipeline_interleaving)) == {(4, 1), (2, 2)}
    assert not explicit.embedding_in_split.any() and not explicit.loss_in_split.any()
    assert set(table.pipeline_layout) == {"even", layout}


def test_a_fresh_process_restores_the_layout_codes():
    """A search's worker (spawned, or a Ray task) registers the caller's
    layouts in the caller's order (autopar.search.runner._task), so codes
    agree; a process that registered others first refuses."""
    code = (
        "from autopar.io.layouts import CHOICES, layout_code, restore_layouts\n"
        f"restore_layouts([{LLAMA_LAYOUT!r}, {QWEN_LAYOUT!r}])\n"
        f"assert layout_code({QWEN_LAYOUT!r}) == 3 and layout_code({LLAMA_LAYOUT!r}) == 2\n"
        "try:\n"
        f"    restore_layouts([{QWEN_LAYOUT!r}])\n"
        "except RuntimeError:\n"
        "    print('refused')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "refused"
