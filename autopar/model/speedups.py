"""The model's speed machinery, apart from its physics.

Nothing here changes what the model computes; it decides on which rows and
in which order the physics (``block``, ``pipeline``, ``communication``,
``memory``, composed by ``evaluate``) runs, and where the results go:

* ``BlockCache``: the transformer block depends on a handful of columns, so
  its sums (``block.block``, a ``BlockSums``) are computed once per distinct
  block and gathered back per row, in parts: the footprint sums
  (``FOOTPRINT_SUMS``) for every row, the ones the batch level computes with
  (``BATCH_SUMS``) only for the rows that fit in memory, the optimizer
  step's (``OPTIM_SUMS``) from a table of its own; ``sum_tables`` lets a
  per-block statistic be gathered straight into the result
  (``direct_block_stats``);
* chunks: ``evaluate_columns`` runs the batch level ``CHUNK`` rows at a time
  (they stay in cache), and only on the rows that pass the rules;
* the result table (``result_table``) and each chunk's place in it
  (``spans``, ``write_chunk``), NaN where a row is not computed;
* row subsets that keep a column of one value a view (``take_rows``,
  ``subset``, ``distinct_codes``).

The lower-level short-cuts sit in ``autopar.model.lookup`` (distinct keys,
value ranges, functions of a few small columns by table lookup), below the
physics that uses them.
"""
from __future__ import annotations

import mmap
import os
import weakref

import numpy as np

from autopar.io.specs import ModelSpec
from autopar.model.block import block, head_microbatch_time
from autopar.model.block_inputs import activation_sizes
from autopar.model.block_sums import CALCULON, BlockSums
from autopar.model.context import (LayoutContext, expert_shard_counts, expert_weight_shards,
                                   grad_scale, masked, shard_counts)
from autopar.model.lookup import distinct, pack

# Rows of the batch level computed at once.
CHUNK = 1 << 16


# Columns the per-block statistics depend on.
_BLOCK_FIELDS = ("attention_impl", "fused_norm",
                 "datatype", "tensor_par", "microbatch_size", "activation_recompute",
                 "tensor_par_comm_type", "tensor_par_overlap", "seq_par_ag_redo",
                 "fused_activation", "attention_type", "training", "tensor_par_net",
                 "optimizer_sharding", "data_par", "context_par", "context_par_net",
                 "context_par_comm", "fp8_recipe", "sharding_group", "unsharded_grads",
                 "weight_sharding", "fp32_grads", "optimizer_outer_sharding",
                 "expert_par", "expert_tensor_par", "expert_par_net",
                 "expert_tensor_par_net", "moe_dispatcher", "moe_overlap",
                 "optimizer", "adapter", "adapter_rank", "adapter_targets", "attention_span",
                 "optimizer_moment_bytes",
                 "recompute_moe_act", "recompute_mla_up_proj", "activation_offload_modules")
# Per-block sums the memory footprints need (``memory.footprints``, with
# the shard divisions of ``BlockCache.rows``): evaluate_columns gathers
# them for every row, the others only for the rows that fit in memory.
FOOTPRINT_SUMS = ("weight_space", "weight_unkept", "x_weight_space", "x_weight_unkept",
                  "act_working", "act_storage",
                  "act_storage_all", "act_offload", "fw_offload_window", "act_offload_max",
                  "wgrad_space", "wgrad_space_full", "act_grad_space", "optimizer_space",
                  "x_wgrad_space", "x_optimizer_space", "dummy_attn", "dummy_rest", "op_grads",
                  "op_grads_mixer", "op_grads_rest")
# Block sums of the optimizer step (they depend on the sharding, cached apart).
OPTIM_SUMS = ("optim_flops", "optim_flops_time", "optim_mem", "optim_mem_time",
              "optim_time")
