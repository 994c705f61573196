"""torchtitan's per-op selective activation checkpointing measured with
PyTorch on CPU, held against autopar's count (issue #24; docs/validation.md,
"torchtitan: recipe defaults and memory, counted").

torchtitan's ``selective_ac_option = "op"`` (the llama3 train configs'
default) wraps each transformer block in a non-reentrant checkpoint whose
policy saves the outputs of ``aten.mm`` except every second one, of the SDPA
kernels and of the reduce-scatters, and recomputes every other op
(``torchtitan/parallelisms/parallelize_llama.py`` at 9dec370; the policy is
written here from that description, not copied).  This builds one Llama
block (RMSNorm with its fp32 upcast, wq / wk / wv without bias and grouped
query heads, a rotary stand-in on q and k, SDPA, wo, the SwiGLU MLP as w1,
w3, w2) at a small shape in bf16, runs its forward under that policy, eager
or under ``torch.compile``, and reads how much resident memory the forward
leaves behind beyond its input and output (the C allocator ``mmap``-s every
tensor of at least a page when ``MALLOC_MMAP_THRESHOLD_`` is small, which
``main`` sets for its child, so the resident set follows the live tensors).
The block's input counts too (in a stack of blocks it is the previous
block's output, kept for the checkpoint): the figure printed is hidden
widths a token, input included.

What it covers: tensor_par 1, bf16, the saved tensors of one block.  What
it cannot: tensor parallelism (reduce-scatter outputs), float8
(``_scaled_mm`` is not ``aten.mm``), the CUDA allocator; on CPU the SDPA op
is ``_scaled_dot_product_flash_attention_for_cpu``, saved here in place of
the CUDA flash kernel the policy names.  Linux only (``/proc``).

Run: ``python benchmarks/memory_sac_torch.py`` (needs torch, the optional
``measure`` extra).
"""
from __future__ import annotations

import os
import subprocess
import sys

HIDDEN, FFN, HEADS, KV_HEADS, SEQ, BATCH = 512, 1792, 8, 2, 2048, 2
MODES = ("eager", "compiled")


def counted(mode: str) -> float:
    """Hidden widths a token autopar keeps for one block
    (``autopar.model.block.op_policy_saves``, tensor_par 1, bf16)."""
    import numpy as np

    import autopar
    from autopar.io.frameworks import load_framework, with_framework
    from autopar.io.specs import load_model, load_system

    model = load_model({"name": "sac", "hidden": HIDDEN, "feedforward": FFN,
                        "seq_size": SEQ, "attn_heads": HEADS, "attn_size": HIDDEN // HEADS,
                        "kv_heads": KV_HEADS, "num_blocks": 2, "block": "llama"})
    name = "torchtitan" if mode == "eager" else "torchtitan-compile"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    system = with_framework(load_system(os.path.join(root, "systems", "h100_96g_nvl8.json")),
                            load_framework(name))
    ex = {"num_procs": 1, "tensor_par": 1, "pipeline_par": 1, "data_par": 1,
          "tensor_par_net": 0, "pipeline_par_net": 0, "data_par_net": 0,
          "batch_size": BATCH, "microbatch_size": BATCH, "datatype": "bfloat16",
          "fused_activation": True, "attention_type": "multihead",
          "activation_recompute": "mlp_only", "pipeline_interleaving": 1,
          "optimizer_sharding": False, "tensor_par_comm_type": "ar",
          "tensor_par_overlap": "none", "seq_par_ag_redo": False,
          "data_par_overlap": False, "weight_offload": False,
          "activations_offload": False, "optimizer_offload": False, "training": True,
          "attention_impl": "flash_v2"}
    kept = autopar.evaluate(model, system, [ex]).iloc[0].block_act_storage_space
    return float(np.float64(kept) / (BATCH * SEQ) / 2 / HIDDEN)


