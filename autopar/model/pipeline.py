"""The pipeline schedule: stages, chunks, interleaving and the bubble.

Follows the batch-level time composition of Calculon's ``llm.py``.  The
blocks are spread over ``pipeline_par`` stages (``blocks_per_stage``, the
last stages lacking ``missing_blocks`` when the stages do not divide the
blocks); with interleaving, a stage holds ``chunks`` chunks of
``blocks_per_chunk`` blocks.  Within a chunk, the *edge* block (the last
one) also pays the p2p transfer to the next stage and, with the p2p TP
variant, split collectives; the others are *base* blocks.  Every
micro-batch passes every chunk; the bubble is ``pipeline_par - 1`` chunk
times, shortened by the missing blocks and lengthened when interleaving
meets micro-batches that do not fill the pipeline.

Uneven splits (issue 24; the ``SPLIT_FIELDS`` of ``autopar.io.layouts``)
follow Megatron-Core: ``stage_split`` gives each stage's blocks (or the rule
the split breaks).  The stage with the most blocks paces the pipeline
(``blocks_per_stage``), the others lack ``missing_blocks`` between them, so
the bubble is Calculon's with that count; ``blocks_first``,
``blocks_second`` and ``blocks_last`` are the blocks of the stages whose
memory can be the largest (the first holds the most micro-batches in
flight, the second the most after it, the last the output layer); a chunk
holds ``blocks_per_stage / chunks`` blocks on average.  At the defaults all
are Calculon's ``ceil(num_blocks / stages)``.

A model whose stages hold blocks of different kinds (``mixed``: dense first
blocks and MoE ones, multi-token-prediction modules on the last stage, a
hybrid pattern, a recipe's BF16 blocks; ``autopar.model.moe.mixed_rows``)
takes the same stage-by-stage path at the defaults, with Calculon's ceil
split as its split (``ceil_chunks``): its default layout and the explicit
layout that states the same stages give the same figures.  A model whose
blocks are all alike keeps Calculon's arithmetic exactly.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from autopar.io.layouts import SPLIT_FIELDS, explicit_layout, layout_stage_blocks
from autopar.model.block_sums import BlockSums
from autopar.model.lookup import Ranges, by_value, distinct, pack


@dataclass(frozen=True)
class Schedule:
    """How one data-parallel replica's batch runs through its pipeline."""
    stages: np.ndarray            # pipeline_par
    interleaving: np.ndarray      # pipeline_interleaving
    microbatches: np.ndarray      # per replica: batch / data_par / microbatch_size
    blocks_per_stage: np.ndarray  # ceil(num_blocks / stages)
    missing_blocks: np.ndarray    # stages * blocks_per_stage - num_blocks
    blocks_per_chunk: np.ndarray
    chunks: np.ndarray            # chunks per stage
    base_blocks: np.ndarray       # blocks of a chunk but its edge block (float)
    chunk_passes: np.ndarray      # microbatches * chunks: chunk passes per stage
    leftover: np.ndarray          # microbatches % stages
    # Blocks of the first, second and last stage (uneven splits; else
    # blocks_per_stage itself).
    blocks_first: np.ndarray
    blocks_second: np.ndarray
    blocks_last: np.ndarray
    uneven: bool = False          # whether some row splits the pipeline unevenly
    # Micro-batches in flight on the first, second and last stage at its
    # peak, in units of its blocks, counted chunk by chunk
    # (``split_in_flight``) where a row splits unevenly with interleaving;
    # None, or NaN in a row, where the formulas of autopar.model.memory hold.
    in_flight: tuple | None = None

    def rows(self, sl) -> "Schedule":
        """The schedule of the rows ``sl`` (a slice, or positions)."""
        return Schedule(**{f.name: getattr(self, f.name)[sl] for f in fields(self)
                           if f.name not in ("uneven", "in_flight")}, uneven=self.uneven,
                        in_flight=None if self.in_flight is None
                        else tuple(c[sl] for c in self.in_flight))