# The other sums the batch level (``evaluate.batch_time``) computes with;
# the rest are only reported, gathered from the block table straight into
# the result.
BATCH_SUMS = ("fw_time", "fw_mem_time", "re_time", "re_flops_time", "re_mem_time",
              "agrad_time", "agrad_flops_time", "agrad_mem_time",
              "wgrad_time", "wgrad_flops_time", "wgrad_mem_time",
              "base_fw_tp_time", "edge_fw_tp_time", "base_fw_tp_exp", "edge_fw_tp_exp",
              "base_agrad_tp_time", "edge_agrad_tp_time", "base_agrad_tp_exp",
              "edge_agrad_tp_exp", "base_recomm_time", "edge_recomm_time",
              "base_recomm_exp", "edge_recomm_exp",
              "cp_fw_link", "cp_bw_link", "cp_fw_exp", "cp_bw_exp", "cp_re_exp",
              "ep_link", "ep_exposed", "useful_fw", "useful_bw", "x_weight_space",
              "weight_copies", "weight_unsent", "x_weight_copies", "x_weight_unsent",
              "bw_offload")


_FEW = 64


def _ones_to_none(a):
    return None if np.all(a == 1) else a


def _where_on(mask, col):
    """``np.where(mask, col, 0)``; a view of a column of zeros where ``col``
    is one (a default network tier, say)."""
    if col.strides == (0,) and len(col) and col[0] == 0:
        return col
    return masked(col, mask)