def measure(mode: str) -> float:
    """Hidden widths a token one block keeps for backward, measured (run in
    this process; ``main`` runs it in a child with the allocator set)."""
    from collections import defaultdict

    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                        create_selective_checkpoint_contexts)

    torch.manual_seed(0)
    torch.set_num_threads(1)
    ops = torch.ops.aten
    saved = {ops.mm.default, ops._scaled_dot_product_efficient_attention.default,
             ops._scaled_dot_product_flash_attention.default,
             ops._scaled_dot_product_flash_attention_for_cpu.default,
             torch.ops._c10d_functional.reduce_scatter_tensor.default,
             ops.abs.default, ops.max.default}

    def context():
        count = defaultdict(int)

        def policy(ctx, func, *args, **kwargs):
            key = "recompute" if ctx.is_recompute else "forward"
            if func == ops.mm.default:
                count[key] += 1
            keep = func in saved and not (func == ops.mm.default and count[key] % 2 == 0)
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
        return create_selective_checkpoint_contexts(policy)

    d, h, kv = HIDDEN // HEADS, HIDDEN, KV_HEADS * (HIDDEN // HEADS)

    class Norm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(h))

        def forward(self, x):
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) \
                * self.weight

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = Norm(), Norm()
            self.wq, self.wk = nn.Linear(h, h, bias=False), nn.Linear(h, kv, bias=False)
            self.wv, self.wo = nn.Linear(h, kv, bias=False), nn.Linear(h, h, bias=False)
            self.w1, self.w3 = nn.Linear(h, FFN, bias=False), nn.Linear(h, FFN, bias=False)
            self.w2 = nn.Linear(FFN, h, bias=False)

        def attention(self, x):
            b, t, _ = x.shape
            q = self.wq(x).view(b, t, HEADS, d) * 1.01     # a pointwise stand-in for rotary
            k = self.wk(x).view(b, t, KV_HEADS, d) * 1.01
            v = self.wv(x).view(b, t, KV_HEADS, d)
            rep = HEADS // KV_HEADS
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True)
            return self.wo(o.transpose(1, 2).contiguous().view(b, t, h))

        def forward(self, x):
            x = x + self.attention(self.n1(x))
            y = self.n2(x)
            return x + self.w2(F.silu(self.w1(y)) * self.w3(y))

    block = Block().to(torch.bfloat16)

    def run(x):
        return checkpoint(block, x, use_reentrant=False, context_fn=context)

    fn = torch.compile(run) if mode == "compiled" else run

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    x = torch.randn(BATCH, SEQ, h, dtype=torch.bfloat16, requires_grad=True)
    fn(x).sum().backward()          # warm up (and compile)
    x.grad = None
    base = rss()
    y = fn(x)
    kept = rss() - base - y.numel() * y.element_size()
    return kept / (BATCH * SEQ) / 2 / h + 1.0          # + the block's input


def measure_in_child(mode: str) -> float:
    """``measure`` in a fresh Python with every allocation of a page or
    more ``mmap``-ed (so that freed memory leaves the resident set)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "4096"}
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
            f"import memory_sac_torch as m; print(m.measure({mode!r}))")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                       text=True, timeout=600)
    if r.returncode:
        raise RuntimeError(r.stderr.strip().splitlines()[-1])
    return float(r.stdout.strip().splitlines()[-1])


def main() -> int:
    try:
        import torch
    except ImportError:
        print("needs torch (the optional 'measure' extra)", file=sys.stderr)
        return 2
    print(f"torch {torch.__version__}: one Llama block (hidden {HIDDEN}, ffn {FFN}, "
          f"{HEADS} heads / {KV_HEADS} kv), {BATCH} x {SEQ} tokens, bf16; hidden widths "
          f"a token kept for backward under the per-op policy, the input included")
    print(f"{'mode':<10} {'measured':>9} {'autopar':>8}")
    for mode in MODES:
        print(f"{mode:<10} {measure_in_child(mode):>9.3f} {counted(mode):>8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
