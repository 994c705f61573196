"""Per-block memory measured with PyTorch on CPU, held against autopar's count.

Issue #24, deliverable 3: memory measured, not fitted.  For each case this
builds one transformer block as real PyTorch modules at a small shape (one
tensor-parallel rank's slice of it where tensor parallelism is emulated),
runs a forward pass under ``torch.autograd.graph.saved_tensors_hooks`` and
counts the bytes autograd keeps for the backward pass, then runs backward
and one Adam step and counts the parameter, gradient and optimizer-state
bytes.  The same shape goes through ``autopar.evaluate`` and the table
prints, per term, the measured bytes, autopar's bytes and their ratio.

What a block is here (the frameworks' own structure, written from their
documented behaviour, not copied):

* ``gpt``: LayerNorm (weight and bias), Q/K/V and output projections with
  biases, the attention core (``flash``: ``F.scaled_dot_product_attention``,
  causal; ``unfused``: Q K^T, scale, causal mask, softmax, dropout, times V,
  as Megatron's non-fused core attention), dropout after the output
  projection and after the MLP, a GeLU MLP of ``ffn``.
* ``llama``: RMSNorm, Q/K/V without bias with ``kv_heads`` grouped-query
  heads, rotary embedding on Q and K, SDPA attention (``enable_gqa``), the
  output projection, a SwiGLU MLP whose first GEMM is gate and up together
  (Megatron's ``linear_fc1`` of width 2 x ffn), no dropout.
* ``moe``: the MLP replaced by a router (softmax, top-k, the chosen
  probabilities renormalised), the token copies permuted by expert, each
  expert's SwiGLU (or GeLU) MLP, the weighted sum back to the tokens, and a
  shared expert where the case has one.

Options: ``recompute`` none / full (``torch.utils.checkpoint`` of the block,
reentrant: it saves the block's input, as Megatron's ``CheckpointFunction``)
/ attn_only (checkpoint of the attention core, Megatron's selective
recompute); ``fused_activation`` (an autograd function that keeps only the
activation's input, as Megatron's fused bias-GeLU / SwiGLU); ``fused_norm``
(LLaMA: an autograd function keeping the input and the fp32 1/rms, as the
fused RMSNorm of Transformer Engine / Apex; False: Hugging Face's
LlamaRMSNorm as separate operations); ``tp`` (one rank's heads and FFN
columns; the all-reduce is the identity) and ``sp`` (sequence parallelism:
norms, dropouts and residuals on ``seq / tp`` tokens; the all-gather before
the QKV and FC1 GEMMs emulated by repeating the local shard; ``ag_redo``:
the GEMM keeps the shard and gathers it again in backward, as Megatron's
column-parallel GEMM, else it keeps the gathered input).

Where a CPU kernel keeps other tensors than the GPU kernel the model stands
for, the block uses the GPU behaviour: ``torch.native_dropout`` (a one-byte
mask; CPU's ``F.dropout`` keeps a mask in the input's datatype), the fused
RMSNorm above (CPU's composite ``F.rms_norm`` keeps the normalised output
too) and scatter-add to combine the experts' outputs (Megatron's unpermute;
``index_add``'s derivative keeps its source).

Counting: saved tensors are deduplicated by storage (a view counts once, a
storage counts whole); storages of parameters and of module buffers (the
causal mask, rotary cos/sin: constants, not per-micro-batch activations)
are left out.  Parameters, gradients (``param.grad``) and Adam's state
(``exp_avg``, ``exp_avg_sq``; the scalar ``step`` is left out) are counted
from the tensors themselves; in bfloat16 the optimizer runs, as in mixed
precision, on fp32 master copies of the weights, which count as optimizer
state (autopar's master weights).

autopar's side (``predict``): ``block_act_storage_space`` (under full
recompute ``block_act_checkpoint_size``), ``block_weight_space``,
``block_weight_grad_space`` and ``block_optimizer_space`` of a one-block
model, on a system with ``memory_overhead.checkpoint_split`` and
``memory_overhead.autograd_inputs`` (the framework behaviour measured here;
both False: Calculon's count).  docs/validation.md, "Memory measured with
PyTorch on CPU", has the figures and what the measurement cannot cover.

    PYTHONPATH=$PWD python benchmarks/memory_torch.py [--case NAME]
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import autopar  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Case:
    """One block's shape and execution (sizes before tensor parallelism)."""
    name: str
    block: str = "llama"             # "gpt" | "llama"
    hidden: int = 512
    ffn: int = 1536
    seq: int = 256
    heads: int = 8
    head_dim: int = 64
    kv_heads: int | None = None      # None: as many as heads
    mbs: int = 2
    attention: str = "flash"         # "flash" (SDPA) | "unfused"
    recompute: str = "none"          # "none" | "full" | "attn_only"
    fused_activation: bool = False
    # llama: a fused RMSNorm kernel (TE / Apex) or Hugging Face's LlamaRMSNorm
    # (upcast to fp32, separate ops)
    fused_norm: bool = True
    tp: int = 1
    sp: bool = False
    # sequence parallelism: the column-parallel GEMMs keep the shard and
    # gather it again in backward (Megatron's), or keep the gathered input
    ag_redo: bool = True
    dtype: str = "float32"
    # mixture of experts: (experts, top_k, expert_ffn, shared_ffn) or None
    moe: tuple | None = None
    dropout: float = 0.1             # gpt only (llama has none)

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads


# --------------------------------------------------------------------------
# The block, one tensor-parallel rank of it.


class _FusedGeLU(torch.autograd.Function):
    """GeLU that keeps only its input (Megatron's fused bias-GeLU keeps the
    GEMM output and recomputes the activation in backward)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return F.gelu(x, approximate="tanh")

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            xx = x.detach().requires_grad_()
            y = F.gelu(xx, approximate="tanh")
        return torch.autograd.grad(y, xx, g)[0]


class _FusedSwiGLU(torch.autograd.Function):
    """SiLU(gate) * up that keeps only the GEMM output holding gate and up
    (Megatron's fused bias-SwiGLU)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            xx = x.detach().requires_grad_()
            gate, up = xx.chunk(2, dim=-1)
            y = F.silu(gate) * up
        return torch.autograd.grad(y, xx, g)[0]


def _activation(case: Case, x):
    if case.block == "llama":
        if case.fused_activation:
            return _FusedSwiGLU.apply(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
    if case.fused_activation:
        return _FusedGeLU.apply(x)
    return F.gelu(x, approximate="tanh")


class _FusedRMSNorm(torch.autograd.Function):
    """RMSNorm that keeps its input and the fp32 reciprocal RMS per token
    (Transformer Engine's and Apex's fused RMSNorm; PyTorch's composite
    ``F.rms_norm`` on CPU keeps the normalised output as well)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        rstd = torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.eps = eps
        return (x.float() * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, g):
        x, weight, _ = ctx.saved_tensors
        with torch.enable_grad():
            xx, ww = x.detach().requires_grad_(), weight.detach().requires_grad_()
            rstd = torch.rsqrt(xx.float().square().mean(-1, keepdim=True) + ctx.eps)
            y = (xx.float() * rstd).to(xx.dtype) * ww
        gx, gw = torch.autograd.grad(y, (xx, ww), g)
        return gx, gw, None


def _hf_rms_norm(x, weight, eps):
    """Hugging Face's LlamaRMSNorm: fp32 upcast, then separate operations."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class _Norm(nn.Module):
    def __init__(self, case: Case, dtype):
        super().__init__()
        self.llama = case.block == "llama"
        self.fused = case.fused_norm
        self.weight = nn.Parameter(torch.ones(case.hidden, dtype=dtype))
        self.bias = None if self.llama else nn.Parameter(torch.zeros(case.hidden, dtype=dtype))

    def forward(self, x):
        if self.llama:
            if not self.fused:
                return _hf_rms_norm(x, self.weight, 1e-5)
            return _FusedRMSNorm.apply(x, self.weight, 1e-5)
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, eps=1e-5)


class _MLP(nn.Module):
    """A dense MLP of ``ffn`` columns split over ``tp`` ranks."""

    def __init__(self, case: Case, ffn: int, tp: int, dtype):
        super().__init__()
        self.case = case
        bias = case.block == "gpt"
        width = ffn // tp
        fc1 = 2 * width if case.block == "llama" else width
        self.fc1 = nn.Linear(case.hidden, fc1, bias=bias, dtype=dtype)
        self.fc2 = nn.Linear(width, case.hidden, bias=bias, dtype=dtype)

    def forward(self, x, sp: int = 1):
        c = self.case
        return self.fc2(_activation(c, _column(self.fc1, x, sp, c.ag_redo)))


class _MoE(nn.Module):
    """Router, top-k, experts (all on this rank) and the weighted sum; the
    shared expert beside them where the case has one."""

    def __init__(self, case: Case, dtype):
        super().__init__()
        experts, self.top_k, ffe, shared = case.moe
        self.router = nn.Linear(case.hidden, experts, bias=False, dtype=dtype)
        self.experts = nn.ModuleList(_MLP(case, ffe, 1, dtype) for _ in range(experts))
        self.shared = _MLP(case, shared, case.tp, dtype) if shared else None

    def forward(self, x):
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = torch.softmax(self.router(tokens), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of = order // self.top_k
        copies = tokens[token_of]                       # permuted token copies
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        outs, start = [], 0
        for expert, n in zip(self.experts, counts):
            if n:
                outs.append(expert(copies[start:start + n]))
            start += n
        ys = torch.cat(outs) * weights.reshape(-1)[order].unsqueeze(-1)
        # Back to the tokens by scatter-add (Megatron's unpermute): it keeps
        # the index only (index_add's derivative keeps its source as well).
        where = token_of.unsqueeze(-1).expand(-1, tokens.shape[-1])
        out = torch.zeros_like(tokens).scatter_add(0, where, ys).reshape(shape)
        if self.shared is not None:
            out = out + self.shared(x)
        return out


def _gather(x, tp):
    """Sequence parallelism's all-gather, emulated: this rank's tokens
    repeated for the other ranks' (their values do not change the bytes)."""
    return torch.cat([x] * tp, dim=1) if tp > 1 else x


class _GatherLinear(torch.autograd.Function):
    """All-gather of the sequence-parallel shard, then a GEMM, keeping only
    the shard and gathering it again in backward (Megatron's column-parallel
    linear with sequence parallelism: autopar's ``seq_par_ag_redo``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, tp):
        ctx.save_for_backward(x, weight)
        ctx.tp, ctx.has_bias = tp, bias is not None
        return F.linear(_gather(x, tp), weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        total = _gather(x, ctx.tp)
        gx = (g @ weight).narrow(1, 0, x.shape[1])       # reduce-scatter: this rank's share
        gw = g.reshape(-1, g.shape[-1]).t() @ total.reshape(-1, total.shape[-1])
        gb = g.reshape(-1, g.shape[-1]).sum(0) if ctx.has_bias else None
        return gx, gw, gb, None


def _column(linear: nn.Linear, x, sp: int, redo: bool):
    """A column-parallel GEMM on a sequence-parallel input (``sp`` ranks)."""
    if sp > 1 and redo:
        return _GatherLinear.apply(x, linear.weight, linear.bias, sp)
    return linear(_gather(x, sp))


def _scatter(x, tp):
    """Sequence parallelism's reduce-scatter, emulated: this rank's share of
    the tokens, as a tensor of its own."""
    return x.narrow(1, 0, x.shape[1] // tp).clone() if tp > 1 else x


class Block(nn.Module):
    """One transformer block as one tensor-parallel rank runs it: input and
    output are ``[mbs, seq, hidden]`` (``seq / tp`` tokens with sequence
    parallelism)."""

    def __init__(self, case: Case):
        super().__init__()
        dtype = DTYPES[case.dtype]
        self.case = case
        c = case
        bias = c.block == "gpt"
        self.h_local, self.kv_local = c.heads // c.tp, c.kv // c.tp
        self.norm1 = _Norm(c, dtype)
        self.q = nn.Linear(c.hidden, self.h_local * c.head_dim, bias=bias, dtype=dtype)
        self.k = nn.Linear(c.hidden, self.kv_local * c.head_dim, bias=bias, dtype=dtype)
        self.v = nn.Linear(c.hidden, self.kv_local * c.head_dim, bias=bias, dtype=dtype)
        self.o = nn.Linear(self.h_local * c.head_dim, c.hidden, bias=bias, dtype=dtype)
        self.norm2 = _Norm(c, dtype)
        self.mlp = _MoE(c, dtype) if c.moe else _MLP(c, c.ffn, c.tp, dtype)
        causal = torch.ones(c.seq, c.seq, dtype=torch.bool).triu(1)
        self.register_buffer("causal", causal, persistent=False)
        if c.block == "llama":
            inv = 1.0 / (10000 ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim))
            ang = torch.outer(torch.arange(c.seq).float(), inv)
            ang = torch.cat([ang, ang], dim=-1)
            self.register_buffer("cos", ang.cos().to(dtype), persistent=False)
            self.register_buffer("sin", ang.sin().to(dtype), persistent=False)

    def _rotary(self, x):
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * self.cos + rotated * self.sin

    def _dropout(self, x):
        if self.case.block == "llama" or not self.case.dropout:
            return x
        # The fused kernel's one-byte mask (CPU's F.dropout keeps a mask in
        # the input's datatype; CUDA's and native_dropout a bool mask).
        return torch.native_dropout(x, self.case.dropout, True)[0]

    def _core(self, q, k, v):
        """The attention core: [mbs, heads, seq, d] in, [mbs, seq, heads*d] out."""
        c = self.case
        if c.attention == "flash":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                 enable_gqa=self.kv_local != self.h_local)
        else:
            if self.kv_local != self.h_local:
                rep = self.h_local // self.kv_local
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(c.head_dim))
            probs = torch.softmax(scores.masked_fill(self.causal, float("-inf")), dim=-1)
            out = self._dropout(probs) @ v
        return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)

    def _attention(self, x):
        c = self.case
        sp = c.tp if c.sp else 1
        n = self.norm1(x)
        mbs, s = n.shape[0], n.shape[1] * sp
        gsp = sp
        if not c.ag_redo:       # one gathered input for the three GEMMs
            n, gsp = _gather(n, sp), 1
        q = _column(self.q, n, gsp, c.ag_redo).view(mbs, s, self.h_local, c.head_dim)
        k = _column(self.k, n, gsp, c.ag_redo).view(mbs, s, self.kv_local, c.head_dim)
        v = _column(self.v, n, gsp, c.ag_redo).view(mbs, s, self.kv_local, c.head_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if c.block == "llama":
            q, k = self._rotary(q), self._rotary(k)
        if c.recompute == "attn_only":
            a = checkpoint(self._core, q, k, v, use_reentrant=True)
        else:
            a = self._core(q, k, v)
        return self._dropout(_scatter(self.o(a), sp))

    def _body(self, x):
        c = self.case
        sp = c.tp if c.sp else 1
        x = x + self._attention(x)
        m = self.norm2(x)
        if c.moe:       # an MoE layer runs on the sequence-parallel tokens
            y = self.mlp(m)
        else:
            y = _scatter(self.mlp(m, sp), sp)
        return x + self._dropout(y)

    def forward(self, x):
        if self.case.recompute == "full":
            return checkpoint(self._body, x, use_reentrant=True)
        return self._body(x)


# --------------------------------------------------------------------------
# Measurement.


def _kind(t: torch.Tensor) -> str:
    if t.dtype == torch.bool:
        return "masks (bool)"
    if not t.is_floating_point():
        return "indices (int)"
    return "activations (float)"


def measure(case: Case, seed: int = 0) -> dict:
    """Bytes of one micro-batch's saved activations (by kind: float, bool
    masks, integer indices; and in all) and of the block's parameters,
    gradients and optimizer state, measured with PyTorch."""
    torch.manual_seed(seed)
    dtype = DTYPES[case.dtype]
    block = Block(case)
    constants = {t.untyped_storage().data_ptr()
                 for t in list(block.parameters()) + list(block.buffers())}
    seq_local = case.seq // case.tp if case.sp else case.seq
    x = torch.randn(case.mbs, seq_local, case.hidden, dtype=dtype, requires_grad=True)
    saved: dict[int, tuple[int, str]] = {}

    def pack(t):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in constants and st.nbytes():
            saved[ptr] = (st.nbytes(), _kind(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = block(x)
    out = {"saved": float(sum(n for n, _ in saved.values()))}
    for kind in ("activations (float)", "masks (bool)", "indices (int)"):
        out[kind] = float(sum(n for n, k in saved.values() if k == kind))
    y.float().square().mean().backward()
    params = list(block.parameters())
    out["weights"] = float(sum(p.numel() * p.element_size() for p in params))
    out["gradients"] = float(sum(p.grad.numel() * p.grad.element_size()
                                 for p in params if p.grad is not None))
    if dtype == torch.float32:
        masters, extra = params, 0.0
    else:           # mixed precision: Adam on fp32 master weights
        masters = [p.detach().float().requires_grad_() for p in params]
        for m, p in zip(masters, params):
            m.grad = p.grad.float()
        extra = float(sum(m.numel() * m.element_size() for m in masters))
    opt = torch.optim.Adam(masters, lr=1e-3)
    opt.step()
    state = sum(v.numel() * v.element_size() for s in opt.state.values()
                for name, v in s.items() if name != "step" and torch.is_tensor(v))
    out["optimizer"] = float(state) + extra
    return out


# --------------------------------------------------------------------------
# The same block through autopar.


def autopar_inputs(case: Case, **execution) -> tuple[dict, dict]:
    """The model and execution (Calculon's fields and autopar's extensions)
    that describe ``case``; ``execution`` overrides fields."""
    c = case
    model = {"hidden": c.hidden, "feedforward": c.ffn, "seq_size": c.seq,
             "attn_heads": c.heads, "attn_size": c.head_dim, "num_blocks": 1,
             "block": c.block}
    if c.kv_heads:
        model["kv_heads"] = c.kv_heads
    if c.moe:
        experts, top_k, ffe, shared = c.moe
        model["feedforward"] = ffe
        model["moe"] = {"experts": experts, "top_k": top_k, "expert_feedforward": ffe,
                        "shared_experts": 1 if shared else 0, "shared_feedforward": shared}
    layout = {
        "num_procs": c.tp, "tensor_par": c.tp, "pipeline_par": 1, "data_par": 1,
        "tensor_par_net": 0, "pipeline_par_net": 0, "data_par_net": 0,
        "batch_size": c.mbs, "microbatch_size": c.mbs, "datatype": c.dtype,
        "fused_activation": c.fused_activation, "attention_type": "multihead",
        "activation_recompute": c.recompute, "pipeline_interleaving": 1,
        "optimizer_sharding": False,
        "tensor_par_comm_type": "rs_ag" if c.sp else "ar",
        "tensor_par_overlap": "none",
        "seq_par_ag_redo": c.sp and c.ag_redo and c.recompute != "full",
        "data_par_overlap": False, "weight_offload": False,
        "activations_offload": False, "optimizer_offload": False, "training": True,
        "attention_impl": "flash_v2" if c.attention == "flash" else "unfused",
        "fused_norm": c.fused_norm,
    }
    layout.update(execution)
    return model, layout


SYSTEM = "systems/a100_80g.json"    # its datatypes only: sizes do not depend on the system


def system(checkpoint_split: bool = True, autograd_inputs: bool = True) -> dict:
    """The system file as a dict, with the framework behaviour measured here:
    the full-recompute checkpoint kept split over tensor_par under sequence
    parallelism (``memory_overhead.checkpoint_split``) and the GEMM and
    router inputs counted as autograd keeps them
    (``memory_overhead.autograd_inputs``); False: Calculon's count."""
    import json
    data = json.loads((ROOT / SYSTEM).read_text())
    data["memory_overhead"] = {"checkpoint_split": checkpoint_split,
                               "autograd_inputs": autograd_inputs}
    return data


def predict(case: Case, checkpoint_split: bool = True, autograd_inputs: bool = True,
            **execution) -> dict:
    """autopar's per-block terms for ``case`` (bytes); ``execution``
    overrides fields of the execution."""
    model, layout = autopar_inputs(case, **execution)
    sysdata = system(checkpoint_split, autograd_inputs)
    row = autopar.evaluate(autopar.load_model(model), autopar.load_system(sysdata),
                           [layout]).iloc[0]
    full = case.recompute == "full"
    return {"saved": float(row["block_act_checkpoint_size"] if full
                           else row["block_act_storage_space"]),
            "weights": float(row["block_weight_space"]),
            "gradients": float(row["block_weight_grad_space"]),
            "optimizer": float(row["block_optimizer_space"])}


TERMS = ("saved", "weights", "gradients", "optimizer")


def compare(case: Case, got: dict | None = None, **execution) -> list:
    """(term, measured bytes, autopar bytes, autopar / measured) per term;
    ``got``: ``measure(case)`` when already taken."""
    got = measure(case) if got is None else got
    want = predict(case, **execution)
    return [(t, got[t], want[t], want[t] / got[t]) for t in TERMS]


# --------------------------------------------------------------------------
# The cases the test and the table cover.

_GPT = dict(block="gpt", hidden=512, ffn=2048, heads=8, head_dim=64)
_LLAMA = dict(block="llama", hidden=512, ffn=1536, heads=8, head_dim=64, kv_heads=2)
_MOE = dict(block="llama", hidden=256, ffn=512, heads=4, head_dim=64, kv_heads=2, seq=128,
            moe=(8, 2, 256, 0))

CASES = [
    Case("gpt-unfused", **_GPT, attention="unfused"),
    Case("gpt-unfused-attn_only", **_GPT, attention="unfused", recompute="attn_only"),
    Case("gpt-unfused-full", **_GPT, attention="unfused", recompute="full"),
    Case("gpt-flash", **_GPT),
    Case("gpt-flash-tp2", **_GPT, tp=2),
    Case("gpt-flash-tp2-sp", **_GPT, tp=2, sp=True),
    Case("gpt-flash-tp2-sp-gathered", **_GPT, tp=2, sp=True, ag_redo=False),
    Case("llama-flash", **_LLAMA),
    Case("llama-flash-fused", **_LLAMA, fused_activation=True),
    Case("llama-flash-bf16", **_LLAMA, dtype="bfloat16"),
    Case("llama-flash-bf16-hf-norm", **_LLAMA, dtype="bfloat16", fused_norm=False),
    Case("llama-flash-hf-norm", **_LLAMA, fused_norm=False),
    Case("llama-flash-attn_only", **_LLAMA, recompute="attn_only"),
    Case("llama-flash-full", **_LLAMA, recompute="full"),
    Case("llama-flash-tp2", **_LLAMA, tp=2),
    Case("llama-flash-tp2-sp", **_LLAMA, tp=2, sp=True),
    Case("llama-flash-tp2-sp-attn_only", **_LLAMA, tp=2, sp=True, recompute="attn_only"),
    Case("llama-flash-tp2-sp-full", **_LLAMA, tp=2, sp=True, recompute="full"),
    Case("moe", **_MOE),
    Case("moe-fused", **_MOE, fused_activation=True),
    Case("moe-shared", **{**_MOE, "moe": (8, 2, 256, 512)}),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", action="append", help="case name (default: all)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cases = [c for c in CASES if not args.case or c.name in args.case]
    print(f"{'case':24} {'term':10} {'measured':>12} {'autopar':>12} {'ratio':>7}")
    for c in cases:
        got = measure(c)
        for term, m, a, r in compare(c, got):
            print(f"{c.name:24} {term:10} {m:12.0f} {a:12.0f} {r:7.4f}")
        extra = {k: got[k] for k in ("masks (bool)", "indices (int)") if got[k]}
        if extra:
            print(f"{'':24} (of saved: {extra})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