class BlockCache:
    """Per-block sums for every row, computed once per distinct block.

    The block depends on a handful of columns; most layouts of a search share
    their block with many others, so it is evaluated on the distinct keys and
    gathered back.  Optimizer sharding only divides footprints (exactly) and
    changes the optimizer step, which is evaluated on its own smaller key.
    """

    def __init__(self, model, system, cols: dict, datatypes, kind: str = "dense",
                 head: bool | None = None):
        n = len(cols["tensor_par"])
        # (the output head's time, with the first kind's table: "dense")
        head = (kind == "dense" if head is None else head) and model.vocab_size > 0
        self._split = self._ext = None
        if n <= _FEW:        # a handful of layouts: no deduplication to win
            ctx = LayoutContext(model, system, cols, datatypes)
            sums = block(ctx, cols, kind).given()
            self._head = (head_microbatch_time(ctx, activation_sizes(ctx, cols).B)
                          if head else None)
            self._n1 = [name for name in sums if name not in OPTIM_SUMS]
            self._t1 = np.stack([np.broadcast_to(sums[name], (n,)) for name in self._n1])
            self._t2 = np.stack([np.broadcast_to(sums[name], (n,)) for name in OPTIM_SUMS])
            self.inv1 = self.inv2 = np.arange(n)
            self.shard = self.grad_shard = np.ones(n)     # already divided
            self.weight_shard = _ones_to_none(shard_counts(cols)[2])
            self.grad_scale = grad_scale(cols)
            self.x_shard = self.x_grad_shard = self.shard
            self.x_weight_shard = None
            if kind == "moe" and self.weight_shard is not None:
                self.x_weight_shard = expert_weight_shards(cols, shard_counts(cols)[2])
            self.shard_counts = None
            return
        t = cols["tensor_par"]
        tpnet = _where_on(t > 1, cols["tensor_par_net"])
        moe_key = []
        if kind == "moe":
            ep, etp = cols["expert_par"], cols["expert_tensor_par"]
            moe_key = [ep, etp, np.where(ep > 1, cols["expert_par_net"], 0),
                       np.where(etp > 1, cols["expert_tensor_par_net"], 0),
                       cols["moe_dispatcher"], cols["moe_overlap"]]
        cp = cols["context_par"]
        # (the distinct blocks come out in the order of their keys, the first
        # column the slowest: the columns that decide which layers a block
        # runs come first, so that each layer's rows are runs of the table
        # and its masked sums cost what unmasked ones do)
        key1 = [cols["training"], cols["activation_recompute"], cols["fp8_recipe"], cp,
                _where_on(cp > 1, cols["context_par_comm"]),
                _where_on(cp > 1, cols["context_par_net"]), t, cols["tensor_par_overlap"],
                cols["tensor_par_comm_type"], cols["seq_par_ag_redo"],
                cols["fused_activation"], cols["fused_norm"], cols["attention_impl"],
                cols["attention_type"], tpnet, cols["datatype"],
                cols["microbatch_size"]] + moe_key
        # Optimizers and adapters (keyed only where some row uses them).
        tune_key = []
        if cols["optimizer"].any():
            tune_key.append(cols["optimizer"])
        if cols["adapter"].any():
            on = cols["adapter"] != 0
            tune_key += [cols["adapter"], _where_on(on, cols["adapter_rank"]),
                         _where_on(on, cols["adapter_targets"])]
        if cols["attention_span"].any():      # packed documents' attention
            tune_key.append(cols["attention_span"])
        if (cols["optimizer_moment_bytes"] != 4).any():     # bf16 moments
            tune_key.append(cols["optimizer_moment_bytes"])
        if cols["activation_offload_modules"].any():     # fine-grained offloading
            tune_key.append(cols["activation_offload_modules"])
        for f in ("recompute_moe_act", "recompute_mla_up_proj"):
            if cols[f].any():        # output-discarding recompute
                tune_key.append(cols[f])
        key1 += tune_key
        idx1, inv1 = distinct(*pack(key1))
        sub = {f: cols[f][idx1] for f in _BLOCK_FIELDS}
        sub["tensor_par_net"] = tpnet[idx1]
        sub["context_par_net"] = np.where(sub["context_par"] > 1, sub["context_par_net"], 0)
        sub["optimizer_sharding"] = np.zeros(len(idx1), dtype=bool)
        sub["data_par"] = np.ones(len(idx1), dtype=np.int64)
        sub["unsharded_grads"] = np.zeros(len(idx1), dtype=bool)
        sub["sharding_group"] = np.zeros(len(idx1), dtype=np.int64)
        sub["weight_sharding"] = np.zeros(len(idx1), dtype=bool)
        sub["optimizer_outer_sharding"] = np.zeros(len(idx1), dtype=bool)
        self.shard_counts = shard_counts(cols)
        shard, grad_shard, weight_shard = self.shard_counts
        key2 = [cols["datatype"], t, cols["attention_type"], cols["tensor_par_overlap"] != 0,
                cols["training"], shard.astype(np.int64)]
        # (the divisors stay the float columns of shard_counts: dividing by
        # them gives what dividing by the same integers gives)
        x_shard, x_grad_shard = shard, grad_shard
        if kind == "moe":
            x_shard, x_grad_shard = expert_shard_counts(cols, weight_shard)
            key2 += [x_shard.astype(np.int64)] + moe_key
        key2 += tune_key
        idx2, inv2 = distinct(*pack(key2))
        # Both tables' blocks in one evaluation (the block is row by row):
        # the first len(idx1) rows give the sums, the others the optimizer step.
        k1, k = len(idx1), len(idx1) + len(idx2)
        both = {f: np.concatenate([sub[f], cols[f][idx2]]) for f in _BLOCK_FIELDS}
        ctx = LayoutContext(model, system, both, datatypes)
        sums = {name: np.broadcast_to(v, (k,))
                for name, v in block(ctx, both, kind).given().items()}
        self._head = (head_microbatch_time(ctx, activation_sizes(ctx, both).B)[:k1][inv1]
                      if head else None)
        # Sums stacked as (sum, distinct block) tables, gathered per chunk.
        self._n1 = [name for name in sums if name not in OPTIM_SUMS]
        self._t1 = np.stack([sums[name][:k1] for name in self._n1])
        self._t2 = np.stack([sums[name][k1:] for name in OPTIM_SUMS])
        self.inv1, self.inv2 = inv1, inv2
        self.shard = shard
        self.grad_shard = grad_shard
        self.weight_shard = _ones_to_none(weight_shard)
        self.grad_scale = grad_scale(cols)
        self.x_shard = x_shard
        self.x_grad_shard = x_grad_shard
        self.x_weight_shard = None
        if kind == "moe" and self.weight_shard is not None:
            self.x_weight_shard = expert_weight_shards(cols, weight_shard)

    def shards(self, sl: slice):
        """``shard_counts`` of the rows ``sl`` (None: compute them)."""
        return None if self.shard_counts is None else tuple(c[sl] for c in self.shard_counts)

    def head(self, sl: slice):
        """``head_microbatch_time`` of the rows ``sl`` (None: no vocabulary)."""
        return None if self._head is None else self._head[sl]

    def rows(self, at, part: str | None = None) -> BlockSums:
        """Per-block sums for the rows ``at`` (a slice, or positions), one
        gather per key table: every sum, or ``part="footprints"``: only the
        ``FOOTPRINT_SUMS`` (what the memory footprints need), or
        ``part="rest"``: the others (with the optimizer step's), or
        ``part="batch"``: of those, the ones the batch level computes with."""
        # np.take keeps each sum a contiguous row (``t[:, idx]`` would give
        # a column-major result, every sum strided across the others).
        if part is None:
            names, table = self._n1, self._t1
        else:
            names, table = self._parts()[part]
        sums = dict(zip(names, np.take(table, self.inv1[at], axis=1)))
        if part == "footprints":
            return self._sharded(BlockSums(**sums), at)
        sums.update(zip(OPTIM_SUMS, np.take(self._t2, self.inv2[at], axis=1)))
        sums = BlockSums(**sums)
        return sums if part in ("rest", "batch") else self._sharded(sums, at)

    def _parts(self) -> dict:
        """The names and table of the footprint sums, of the others, and of
        those the batch level computes with (``BATCH_SUMS``)."""
        if self._split is None:
            # (the framework terms among them only where the framework asks)
            held = [name for name in FOOTPRINT_SUMS if name in self._n1]
            foot = [self._n1.index(name) for name in held]
            rest = [i for i in range(len(self._n1)) if i not in foot]
            batch = [i for i in rest if self._n1[i] in BATCH_SUMS]
            self._split = {
                "footprints": (held, self._t1[foot]),
                "rest": ([self._n1[i] for i in rest], self._t1[rest]),
                "batch": ([self._n1[i] for i in batch], self._t1[batch])}
        return self._split

    def sum_tables(self) -> dict:
        """Each sum's row of distinct-block values followed by a NaN, with
        the distinct-block index it takes (``inv1`` or ``inv2``): a statistic
        that is a block sum is gathered from it straight into the result."""
        if self._ext is None:
            ext = {}
            for names, table, inv in ((self._n1, self._t1, self.inv1),
                                      (OPTIM_SUMS, self._t2, self.inv2)):
                t = np.empty((table.shape[0], table.shape[1] + 1))
                t[:, :-1] = table
                t[:, -1] = np.nan
                ext.update({name: (t[i], inv) for i, name in enumerate(names)})
            self._ext = ext
        return self._ext

    def _sharded(self, sums: BlockSums, at) -> BlockSums:
        """The footprint sums divided by the rows' shards (in place)."""
        # Expert footprints shard over expert-data-parallel, the rest over data_par.
        xw, xo = sums.x_wgrad_space, sums.x_optimizer_space
        sums.x_wgrad_space = xw / self.x_grad_shard[at]
        sums.x_optimizer_space = xo / self.x_shard[at]
        sums.wgrad_space = (sums.wgrad_space - xw) / self.grad_shard[at] + sums.x_wgrad_space
        sums.optimizer_space = (sums.optimizer_space - xo) / self.shard[at] \
            + sums.x_optimizer_space
        if self.grad_scale is not None:
            sums.wgrad_space = sums.wgrad_space * self.grad_scale[at]
        # ZeRO-3 / FSDP keeps 1/shards of the weights; a whole block is
        # gathered when it runs (``weight_space_full``).
        sums.weight_space_full = sums.weight_space
        sums.weight_unkept_full = sums.weight_unkept
        if self.weight_shard is not None and self.x_weight_shard is not None:
            # Megatron-FSDP with experts: the routed experts' weights over
            # the expert-data-parallel group (context.expert_weight_shards),
            # the others over data_par.
            ws, xws = self.weight_shard[at], self.x_weight_shard[at]
            xw = sums.x_weight_space
            sums.weight_space = (sums.weight_space - xw) / ws + xw / xws
            if sums.weight_unkept is not None:
                xu = 0.0 if sums.x_weight_unkept is None else sums.x_weight_unkept
                sums.weight_unkept = (sums.weight_unkept - xu) / ws + xu / xws
        elif self.weight_shard is not None:
            sums.weight_space = sums.weight_space / self.weight_shard[at]
            if sums.weight_unkept is not None:
                sums.weight_unkept = sums.weight_unkept / self.weight_shard[at]
        return sums


