"""The analytical performance model, array-native.

``evaluate_columns(model, system, cols)`` predicts, for every layout of a
layout table (see ``autopar.io.layouts``) at once, the time and memory of one
training (or inference) batch in the method of Calculon (Isaev et al., SC'23):
a transformer block is a sequence of layers; each layer has flops, memory
traffic, tensor-parallel communication and memory footprints; per-block sums
are scaled by blocks per processor and micro-batches, and pipeline bubbles,
data-parallel communication (with overlap), offloading and memory capacity
are accounted at the batch level.

Every quantity is a numpy column with one entry per layout; a single layout is
a column of one.  Rows that are invalid or infeasible get ``feasible=False``,
a ``reason_code`` (index into ``REASONS``) and NaN statistics.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from autopar.io.layouts import BYTES_PER_ELEMENT, CHOICES, EXT_DEFAULTS, FIELDS, to_columns
from autopar.io.specs import MemoryOverhead, ModelSpec, SystemSpec

# ----------------------------------------------------------------------------
# Statistics reported, by Calculon's names, in Calculon's order.
STATS: tuple[str, ...] = (
    "block_fw_flops", "block_fw_flops_time", "block_fw_mem_accessed",
    "block_fw_mem_time", "block_fw_time",
    "baseblock_fw_tp_time", "edgeblock_fw_tp_time",
    "baseblock_fw_tp_time_exposed", "edgeblock_fw_tp_time_exposed",
    "block_re_flops", "block_re_flops_time", "block_re_mem_accessed",
    "block_re_mem_time", "block_re_time",
    "baseblock_recomm_time", "edgeblock_recomm_time",
    "baseblock_recomm_time_exposed", "edgeblock_recomm_time_exposed",
    "block_agrad_flops", "block_agrad_flops_time", "block_agrad_mem_accessed",
    "block_agrad_mem_time", "block_agrad_time",
    "baseblock_agrad_tp_time", "edgeblock_agrad_tp_time",
    "baseblock_agrad_tp_time_exposed", "edgeblock_agrad_tp_time_exposed",
    "block_wgrad_flops", "block_wgrad_flops_time", "block_wgrad_mem_accessed",
    "block_wgrad_mem_time", "block_wgrad_time",
    "block_optim_flops", "block_optim_flops_time", "block_optim_mem_accessed",
    "block_optim_mem_time", "block_optim_time",
    "baseblock_fw_tp_size", "edgeblock_fw_tp_size",
    "baseblock_bw_tp_size", "edgeblock_bw_tp_size",
    "baseblock_recomm_size", "edgeblock_recomm_size",
    "block_fw_pp_size", "block_bw_pp_size", "block_dp_size",
    "tp_bw_overlap_req", "dp_bw_overlap_req_chunk", "dp_bw_overlap_req_tail",
    "block_weight_space", "block_act_working_space", "block_act_storage_space",
    "block_act_checkpoint_size", "block_weight_grad_space",
    "block_weight_grad_space_no_sharding", "block_act_grad_space",
    "block_optimizer_space",
    "weight_space_with_offload", "act_space_with_offload",
    "act_checkpoint_size_with_offload", "act_grad_space_with_offload",
    "weight_grad_space_with_offload", "optimizer_space_with_offload",
    "weight_space", "act_space", "act_checkpoint_size", "act_grad_space",
    "weight_grad_space", "optimizer_space",
    "fw_time", "bw_time", "optim_step_time", "recompute_time",
    "recomm_link_time", "recomm_exposed_time", "bubble_time",
    "tp_comm_link_time", "pp_comm_link_time", "dp_comm_link_time",
    "tp_comm_exposed_time", "pp_comm_exposed_time", "dp_comm_exposed_time",
    "fw_offload_exposed_time", "bw_offload_exposed_time", "total_time",
    "act_offload_bw_req", "weight_offload_bw_req", "optim_offload_bw_req",
    "offload_mem_bw_req", "proc_mem_tier1_cap_req", "proc_mem_tier2_cap_req",
    "useful_flops", "compute_efficiency", "system_efficiency",
    "total_efficiency", "sample_rate",
)

MAX_TIERS = 16

# Why a layout cannot run.  "invalid": the layout breaks a rule of its own;
# "infeasible": well formed, but the system cannot run it.
REASONS: tuple[str, ...] = (
    "",
    "invalid: sizes must be positive",
    "invalid: tensor_par * pipeline_par * data_par != num_procs",
    "invalid: batch_size is not divisible by data_par",
    "invalid: local batch is not divisible by microbatch_size",
    "invalid: activation recompute is only for training",
    "invalid: pipeline_interleaving must be 1 when pipeline_par is 1",
    "invalid: optimizer_sharding needs data_par > 1",
    "invalid: tensor_par_overlap needs tensor_par > 1",
    "invalid: seq_par_ag_redo needs tensor_par_comm_type rs_ag",
    "invalid: seq_par_ag_redo is not used with full recompute",
    "invalid: data_par_overlap needs training and data_par > 1",
    "invalid: optimizer_offload is only for training",
    "invalid: network tier out of range",
    "invalid: datatype not supported by the system",
    "invalid: hidden, feedforward and attn_heads must be divisible by tensor_par",
    "invalid: microbatch_size * seq_size must be divisible by tensor_par",
    "infeasible: pipeline_interleaving exceeds the blocks per processor",
    "infeasible: pipeline_interleaving must divide the blocks per processor",
    "infeasible: offloading requires each processor to handle at least 3 blocks",
    "infeasible: mem tier1 capacity exceeded",
    "infeasible: mem tier2 capacity exceeded",
) + tuple(f"infeasible: network tier{t} isn't big enough" for t in range(MAX_TIERS)) \
  + tuple(f"infeasible: network tier{t} isn't fully used" for t in range(MAX_TIERS))

_R = {r: i for i, r in enumerate(REASONS)}
_NET_BIG = _R["infeasible: network tier0 isn't big enough"]
_NET_FILL = _R["infeasible: network tier0 isn't fully used"]

_OPS = ("p2p", "reduce_scatter", "all_gather", "all_reduce")


# ----------------------------------------------------------------------------
# Hardware lookups over columns.

def _curve(table) -> tuple[np.ndarray, np.ndarray]:
    """(thresholds ascending, efficiencies) from a descending (x, eff) table."""
    xs = np.array([x for x, _ in table][::-1], dtype=float)
    es = np.array([e for _, e in table][::-1], dtype=float)
    return xs, es


def _lookup(xs: np.ndarray, es: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Efficiency of the largest threshold <= v (tables end at 0)."""
    idx = np.searchsorted(xs, v, side="right") - 1
    return es[np.maximum(idx, 0)]


class _Engine:
    """Throughput of one compute engine (matrix or vector) per row's datatype."""

    def __init__(self, procs: Mapping, dt_codes: np.ndarray, uniq: list[int]):
        self.dt = dt_codes
        self.parts = []
        for c in uniq:
            p = procs[CHOICES["datatype"][c]]
            xs, es = _curve(p.gflops_efficiency)
            self.parts.append((c, p.tflops * 1e12, xs * 1e9, es))
        self.single = len(self.parts) == 1
        if self.single:
            self.peak = self.parts[0][1]
        else:
            self.peak = np.zeros(len(dt_codes))
            for c, peak, _, _ in self.parts:
                self.peak[dt_codes == c] = peak

    def time(self, flops: np.ndarray) -> np.ndarray:
        """Seconds to run ``flops`` (per row) at this engine's efficiency."""
        flops = np.asarray(flops, dtype=float)
        if self.single:
            _, peak, xs, es = self.parts[0]
            return flops / (peak * _lookup(xs, es, flops))
        out = np.empty(len(self.dt))
        fl = np.broadcast_to(flops, self.dt.shape)
        for c, peak, xs, es in self.parts:
            m = self.dt == c
            out[m] = fl[m] / (peak * _lookup(xs, es, fl[m]))
        return out


class _Memory:
    def __init__(self, mem):
        self.capacity = mem.GiB * 1024 ** 3
        self.bw = mem.GBps * 1e9
        xs, es = _curve(mem.MB_efficiency)
        self.xs, self.es = xs * 1e6, es

    def time(self, nbytes: np.ndarray) -> np.ndarray:
        nbytes = np.asarray(nbytes, dtype=float)
        if self.bw <= 0:
            return np.where(nbytes > 0, np.inf, 0.0)
        return nbytes / (self.bw * _lookup(self.xs, self.es, nbytes))


class _Net:
    """One network tier per row (the tier a parallelism is assigned to).

    Per-tier constants are gathered to rows lazily, on first use.
    """

    def __init__(self, networks, tier: np.ndarray):
        self.tier = np.clip(tier, 0, len(networks) - 1)
        self._nets = networks
        self._cache: dict = {}

    def _col(self, name, f):
        if name not in self._cache:
            per_tier = np.array([f(n) for n in self._nets], dtype=float)
            self._cache[name] = per_tier[self.tier]
        return self._cache[name]

    @property
    def usage(self):
        return self._col("usage", lambda n: n.processor_usage)

    def time(self, op: str, nbytes, peers) -> np.ndarray:
        lat = self._col("lat", lambda n: n.latency)
        rate = self._col("rate", lambda n: n.bandwidth * 1e9 * n.efficiency)
        scale = self.scale(op)
        offset = self._col("off_" + op, lambda n: n.ops[op][1] or 0.0)
        size = nbytes * scale
        size = size + size / peers * offset
        return lat + size / rate

    def scale(self, op: str):
        return self._col("scale_" + op, lambda n: n.ops[op][0])


