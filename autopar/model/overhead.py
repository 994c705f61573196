"""Host (CPU) time of an eager framework that the GPU can wait on.

An eager framework (PyTorch without CUDA graphs or ``torch.compile``)
issues every operation of a block from Python: its dispatcher picks the
kernel and the CUDA driver launches it, one at a time.  The GPU runs the
kernels asynchronously, so while each block pass gives the GPU more work
than the host needs to issue it, the host stays ahead and its time is hidden
(Calculon's assumption).  When a block pass's kernels are shorter than the
time the host needs to issue them -- small hidden sizes, small micro-batches,
short sequences -- the GPU idles between them and the pass runs at the host's
pace (NVIDIA, "Getting Started with CUDA Graphs", developer.nvidia.com/blog/
cuda-graphs: short kernels are bound by their launch overhead; PyTorch,
"Accelerating PyTorch with CUDA Graphs", pytorch.org/blog: CUDA graphs
exist to remove this per-kernel CPU cost).

``block_kernels`` counts the kernels one block pass issues, from the
block's ops (the layers of ``autopar.model.block``) as eager PyTorch runs
them; ``launch_time`` is the host time a batch exposes at
``time_overhead.launch_s`` seconds per kernel (0 by default: nothing
exposed, Calculon's meaning).
"""
from __future__ import annotations

import numpy as np

from autopar.io.layouts import CHOICES

_IMPL = CHOICES["attention_impl"]
_FLASH_V1 = _IMPL.index("flash_v1")
_FUSED_SOFTMAX = _IMPL.index("fused_softmax")
_FULL = CHOICES["activation_recompute"].index("full")
_RS_AG = CHOICES["tensor_par_comm_type"].index("rs_ag")

# Kernels of one op in eager PyTorch, forward and backward.
#   GEMM (a linear layer): one cuBLAS call forward (bias in the epilogue);
#     backward: the input gradient and the weight gradient, plus the bias
#     gradient's reduction where the layer has a bias (the GPT block).
#   Norm: one fused kernel (torch's layer_norm / a fused RMSNorm) forward,
#     two backward (input gradient; weight and bias reduction); unfused
#     (the statistics, the normalisation and the affine as separate
#     elementwise ops): four forward, four backward.
#   Element-wise op (GeLU, SiLU-and-multiply, dropout, rotary, residual add):
#     one kernel each way (a residual add's backward passes the gradient on:
#     the branch's gradients are summed by one add instead).
#   FlashAttention: one kernel forward; backward two (FlashAttention-2's
#     preprocessing of dO.O and its main kernel).  Unfused attention: the two
#     batched GEMMs (two kernels each backward), the softmax (with its scale
#     and mask: one fused kernel, or three ops unfused) and the GPT block's
#     dropout on the scores.
_NORM = {True: (1, 2), False: (4, 4)}


def block_kernels(model, cols) -> tuple[np.ndarray, np.ndarray]:
    """Kernels one block pass issues per micro-batch in eager PyTorch:
    (forward, backward), per layout.  The backward includes a full
    recompute's forward; tensor parallelism adds its collectives (two a
    pass, four with sequence parallelism's gather / reduce-scatter); ZeRO-3
    / FSDP its per-block weight all-gather (forward and backward) and
    gradient reduce-scatter."""
    llama = model.block == "llama"
    impl = cols["attention_impl"]
    fused_norm = cols["fused_norm"].astype(bool)
    fused_act = cols["fused_activation"].astype(bool)
    norm_fw = np.where(fused_norm, _NORM[True][0], _NORM[False][0])
    norm_bw = np.where(fused_norm, _NORM[True][1], _NORM[False][1])
    flash = impl >= _FLASH_V1
    softmax = np.where(impl == _FUSED_SOFTMAX, 1, 3)
    drop = 0 if llama else 1                  # the GPT block's dropouts
    # Attention core: flash (1 / 2) or bmm, softmax, (dropout), bmm.
    core_fw = np.where(flash, 1, 2 + softmax + drop)
    core_bw = np.where(flash, 2, 4 + softmax + drop)
    # GEMMs: GPT: fused QKV, projection, MLP in and out (with biases);
    # Llama: Q, K, V apart, projection, gate, up, down (no biases).
    gemms = 7 if llama else 4
    bias = 0 if llama else 4
    # Element-wise ops besides the core: rotary on Q and K (Llama), the MLP
    # activation (GeLU; SiLU-and-multiply, two ops unfused), two residual
    # adds, the GPT block's two dropouts on the residual branches.
    act_ops = np.where(fused_act, 1, 2) if llama else 1
    elem_fw = (2 if llama else 0) + act_ops + 2 + 2 * drop
    # Backward: the residual adds pass gradients on; the two branch points
    # sum two gradients each.
    elem_bw = (2 if llama else 0) + act_ops + 2 * drop + 2
    fw = 2 * norm_fw + core_fw + gemms + elem_fw
    bw = 2 * norm_bw + core_bw + 2 * gemms + bias + elem_bw
    tp = cols["tensor_par"] > 1
    tp_ops = np.where(cols["tensor_par_comm_type"] == _RS_AG, 4, 2) * tp
    fw = fw + tp_ops
    bw = bw + tp_ops
    if "weight_sharding" in cols:
        ws = cols["weight_sharding"].astype(bool)
        fw = fw + ws
        bw = bw + 2 * ws
    recompute = cols["activation_recompute"] == _FULL
    bw = bw + np.where(recompute, fw, 0)
    return fw.astype(float), np.where(cols["training"], bw, 0).astype(float)


