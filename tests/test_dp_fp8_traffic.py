"""The data-parallel traffic of an fp8 layout counted by hand (issue 24):
the gradients move one element a parameter at the gradient datatype, the
parameter all-gather one a parameter at bf16 -- or, where the quantized
weight is the only copy (``memory_overhead.fp8_primary_weights``,
Megatron-Core's fp8_param_gather), at the bytes Megatron-Core's buffer
holds for it -- and neither moves Transformer Engine's cached quantized
copies (docs/validation.md, "Data-parallel traffic under fp8 recipes,
counted")."""
from __future__ import annotations

import numpy as np
import pytest

from autopar.model import evaluate_one
from autopar.model.hardware import NetworkTier
from autopar.studies import published_base as P

# Llama 2 7B (models/llama2-7B.json): a block's linear weights (q, k, v, o
# with 32 of 32 KV heads; SwiGLU's gate, up and down) and its two RMSNorm
# weights; the linear weights alone run in fp8.
H, F, BLOCKS, DP = 4096, 11008, 32, 8
LINEAR = 4 * H * H + 3 * H * F
NORMS = 2 * H


def _run(recipe: str, primary: bool, fp32_grads: bool = False):
    # megatron-bridge.json is megatron-core-te-ce.json with the fp8 weight
    # kept as the only copy (tests/test_bridge_memory.py)
    sy = P.system("b200_nvl8", "megatron-bridge" if primary else "megatron-core-te-ce")
    ex = P.megatron_execution(sy, n=DP, tp=1, pp=1, dp=DP, gbs=8 * DP, mbs=1, fp8=recipe,
                              fp32_grads=fp32_grads)
    assert ex["optimizer_sharding"] and ex["param_gather_overlap"]
    s = evaluate_one(P.model("llama2-7B"), sy, ex)
    assert s["feasible"]
    return sy, ex, s


def _gather_link(sy, ex, nbytes):
    """Megatron's overlapped parameter all-gather of a step: one gather of
    every block over the data-parallel ranks (communication.weight_gathers)."""
    net = NetworkTier(sy.networks, np.array([ex["data_par_net"]]))
    return BLOCKS * float(net.time("all_gather", float(nbytes), DP)[0])


@pytest.mark.parametrize("recipe, primary, gathered", [
    ("none", False, 2 * LINEAR + 2 * NORMS),
    ("tensorwise", False, 2 * LINEAR + 2 * NORMS),
    ("mxfp8", False, 2 * LINEAR + 2 * NORMS),
    # fp8_param_gather: a Float8Tensor weight is one uint8 element a
    # parameter in the buffer; an MXFP8 one is gathered through the bf16
    # view of the gradient buffer and re-quantized (param_and_grad_buffer.py)
    ("tensorwise", True, 1 * LINEAR + 2 * NORMS),
    ("mxfp8", True, 2 * LINEAR + 2 * NORMS),
])
def test_dp_bytes_of_an_fp8_block_by_hand(recipe, primary, gathered):
    sy, ex, s = _run(recipe, primary)
    # the gradient reduce-scatter: bf16 gradients of the parameters only
    # (TE's cached copies -- tensorwise one fp8 byte a weight, mxfp8 two --
    # would add LINEAR or 2 x LINEAR bytes)
    assert s["block_dp_size"] == 2 * LINEAR + 2 * NORMS
    assert s["weight_gather_link_time"] == pytest.approx(_gather_link(sy, ex, gathered),
                                                         rel=1e-12)
    if recipe != "none":
        # the copies are still held in memory (the weight space counts them)
        copies = {"tensorwise": 1, "mxfp8": 2}[recipe] * LINEAR
        held = s["block_weight_space"]
        expected = (2 * LINEAR + 2 * NORMS + copies) - (2 * LINEAR if primary else 0)
        assert held == pytest.approx(expected, rel=1e-12)


def test_fp32_gradients_double_the_reduce_scatter_not_the_gather():
    """grad_reduce_in_fp32: the gradient buffer is fp32 (4 bytes a
    parameter), the parameter buffer stays bf16 (param_and_grad_buffer.py
    ``grad_dtype`` / ``param_dtype``)."""
    sy, ex, s16 = _run("tensorwise", False)
    _, _, s32 = _run("tensorwise", False, fp32_grads=True)
    assert s32["weight_gather_link_time"] == s16["weight_gather_link_time"]
    net = NetworkTier(sy.networks, np.array([ex["data_par_net"]]))
    rs = lambda b: BLOCKS * float(net.time("reduce_scatter", float(b), DP)[0])  # noqa: E731
    grads = 2 * LINEAR + 2 * NORMS
    assert s32["dp_comm_link_time"] == pytest.approx(rs(2 * grads), rel=1e-12)
    assert s16["dp_comm_link_time"] == pytest.approx(rs(grads), rel=1e-12)