# ----------------------------------------------------------------------------
# Layers.  Each layer is a dict of per-row columns with Calculon's meaning:
# flops/mem per stage, processing time per stage, TP comm bytes, link time and
# exposed time per stage for base and edge blocks, footprints and flags.

_STAGES = ("fw", "agrad", "wgrad", "optim")


class _Ctx:
    """Per-row quantities shared by all layers of a block."""

    def __init__(self, model: ModelSpec, system: SystemSpec, c: dict, uniq_dt):
        self.m = model
        self.n = len(c["tensor_par"])
        self.training = c["training"]
        self.bpe = np.array([BYTES_PER_ELEMENT[d] for d in CHOICES["datatype"]],
                            dtype=float)[c["datatype"]]
        self.matrix = _Engine(system.matrix, c["datatype"], uniq_dt)
        self.vector = _Engine(system.vector, c["datatype"], uniq_dt)
        self.mem1 = _Memory(system.mem1)
        self.mem2 = _Memory(system.mem2)
        self.roofline = system.processing_mode == "roofline"
        self.t = c["tensor_par"].astype(float)
        shard = np.where(c["optimizer_sharding"], c["data_par"], 1)
        self.shard = shard.astype(float)
        unsharded = c.get("unsharded_grads", False)
        self.grad_shard = np.where(unsharded, 1.0, self.shard)
        self.tp_net = _Net(system.networks, c["tensor_par_net"])
        ct = c["tensor_par_comm_type"]
        self.rs_ag = ct == CHOICES["tensor_par_comm_type"].index("rs_ag")
        self.p2p = ct == CHOICES["tensor_par_comm_type"].index("p2p_rs_ag")
        self.pipe = c["tensor_par_overlap"] == CHOICES["tensor_par_overlap"].index("pipe")
        self.zeros = np.zeros(self.n)

    def proc(self, flops_time, mem_time):
        if self.roofline:
            return np.maximum(flops_time, mem_time)
        return flops_time + mem_time


def _layer(ctx: _Ctx, *, fw=0.0, agrad=0.0, wgrad=0.0, inputs=0.0, outputs=0.0,
           act=0.0, act_grads=0.0, weight=0.0, weight_grads=0.0, optim=0.0,
           recompute=False, recomm=False, reused=False, stored=True,
           out_stored=True, matrix=False):
    """A plain layer (Calculon's base Layer semantics); sizes in elements."""
    z = ctx.zeros
    L = dict(fw=fw + z, agrad=agrad + z, wgrad=wgrad + z, inputs=inputs + z,
             outputs=outputs + z, act=act + z, act_grads=act_grads + z,
             weight=weight + z, weight_grads=weight_grads + z, optim=optim + z,
             recompute=np.broadcast_to(recompute, z.shape),
             recomm=np.broadcast_to(recomm, z.shape),
             reused=np.broadcast_to(reused, z.shape),
             stored=np.broadcast_to(stored, z.shape),
             out_stored=np.broadcast_to(out_stored, z.shape), matrix=matrix)
    b = ctx.bpe
    L["optim_flops"] = L["weight_grads"] / ctx.shard * 11
    L["mem_fw"] = (L["inputs"] + L["outputs"] + L["weight"]) * b
    L["mem_agrad"] = (L["weight"] + L["act"] + L["act_grads"]) * b
    L["mem_wgrad"] = np.where(L["weight"] == 0, 0.0,
                              (L["weight_grads"] + L["act"] + L["act_grads"]) * b)
    master = np.where(b < 4, L["weight"] * 4, 0.0)
    L["optimizer"] = (master + L["optim"] * 4) / ctx.shard
    L["mem_optim"] = L["optimizer"]
    L["weight_b"] = L["weight"] * b
    L["act_b"] = L["act"] * b
    L["out_b"] = L["outputs"] * b
    L["wgrad_sh"] = L["weight_grads"] * b / ctx.grad_shard
    L["wgrad_full"] = L["weight_grads"] * 4
    L["agrad_b"] = L["act_grads"] * b
    L["kind"] = "plain"
    return L


def _finish(ctx: _Ctx, L: dict) -> dict:
    """Compute times of a layer once its flops/mem columns are final."""
    flops = {"fw": L["fw"], "agrad": L["agrad"], "wgrad": L["wgrad"],
             "optim": L["optim_flops"]}
    if "time_scale" in L:       # a kernel that executes other work than it counts
        flops = dict(flops, agrad=flops["agrad"] + L["agrad_extra"])
    for s in _STAGES:
        eng = ctx.matrix if (L["matrix"] and s != "optim") else ctx.vector
        L["ft_" + s] = eng.time(flops[s])
        L["mt_" + s] = ctx.mem1.time(L["mem_" + s])
    if "time_scale" in L:
        for s in ("fw", "agrad"):
            L["ft_" + s] = L["ft_" + s] * L["time_scale"]
    if L["kind"] == "plain":
        for s in _STAGES:
            L["pt_" + s] = ctx.proc(L["ft_" + s], L["mt_" + s])
        z = ctx.zeros
        for s in ("fw", "agrad", "wgrad"):
            for e in ("base", "edge"):
                L[f"bytes_{s}_{e}"] = z
                L[f"net_{s}_{e}"] = z
                L[f"exp_{s}_{e}"] = z
        L["req_fw"] = L["req_agrad"] = z
    elif L["kind"] == "tpcomm":
        _finish_tpcomm(ctx, L)
    else:
        _finish_overlapped(ctx, L)
    return L


def _linear(ctx, m, n, k, **kw):
    return _layer(ctx, fw=2 * m * n * k, agrad=2 * m * n * k, wgrad=2 * m * n * k,
                  inputs=m * n, outputs=m * k, weight=n * k, weight_grads=n * k,
                  act=m * n, act_grads=m * k, optim=2 * n * k, matrix=True, **kw)


def _bmm(ctx, batch, m, n, k, **kw):
    return _layer(ctx, fw=batch * 2 * m * n * k, agrad=batch * 4 * m * n * k,
                  inputs=batch * (m * n + n * k), outputs=batch * m * k,
                  act=batch * (m * n + n * k), act_grads=batch * m * k,
                  matrix=True, **kw)


def _layernorm(ctx, size, hidden, fused_norm, **kw):
    """LayerNorm as Calculon counts it (one pass; a fused kernel changes nothing)."""
    return _layer(ctx, fw=9 * size, agrad=14 * size, wgrad=7 * size,
                  inputs=size, outputs=size, act=size, act_grads=size,
                  weight=2 * hidden, weight_grads=2 * hidden, optim=4 * hidden, **kw)


# PyTorch's reference RMSNorm upcasts to fp32 and runs as separate kernels:
# about this many extra bytes per element move through memory, and autograd
# keeps an fp32 copy of the input and the normalized fp32 output.
_RMS_UNFUSED_TRAFFIC = {"fw": 48.0, "agrad": 80.0}
_RMS_UNFUSED_STORED = 8.0


def _rmsnorm(ctx, size, hidden, fused_norm, **kw):
    """RMSNorm: a fused kernel is one pass; unfused adds fp32 intermediates."""
    L = _layer(ctx, fw=4 * size, agrad=8 * size, wgrad=2 * size,
               inputs=size, outputs=size, act=size, act_grads=size,
               weight=hidden, weight_grads=hidden, optim=2 * hidden, **kw)
    extra = np.where(fused_norm, 0.0, 1.0) * size
    L["mem_fw"] = L["mem_fw"] + extra * _RMS_UNFUSED_TRAFFIC["fw"]
    L["mem_agrad"] = L["mem_agrad"] + extra * _RMS_UNFUSED_TRAFFIC["agrad"]
    # Stored beside the input that the Fork before it keeps.
    L["keep_b"] = extra * _RMS_UNFUSED_STORED
    return L


def _rotary(ctx, size, **kw):
    """Rotary position embedding applied to queries and keys (elementwise)."""
    return _layer(ctx, fw=3 * size, agrad=3 * size, inputs=size, outputs=size,
                  act=0.0, act_grads=size, **kw)


def _swiglu(ctx, size, fused, **kw):
    """SiLU(gate) * up over ``size`` outputs; keeps gate and up for backward
    (and SiLU(gate) too when not fused)."""
    keep = np.where(fused, 2.0, 3.0) * size
    L = _layer(ctx, fw=6 * size, agrad=10 * size, inputs=2 * size, outputs=size,
               act=keep, act_grads=size, **kw)
    L["mem_agrad"] = L["mem_fw"]
    return L


# Executed work of a causal FlashAttention kernel relative to the counted
# (dense) attention flops, and its speed relative to the matrix engine's
# curve; FlashAttention-2 partitions work better than v1.
_FLASH_CAUSAL = 0.5
_FLASH_SPEED = {"flash_v1": 0.6, "flash_v2": 0.75}


def _flash(ctx, mbs, heads_t, s, d, kv, impl, **kw):
    """FlashAttention: QK^T, softmax and PV in one kernel; the s x s scores
    never reach memory and are recomputed in the backward pass."""
    q = mbs * s * heads_t * d
    k = mbs * s * kv
    fw = 4 * mbs * heads_t * s * s * d
    L = _layer(ctx, fw=fw, agrad=2 * fw, inputs=q + 2 * k, outputs=q,
               act=q + 2 * k, act_grads=q, matrix=True, **kw)
    L["keep_b"] = mbs * heads_t * s * 4 + ctx.zeros          # log-sum-exp, fp32
    L["mem_agrad"] = 2 * L["mem_fw"]
    speed = np.where(impl == CHOICES["attention_impl"].index("flash_v1"),
                     _FLASH_SPEED["flash_v1"], _FLASH_SPEED["flash_v2"])
    # Scale the executed flops into the time the kernel takes.
    L["time_scale"] = _FLASH_CAUSAL / speed
    L["agrad_extra"] = fw                                      # recomputed forward
    return L