def launch_time(model, cols, sums, share, passes, launch_s: float):
    """Host time exposed per batch (seconds, per layout): for every block
    pass, what issuing its kernels at ``launch_s`` each takes beyond the
    GPU time of the pass (forward: ``fw_time``; backward: ``agrad_time +
    wgrad_time`` and the recompute's ``re_time`` times its ``share``);
    ``passes``: block passes per stage (blocks x micro-batches).  0 when
    ``launch_s`` is 0."""
    if not launch_s:
        return 0.0
    k_fw, k_bw = block_kernels(model, cols)
    gpu_bw = sums.agrad_time + sums.wgrad_time + sums.re_time * share
    fw = np.maximum(k_fw * launch_s - sums.fw_time, 0.0)
    bw = np.where(cols["training"], np.maximum(k_bw * launch_s - gpu_bw, 0.0), 0.0)
    return passes * (fw + bw)


# Ops the host issues after a dropless MoE layer's token-count sync, per MoE
# block and micro-batch (``moe_sync_ops``).
#   Per local expert, Transformer Engine's GroupedLinear (the experts' fc1
#   and fc2; NVIDIA/TransformerEngine v2.11 @c188b533, transformer_engine/
#   pytorch/module/grouped_linear.py _GroupedLinear.forward / backward)
#   issues one cuBLAS GEMM per expert in each general_grouped_gemm call
#   (transformer_engine/common/gemm/cublaslt_gemm.cu multi_stream_cublas_gemm:
#   a loop of nvte_cublas_gemm_v2 over the groups): forward 1, backward 2
#   (input gradient, weight gradient), for each of the two layers.  With an
#   fp8 recipe, tex.split_quantize quantizes each expert's slice of the
#   layer's input (forward) and of its output gradient (backward) with one
#   kernel per slice (transformer_engine/common/cast/cast.cu
#   nvte_multi_tensor_quantize: a loop over the tensors): 1 more per
#   expert and layer each way.
_MOE_GEMMS_PER_EXPERT = (2, 4)
_MOE_QUANTIZE_PER_EXPERT = (2, 2)
#   Fixed, per block: Megatron-Core's all-to-all dispatcher after its sync
#   (NVIDIA/Megatron-LM @23e00ed0, megatron/core/transformer/moe/
#   token_dispatcher.py MoEAlltoAllTokenDispatcher: cuda_sync_point
#   "before_ep_alltoall" in preprocess, then token_dispatch,
#   dispatch_postprocess, combine_preprocess, token_combine,
#   combine_postprocess; experts.py TEGroupedMLP.forward): forward, the
#   all-to-all of the tokens and of their probabilities, the sort of both by
#   local expert, the activation weighted by the probabilities, the sort
#   back, the combine's all-to-all and the unpermute (8); backward, each
#   one's gradient op (8).
_MOE_FIXED_OPS = (8, 8)


def moe_sync_ops(local_experts, fp8) -> tuple[np.ndarray, np.ndarray]:
    """Ops the host issues after an MoE block's token-count sync, per
    micro-batch: (forward, backward), per layout.  ``local_experts``: the
    experts a processor holds (experts / expert_par); ``fp8``: whether the
    row's GEMMs run an fp8 / fp4 recipe (bool per layout).  A dropless
    dispatcher copies the per-expert token counts to the host and waits for
    them (Megatron-Core's token_dispatcher.py: the all-to-all dispatcher's
    ``d2h_event.synchronize()`` at its cuda_sync_point; the flex dispatcher's
    HybridEP/DeepEP dispatch blocks until the received counts are in pinned
    memory unless num_permuted_tokens is given, fused_a2a.py
    HybridEPDispatch.forward ``non_blocking``), so the GPU's queue is empty
    and every op after it is issued at the host's pace: the count here, at
    ``time_overhead.moe_host_op_s`` each (``autopar.model.moe.host_sync``)."""
    e = np.asarray(local_experts, dtype=float)
    q = np.asarray(fp8, dtype=float)
    fw = _MOE_FIXED_OPS[0] + e * (_MOE_GEMMS_PER_EXPERT[0] + q * _MOE_QUANTIZE_PER_EXPERT[0])
    bw = _MOE_FIXED_OPS[1] + e * (_MOE_GEMMS_PER_EXPERT[1] + q * _MOE_QUANTIZE_PER_EXPERT[1])
    return fw, bw