# Tables of at least this many bytes are mapped with their pages in place,
# and the mapping of one that is no longer used, up to _SPARE_BYTES (a
# sixteenth of the machine's memory), is kept for the next; a larger one goes
# back to the system when it is freed.
_POPULATE_BYTES = 1 << 26
_SPARE: list = []


def _physical_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return 1 << 32


_SPARE_BYTES = _physical_bytes() // 16


def result_table(k: int, n: int) -> np.ndarray:
    """An uninitialised (k, n) float64 table (every entry is written after).

    A large one is an anonymous mapping whose pages the kernel provides at
    once (MAP_POPULATE, Linux): faulting them in one by one as the table is
    first written cost 0.3 s for 104 x 1M, or over 1 s where numpy's
    transparent-huge-page advice made the kernel compact memory first;
    populated, 0.26 s.  When a table of up to ``_SPARE_BYTES`` is freed its
    mapping is kept (one at most) and the next large table that fits in it
    reuses it, its pages already in place: evaluating chunk after chunk pays
    for them once, and at most a sixteenth of the memory stays held between
    calls (1.5 GiB on the 24 GiB development machine)."""
    nbytes = k * n * 8
    populate = getattr(mmap, "MAP_POPULATE", None)
    if nbytes < _POPULATE_BYTES or populate is None:
        return np.empty((k, n))
    try:
        buf = _SPARE.pop()
    except IndexError:
        buf = None
    if buf is None or not nbytes <= len(buf) <= 2 * nbytes:
        try:
            buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
        except (OSError, ValueError):
            return np.empty((k, n))
    # (rows of it have the table as their base, as with np.empty: frame.py
    # wraps the table itself)
    table = np.ndarray((k, n), dtype=np.float64, buffer=buf)
    weakref.finalize(table, _keep, buf).atexit = False
    return table