def _dropout(ctx, size, **kw):
    L = _layer(ctx, fw=size, agrad=size, inputs=size, outputs=size, act=size,
               act_grads=size, **kw)
    # The mask is one byte per element and is the only stored activation.
    L["act_b"] = L["act"]
    L["agrad_b"] = L["act_grads"]
    L["mem_fw"] = (L["inputs"] + L["outputs"]) * ctx.bpe + L["act"]
    L["mem_agrad"] = L["mem_fw"]
    return L


def _gelu(ctx, size, fused, **kw):
    keep = np.where(fused, 0.0, 1.0) * size
    L = _layer(ctx, fw=8 * size, agrad=13 * size, inputs=size, outputs=size,
               act=keep, act_grads=keep, **kw)
    L["mem_agrad"] = L["mem_fw"]
    return L


def _softmax(ctx, size, impl, llama, **kw):
    """Softmax over the attention scores.  PyTorch's LLaMA code computes it in
    fp32 with a separate scale/mask pass; a fused scale-mask-softmax kernel
    (and Calculon's count) keeps one score tensor in the working precision."""
    L = _layer(ctx, fw=5 * size, agrad=8 * size, inputs=size, outputs=size,
               act=size, act_grads=size, **kw)
    if llama:
        torch = impl == CHOICES["attention_impl"].index("unfused")
        extra = np.where(torch, size * (4 - ctx.bpe + 4), 0.0)   # fp32 probs + masked scores
        L["act_b"] = L["act_b"] + extra
        L["mem_fw"] = L["mem_fw"] + 2 * extra
    L["mem_agrad"] = L["mem_fw"]
    return L


def _residual(ctx, a, b_, **kw):
    size = np.maximum(a, b_)
    return _layer(ctx, fw=size, agrad=a + b_, inputs=a + b_, outputs=size,
                  act=a + b_, act_grads=size, **kw)


def _fork(ctx, size, users, **kw):
    L = _layer(ctx, inputs=size, agrad=users * size, act=size, **kw)
    L["mem_fw"] = ctx.zeros
    L["mem_agrad"] = L["act"] * ctx.bpe * (users + 1)
    return L


def _tpcomm(ctx, size, conjugate, recomm, stored=True):
    """Tensor-parallel collective between layers (not overlapped)."""
    t = ctx.t
    multi = t > 1
    part = np.where(multi, size * (t - 1) / t, 0.0)
    io = np.where(multi, size, 0.0)
    L = _layer(ctx, fw=part if conjugate else 0.0, agrad=0.0 if conjugate else part,
               inputs=io, outputs=io, act=io, act_grads=io, recomm=recomm,
               stored=stored)
    b = ctx.bpe
    rs = ctx.rs_ag
    if conjugate:
        L["act_b"] = np.where(rs, io * b / t, io * b)
        L["agrad_b"] = np.where(rs, io * b / t, 0.0)
        L["mem_agrad"] = np.where(rs, L["mem_agrad"], 0.0)
    else:
        L["act_b"] = np.where(rs, io * b / t, 0.0)
        L["agrad_b"] = np.where(rs, io * b / t, io * b)
        L["mem_fw"] = np.where(rs, L["mem_fw"], 0.0)
    L["kind"] = "tpcomm"
    L["conj"] = conjugate
    L["size"] = size
    return L


def _finish_tpcomm(ctx: _Ctx, L: dict):
    t, b, net = ctx.t, ctx.bpe, ctx.tp_net
    multi = t > 1
    conj = L["conj"]
    nbytes = L["size"] * b
    for s in _STAGES:
        L["pt_" + s] = ctx.zeros
    # The layer's own (vector) work, charged inside its communication time.
    own = {s: ctx.proc(L["ft_" + s], L["mt_" + s]) for s in ("fw", "agrad", "wgrad")}
    tpeers = np.maximum(t, 2)
    for e in ("base", "edge"):
        split = ctx.rs_ag | (ctx.p2p & (e == "edge"))
        if conj:
            fw_b = nbytes + ctx.zeros
            ag_b = np.where(split, nbytes, 0.0)
            wg_b = np.where(L["recomm"], nbytes, 0.0)
            fw_op = np.where(split, net.time("reduce_scatter", fw_b, tpeers),
                             net.time("all_reduce", fw_b, tpeers))
            ag_op = np.where(split, net.time("all_gather", ag_b, tpeers), 0.0)
            wg_op = np.where(split, net.time("reduce_scatter", wg_b, tpeers),
                             net.time("all_reduce", wg_b, tpeers))
        else:
            fw_b = np.where(split, nbytes, 0.0)
            ag_b = nbytes + ctx.zeros
            wg_b = np.where(L["recomm"] & split, nbytes, 0.0)
            fw_op = np.where(split, net.time("all_gather", fw_b, tpeers), 0.0)
            ag_op = np.where(split, net.time("reduce_scatter", ag_b, tpeers),
                             net.time("all_reduce", ag_b, tpeers))
            wg_op = np.where(split, net.time("all_gather", wg_b, tpeers), 0.0)
        L[f"bytes_fw_{e}"] = np.where(multi, fw_b, 0.0)
        L[f"bytes_agrad_{e}"] = np.where(multi, ag_b, 0.0)
        L[f"bytes_wgrad_{e}"] = np.where(multi, wg_b, 0.0)
        L[f"net_fw_{e}"] = np.where(multi, fw_op + own["fw"], 0.0)
        L[f"net_agrad_{e}"] = np.where(multi, ag_op + own["agrad"], 0.0)
        L[f"net_wgrad_{e}"] = np.where(multi & L["recomm"], wg_op + own["wgrad"], 0.0)
        for s in ("fw", "agrad", "wgrad"):
            L[f"exp_{s}_{e}"] = L[f"net_{s}_{e}"]
    L["req_fw"] = L["req_agrad"] = ctx.zeros


def _overlapped(ctx: _Ctx, m, n, k, conjugate, recompute, recomm):
    """A linear layer whose TP communication is overlapped tile by tile."""
    t = ctx.t
    rs = ctx.rs_ag
    if not conjugate:
        k = k / t
        act = np.where(rs, m * n / t, m * n)
        agr = np.where(rs, m * k, 0.0)
    else:
        n = n / t
        act = np.where(rs, m * n, 0.0)
        agr = np.where(rs, 2 * (m * k / t), 2 * m * k)
    L = _layer(ctx, fw=2 * m * n * k, agrad=2 * m * n * k, wgrad=2 * m * n * k,
               inputs=m * n, outputs=m * k, weight=n * k, weight_grads=n * k,
               act=act, act_grads=agr, optim=2 * n * k, recompute=recompute,
               recomm=recomm, matrix=True)
    L["kind"] = "overlapped"
    L["conj"] = conjugate
    return L


def _finish_overlapped(ctx: _Ctx, L: dict):
    t, b, net = ctx.t, ctx.bpe, ctx.tp_net
    conj = L["conj"]
    tpeers = np.maximum(t, 2)
    ag_size = L["inputs"] * b
    rs_size = L["outputs"] * b

    def comm(e):
        split = ctx.rs_ag | (ctx.p2p & (e == "edge"))
        if conj:
            fw_b = rs_size
            ag_b = np.where(split, rs_size, 0.0)
            fw_t = np.where(split, net.time("reduce_scatter", fw_b, tpeers),
                            net.time("all_reduce", fw_b, tpeers))
            fw_t = fw_t + ctx.vector.time(fw_b / b * (t - 1) / t)
            ag_t = np.where(split, net.time("all_gather", ag_b, tpeers)
                            + 0.0, 0.0)
            wg_b = np.where(L["recomm"], fw_b, 0.0)
            wg_t = np.where(L["recomm"],
                            np.where(split, net.time("reduce_scatter", wg_b, tpeers),
                                     net.time("all_reduce", wg_b, tpeers)), 0.0)
        else:
            fw_b = np.where(split, ag_size, 0.0)
            ag_b = ag_size
            fw_t = np.where(split, net.time("all_gather", fw_b, tpeers), 0.0)
            ag_t = np.where(split, net.time("reduce_scatter", ag_b, tpeers),
                            net.time("all_reduce", ag_b, tpeers))
            ag_t = ag_t + ctx.vector.time(ag_b / b * (t - 1) / t)
            wg_b = np.where(L["recomm"], fw_b, 0.0)
            wg_t = np.where(L["recomm"] & split,
                            net.time("all_gather", wg_b, tpeers), 0.0)
        return {"fw": (fw_b, fw_t), "agrad": (ag_b, ag_t), "wgrad": (wg_b, wg_t)}

    cb, ce = comm("base"), comm("edge")
    for s in ("fw", "agrad", "wgrad"):
        L[f"bytes_{s}_base"], L[f"net_{s}_base"] = cb[s]
        L[f"bytes_{s}_edge"], L[f"net_{s}_edge"] = ce[s]

    usage = net.usage
    exposed = {}
    for s in _STAGES:
        ft, mt = L["ft_" + s], L["mt_" + s]
        nt = L[f"net_{s}_base"] if s != "optim" else ctx.zeros
        fts = ft / (1 - usage)
        ct = ctx.proc(ft, mt)
        cts = ctx.proc(fts, mt)
        T = t
        infl = nt / T - fts / T
        hidden = ct / T + (T - 1) * ct / T + (T - 1) * (nt / T) * usage
        shown = ct / T + (T - 1) * cts / T
        time = np.where(infl > 0, shown, hidden)
        ex = np.where(infl > 0, (T - 1) * infl, 0.0)
        pipe_tile = np.where(ctx.pipe, nt / T, 0.0)
        time = time + pipe_tile
        ex = ex + pipe_tile
        has = nt != 0
        L["pt_" + s] = np.where(has, time, ct)
        exposed[s] = np.where(has, ex, 0.0)
    # Calculon reads the exposed time of the last processed stage: the
    # re-communication is reported with the forward pass's exposure.
    for e in ("base", "edge"):
        L[f"exp_fw_{e}"] = exposed["fw"]
        L[f"exp_agrad_{e}"] = exposed["agrad"]
        L[f"exp_wgrad_{e}"] = exposed["fw"]
    with np.errstate(divide="ignore", invalid="ignore"):
        for s in ("fw", "agrad"):
            fts_tile = L["ft_" + s] / (1 - usage) / t
            L["req_" + s] = np.maximum(L[f"bytes_{s}_base"] / t / fts_tile,
                                       L[f"bytes_{s}_edge"] / t / fts_tile)