def schedule(cols: dict, num_blocks: int, mixed=False) -> Schedule:
    """The rows' schedule.  ``mixed`` (a bool, or one a row): the rows whose
    stages hold blocks of different kinds, which count their stages one by
    one at the defaults too (``uneven_rows``)."""
    stages, interleaving = cols["pipeline_par"], cols["pipeline_interleaving"]

    def per_stage(p):
        return -(-num_blocks // p)

    # Functions of (stages, interleaving), which take few values: once per value.
    ranges = Ranges()
    blocks_per_stage = by_value(per_stage, stages, ranges=ranges)
    missing = by_value(lambda p: np.where(num_blocks % p != 0, p - num_blocks % p, 0), stages,
                       ranges=ranges)
    blocks_per_chunk = by_value(lambda p, v: np.maximum(per_stage(p) // v, 1),
                                stages, interleaving, ranges=ranges)
    chunks = by_value(lambda p, v: per_stage(p) // np.maximum(per_stage(p) // v, 1),
                      stages, interleaving, ranges=ranges)
    # (floor(floor(b / d) / m) is floor(b / (d m)) for positive integers: one
    # division instead of two, where the product stays within int64)
    dp, mbs = cols["data_par"], cols["microbatch_size"]
    if len(dp) and min(ranges(dp)[0], ranges(mbs)[0]) > 0 \
            and ranges(dp)[1] * ranges(mbs)[1] < 1 << 62:
        microbatches = cols["batch_size"] // (dp * mbs)
    else:
        microbatches = cols["batch_size"] // dp // mbs
    base_blocks = (blocks_per_chunk - 1).astype(float)
    first = second = last = blocks_per_stage
    in_flight = None
    split = uneven_rows(cols, mixed)
    if split is not None:
        # Megatron's splits (only where a row asks for one): the pacing
        # stage's blocks, the missing ones, the three stages' blocks; chunks
        # of blocks_per_stage / interleaving blocks on average.
        rows = np.flatnonzero(split)
        counts = split_counts(cols, num_blocks, rows)
        pace, first, second, last = (_put(blocks_per_stage, rows, c) for c in counts)
        missing = _put(missing, rows, stages[rows] * counts[0] - num_blocks)
        # (a virtual stage may hold only the embedding or the loss: chunks
        # with blocks, at most the pacing stage's blocks)
        v = np.minimum(interleaving[rows], np.maximum(counts[0], 1))
        chunks = _put(chunks, rows, v)
        blocks_per_chunk = _put(blocks_per_chunk.astype(float), rows, counts[0] / v)
        base_blocks = blocks_per_chunk - 1.0
        blocks_per_stage = pace
        if np.any(interleaving[rows] > 1):
            nan = np.full(len(stages), np.nan)
            in_flight = tuple(_put(nan, rows, c) for c in
                              split_in_flight(cols, num_blocks, rows, microbatches))
    return Schedule(
        stages=stages, interleaving=interleaving, microbatches=microbatches,
        blocks_per_stage=blocks_per_stage, missing_blocks=missing,
        blocks_per_chunk=blocks_per_chunk, chunks=chunks,
        base_blocks=base_blocks, chunk_passes=microbatches * chunks,
        leftover=microbatches % stages, blocks_first=first, blocks_second=second,
        blocks_last=last, uneven=split is not None, in_flight=in_flight)


def _put(col, rows, values):
    """``col`` with ``values`` at ``rows`` (a copy, in the values' dtype where
    they are floats)."""
    out = np.array(col, dtype=np.result_type(col, values))
    out[rows] = values
    return out


def uneven_rows(cols: dict, mixed=False):
    """The rows whose stages are counted one by one: those that set a field
    of the pipeline split (``SPLIT_FIELDS``) and, with ``mixed`` (a bool, or
    one a row: stages whose blocks differ in kind), those with more than one
    stage at the defaults (their split is Calculon's ceil split,
    ``ceil_chunks``); None where there are none (every default is 0: one
    ``any`` a column)."""
    present = [cols[f] != 0 for f in SPLIT_FIELDS if f in cols and cols[f].any()]
    if np.any(mixed):
        present.append(np.asarray(mixed, dtype=bool) & (cols["pipeline_par"] > 1))
    if not present:
        return None
    mask = present[0]
    for c in present[1:]:
        mask = mask | c
    return mask if mask.any() else None


def stage_split(num_blocks: int, p: int, v: int, first: int, last: int, embedding: bool,
                loss: bool, layout: int):
    """The blocks of each of the ``p`` stages, as Megatron-Core builds them,
    or the reason (a ``REASONS`` text of ``autopar.model.rules``) the split
    cannot be built.

    * ``first`` / ``last`` > 0 (``num_layers_in_first_pipeline_stage`` /
      ``..._last_...``): those stages hold that many blocks, the stages
      between share the rest evenly
      (transformer_block.py ``get_num_layers_to_build``); transformer_config.py
      (``__post_init__``) requires them divisible by the virtual size, the rest
      divisible by the middle stages (and there to be middle blocks exactly
      where there are middle stages), each middle stage's share divisible by
      the virtual size, and refuses them together with the embedding or loss
      counted.
    * ``embedding`` / ``loss`` (``account_for_embedding_in_pipeline_split`` /
      ``account_for_loss_...``): the embedding / loss counts as a block of the
      even split; ``num_blocks + embedding + loss`` must divide by ``p`` and
      each stage's share by ``v``; the first / last stage builds one block
      fewer (``get_num_layers_to_build``).
    * ``balanced``: a ``pipeline_model_parallel_layout``
      (pipeline_parallel_layer_layout.py) whose ``p * v`` virtual stages, in
      order (virtual stage ``k`` on stage ``k % p``), hold ``q`` or ``q + 1``
      of the ``num_blocks + embedding + loss`` layers, the earlier ones the
      more; the embedding in the first virtual stage and the loss in the
      last, as the layout requires.  Layouts conflict with first/last
      (transformer_config.py); every virtual stage holds a layer.
    * ``layout`` >= 2: an explicit ``pipeline_model_parallel_layout`` (the
      code of ``autopar.io.layouts.layout_code``; ``layout_chunks``).

    ``layout`` is the ``pipeline_layout`` code: 0 even, 1 balanced (a bool
    reads as those two).
    """
    split = chunk_split(num_blocks, p, v, first, last, embedding, loss, layout)
    return split if isinstance(split, str) else [sum(chunks) for chunks in split]


def chunk_split(num_blocks: int, p: int, v: int, first: int, last: int, embedding: bool,
                loss: bool, layout: int):
    """The blocks of each of the ``v`` model chunks of each of the ``p``
    stages (chunk ``j`` of stage ``s`` is virtual stage ``j * p + s``), or the
    reason the split cannot be built (``stage_split``, which sums them).
    Megatron-Core builds every virtual stage alike
    (transformer_block.py ``get_num_layers_to_build``: a stage's layers over
    its ``v`` chunks), but the first virtual stage builds one block fewer
    where the embedding is counted and the last where the loss is: with one
    layer a virtual stage, the first rank's chunk 0 holds only the
    embedding and the last rank's last chunk only the loss.  With every
    field at its default it is Calculon's ceil split (``ceil_chunks``)."""
    e, l_ = int(embedding), int(loss)
    if min(first, last) < 0:
        return "invalid: first_stage_blocks and last_stage_blocks must be >= 0"
    if p <= 1:
        return "invalid: pipeline split fields need pipeline_par > 1"
    if (first or last) and (e or l_):
        return ("invalid: first_stage_blocks and last_stage_blocks cannot be set with "
                "embedding_in_split or loss_in_split")
    if int(layout) >= 2:
        if first or last or e or l_:
            return ("invalid: an explicit pipeline_layout cannot be set with first_stage_blocks, "
                    "last_stage_blocks, embedding_in_split or loss_in_split")
        return layout_chunks(explicit_layout(int(layout)), num_blocks, p, v)
    balanced = bool(layout)
    if balanced:
        if first or last:
            return ("invalid: pipeline_layout balanced cannot be set with first_stage_blocks "
                    "or last_stage_blocks")
        layers, k = num_blocks + e + l_, p * v
        q, r = divmod(layers, k)
        if q < 1:
            return "infeasible: pipeline_layout balanced needs a block for every virtual stage"
        chunks = [[q + (j * p + s < r) for j in range(v)] for s in range(p)]
        chunks[0][0] -= e
        chunks[-1][-1] -= l_
        return chunks
    if first or last:
        if first % v or last % v:
            return ("infeasible: first_stage_blocks and last_stage_blocks must be divisible "
                    "by pipeline_interleaving")
        rest, middle = num_blocks - first - last, p - bool(first) - bool(last)
        if rest < 0 or bool(rest) != bool(middle) or (middle and rest % middle):
            return ("infeasible: the middle stages must share the blocks first_stage_blocks "
                    "and last_stage_blocks leave evenly")
        share = rest // middle if middle else 0
        if share % v:
            return ("infeasible: the middle stages' blocks must be divisible by "
                    "pipeline_interleaving")
        per = [share] * p
        if first:
            per[0] = first
        if last:
            per[-1] = last
        return [[n // v] * v for n in per]
    if not (e or l_):
        return ceil_chunks(num_blocks, p, v)
    layers = num_blocks + e + l_
    if layers % p:
        return ("infeasible: blocks with the embedding and loss counted must be divisible "
                "by pipeline_par")
    if (layers // p) % v:
        return ("infeasible: blocks per stage with the embedding and loss counted must be "
                "divisible by pipeline_interleaving")
    chunks = [[layers // p // v] * v for _ in range(p)]
    chunks[0][0] -= e
    chunks[-1][-1] -= l_
    return chunks


def ceil_chunks(num_blocks: int, p: int, v: int):
    """Calculon's split (every split field at its default) as chunks:
    ``ceil(num_blocks / p)`` blocks a stage, ``1 / v`` of them a chunk, in
    Megatron's interleaved order (virtual stage ``k = j * p + s``, chunk
    ``j`` of stage ``s``, holds blocks ``[k b, (k + 1) b)`` of the model,
    ``b = ceil(num_blocks / p) / v``), the last virtual stages lacking the
    blocks the model does not have (Calculon's ``missing_blocks``; the
    layout ``Etttt|...|tttt|tmL`` Megatron-Bridge's DeepSeek-V3 recipes
    state for 61 blocks on 16 virtual stages).  Calculon's rule that ``v``
    divides a stage's blocks (``autopar.model.rules``) is the reason where
    it does not."""
    share = -(-num_blocks // p)
    if share % v:
        return "infeasible: pipeline_interleaving must divide the blocks per processor"
    b = share // v
    return [[min(b, max(num_blocks - (j * p + s) * b, 0)) for j in range(v)]
            for s in range(p)]


def layout_chunks(stages, num_blocks: int, p: int, v: int):
    """The blocks of each of the ``v`` model chunks of each of the ``p``
    stages under an explicit layout's virtual ``stages`` (each the string of
    its layers, ``autopar.io.layouts.parse_layout``), or the reason it cannot
    be built here.  Virtual stage ``k`` is chunk ``k // p`` of rank ``k % p``
    and builds as many decoder layers as it holds ``t``
    (NVIDIA/Megatron-LM@2a75ac1 pipeline_parallel_layer_layout.py
    ``__init__``: ``layout[vpp_rank * pp + pp_rank]``;
    ``get_num_layers_to_build``: the count of decoder layers in
    ``layout[pp_rank][vp_stage]``), in order (``get_layer_offset``); a
    ``t`` is one block, or two of a hybrid pattern's mixer + MLP pairs
    (``autopar.io.layouts.layout_stage_blocks``; the rules check the
    pattern, ``autopar.model.rules``)."""
    if len(stages) != p * v:
        return ("invalid: an explicit pipeline_layout's virtual stages must number "
                "pipeline_par x pipeline_interleaving")
    per = layout_stage_blocks(stages, num_blocks)
    if per is None:
        return ("invalid: an explicit pipeline_layout's decoder layers t must number the "
                "model's blocks (or half of a hybrid pattern's mixer + MLP pairs)")
    return [[per[j * p + s] for j in range(v)] for s in range(p)]


def distinct_splits(cols: dict, num_blocks: int, rows: np.ndarray, reasons: bool = False,
                    chunks: bool = False):
    """The distinct splits of the ``rows`` (positions): each one's stage
    blocks (``stage_split``; for a split the rules flag, whose rows are not
    computed, all 0, or with ``reasons`` the reason) and each row's split
    among them.  With ``chunks``, a split of more than one chunk a stage is
    given as each stage's block spans instead (``chunk_spans``)."""
    keys = [np.asarray(cols[f])[rows].astype(np.int64)
            for f in ("pipeline_par", "pipeline_interleaving") + SPLIT_FIELDS]
    idx, inv = distinct(*pack(keys))
    splits = []
    for i in idx.tolist():
        p, v, first, last, e, l_, bal = (int(c[i]) for c in keys)
        per = stage_split(num_blocks, p, max(v, 1), first, last, bool(e), bool(l_), bal)
        if chunks and v > 1 and not isinstance(per, str):
            per = chunk_spans(chunk_split(num_blocks, p, v, first, last, bool(e), bool(l_),
                                          bal))
        splits.append(per if reasons or not isinstance(per, str) else [0] * max(p, 1))
    return splits, inv


def chunk_spans(chunks) -> list | None:
    """Each stage's blocks as (start, end) spans, one a model chunk, from
    ``chunk_split``'s chunks (None for a reason): virtual stage ``k = j * p +
    s`` (chunk ``j`` of stage ``s``) holds the ``k``-th run of blocks in
    order (NVIDIA/Megatron-LM@2a75ac1 transformer_block.py
    ``get_transformer_layer_offset``; for a hybrid pattern,
    hybrid_layer_allocation.py ``select_pipeline_segment``: segment
    ``vp_stage * pp + rank``)."""
    if isinstance(chunks, str):
        return None
    p, v = len(chunks), len(chunks[0])
    spans, lo = [[] for _ in range(p)], 0
    for j in range(v):
        for s in range(p):
            spans[s].append((lo, lo + chunks[s][j]))
            lo += chunks[s][j]
    return spans


def interleaved_peak(p: int, v: int, m: int, rank: int, chunk_blocks) -> float:
    """The most blocks' activations pipeline rank ``rank`` of ``p`` holds at
    once over a training step of ``m`` micro-batches, its ``v`` model chunks
    holding ``chunk_blocks`` blocks each, under the interleaved 1F1B
    schedule (NVIDIA/Megatron-LM@2a75ac1 megatron/core/pipeline_parallel/
    schedules.py ``forward_backward_pipelining_with_interleaving``):

    * the order of the chunk passes is ``get_schedule_table`` with groups of
      ``microbatch_group_size_per_vp_stage`` micro-batches, which defaults to
      ``p`` (model_parallel_config.py ``__post_init__``): micro-batches
      0..p-1 through chunk 0, then through chunk 1, ..., then p..2p-1, the
      last group the micro-batches left; a forward runs table entry ``k`` on
      its chunk (``get_model_chunk_id``), a backward entry ``k`` on chunk
      ``v - 1 - chunk``;
    * ``get_pp_rank_microbatches``: ``(p - rank - 1) * 2 + (v - 1) * p``
      warm-up forwards, at most the ``m * v`` there are; then each steady
      step runs one forward before one backward, so the peak is right after
      a forward; a backward frees the activations of its chunk pass (the
      chunk's output is sent and freed at once: ``deallocate_output_tensor``).

    torch.distributed.pipelining's ``ScheduleInterleaved1F1B`` runs the same
    order (``get_rank_warmup_ops``: the same warm-up, capped at ``m * v``;
    rounds of ``p`` micro-batches a local stage, backward stages reversed).
    A chunk of no blocks (the embedding or the loss alone) holds none: the
    embedding's saved token ids and the loss's logits are the head's, counted
    apart."""
    w = np.asarray(chunk_blocks, dtype=float)
    total = m * v
    warm = min(2 * (p - rank - 1) + (v - 1) * p, total)
    if warm >= total:
        return float(m * w.sum())
    chunk = np.concatenate([np.repeat(np.arange(v), min(p, m - lo)) for lo in range(0, m, p)])
    held_after_forwards = np.cumsum(w[chunk])
    freed_after_backwards = np.concatenate(([0.0], np.cumsum(w[v - 1 - chunk])))
    k = np.arange(total - warm)
    # (steady step k: k + warm + 1 forwards done, k backwards)
    return float(np.max(held_after_forwards[k + warm] - freed_after_backwards[k]))


def split_in_flight(cols: dict, num_blocks: int, rows: np.ndarray, microbatches: np.ndarray):
    """For the ``rows`` (that set a split field and pass the rules): the
    micro-batches in flight on the first, the second and the last stage at
    its peak, in units of the stage's blocks (``interleaved_peak`` over the
    stage's blocks, 0 on a stage of none), from each stage's chunks
    (``chunk_split``); NaN where there is no interleaving (one chunk a
    stage: the counts of ``autopar.model.memory`` are exact)."""
    keys = [np.asarray(cols[f])[rows].astype(np.int64)
            for f in ("pipeline_par", "pipeline_interleaving") + SPLIT_FIELDS]
    keys.append(np.asarray(microbatches)[rows].astype(np.int64))
    idx, inv = distinct(*pack(keys))
    table = []
    for i in idx.tolist():
        p, v, first, last, e, l_, bal, m = (int(c[i]) for c in keys)
        chunks = chunk_split(num_blocks, p, max(v, 1), first, last, bool(e), bool(l_),
                             bal) if v > 1 else "one chunk"
        if isinstance(chunks, str):
            table.append((np.nan,) * 3)
            continue
        held = []
        for rank in (0, min(1, p - 1), p - 1):
            blocks = sum(chunks[rank])
            held.append(interleaved_peak(p, v, max(m, 1), rank, chunks[rank]) / blocks
                        if blocks else 0.0)
        table.append(tuple(held))
    table = np.array(table, dtype=float).reshape(-1, 3).T
    return tuple(table[k].take(inv) for k in range(3))


def split_counts(cols: dict, num_blocks: int, rows: np.ndarray):
    """For the ``rows`` (that set a split field and pass the rules): the
    blocks of the pacing stage (the most), of the first, the second and the
    last stage."""
    splits, inv = distinct_splits(cols, num_blocks, rows)
    table = np.array([(max(per), per[0], per[min(1, len(per) - 1)], per[-1])
                      for per in splits], dtype=np.int64).T
    return tuple(table[k].take(inv) for k in range(4))


def per_batch(sched: Schedule, base_value, edge_value):
    """A per-block quantity over the batch: every micro-batch runs every chunk,
    each with ``base_blocks`` base blocks and one edge block."""
    return sched.chunk_passes * (sched.base_blocks * base_value + edge_value)


def chunk_times(sums: BlockSums, sched: Schedule, p2p_fw_time, p2p_bw_time,
                offload_fw_time, offload_bw_time) -> dict:
    """Forward and backward time of a base and an edge block, and of a chunk.

    Offloading to the second memory tier overlaps a block's compute; where
    the transfer (with the block's own memory traffic) takes longer than the
    block, the difference is an overhead (``*_offload``).  ``*_no_offload``
    are the times before it.
    """
    fw_base = sums.fw_time + sums.base_fw_tp_exp
    fw_edge = sums.fw_time + sums.edge_fw_tp_exp + p2p_fw_time
    fw_base_offload = np.maximum(0.0, offload_fw_time + sums.fw_mem_time - fw_base)
    fw_edge_offload = np.maximum(0.0, offload_fw_time + sums.fw_mem_time - fw_edge)
    bw_common = sums.re_time + sums.agrad_time + sums.wgrad_time
    bw_base = bw_common + sums.base_recomm_exp + sums.base_agrad_tp_exp
    bw_edge = bw_common + sums.edge_recomm_exp + sums.edge_agrad_tp_exp + p2p_bw_time
    grad_mem_time = sums.agrad_mem_time + sums.wgrad_mem_time
    bw_base_offload = np.maximum(0.0, offload_bw_time + grad_mem_time - bw_base)
    bw_edge_offload = np.maximum(0.0, offload_bw_time + grad_mem_time - bw_edge)
    t = {"fw_base_no_offload": fw_base, "fw_edge_no_offload": fw_edge,
         "bw_base_no_offload": bw_base, "bw_edge_no_offload": bw_edge,
         "fw_base_offload": fw_base_offload, "fw_edge_offload": fw_edge_offload,
         "bw_base_offload": bw_base_offload, "bw_edge_offload": bw_edge_offload,
         "fw_base": fw_base + fw_base_offload, "fw_edge": fw_edge + fw_edge_offload,
         "bw_base": bw_base + bw_base_offload, "bw_edge": bw_edge + bw_edge_offload,
         "grad_mem_time": grad_mem_time}
    t["fw"] = sched.base_blocks * t["fw_base"] + 1.0 * t["fw_edge"]
    t["bw"] = sched.base_blocks * t["bw_base"] + 1.0 * t["bw_edge"]
    return t


def bubble(sched: Schedule, chunk: dict):
    """Idle time of the pipeline over one batch."""
    stages = sched.stages
    chunk_time = chunk["fw"] + chunk["bw"]
    # Stages lacking blocks finish early: the bubble shrinks by their share.
    saved = np.where(sched.base_blocks > 0,
                     sched.missing_blocks * (chunk["fw_base"] + chunk["fw_edge"]
                                             + chunk["bw_base"] + chunk["bw_edge"]) / 2,
                     sched.missing_blocks * (chunk["fw_edge"] + chunk["bw_edge"]))
    # Interleaving with micro-batches that do not fill the pipeline idles more.
    leftover = sched.leftover
    extra = np.where(leftover != 0, (sched.interleaving - 1) * (stages - leftover), 0)
    return (stages - 1) * chunk_time + (extra * chunk_time - saved)


def last_stage_slack(sched: Schedule, chunk: dict, extra_last: int = 0):
    """Seconds per micro-batch the last stage has to spare against the
    pacing stage (its ``blocks_per_stage - blocks_last`` fewer blocks at the
    average block's forward and backward time), in which the output layer
    and its loss run (Megatron's ``num_layers_in_last_pipeline_stage`` /
    ``account_for_loss_in_pipeline_split`` exist to give it this room); None
    where every stage is even.  ``extra_last``: the layers the last stage
    runs beside its decoder blocks (the multi-token-prediction modules'
    transformer layers, ``autopar.model.moe.mtp_layer_count``: Megatron-Core
    builds them on the last pipeline stage, NVIDIA/Megatron-LM@2a75ac1
    multi_token_prediction.py ``mtp_on_this_rank``, gpt_model.py
    ``GPTModel.__init__`` ``mtp_process``), which take from that spare
    time; none is left where they fill it."""
    if not sched.uneven:
        return None
    fewer = np.maximum(sched.blocks_per_stage - sched.blocks_last - extra_last, 0)
    return fewer * (chunk["fw"] + chunk["bw"]) / sched.blocks_per_chunk