def _keep(buf) -> None:
    """A freed table's mapping, kept for the next table (one at most, of up
    to ``_SPARE_BYTES``)."""
    if not _SPARE and len(buf) <= _SPARE_BYTES:
        _SPARE.append(buf)


def take_rows(cols: dict, rows: np.ndarray) -> dict:
    """The columns at ``rows`` (``subset``); a column of one value (a
    default, or a field the table fixes) becomes a read-only view of that
    value instead of a copy."""
    return subset({f: np.broadcast_to(v[:1], v.shape) if v.strides != (0,)
                    and v[0] == v[-1] and (v == v[0]).all() else v
                    for f, v in cols.items()}, rows)


def distinct_codes(col: np.ndarray) -> list[int]:
    """The distinct values of a column of codes, sorted (a column of one
    value, a view of it, is not sorted to find it)."""
    if col.strides == (0,):
        return [int(col[0])]
    return np.unique(col).tolist()


def subset(cols: dict, fit: np.ndarray) -> dict:
    """The columns (or per-row values) at the positions ``fit``; a column of
    one value (a view of it) stays a view, a scalar stays itself."""
    out = {}
    k = len(fit)
    for f, v in cols.items():
        if np.ndim(v) == 0:
            out[f] = v
        elif v.strides == (0,):
            out[f] = np.broadcast_to(v[:1], (k,))
        else:
            out[f] = v.take(fit)
    return out