# ----------------------------------------------------------------------------
# The transformer block: attention then MLP.  Layers that exist only for some
# rows (e.g. overlapped vs. separate TP communication) carry a presence mask;
# the sequence is a superset whose order agrees with every variant, so running
# sums over the sequence equal the running sums over each row's own layers.

def _block(ctx: _Ctx, c: dict):
    """Per-block sums of one micro-batch for every row of ``c``.

    The GPT block with default options is exactly Calculon's layer sequence.
    A LLaMA block (``model.block == "llama"``) has RMSNorm, rotary embeddings,
    grouped-query attention (``kv_heads``), no dropout and a SwiGLU MLP whose
    first matrix is two matrices wide.  ``attention_impl`` replaces the
    attention core by a fused softmax or a FlashAttention kernel, and
    ``fused_norm`` the norm by a fused kernel.
    """
    m = ctx.m
    llama = m.block == "llama"
    h, f, s, H, d = (float(m.hidden), float(m.feedforward), float(m.seq_size),
                     float(m.attn_heads), float(m.attn_size))
    KV = float(m.kv_heads or m.attn_heads)
    t = ctx.t
    mbs = c["microbatch_size"].astype(float)
    B = mbs * s
    A = B * h
    As = np.floor_divide(B, t) * h
    ap = np.where(ctx.rs_ag, As, A)
    rec = c["activation_recompute"]
    rf = rec == CHOICES["activation_recompute"].index("full")
    raf = rf | (rec == CHOICES["activation_recompute"].index("attn_only"))
    redo = c["seq_par_ag_redo"]
    rag_attn = raf | redo
    rag_mlp = rf | redo
    sep = c["tensor_par_overlap"] == 0          # TP comm as separate layers
    ovl = ~sep
    mq = c["attention_type"] == CHOICES["attention_type"].index("multiquery")
    kv = np.where(mq, d, KV * d / t)           # K (and V) output width per processor
    impl = c["attention_impl"]
    flash = impl >= CHOICES["attention_impl"].index("flash_v1")
    core = ~flash
    fused_norm = c["fused_norm"]
    fused = c["fused_activation"]
    heads_t = H / t
    scores = heads_t * s * s * mbs
    norm = _rmsnorm if llama else _layernorm
    ff1 = 2 * f if llama else f                 # SwiGLU: gate and up projections

    seq = [
        # attention block
        (_fork(ctx, ap, 2, recompute=rf, stored=True), True),
        (norm(ctx, ap, h, fused_norm, recompute=rf, stored=False, reused=True), True),
        (_tpcomm(ctx, A, False, recomm=rag_attn), sep),
        (_fork(ctx, A, 3, recompute=rag_attn, stored=~rag_attn), sep),
        (_linear(ctx, B, h, H * d / t, recompute=rf, stored=False, reused=True), sep),
        (_overlapped(ctx, B, h, (H + 2 * KV) * d, False, rf, rag_attn), ovl & ~mq),
        (_overlapped(ctx, B, h, H * d, False, rf, rag_attn), ovl & mq),
        (_fork(ctx, A, 2, recompute=rag_attn, stored=~rag_attn), ovl & mq),
        (_linear(ctx, B, h, kv, recompute=rf, stored=False, reused=True), sep | mq),
        (_linear(ctx, B, h, kv, recompute=rf, stored=False, reused=True), sep | mq),
    ]
    if llama:
        seq.append((_rotary(ctx, B * (H * d / t + kv), recompute=raf), True))
    seq += [
        (_bmm(ctx, mbs * heads_t, s, d, s, recompute=raf, out_stored=~raf), core),
        (_softmax(ctx, scores, impl, llama, recompute=raf, out_stored=~raf), core),
    ]
    if not llama:
        seq.append((_dropout(ctx, scores, recompute=raf, stored=~raf), core))
    seq += [
        (_bmm(ctx, mbs * heads_t, s, s, d, recompute=rf), core),
        (_flash(ctx, mbs, heads_t, s, d, kv, impl, recompute=rf), flash),
        (_linear(ctx, B, H * d / t, h, recompute=rf), sep),
        (_tpcomm(ctx, A, True, recomm=rf, stored=False), sep),
        (_overlapped(ctx, B, H * d, h, True, rf, rf), ovl),
    ]
    if not llama:
        seq.append((_dropout(ctx, ap, recompute=rf), True))
    seq += [
        (_residual(ctx, ap, ap, recompute=rf, stored=False, reused=True), True),
        # MLP block
        (_fork(ctx, ap, 2, recompute=rf, stored=True), True),
        (norm(ctx, ap, h, fused_norm, recompute=rf, stored=False, reused=True), True),
        (_tpcomm(ctx, A, False, recomm=rag_mlp), sep),
        (_linear(ctx, B, h, ff1 / t, recompute=rf, stored=~rag_mlp), sep),
        (_overlapped(ctx, B, h, ff1, False, rf, rag_mlp), ovl),
        ((_swiglu if llama else _gelu)(ctx, f * B / t, fused, recompute=rf), True),
        (_linear(ctx, B, f / t, h, recompute=rf), sep),
        (_tpcomm(ctx, A, True, recomm=rf, stored=False), sep),
        (_overlapped(ctx, B, f, h, True, rf, rf), ovl),
    ]
    if not llama:
        seq.append((_dropout(ctx, ap, recompute=rf), True))
    seq.append((_residual(ctx, ap, ap, recompute=rf, stored=False, reused=True), True))
    return _accumulate(ctx, c, seq, rf)


def _sizes(ctx: _Ctx, c: dict) -> dict:
    """Activation sizes (elements) of one micro-batch and the recompute flag."""
    B = c["microbatch_size"].astype(float) * ctx.m.seq_size
    A = B * ctx.m.hidden
    As = np.floor_divide(B, ctx.t) * ctx.m.hidden
    rf = c["activation_recompute"] == CHOICES["activation_recompute"].index("full")
    return dict(B=B, A=A, As=As, rf=rf)


# Columns the per-block statistics depend on.
_BLOCK_FIELDS = ("attention_impl", "fused_norm",
                 "datatype", "tensor_par", "microbatch_size", "activation_recompute",
                 "tensor_par_comm_type", "tensor_par_overlap", "seq_par_ag_redo",
                 "fused_activation", "attention_type", "training", "tensor_par_net",
                 "optimizer_sharding", "data_par")
_OPTIM_SUMS = ("optim_flops", "optim_flops_time", "optim_mem", "optim_mem_time",
               "optim_time")


def _pack(parts) -> np.ndarray:
    """One int64 key per row from (column, radix) pairs (mixed radix)."""
    key = np.zeros(len(parts[0][0]), dtype=np.int64)
    for col, radix in parts:
        key = key * radix + col
    return key


def _compact(col: np.ndarray) -> tuple[np.ndarray, int]:
    """Small non-negative codes for an integer column, and their radix."""
    hi = int(col.max()) + 1 if len(col) else 1
    if hi <= 1 << 20:
        return col, hi
    _, inv = np.unique(col, return_inverse=True)
    return inv, int(inv.max()) + 1


_FEW = 64


