"""``activation_offload_blocks`` in the launch formats: Megatron-LM's
``--cpu-offloading-num-layers N`` (NVIDIA/Megatron-LM@d98e8a6 arguments.py:
generated from TransformerConfig, ``cpu_offloading`` itself excluded and set
by validate_args from N > 0), Megatron-Bridge's ``model.cpu_offloading`` /
``model.cpu_offloading_num_layers``; torchtitan and DeepSpeed refuse it with
their reason."""
from __future__ import annotations

from pathlib import Path

import pytest

from autopar.io.errors import SpecError
from autopar.io.launch import get
from autopar.io.launch.mcore import NOT_SETTINGS
from autopar.io.specs import load_execution, load_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def llama():
    return load_model(ROOT / "models" / "llama2-7B.json")      # 32 blocks


def _layout(**kw):
    """Llama 2 7B on 8 GPUs, one stage, no recompute, 12 blocks offloaded."""
    ex = {"num_procs": 8, "tensor_par": 2, "pipeline_par": 1, "data_par": 4,
          "tensor_par_net": 0, "pipeline_par_net": 0, "data_par_net": 1, "batch_size": 32,
          "microbatch_size": 1, "datatype": "bfloat16", "fused_activation": True,
          "attention_type": "multihead", "activation_recompute": "none",
          "pipeline_interleaving": 1, "optimizer_sharding": True,
          "tensor_par_comm_type": "rs_ag", "tensor_par_overlap": "none",
          "seq_par_ag_redo": False, "data_par_overlap": True, "weight_offload": False,
          "activations_offload": False, "optimizer_offload": False, "training": True,
          "attention_impl": "flash_v2", "fused_norm": True, "unsharded_grads": True,
          "fp32_grads": True, "activation_offload_blocks": 12}
    ex.update(kw)
    return ex


@pytest.mark.parametrize("fmt", ["megatron", "bridge"])
def test_export_import_round_trip(llama, fmt):
    lf = get(fmt)
    ex = _layout()
    text = lf.write(llama, ex)
    if fmt == "megatron":
        assert "--cpu-offloading-num-layers 12" in text
        assert "--cpu-offloading " not in text and "--cpu-offloading\n" not in text
    else:
        assert "model.cpu_offloading=true" in text
        assert "model.cpu_offloading_num_layers=12" in text
        assert "model.cpu_offloading_weights=false" in text
    back = lf.read(text, f"test.{fmt}").execution
    assert back["activation_offload_blocks"] == 12
    for f in ("tensor_par", "pipeline_par", "data_par", "batch_size", "microbatch_size",
              "activation_recompute"):
        assert back[f] == ex[f], f
    # and the layout read back (with the network tiers, not a framework
    # setting) is one autopar takes
    nets = {f: ex[f] for f in NOT_SETTINGS if f in ex}
    assert load_execution({**nets, **back}, model=llama)["activation_offload_blocks"] == 12


@pytest.mark.parametrize("fmt", ["megatron", "bridge"])
def test_no_offload_reads_back_as_none(llama, fmt):
    lf = get(fmt)
    text = lf.write(llama, _layout(activation_offload_blocks=0))
    assert "cpu_offloading_num_layers" not in text and "cpu-offloading" not in text
    assert lf.read(text, "t").execution.get("activation_offload_blocks", 0) == 0


def test_bridge_reads_offloading_off_or_weights_only_as_none():
    lf = get("bridge")
    base = ("model.tensor_model_parallel_size=1\nmodel.pipeline_model_parallel_size=1\n"
            "model.cpu_offloading_num_layers=5\n")
    assert lf.read(base + "model.cpu_offloading=false\n", "t").execution[
        "activation_offload_blocks"] == 0
    assert lf.read(base + "model.cpu_offloading=true\n", "t").execution[
        "activation_offload_blocks"] == 5
    # TE 2.x: offloading weights is a deprecated no-op; activations off: nothing offloaded
    assert lf.read(base + "model.cpu_offloading=true\nmodel.cpu_offloading_activations=false\n",
                   "t").execution["activation_offload_blocks"] == 0
    # not stated: the recipe's (left out)
    assert "activation_offload_blocks" not in lf.read(base, "t").execution


@pytest.mark.parametrize("fmt", ["megatron", "bridge"])
@pytest.mark.parametrize("change, needle", [
    ({"pipeline_par": 2, "data_par": 2}, "pipeline parallelism"),
    ({"activation_recompute": "full"}, "activation recompute"),
    ({"activation_offload_blocks": 32}, "below num_layers (32)"),
])
def test_megatron_refuses_what_transformer_config_refuses(llama, fmt, change, needle):
    lf = get(fmt)
    why = lf.refuse_layout(llama, _layout(**change))
    assert why and why.startswith(f"{fmt}: activation_offload_blocks=") and needle in why, why
    with pytest.raises(SpecError):
        lf.write(llama, _layout(**change))


def test_a_bad_number_of_layers_is_one_error_naming_the_argument():
    with pytest.raises(SpecError) as e:
        get("megatron").read("pretrain_gpt.py --cpu-offloading-num-layers x", "run.sh")
    assert e.value.field == "--cpu-offloading-num-layers"


@pytest.mark.parametrize("fmt, needle", [("torchtitan", "enable_cpu_offload"),
                                         ("deepspeed", "cpu_checkpointing")])
def test_torchtitan_and_deepspeed_refuse_with_their_reason(llama, fmt, needle):
    lf = get(fmt)
    why = lf.refuse_layout(llama, _layout(weight_sharding=False, unsharded_grads=False))
    assert why and "activation_offload_blocks=12" in why and needle in why, why