def spans(rows, sl: slice, n: int, every: bool, memory_failed, fit):
    """Where a chunk of computed rows (``rows[sl]``) goes in the table: the
    columns ``lo:hi`` (the chunk's rows and the uncomputed ones before the
    next chunk's), the chunk's length ``L``, for the statistics kept on a
    memory failure (``where``) and for the other memory statistics
    (``failed``) each column's position in the chunk (``L``: NaN), or None
    where the columns are the chunk in order; and for the time statistics,
    computed only for the chunk's rows at ``fit`` (None: all of them), the
    number ``F`` of those rows and each column's position among them
    (``timed``; ``F``: NaN)."""
    L = sl.stop - sl.start
    if every:
        lo, hi = sl.start, sl.stop
        if fit is None:
            return lo, hi, L, None, None, L, None
        failed = np.arange(L)
        failed[memory_failed] = L
        F = len(fit)
        timed = np.full(L, F, dtype=np.intp)
        timed[fit] = np.arange(F)
        return lo, hi, L, None, failed, F, timed
    lo = 0 if sl.start == 0 else int(rows[sl.start])
    hi = n if sl.stop == len(rows) else int(rows[sl.stop])
    at = rows[sl] - lo
    where = np.full(hi - lo, L, dtype=np.intp)
    where[at] = np.arange(L)
    if fit is None:
        return lo, hi, L, where, where, L, where
    failed = where.copy()
    failed[at[memory_failed]] = L
    F = len(fit)
    position = np.full(L + 1, F, dtype=np.intp)
    position[fit] = np.arange(F)
    return lo, hi, L, where, failed, F, position.take(where)


def write_chunk(table, kept, mem, times, names, ext, span, block_sums=None) -> None:
    """A chunk's statistics into their table rows, each row's columns written
    once: a contiguous copy, or a gather through the span's positions from
    the chunk's values (``mem``, the memory statistics of every row;
    ``times``, the others, of the rows that fit, None where none does)
    followed by a NaN (``ext``, a buffer).  ``block_sums``: the block
    table's sums (``BlockCache.sum_tables``) and the rows that fit (their
    positions among the computed rows), from which the per-block statistics
    are gathered instead (None: they are in ``times``)."""
    lo, hi, L, where, failed, F, timed = span
    through = {}         # per distinct-block index: each column's block, or NaN
    for j, name in enumerate(names):
        if name in mem:
            values, index, k = mem[name], where if kept[j] else failed, L
        elif times is None:
            table[j, lo:hi] = np.nan
            continue
        elif block_sums is not None and name in CALCULON:
            row, inv = block_sums[0][CALCULON[name]]
            index = through.get(id(inv))
            if index is None:
                index = inv[block_sums[1]]
                if timed is not None:
                    index = np.append(index, len(row) - 1).take(timed)
                through[id(inv)] = index
            np.take(row, index, out=table[j, lo:hi], mode="wrap")
            continue
        else:
            values, index, k = times[name], timed, F
        if index is None:
            table[j, lo:hi] = values
        else:
            buf = ext[:k + 1]
            buf[:k] = values
            buf[k] = np.nan
            # (every position is in range: "wrap" never wraps, and gathers
            # a tenth faster than "clip", which tests each index's bounds)
            np.take(buf, index, out=table[j, lo:hi], mode="wrap")


def direct_block_stats(model: ModelSpec) -> bool:
    """Whether the per-block statistics are gathered straight from the block
    table into the result: for a model whose blocks are all alike (they are
    the table's); one of dense and MoE blocks, or with MTP, reports the mix
    of its pacing stage (``evaluate._stage_sums``)."""
    return model.moe is None and not model.mtp and not model.hybrid_pattern