class _Blocks:
    """Per-block sums for every row, computed once per distinct block.

    The block depends on a handful of columns; most layouts of a search share
    their block with many others, so it is evaluated on the distinct keys and
    gathered back.  Optimizer sharding only divides footprints (exactly) and
    changes the optimizer step, which is evaluated on its own smaller key.
    """

    def __init__(self, model, system, c: dict, uniq_dt):
        n = len(c["tensor_par"])
        if n <= _FEW:        # a handful of layouts: no deduplication to win
            k = _block(_Ctx(model, system, c, uniq_dt), c)
            self._n1 = [name for name in k if name not in _OPTIM_SUMS]
            self._t1 = np.stack([np.broadcast_to(k[name], (n,)) for name in self._n1])
            self._t2 = np.stack([np.broadcast_to(k[name], (n,)) for name in _OPTIM_SUMS])
            self.inv1 = self.inv2 = np.arange(n)
            self.shard = self.grad_shard = np.ones(n)     # already divided
            return
        t = c["tensor_par"]
        tpnet = np.where(t > 1, c["tensor_par_net"], 0)
        tp_code, tp_rad = _compact(t)
        mbs_code, mbs_rad = _compact(c["microbatch_size"])
        key1 = _pack([(c["datatype"].astype(np.int64), 4), (tp_code, tp_rad),
                      (mbs_code, mbs_rad), (c["activation_recompute"].astype(np.int64), 3),
                      (c["tensor_par_comm_type"].astype(np.int64), 3),
                      (c["tensor_par_overlap"].astype(np.int64), 3),
                      (c["seq_par_ag_redo"].astype(np.int64), 2),
                      (c["fused_activation"].astype(np.int64), 2),
                      (c["attention_type"].astype(np.int64), 2),
                      (c["training"].astype(np.int64), 2), (tpnet, MAX_TIERS),
                      (c["attention_impl"].astype(np.int64), 4),
                      (c["fused_norm"].astype(np.int64), 2)])
        _, idx1, inv1 = np.unique(key1, return_index=True, return_inverse=True)
        sub = {f: c[f][idx1] for f in _BLOCK_FIELDS}
        sub["tensor_par_net"] = tpnet[idx1]
        sub["optimizer_sharding"] = np.zeros(len(idx1), dtype=bool)
        sub["data_par"] = np.ones(len(idx1), dtype=np.int64)
        k1 = _block(_Ctx(model, system, sub, uniq_dt), sub)

        shard = np.where(c["optimizer_sharding"], c["data_par"], 1)
        sh_code, sh_rad = _compact(shard)
        key2 = _pack([(c["datatype"].astype(np.int64), 4), (tp_code, tp_rad),
                      (c["attention_type"].astype(np.int64), 2),
                      ((c["tensor_par_overlap"] != 0).astype(np.int64), 2),
                      (c["training"].astype(np.int64), 2), (sh_code, sh_rad)])
        _, idx2, inv2 = np.unique(key2, return_index=True, return_inverse=True)
        sub2 = {f: c[f][idx2] for f in _BLOCK_FIELDS}
        k2 = _block(_Ctx(model, system, sub2, uniq_dt), sub2)
        # Sums stacked as (sum, distinct block) tables, gathered per chunk.
        self._n1 = [name for name in k1 if name not in _OPTIM_SUMS]
        self._t1 = np.stack([np.broadcast_to(k1[name], (len(idx1),)) for name in self._n1])
        self._t2 = np.stack([np.broadcast_to(k2[name], (len(idx2),)) for name in _OPTIM_SUMS])
        self.inv1, self.inv2 = inv1, inv2
        self.shard = shard
        self.grad_shard = np.where(c["unsharded_grads"], 1, shard)

    def rows(self, sl: slice) -> dict:
        """Per-block sums for the rows ``sl`` (one gather per key table)."""
        a = self._t1[:, self.inv1[sl]]
        b = self._t2[:, self.inv2[sl]]
        k = dict(zip(self._n1, a))
        k.update(zip(_OPTIM_SUMS, b))
        k["wgrad_space"] = k["wgrad_space"] / self.grad_shard[sl]
        k["optimizer_space"] = k["optimizer_space"] / self.shard[sl]
        return k


_SUMS = (
    "fw_flops", "fw_flops_time", "fw_mem", "fw_mem_time", "fw_time",
    "base_fw_tp_size", "edge_fw_tp_size", "base_fw_tp_time", "edge_fw_tp_time",
    "base_fw_tp_exp", "edge_fw_tp_exp",
    "re_flops", "re_flops_time", "re_mem", "re_mem_time", "re_time",
    "base_recomm_size", "edge_recomm_size", "base_recomm_time", "edge_recomm_time",
    "base_recomm_exp", "edge_recomm_exp",
    "agrad_flops", "agrad_flops_time", "agrad_mem", "agrad_mem_time", "agrad_time",
    "base_agrad_tp_size", "edge_agrad_tp_size", "base_agrad_tp_time",
    "edge_agrad_tp_time", "base_agrad_tp_exp", "edge_agrad_tp_exp",
    "wgrad_flops", "wgrad_flops_time", "wgrad_mem", "wgrad_mem_time", "wgrad_time",
    "optim_flops", "optim_flops_time", "optim_mem", "optim_mem_time", "optim_time",
    "weight_space", "act_working", "act_storage", "wgrad_space",
    "wgrad_space_full", "act_grad_space", "optimizer_space", "useful_fw",
    "useful_bw",
)


def _accumulate(ctx: _Ctx, c: dict, seq, rf) -> dict:
    """Per-block sums over the layer sequence, for one micro-batch."""
    z = ctx.zeros
    acc = {k: z.copy() for k in _SUMS}
    acc["tp_bw_req"] = z.copy()
    tr = ctx.training
    for L, present in seq:
        p = np.broadcast_to(present, z.shape)
        if not p.any():
            continue
        _finish(ctx, L)
        pt = p & tr

        def add(key, val, mask=p):
            if mask is True or mask.all():
                acc[key] += val
            elif mask.any():
                acc[key] += np.where(mask, val, 0.0)

        add("fw_flops", L["fw"])
        add("fw_flops_time", L["ft_fw"])
        add("fw_mem", L["mem_fw"])
        add("fw_mem_time", L["mt_fw"])
        add("fw_time", L["pt_fw"])
        add("useful_fw", L["fw"])
        for e in ("base", "edge"):
            add(f"{e}_fw_tp_size", L[f"bytes_fw_{e}"])
            add(f"{e}_fw_tp_time", L[f"net_fw_{e}"])
            add(f"{e}_fw_tp_exp", L[f"exp_fw_{e}"])
        acc["tp_bw_req"] = np.maximum(acc["tp_bw_req"], np.where(p, L["req_fw"], 0.0))
        # Calculon adds the running forward totals (not the layer's own) to the
        # recompute sums; its recompute time is the layer's own.
        r = pt & L["recompute"]
        add("re_flops", acc["fw_flops"], r)
        add("re_flops_time", acc["fw_flops_time"], r)
        add("re_mem", acc["fw_mem"], r)
        add("re_mem_time", acc["fw_mem_time"], r)
        add("re_time", L["pt_fw"], r)
        rc = pt & L["recomm"]
        for e in ("base", "edge"):
            add(f"{e}_recomm_size", L[f"bytes_wgrad_{e}"], rc)
            add(f"{e}_recomm_time", L[f"net_wgrad_{e}"], rc)
            add(f"{e}_recomm_exp", L[f"exp_wgrad_{e}"], rc)
            add(f"{e}_agrad_tp_size", L[f"bytes_agrad_{e}"], pt)
            add(f"{e}_agrad_tp_time", L[f"net_agrad_{e}"], pt)
            add(f"{e}_agrad_tp_exp", L[f"exp_agrad_{e}"], pt)
        add("agrad_flops", L["agrad"], pt)
        add("agrad_flops_time", L["ft_agrad"], pt)
        add("agrad_mem", L["mem_agrad"], pt)
        add("agrad_mem_time", L["mt_agrad"], pt)
        add("agrad_time", L["pt_agrad"], pt)
        add("wgrad_flops", L["wgrad"], pt)
        add("wgrad_flops_time", L["ft_wgrad"], pt)
        add("wgrad_mem", L["mem_wgrad"], pt)
        add("wgrad_mem_time", L["mt_wgrad"], pt)
        add("wgrad_time", L["pt_wgrad"], pt)
        add("optim_flops", L["optim_flops"], pt)
        add("optim_flops_time", L["ft_optim"], pt)
        add("optim_mem", L["mem_optim"], pt)
        add("optim_mem_time", L["mt_optim"], pt)
        add("optim_time", L["pt_optim"], pt)
        add("useful_bw", L["agrad"] + L["wgrad"], pt)
        acc["tp_bw_req"] = np.maximum(acc["tp_bw_req"], np.where(pt, L["req_agrad"], 0.0))
        add("weight_space", L["weight_b"])
        add("act_working", L["act_b"], p & ~L["reused"])
        add("act_storage", L["act_b"])
        add("act_storage", -L["out_b"], pt & ~L["out_stored"])
        add("act_storage", -L["act_b"], pt & ~L["stored"])
        if "keep_b" in L:       # intermediates a kernel keeps beyond Calculon's count
            add("act_storage", L["keep_b"])
            add("act_working", L["keep_b"])
        add("wgrad_space", L["wgrad_sh"], pt)
        add("wgrad_space_full", L["wgrad_full"], pt)
        add("act_grad_space", L["agrad_b"], pt)
        add("optimizer_space", L["optimizer"], pt)
    acc["act_storage"] = np.where(rf, 0.0, acc["act_storage"])
    return acc


# ----------------------------------------------------------------------------
# Batch level: pipeline schedule, bubbles, DP communication, offload, memory.

