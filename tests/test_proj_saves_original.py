"""The attention output projection's saved input under fp8 / fp4
(``memory_overhead.proj_saves_original``): Megatron-Core's
``set_save_original_input(linear_proj)`` (NVIDIA/Megatron-LM@2a75ac1
megatron/core/transformer/attention.py) makes TE's Linear keep the
unquantized attention output, which the attention core saves anyway, not a
1-byte cast of it (docs/validation.md, "Llama 3.1 405B recipes: memory term
by term against Megatron's own accounting")."""
from __future__ import annotations

import dataclasses

import pytest

import autopar
from autopar.io.errors import SpecError
from autopar.io.frameworks import load_framework, with_framework
from autopar.io.specs import load_model, load_system
from test_te_memory import LAYOUT as TE_LAYOUT

BRIDGE = load_framework("megatron-bridge")
B200 = load_system("systems/b200_nvl8.json")
SEQ, TP = 4096, 2
# (TE's one-stage layout: tensor_par 2, the distributed optimizer over 4)
LAYOUT = TE_LAYOUT


def _storage(on: bool, **kw) -> float:
    model = dataclasses.replace(load_model("models/llama3-8B.json"), num_blocks=4,
                                seq_size=SEQ)
    system = with_framework(B200, BRIDGE)
    system = dataclasses.replace(system, memory_overhead=dataclasses.replace(
        system.memory_overhead, proj_saves_original=on))
    row = autopar.evaluate(model, system, [{**LAYOUT, **kw}]).iloc[0]
    return float(row["block_act_storage_space"])


@pytest.mark.parametrize("recipe, saved", [("tensorwise", 1.0), ("mxfp8", 1.0),
                                           ("nvfp4", 0.5 + 1 / 16)])
def test_hand_count_the_projection_input(recipe, saved):
    # Llama 3 8B: 32 heads x 128 = 4096 columns into the output projection;
    # a micro-batch of 4096 tokens on tensor_par 2: 4096 x 4096 / 2 elements
    # whose saved copy is 2 bytes (bf16) with the field, `saved` without it
    elements = SEQ * 32 * 128 / TP
    gain = _storage(True, fp8_recipe=recipe) - _storage(False, fp8_recipe=recipe)
    assert gain == pytest.approx(elements * (2.0 - saved), rel=1e-12)


def test_no_recipe_no_change():
    # bf16: the projection saves the bf16 output either way
    assert _storage(True) == _storage(False)
    assert _storage(True, fp8_recipe="none") == _storage(False, fp8_recipe="none")


def test_bridge_turns_it_on_and_bad_input_is_one_line():
    assert BRIDGE.memory_overhead.proj_saves_original
    assert not load_framework("megatron-core-te-ce").memory_overhead.proj_saves_original
    from autopar.io.specs import load_system as load
    bad = {**__import__("json").loads(open("systems/b200_nvl8.json").read())}
    bad["memory_overhead"] = {"proj_saves_original": "yes"}
    with pytest.raises(SpecError, match="proj_saves_original"):
        load(bad)


def test_hand_count_mla_projection_input():
    # DeepSeek-V2's multi-latent attention: MultiLatentAttention sets
    # save_original_input on its linear_proj as Attention does; its input
    # is heads x v_head_dim wide (128 x 128), a block's delta the same
    # per-element count as the dense block's
    model = dataclasses.replace(load_model("models/deepseek-v2.json"), seq_size=SEQ,
                                num_blocks=2)
    mla = model.mla
    system = with_framework(B200, BRIDGE)
    # (room for the whole model: only the per-block count is read)
    system = dataclasses.replace(system, mem1=dataclasses.replace(system.mem1, GiB=1e5))

    def storage(on):
        sy = dataclasses.replace(system, memory_overhead=dataclasses.replace(
            system.memory_overhead, proj_saves_original=on))
        row = autopar.evaluate(model, sy, [{**LAYOUT, "fp8_recipe": "tensorwise"}]).iloc[0]
        return float(row["block_act_storage_space"])

    elements = SEQ * model.attn_heads * mla.v_head_dim / TP
    assert storage(True) - storage(False) == pytest.approx(elements * 1.0, rel=1e-9)