def _batch(ctx: _Ctx, c: dict, k: dict, x: dict, system: SystemSpec) -> dict:
    """Whole-batch statistics per row from the per-block sums ``k``."""
    tr = ctx.training
    nb = ctx.m.num_blocks
    pp, dp = c["pipeline_par"], c["data_par"]
    ppf = pp.astype(float)
    ppint = c["pipeline_interleaving"]
    bpe = ctx.bpe
    rf = x["rf"]
    bpp = -(-nb // pp)
    brb = np.where(nb % pp != 0, pp - nb % pp, 0)
    bpc = np.maximum(bpp // ppint, 1)
    chunks = bpp // bpc
    base = (bpc - 1).astype(float)
    edge = 1.0
    nmb = c["batch_size"] // dp // c["microbatch_size"]
    osh = c["optimizer_sharding"]
    wo, ao, oo = c["weight_offload"], c["activations_offload"], c["optimizer_offload"]

    ckpt = np.where(tr & rf, x["A"] * bpe, 0.0)
    pp_size = np.where(pp > 1, np.where(ctx.rs_ag | ctx.p2p, x["As"], x["A"]) * bpe, 0.0)
    bw_pp_size = np.where(tr, pp_size, 0.0)

    mult = bpp * nmb
    S = {}
    # Per-block statistics.
    for name, key in (("fw", "fw"), ("re", "re"), ("agrad", "agrad"),
                      ("wgrad", "wgrad"), ("optim", "optim")):
        S[f"block_{name}_flops"] = k[f"{key}_flops"]
        S[f"block_{name}_flops_time"] = k[f"{key}_flops_time"]
        S[f"block_{name}_mem_accessed"] = k[f"{key}_mem"]
        S[f"block_{name}_mem_time"] = k[f"{key}_mem_time"]
        S[f"block_{name}_time"] = k[f"{key}_time"]
    for e in ("base", "edge"):
        S[f"{e}block_fw_tp_time"] = k[f"{e}_fw_tp_time"]
        S[f"{e}block_fw_tp_time_exposed"] = k[f"{e}_fw_tp_exp"]
        S[f"{e}block_recomm_time"] = k[f"{e}_recomm_time"]
        S[f"{e}block_recomm_time_exposed"] = k[f"{e}_recomm_exp"]
        S[f"{e}block_agrad_tp_time"] = k[f"{e}_agrad_tp_time"]
        S[f"{e}block_agrad_tp_time_exposed"] = k[f"{e}_agrad_tp_exp"]
        S[f"{e}block_fw_tp_size"] = k[f"{e}_fw_tp_size"]
        S[f"{e}block_bw_tp_size"] = k[f"{e}_agrad_tp_size"]
        S[f"{e}block_recomm_size"] = k[f"{e}_recomm_size"]
    S["block_fw_pp_size"] = pp_size
    S["block_bw_pp_size"] = bw_pp_size
    S["tp_bw_overlap_req"] = k["tp_bw_req"]

    def per_chunk_total(b_val, e_val):
        return nmb * chunks * (base * b_val + edge * e_val)

    tp_fw = per_chunk_total(k["base_fw_tp_time"], k["edge_fw_tp_time"])
    tp_fw_exp = per_chunk_total(k["base_fw_tp_exp"], k["edge_fw_tp_exp"])
    tp_bw = per_chunk_total(k["base_agrad_tp_time"], k["edge_agrad_tp_time"])
    tp_bw_exp = per_chunk_total(k["base_agrad_tp_exp"], k["edge_agrad_tp_exp"])
    recomm = per_chunk_total(k["base_recomm_time"], k["edge_recomm_time"])
    recomm_exp = per_chunk_total(k["base_recomm_exp"], k["edge_recomm_exp"])

    pp_net = _Net(system.networks, c["pipeline_par_net"])
    chunk_fw_pp = pp_net.time("p2p", pp_size, 2)
    chunk_bw_pp = pp_net.time("p2p", bw_pp_size, 2)
    n_fw_p2p = np.where(pp > 1, chunks, 0)
    n_bw_p2p = np.where((pp > 1) & tr, chunks, 0)
    pp_link = nmb * n_fw_p2p * chunk_fw_pp + nmb * n_bw_p2p * chunk_bw_pp

    # Offloading to the second memory tier, overlapped with block compute.
    act_off = np.where(rf, ckpt, k["act_storage"])
    fw_off_size = np.maximum(np.where(wo, k["weight_space"], 0.0),
                             np.where(ao, act_off, 0.0))
    bw_off_size = np.where(tr, np.where(wo, k["weight_space"], 0.0)
                           + np.where(ao, act_off, 0.0)
                           + np.where(oo, k["optimizer_space"], 0.0), 0.0)
    fw_off_t = ctx.mem2.time(fw_off_size)
    bw_off_t = np.where(tr, ctx.mem2.time(bw_off_size), 0.0)

    base_fw_no = k["fw_time"] + k["base_fw_tp_exp"]
    edge_fw_no = k["fw_time"] + k["edge_fw_tp_exp"] + chunk_fw_pp
    base_fw_oh = np.maximum(0.0, fw_off_t + k["fw_mem_time"] - base_fw_no)
    edge_fw_oh = np.maximum(0.0, fw_off_t + k["fw_mem_time"] - edge_fw_no)
    base_fw = base_fw_no + base_fw_oh
    edge_fw = edge_fw_no + edge_fw_oh
    bw_common = k["re_time"] + k["agrad_time"] + k["wgrad_time"]
    base_bw_no = bw_common + k["base_recomm_exp"] + k["base_agrad_tp_exp"]
    edge_bw_no = bw_common + k["edge_recomm_exp"] + k["edge_agrad_tp_exp"] + chunk_bw_pp
    grad_mem_t = k["agrad_mem_time"] + k["wgrad_mem_time"]
    base_bw_oh = np.maximum(0.0, bw_off_t + grad_mem_t - base_bw_no)
    edge_bw_oh = np.maximum(0.0, bw_off_t + grad_mem_t - edge_bw_no)
    base_bw = base_bw_no + base_bw_oh
    edge_bw = edge_bw_no + edge_bw_oh
    chunk_fw = base * base_fw + edge * edge_fw
    chunk_bw = base * base_bw + edge * edge_bw

    # Time in which DP communication can hide (not memory-bound work).
    optim_free = np.where(osh, 0.0, k["optim_time"] - k["optim_mem_time"])
    base_dp_ovl = base_bw - (grad_mem_t + k["re_mem_time"]) + optim_free
    edge_dp_ovl = edge_bw - (grad_mem_t + k["re_mem_time"]) + optim_free
    block_dp_compute = (k["agrad_flops_time"] + k["wgrad_flops_time"] + k["re_flops_time"]
                        + np.where(osh, 0.0, k["optim_flops_time"]))
    same_tp = c["data_par_net"] == c["tensor_par_net"]
    base_dp_ovl = base_dp_ovl - np.where(same_tp, k["base_recomm_time"] + k["base_agrad_tp_time"], 0.0)
    edge_dp_ovl = edge_dp_ovl - np.where(same_tp, k["edge_recomm_time"] + k["edge_agrad_tp_time"], 0.0)
    chunk_dp_ovl = base * base_dp_ovl + edge * edge_dp_ovl
    chunk_dp_compute = bpc * block_dp_compute
    chunk_time = chunk_fw + chunk_bw

    # Pipeline bubble, shortened by missing blocks, lengthened by missing
    # micro-batches with interleaving.
    bubble_red = np.where(base > 0, brb * (base_fw + edge_fw + base_bw + edge_bw) / 2,
                          brb * (edge_fw + edge_bw))
    rem = nmb % pp
    extra = np.where(rem != 0, (ppint - 1) * (pp - rem), 0)
    bubble = (pp - 1) * chunk_time + (extra * chunk_time - bubble_red)

    # Data-parallel gradient communication.
    dp_net = _Net(system.networks, c["data_par_net"])
    dpeers = np.maximum(dp, 2)
    dp_on = (dp > 1) & tr
    block_dp_size = np.where(dp_on, k["weight_space"], 0.0)
    block_dp_time = np.where(dp_on, np.where(
        osh, dp_net.time("reduce_scatter", block_dp_size, dpeers)
        + dp_net.time("all_gather", block_dp_size, dpeers),
        dp_net.time("all_reduce", block_dp_size, dpeers)), 0.0)
    op_scale = np.where(osh, dp_net.scale("reduce_scatter") + dp_net.scale("all_gather"),
                        dp_net.scale("all_reduce"))
    usage = dp_net.usage
    n_ovl = ppint - 1
    last_size = bpc - 1
    window = ppf * chunk_dp_ovl
    ovl_compute = ppf * chunk_dp_compute
    chunk_dp_time = bpc * block_dp_time
    same_pp = c["data_par_net"] == c["pipeline_par_net"]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.floor_divide(chunk_dp_time, chunk_bw)
        num_ovl_pp = np.where(same_pp, np.minimum(q, np.where(rem != 0, rem, pp)), 0.0)
        infl = chunk_dp_time - (window - num_ovl_pp * chunk_bw_pp) + ovl_compute * usage
        ovl_exposed = np.where(infl > 0, n_ovl * infl, n_ovl * chunk_dp_time * usage)
        chunk_ovl_time = (window + ovl_compute * usage - np.where(same_pp, chunk_bw_pp, 0.0)) * n_ovl
        req_chunk = np.where(chunk_ovl_time > 0,
                             bpc * block_dp_size / chunk_ovl_time * op_scale, 0.0)
        last_window = np.where(base > 0, chunk_dp_ovl - chunk_bw_pp - (base_bw + edge_bw) / 2
                               + optim_free, 0.0)
        last_infl = last_size * block_dp_time + (block_dp_compute * usage - last_window)
        last_exposed = np.where(last_infl > 0, last_infl, last_size * block_dp_time * usage)
        tail_time = last_window + last_size * block_dp_time * usage
        req_tail = np.where(tail_time > 0, bpc * block_dp_size / tail_time * op_scale, 0.0)
    dp_ovl_on = dp_on & c["data_par_overlap"]
    dp_link = np.where(dp_on, bpp * block_dp_time, 0.0)
    dp_exp = np.where(dp_ovl_on, block_dp_time + ovl_exposed + last_exposed, dp_link)
    S["block_dp_size"] = block_dp_size
    S["dp_bw_overlap_req_chunk"] = np.where(dp_ovl_on, req_chunk, 0.0)
    S["dp_bw_overlap_req_tail"] = np.where(dp_ovl_on, req_tail, 0.0)

    # Memory footprints.
    S["block_weight_space"] = k["weight_space"]
    S["block_act_working_space"] = k["act_working"]
    S["block_act_storage_space"] = k["act_storage"]
    S["block_act_checkpoint_size"] = ckpt
    S["block_weight_grad_space"] = k["wgrad_space"]
    S["block_weight_grad_space_no_sharding"] = k["wgrad_space_full"]
    S["block_act_grad_space"] = k["act_grad_space"]
    S["block_optimizer_space"] = k["optimizer_space"]
    weight_space = k["weight_space"] * bpp
    mem_mb = np.minimum(nmb, pp).astype(float)
    pp_factor = np.where(ppint > 1, mem_mb * (1 + (pp - 1) / (ppint * ppf)), mem_mb)

    def stage_acts(in_flight):
        """Activations and checkpoints of a stage with ``in_flight`` micro-batches."""
        act = np.where(tr & ~rf, k["act_working"] + k["act_storage"] * (bpp * in_flight - 1),
                       k["act_working"])
        return act, np.where(tr & rf, bpp * ckpt * in_flight, 0.0)

    act_space, ckpt_total = stage_acts(pp_factor)
    # The last stage has one micro-batch in flight where the first has mem_mb.
    act_last, ckpt_last = stage_acts(pp_factor / np.maximum(mem_mb, 1.0))
    act_grad = np.where(tr, k["act_grad_space"], 0.0)
    wgrad_space = np.where(tr, k["wgrad_space_full"] + k["wgrad_space"] * (bpp - 1), 0.0)
    optimizer_space = np.where(tr, k["optimizer_space"] * bpp, 0.0)
    weight_min = k["weight_space"] * 2
    act_min = np.where(rf, k["act_working"], k["act_working"] + k["act_storage"])
    ckpt_min = np.where(tr, np.where(rf, ckpt * 2, 0.0), np.nan)
    wgrad_min = np.where(tr, k["wgrad_space_full"] + k["wgrad_space"], 0.0)
    optim_min = np.where(tr, k["optimizer_space"] * 2, 0.0)
    S["weight_space_with_offload"] = weight_min
    S["act_space_with_offload"] = act_min
    S["act_checkpoint_size_with_offload"] = ckpt_min
    S["act_grad_space_with_offload"] = act_grad
    S["weight_grad_space_with_offload"] = wgrad_min
    S["optimizer_space_with_offload"] = optim_min
    S["weight_space"] = weight_space
    S["act_space"] = act_space
    S["act_checkpoint_size"] = ckpt_total
    S["act_grad_space"] = act_grad
    S["weight_grad_space"] = wgrad_space
    S["optimizer_space"] = optimizer_space

    # Times of the whole batch.
    fw_time = mult * k["fw_time"]
    bw_time = mult * (k["agrad_time"] + k["wgrad_time"])
    optim_time = bpp * k["optim_time"]
    fw_oh = per_chunk_total(base_fw_oh, edge_fw_oh)
    bw_oh = np.where(tr, per_chunk_total(base_bw_oh, edge_bw_oh), 0.0)
    re_time = mult * k["re_time"]
    recomm_link = np.where(tr, recomm, 0.0)
    recomm_exp = np.where(tr, recomm_exp, 0.0)
    S["fw_time"] = fw_time
    S["bw_time"] = bw_time
    S["optim_step_time"] = optim_time
    S["recompute_time"] = re_time
    S["recomm_link_time"] = recomm_link
    S["recomm_exposed_time"] = recomm_exp
    S["bubble_time"] = bubble
    S["tp_comm_link_time"] = tp_fw + tp_bw
    S["pp_comm_link_time"] = pp_link
    S["dp_comm_link_time"] = dp_link
    S["tp_comm_exposed_time"] = tp_fw_exp + tp_bw_exp
    S["dp_comm_exposed_time"] = dp_exp
    S["fw_offload_exposed_time"] = fw_oh
    S["bw_offload_exposed_time"] = bw_oh
    total = (fw_time + bw_time + optim_time + fw_oh + bw_oh + re_time + recomm_exp
             + bubble + S["tp_comm_exposed_time"] + pp_link + dp_exp)
    head_time, head_mem = _head(ctx, c, x, nmb, pp, system)
    total = total + head_time
    # Pipelined steps run slower by the system's pipeline_fraction: at every
    # synchronising p2p exchange a stage waits for its neighbour.
    frac = system.time_overhead.pipeline_fraction if system.time_overhead else 0.0
    pp_sync = np.where(pp > 1, frac * total, 0.0)
    S["pp_comm_exposed_time"] = pp_link + pp_sync
    total = total + pp_sync
    S["total_time"] = total

    with np.errstate(divide="ignore", invalid="ignore"):
        fw_ot = np.minimum(base_fw_no, edge_fw_no) - k["fw_mem_time"]
        bw_ot = np.minimum(base_bw_no, edge_bw_no) - grad_mem_t
        S["act_offload_bw_req"] = act_off / fw_ot
        S["weight_offload_bw_req"] = k["weight_space"] / fw_ot
        S["optim_offload_bw_req"] = np.where(
            tr, (k["wgrad_space"] + k["optimizer_space"]) / bw_ot, 0.0)
        S["offload_mem_bw_req"] = np.where(
            tr, np.maximum(fw_off_size / fw_ot, bw_off_size / bw_ot), fw_off_size / fw_ot)

    # Tier 1 holds persistent state (weights, gradients, optimizer) and
    # transient tensors (activations, checkpoints, gradients of activations,
    # logits); fragmentation is charged on the transient part.  The need is
    # that of the fuller of the first stage (most micro-batches in flight,
    # the embedding) and the last (one micro-batch, the output layer and the
    # logits); with one stage, they are the same.
    static = np.where(wo, weight_min, weight_space)
    tier2 = np.where(wo, weight_space, 0.0)
    ao_rf = ao & rf
    ckpt_off = np.where(ao_rf, np.nan_to_num(ckpt_min), 0.0)
    transient = np.where(ao, act_min, act_space + ckpt_total) + ckpt_off + act_grad
    last = np.where(ao, act_min, act_last + ckpt_last) + ckpt_off + act_grad + head_mem["logits"]
    tier2 = tier2 + np.where(ao, np.where(rf, ckpt_total, act_space), 0.0)
    static = static + np.where(oo, wgrad_min + optim_min, wgrad_space + optimizer_space)
    tier2 = tier2 + np.where(oo, k["wgrad_space"] * bpp + optimizer_space, 0.0)
    over = system.memory_overhead
    grow = 1.0 + (over.fraction if over is not None else 0.0)
    tier1 = np.maximum(static + head_mem["first"] + transient * grow,
                       static + head_mem["last"] + last * grow)
    if over is not None:
        tier1 = tier1 + over.reserved_GiB * 1024 ** 3
    S["proc_mem_tier1_cap_req"] = tier1
    S["proc_mem_tier2_cap_req"] = tier2

    useful = k["useful_fw"] + k["useful_bw"] + k["optim_flops"]
    compute_time = fw_time + bw_time + optim_time
    perfect = mult * useful / ctx.matrix.peak
    with np.errstate(divide="ignore", invalid="ignore"):
        S["useful_flops"] = useful
        S["compute_efficiency"] = perfect / compute_time
        S["system_efficiency"] = compute_time / total
        S["total_efficiency"] = perfect / total
        S["sample_rate"] = c["batch_size"] / total
    S["_mem1_cap"] = ctx.mem1.capacity
    S["_mem2_cap"] = ctx.mem2.capacity
    return S


def _head(ctx: _Ctx, c: dict, x: dict, nmb, pp, system: SystemSpec):
    """Time and memory of the embedding and the output layer with its loss.

    Only for models that give ``vocab_size`` (Calculon models none).  The
    output layer and the cross-entropy (in fp32) run on the last pipeline
    stage for every micro-batch; that stage paces the pipeline, so the extra
    time is paid in each of the ``nmb + pp - 1`` schedule slots.  The first
    stage holds the embedding, the last the output matrix and one
    micro-batch's logits (with the fp32 copies the system's
    ``memory_overhead`` says the loss keeps); with one stage, both.
    """
    V = float(ctx.m.vocab_size)
    if V <= 0:
        return 0.0, {"first": 0.0, "last": 0.0, "logits": 0.0}
    t, tr, b = ctx.t, ctx.training, ctx.bpe
    B = x["B"]
    out = _finish(ctx, _linear(ctx, B, float(ctx.m.hidden), V / t))
    logits = B * V / t
    loss = _finish(ctx, _layer(ctx, fw=5 * logits, agrad=3 * logits, inputs=logits,
                               outputs=logits))
    per_mb = out["pt_fw"] + loss["pt_fw"] + np.where(
        tr, out["pt_agrad"] + out["pt_wgrad"] + loss["pt_agrad"], 0.0)
    time = (nmb + pp - 1) * per_mb
    params = V * ctx.m.hidden / t
    grads = np.where(c["unsharded_grads"], b, b / ctx.shard)
    per_param = b + np.where(tr, grads + np.where(b < 4, 12.0, 8.0) / ctx.shard, 0.0)
    matrix = params * per_param
    over = system.memory_overhead or MemoryOverhead()
    logit_mem = B * V / (1.0 if over.logits_gathered else t) * (
        b + np.where(tr, over.logits_fp32_copies * 4.0, 0.0))
    return time, {"first": matrix, "last": np.where(pp == 1, 2 * matrix, matrix),
                  "logits": logit_mem}


# ----------------------------------------------------------------------------
# Validity, in the order Calculon checks it.

def _reasons(model: ModelSpec, system: SystemSpec, c: dict) -> np.ndarray:
    n = len(c["tensor_par"])
    code = np.zeros(n, dtype=np.int16)

    def flag(mask, reason):
        mask = np.asarray(mask, dtype=bool)
        code[(code == 0) & mask] = _R[reason]

    t, pp, dp = c["tensor_par"], c["pipeline_par"], c["data_par"]
    tr = c["training"]
    flag((c["num_procs"] <= 0) | (t <= 0) | (pp <= 0) | (dp <= 0) | (c["batch_size"] <= 0)
         | (c["microbatch_size"] <= 0) | (c["pipeline_interleaving"] <= 0),
         "invalid: sizes must be positive")
    tp1, pp1, dp1 = np.maximum(t, 1), np.maximum(pp, 1), np.maximum(dp, 1)
    mbs1 = np.maximum(c["microbatch_size"], 1)
    flag(t * pp * dp != c["num_procs"], "invalid: tensor_par * pipeline_par * data_par != num_procs")
    flag(c["batch_size"] % dp1 != 0, "invalid: batch_size is not divisible by data_par")
    flag((c["batch_size"] // dp1) % mbs1 != 0,
         "invalid: local batch is not divisible by microbatch_size")
    rec = c["activation_recompute"]
    flag((rec != CHOICES["activation_recompute"].index("none")) & ~tr,
         "invalid: activation recompute is only for training")
    flag((pp == 1) & (c["pipeline_interleaving"] != 1),
         "invalid: pipeline_interleaving must be 1 when pipeline_par is 1")
    flag(c["optimizer_sharding"] & (dp <= 1), "invalid: optimizer_sharding needs data_par > 1")
    flag((c["tensor_par_overlap"] != 0) & (t <= 1), "invalid: tensor_par_overlap needs tensor_par > 1")
    rs = c["tensor_par_comm_type"] == CHOICES["tensor_par_comm_type"].index("rs_ag")
    redo = c["seq_par_ag_redo"]
    flag(redo & ~rs, "invalid: seq_par_ag_redo needs tensor_par_comm_type rs_ag")
    flag(redo & (rec == CHOICES["activation_recompute"].index("full")),
         "invalid: seq_par_ag_redo is not used with full recompute")
    flag(c["data_par_overlap"] & (~tr | (dp <= 1)),
         "invalid: data_par_overlap needs training and data_par > 1")
    flag(c["optimizer_offload"] & ~tr, "invalid: optimizer_offload is only for training")
    nets = system.networks
    nn = len(nets)
    for f in ("tensor_par_net", "pipeline_par_net", "data_par_net"):
        flag((c[f] < 0) | (c[f] >= nn), "invalid: network tier out of range")
    # Network tiers: each must hold the product of the parallelisms on it,
    # and a tier that must be filled must be filled exactly.
    for tier in range(min(nn, MAX_TIERS)):
        size = np.ones(n, dtype=np.int64)
        used = np.zeros(n, dtype=bool)
        for par, net in ((t, "tensor_par_net"), (pp, "pipeline_par_net"), (dp, "data_par_net")):
            on = (par > 1) & (c[net] == tier)
            used |= on
            size = np.where(on, size * par, size)
        flag(used & (size > nets[tier].size), REASONS[_NET_BIG + tier])
        if nets[tier].must_be_filled:
            flag(used & (nets[tier].size % np.maximum(size, 1) != 0), REASONS[_NET_FILL + tier])
    dts = [CHOICES["datatype"].index(d) for d in CHOICES["datatype"]
           if d in system.matrix and d in system.vector]
    flag(~np.isin(c["datatype"], dts), "invalid: datatype not supported by the system")
    nb = model.num_blocks
    bpp = -(-nb // pp1)
    ppint1 = np.maximum(c["pipeline_interleaving"], 1)
    flag(ppint1 > bpp, "infeasible: pipeline_interleaving exceeds the blocks per processor")
    flag(bpp % ppint1 != 0, "infeasible: pipeline_interleaving must divide the blocks per processor")
    flag((c["weight_offload"] | c["activations_offload"] | c["optimizer_offload"]) & (bpp <= 2),
         "infeasible: offloading requires each processor to handle at least 3 blocks")
    p2p = c["tensor_par_comm_type"] == CHOICES["tensor_par_comm_type"].index("p2p_rs_ag")
    flag((rs | p2p) & ((c["microbatch_size"] * model.seq_size) % tp1 != 0),
         "invalid: microbatch_size * seq_size must be divisible by tensor_par")
    flag((model.hidden % tp1 != 0) | (model.feedforward % tp1 != 0) | (model.attn_heads % tp1 != 0),
         "invalid: hidden, feedforward and attn_heads must be divisible by tensor_par")
    return code, dts


def _normalize(cols: Mapping) -> dict:
    missing = [f for f in FIELDS if f not in cols]
    if missing:
        raise ValueError(f"layout table lacks columns: {', '.join(missing)}")
    n = len(cols["tensor_par"])
    c = {}
    for f in FIELDS:
        a = np.asarray(cols[f])
        if a.shape != (n,):
            a = np.broadcast_to(a, (n,))
        c[f] = a
    for f, default in EXT_DEFAULTS.items():
        if f in cols:
            c[f] = np.broadcast_to(np.asarray(cols[f]), (n,))
        elif f in CHOICES:
            c[f] = np.full(n, CHOICES[f].index(default), dtype=np.int8)
        else:
            c[f] = np.full(n, default, dtype=bool)
    return c


CHUNK = 1 << 14
_MEM_REQ = ("proc_mem_tier1_cap_req", "proc_mem_tier2_cap_req")


def evaluate_columns(model: ModelSpec, system: SystemSpec, cols: Mapping,
                     stats=None) -> dict:
    """Every statistic for every layout of ``cols`` (a layout table).

    Returns a dict of columns: each name of ``STATS`` (or of ``stats``, a
    subset, when given; NaN where the layout cannot run, except that a layout
    that fails on memory capacity keeps its two ``proc_mem_tier*_cap_req``
    requirements), ``feasible`` (bool) and ``reason_code`` (index in
    REASONS).  Only layouts that pass the rules are computed: the block once
    per distinct block, the batch level in chunks that stay in cache.
    """
    names = STATS if stats is None else tuple(stats)
    unknown = [x for x in names if x not in STATS]
    if unknown:
        raise ValueError(f"unknown statistics: {', '.join(unknown)}")
    c = _normalize(cols)
    n = len(c["tensor_par"])
    code, dts = _reasons(model, system, c)
    # One (statistic, layout) table; each statistic is a contiguous row of it.
    table = np.full((len(names), n), np.nan)
    out = dict(zip(names, table))
    rows = np.flatnonzero(code == 0)
    if len(rows):
        every = len(rows) == n
        valid = _typed_columns(c if every else {f: v[rows] for f, v in c.items()})
        uniq = sorted(set(np.unique(valid["datatype"]).tolist()))
        m = len(rows)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            blocks = _Blocks(model, system, valid, uniq)
            for i in range(0, m, CHUNK):
                sl = slice(i, min(i + CHUNK, m))
                at = sl if every else rows[sl]
                cs = {f: v[sl] for f, v in valid.items()}
                ctx = _Ctx(model, system, cs, uniq)
                S = _batch(ctx, cs, blocks.rows(sl), _sizes(ctx, cs), system)
                cc = np.zeros(sl.stop - sl.start, dtype=code.dtype)
                cc[S["proc_mem_tier1_cap_req"] > S["_mem1_cap"]] = \
                    _R["infeasible: mem tier1 capacity exceeded"]
                cc[(cc == 0) & (S["proc_mem_tier2_cap_req"] > S["_mem2_cap"])] = \
                    _R["infeasible: mem tier2 capacity exceeded"]
                code[at] = cc
                # A layout that fails only on memory keeps its requirements,
                # so that the reason can say how much it needs.
                bad = cc != 0
                for name in names:
                    v = np.array(np.broadcast_to(S[name], cc.shape), dtype=float)
                    if name not in _MEM_REQ:
                        np.putmask(v, bad, np.nan)
                    out[name][at] = v
    out["feasible"] = code == 0
    out["reason_code"] = code
    return out


def evaluate_one(model: ModelSpec, system: SystemSpec, execution: Mapping) -> dict:
    """One execution -> what ``evaluate_columns`` returns, as Python values."""
    out = evaluate_columns(model, system, to_columns([execution]))
    return {k: (v[0].item() if hasattr(v[0], "item") else v[0]) for k, v in out.items()}


def _typed_columns(c: dict) -> dict:
    """The columns in the dtypes the model computes with."""
    typed = {}
    for f in ("tensor_par", "pipeline_par", "data_par", "microbatch_size",
              "pipeline_interleaving", "batch_size", "num_procs",
              "tensor_par_net", "pipeline_par_net", "data_par_net"):
        typed[f] = c[f].astype(np.int64, copy=False)
    for f in ("fused_activation", "optimizer_sharding", "seq_par_ag_redo",
              "data_par_overlap", "weight_offload", "activations_offload",
              "optimizer_offload", "training", "fused_norm", "unsharded_grads"):
        typed[f] = c[f].astype(bool, copy=False)
    for f in ("datatype", "attention_type", "activation_recompute", "tensor_par_comm_type",
              "tensor_par_overlap", "attention_impl"):
        typed[f] = c[f].astype(np.int8, copy=False)
    return typed


def reason_text(out: Mapping, system: SystemSpec):
    """One reason per row of an ``evaluate_columns`` result, as a pandas
    Categorical ('' when feasible).  Memory failures say how much is needed
    against the tier's capacity."""
    import pandas as pd

    codes = np.asarray(out["reason_code"]).astype(np.int64)
    cats = list(REASONS)
    for tier, mem in ((1, system.mem1), (2, system.mem2)):
        need = out.get(f"proc_mem_tier{tier}_cap_req")
        rows = np.flatnonzero(codes == _R[f"infeasible: mem tier{tier} capacity exceeded"])
        if need is None or not len(rows):
            continue
        gib = np.round(need[rows] / 1024 ** 3, 2)
        values, inverse = np.unique(gib, return_inverse=True)
        codes[rows] = len(cats) + inverse
        cats += [f"infeasible: mem tier{tier} needs {v:.2f} GiB but has {mem.GiB:g} GiB"
                 for v in values]
    return pd.Categorical.from_codes(codes, categories=pd.Index(cats, dtype=object))
