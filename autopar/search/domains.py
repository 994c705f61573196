"""Domain rules: the values each parameter may take, given the case and the
parameters decided before it.

One rule per parameter, in define-by-run order (``RULES``; dependencies
first, Calculon's loop nesting).  A rule returns ``(candidates, forced)``:
the values that make a valid layout (divisors of the processor count,
network tiers of the system, the options a choice allows), and, when the
option does not apply (e.g. ``data_par_overlap`` with ``data_par == 1``), a
reason with its one neutral value, which no space setting overrides.  The
rules follow Calculon's own search (``llm-optimal-execution``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

from autopar.io.layouts import (CHOICES, EXPERT_OFFLOAD_MODULES, EXT_DEFAULTS, MOMENT_BYTES, is_explicit_layout,
                                parse_layout, placement_problem)
from autopar.io.spaces import DERIVED, PARAMS
from autopar.model.pipeline import stage_split

@lru_cache(maxsize=4096)
def divisors(n: int) -> tuple[int, ...]:
    """The positive divisors of n, ascending."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return tuple(small + large[::-1])


_TF = (True, False)


def _r_tp(c, s):
    return tuple(d for d in divisors(c.num_procs)
                 if c.hidden % d == 0 and c.heads % d == 0
                 and (c.mamba_tp == 0 or c.mamba_tp % d == 0)), None


def _r_pp(c, s):
    if c.uneven:
        # Uneven splits: any pipeline size up to the blocks (the split's
        # rules decide, below).
        return tuple(d for d in divisors(c.num_procs // s["tensor_par"]) if d <= c.blocks), None
    return divisors(math.gcd(c.num_procs // s["tensor_par"], c.blocks)), None


def _r_cp(c, s):
    if c.hybrid:
        return (1,), "1 for a hybrid model"
    rest = c.num_procs // (s["tensor_par"] * s["pipeline_par"])
    return tuple(d for d in divisors(rest) if d == 1 or c.seq % (2 * d) == 0), None


def _r_dp(c, s):
    tp, pp, cp = s["tensor_par"], s["pipeline_par"], s["context_par"]
    return ((c.num_procs // (tp * pp * cp),) if c.num_procs % (tp * pp * cp) == 0
            else ()), None


def _r_reclayers(c, s):
    if s["activation_recompute"] != "full":
        return (0,), "needs activation_recompute full"
    return tuple(range(-(-c.blocks // s["pipeline_par"]))), None


def _r_wsh(c, s):
    if not s["optimizer_sharding"]:
        return (False,), "needs optimizer_sharding"
    return _TF, None


def _r_group(c, s):
    if not s["optimizer_sharding"]:
        return (0,), "needs optimizer_sharding"
    return (0,) + tuple(d for d in divisors(s["data_par"]) if 1 < d < s["data_par"]), None


def _r_cpcomm(c, s):
    if s["context_par"] == 1:
        return ("p2p",), "must be p2p when context_par is 1"
    if c.heads % (s["tensor_par"] * s["context_par"]):
        return ("p2p",), "a2a needs tensor_par * context_par to divide attn_heads"
    # (allgather is an execution's choice, not searched: autopar models it for
    # DeepSeek Sparse Attention only)
    return ("p2p", "a2a"), None


def _r_pgo(c, s):
    if not s["optimizer_sharding"] or s["weight_sharding"] or not c.training:
        return (False,), "needs optimizer_sharding without weight_sharding, and training"
    return _TF, None


def _r_outer(c, s):
    if not s["weight_sharding"] or not 0 < s["sharding_group"] < s["data_par"]:
        return (False,), "needs weight_sharding and 0 < sharding_group < data_par"
    return _TF, None


def _r_fp32grads(c, s):
    if not c.training:
        return (False,), "needs training"
    return _TF, None


def _r_recompute_moe_act(c, s):
    if not (c.training and c.experts) or s["activation_recompute"] == "full":
        return (False,), "needs training, experts and activation_recompute other than full"
    return _TF, None


def _r_recompute_up_proj(c, s):
    if not (c.training and c.mla) or s["activation_recompute"] == "full":
        return (False,), "needs training, latent attention (mla) and activation_recompute " \
            "other than full"
    return _TF, None


def _r_fp8(c, s):
    if c.datatype not in ("bfloat16", "float16"):
        return ("none",), "needs datatype bfloat16 or float16"
    return ("none",) + c.fp8, None


def _r_bf16_blocks(c, s):
    # The recipe's BF16 first / last blocks: 0 up to the model's blocks.  No
    # dependency on pipeline_par or fp8_recipe here: a field with one is
    # checked per combination of what it depends on, which made a space that
    # holds it fixed (every shipped one) 25x slower to enumerate.  The
    # model's rules refuse a count above a stage's blocks (Megatron-Core's
    # bound, num_blocks // pipeline_par) with their reason; without a
    # recipe the counts change nothing.
    return tuple(range(c.blocks + 1)), None


def _r_optimizer(c, s):
    if not c.training:
        return ("adam",), "needs training"
    return CHOICES["optimizer"], None


def _r_adapter(c, s):
    if not c.training:
        return ("none",), "needs training"
    return CHOICES["adapter"], None


# Adapter ranks and real-token percentages a space may fix or narrow (a
# recipe's, not a layout's: ``derived`` offers every one).
_RANKS = tuple(range(1, 1025))
_FILLS = tuple(range(1, 101))


def _r_rank(c, s):
    if s["adapter"] == "none":
        return (EXT_DEFAULTS["adapter_rank"],), "needs an adapter"
    return _RANKS, None


def _r_targets(c, s):
    if s["adapter"] == "none":
        return (EXT_DEFAULTS["adapter_targets"],), "needs an adapter"
    return CHOICES["adapter_targets"], None


def _r_fill(c, s):
    return _FILLS, None


def _r_span(c, s):
    # The packed documents' attention span (the data's): 0 (one document a
    # sequence) or 1 up to the sequence.
    return tuple(range(c.seq + 1)), None


def _r_moments(c, s):
    # fp32 or bf16 moments (autopar.io.layouts MOMENT_BYTES)
    return MOMENT_BYTES, None


def batch_for(policy: str, data_par: int, max_batch: int) -> int | None:
    """The global batch of a layout, or None when its data_par allows none."""
    if policy == "fixed":
        return max_batch if max_batch % data_par == 0 else None
    return (max_batch // data_par) * data_par if data_par <= max_batch else None


def _r_batch(c, s):
    b = batch_for(c.policy, s["data_par"], c.max_batch)
    return ((b,) if b is not None else ()), None


def _r_ppint(c, s):
    pp = s["pipeline_par"]
    if pp == 1:
        return (1,), "must be 1 when pipeline_par is 1"
    if c.hybrid and not c.uneven:
        # (a hybrid pattern's virtual stages: one '|' segment each, of equal
        # blocks: autopar.model.rules._check_hybrid)
        if c.blocks % pp:
            return (1,), "1 for a hybrid model whose blocks do not divide by pipeline_par"
        return divisors(c.blocks // pp), None
    if c.uneven:
        return tuple(range(1, c.blocks // pp + 1)), None
    return divisors(c.blocks // pp), None


# Uneven pipelines (the space searches or fixes a split field: ``c.uneven``):
# the split's values that Megatron builds (``stage_split``); where every
# split field stays at its default, Calculon's rule on the interleaving.
# first/last_stage_blocks are proposed up to the even share ceil(blocks / pp)
# (the use of them: room for the embedding and the loss).

def _split(c, s, first=0, last=0, embedding=None, loss=None, balanced=None):
    """The stages' blocks of a split (``stage_split``; Calculon's ceil split
    where every field is at its default), or None where it cannot be built."""
    e = s.get("embedding_in_split", False) if embedding is None else embedding
    l_ = s.get("loss_in_split", False) if loss is None else loss
    bal = s["pipeline_layout"] == "balanced" if balanced is None else balanced
    p, v = s["pipeline_par"], s["pipeline_interleaving"]
    if not (first or last or e or l_ or bal):
        return _calculon_split(c.blocks, p, v)
    per = stage_split(c.blocks, p, v, first, last, e, l_, bal)
    return None if isinstance(per, str) else per


@lru_cache(maxsize=1024)
def _calculon_split(blocks: int, p: int, v: int) -> list | None:
    """Calculon's ceil split (every split field at its default) as the
    model counts it (``stage_split``, ``autopar.model.pipeline.ceil_chunks``),
    or None where the interleaving does not divide a stage's blocks."""
    per = stage_split(blocks, p, v, 0, 0, False, False, 0)
    return None if isinstance(per, str) else per


def _new_split(c, s, **kw) -> bool:
    """Whether a split that sets a field can be built and gives the stages
    blocks the default split does not (the same blocks are the same layout
    for the model: proposed once, at the defaults)."""
    per = _split(c, s, **kw)
    return per is not None and per != _split(c, s, 0, 0, False, False, False)




def _r_layout(c, s):
    if s["pipeline_par"] == 1:
        return ("even",), "needs pipeline_par > 1"
    p, v = s["pipeline_par"], s["pipeline_interleaving"]
    # (an explicit layout, where a space names one: only on the pipeline
    # sizes it was written for and for a model whose layers it places; the
    # layouts registered in this process for other models are not proposed)
    return tuple(x for x in CHOICES["pipeline_layout"]
                 if x == "even" or (x == "balanced" and c.blocks >= p * v)
                 or (is_explicit_layout(x) and _layout_fits(x, p * v, c))), None


def _layout_fits(x: str, stages: int, c) -> bool:
    """Whether explicit layout ``x`` has ``stages`` virtual stages and places
    the layers of the case's model (``placement_problem`` for one of its
    decoder-layer counts and its MTP layers)."""
    parsed = parse_layout(x)
    return len(parsed) == stages and any(placement_problem(parsed, n, c.mtp) is None
                                         for n in c.layer_counts)


def _r_embedding(c, s):
    if s["pipeline_par"] == 1:
        return (False,), "needs pipeline_par > 1"
    if is_explicit_layout(s["pipeline_layout"]):
        return (False,), "an explicit pipeline_layout places the embedding itself"
    return tuple(e for e in _TF if not e or _split(c, s, embedding=True, loss=False)
                 or _split(c, s, embedding=True, loss=True)), None


def _r_loss(c, s):
    if s["pipeline_par"] == 1:
        return (False,), "needs pipeline_par > 1"
    if is_explicit_layout(s["pipeline_layout"]):
        return (False,), "an explicit pipeline_layout places the loss itself"
    e = s["embedding_in_split"]
    return tuple(x for x in _TF if (not (x or e) and s["pipeline_layout"] == "even")
                 or _new_split(c, s, loss=x)), None


def _stage_block_values(c, s):
    share = -(-c.blocks // s["pipeline_par"])
    v = s["pipeline_interleaving"]
    return tuple(range(v, share + 1, v))


def _r_first(c, s):
    if s["pipeline_par"] == 1 or s["pipeline_layout"] != "even" \
            or s["embedding_in_split"] or s["loss_in_split"]:
        return (0,), "needs pipeline_layout even without the embedding or loss in the split"
    return (0,) + _stage_block_values(c, s), None


def _r_last(c, s):
    if s["pipeline_par"] == 1 or s["pipeline_layout"] != "even" \
            or s["embedding_in_split"] or s["loss_in_split"]:
        return (0,), "needs pipeline_layout even without the embedding or loss in the split"
    first = s["first_stage_blocks"]
    return tuple(x for x in (0,) + _stage_block_values(c, s)
                 if (_split(c, s, first, x) is not None if not (first or x)
                     else _new_split(c, s, first=first, last=x))), None


def _r_recompute(c, s):
    if not c.training:
        return ("none",), "must be none when not training"
    return CHOICES["activation_recompute"], None


def _r_optsh(c, s):
    if s["data_par"] * s["context_par"] == 1:
        return (False,), "needs data_par * context_par > 1"
    return _TF, None


def _r_comm(c, s):
    if c.experts and s["tensor_par"] > 1:
        return ("rs_ag",), "must be rs_ag for a mixture-of-experts model with tensor_par > 1"
    return CHOICES["tensor_par_comm_type"], None


def _r_redo(c, s):
    if s["tensor_par_comm_type"] != "rs_ag" or s["activation_recompute"] == "full":
        return (False,), ("needs tensor_par_comm_type rs_ag and "
                          "activation_recompute other than full")
    return _TF, None


def _r_dpov(c, s):
    if s["data_par"] == 1 or not c.training:
        return (False,), "needs data_par > 1 and training"
    return _TF, None


def _r_tpov(c, s):
    if s["tensor_par"] == 1:
        return ("none",), "must be none when tensor_par is 1"
    if c.mla:
        return ("none",), "must be none with latent attention (mla)"
    return CHOICES["tensor_par_overlap"], None


def _r_woff(c, s):
    if not c.mem2:
        return (False,), "needs a second memory tier (mem2)"
    return _TF, None


def _r_aoff(c, s):
    if not c.mem2 or s["activation_recompute"] == "full":
        return (False,), "needs a second memory tier (mem2) and activation_recompute other than full"
    return _TF, None


def _r_ooff(c, s):
    if not c.mem2 or not c.training:
        return (False,), "needs a second memory tier (mem2) and training"
    return _TF, None


def _r_offload_blocks(c, s):
    # Partial CPU activation offloading (activation_offload_blocks): 0 up to
    # the model's blocks - 1 where there is a second tier to offload to and
    # a backward to keep activations for.  No dependency on pipeline_par or
    # activation_recompute (see _r_bf16_blocks: a field with one is checked
    # per combination, slow even where a space holds it fixed); the model's
    # rules refuse it with pipeline stages or recompute, as Megatron-Core does.
    if not c.mem2 or not c.training:
        return (0,), "needs a second memory tier (mem2) and training"
    return tuple(range(c.blocks)), None


def _r_offload_modules(c, s):
    # Fine-grained activation offloading (activation_offload_modules): every
    # set of the modules autopar counts where there is a second tier and a
    # backward; the experts' modules only for a model with experts.  No
    # dependency on activation_recompute (as _r_offload_blocks): the model's
    # rules refuse it with full recompute.
    if not c.mem2 or not c.training:
        return ("none",), "needs a second memory tier (mem2) and training"
    values = CHOICES["activation_offload_modules"]
    if not c.experts:
        values = tuple(v for v in values
                       if not set(EXPERT_OFFLOAD_MODULES) & set(v.split("+")))
    return values, None


def _r_fused(c, s):
    return _TF, None


def _r_attn(c, s):
    return CHOICES["attention_type"], None


def _r_impl(c, s):
    return CHOICES["attention_impl"], None


def _r_unsharded(c, s):
    if not s["optimizer_sharding"] or s["weight_sharding"]:
        return (False,), "needs optimizer_sharding without weight_sharding"
    return _TF, None


def _r_ep(c, s):
    if not c.experts:
        return (1,), "needs a mixture-of-experts model"
    domain = s["tensor_par"] * s["data_par"] * s["context_par"]
    return tuple(d for d in divisors(c.experts) if domain % d == 0), None


def _r_etp(c, s):
    if not c.experts:
        return (1,), "needs a mixture-of-experts model"
    room = s["tensor_par"] * s["data_par"] * s["context_par"] // s["expert_par"]
    return tuple(d for d in divisors(room) if c.expert_ff % d == 0), None


def _r_dispatch(c, s):
    if s["expert_par"] == 1 and s["expert_tensor_par"] == 1:
        return ("alltoall",), "must be alltoall when expert_par and expert_tensor_par are 1"
    return CHOICES["moe_dispatcher"], None


def _r_moe_overlap(c, s):
    if s["expert_par"] == 1 and s["expert_tensor_par"] == 1:
        return (False,), "needs expert_par or expert_tensor_par > 1"
    return _TF, None


def _r_mbs(c, s):
    tp = s["tensor_par"]
    local = s["batch_size"] // s["data_par"]
    return tuple(m for m in divisors(local) if (m * c.seq) % tp == 0), None


def _r_net(par):
    def rule(c, s):
        if s[par] == 1:
            return (0,), f"must be 0 when {par} is 1"
        return tuple(range(c.nets)), None
    return rule


@dataclass(frozen=True)
class Rule:
    name: str
    deps: tuple[str, ...]
    fn: Callable
    text: str            # why a value outside the candidates is invalid


RULES: tuple[Rule, ...] = (
    Rule("optimizer", (), _r_optimizer, ""),
    Rule("adapter", (), _r_adapter, ""),
    Rule("adapter_rank", ("adapter",), _r_rank, "1..1024"),
    Rule("adapter_targets", ("adapter",), _r_targets, ""),
    Rule("sequence_fill", (), _r_fill, "1..100"),
    Rule("attention_span", (), _r_span, "0 up to seq_size"),
    Rule("optimizer_moment_bytes", (), _r_moments, "4 (fp32) or 2 (bf16)"),
    Rule("tensor_par", (), _r_tp, "must divide num_procs, hidden, attn_heads and the "
         "mamba heads and groups"),
    Rule("pipeline_par", ("tensor_par",), _r_pp,
          "must divide num_procs/tensor_par and num_blocks"),
    Rule("context_par", ("tensor_par", "pipeline_par"), _r_cp,
          "must divide num_procs/(tensor_par*pipeline_par), with seq_size divisible by "
          "2*context_par"),
    Rule("data_par", ("tensor_par", "pipeline_par", "context_par"), _r_dp,
          "tensor_par*pipeline_par*context_par must divide num_procs"),
    Rule("batch_size", ("data_par",), _r_batch, "batch"),
    Rule("expert_par", ("tensor_par", "data_par", "context_par"), _r_ep,
          "must divide the number of experts and tensor_par*data_par*context_par"),
    Rule("expert_tensor_par", ("tensor_par", "data_par", "context_par", "expert_par"), _r_etp,
          "must divide the expert feed-forward size, with expert_par*expert_tensor_par "
          "dividing tensor_par*data_par*context_par"),
    Rule("pipeline_interleaving", ("pipeline_par",), _r_ppint,
          "must divide num_blocks/pipeline_par"),
    Rule("pipeline_layout", ("pipeline_par", "pipeline_interleaving"), _r_layout,
          "balanced needs a block per virtual stage"),
    Rule("embedding_in_split", ("pipeline_par", "pipeline_interleaving", "pipeline_layout"),
          _r_embedding, "the blocks with the embedding counted must split as Megatron does"),
    Rule("loss_in_split", ("pipeline_par", "pipeline_interleaving", "pipeline_layout",
                           "embedding_in_split"), _r_loss,
          "the blocks with the loss counted must split as Megatron does"),
    Rule("first_stage_blocks", ("pipeline_par", "pipeline_interleaving", "pipeline_layout",
                                "embedding_in_split", "loss_in_split"), _r_first,
          "0 or a multiple of pipeline_interleaving up to ceil(num_blocks/pipeline_par)"),
    Rule("last_stage_blocks", ("pipeline_par", "pipeline_interleaving", "pipeline_layout",
                               "embedding_in_split", "loss_in_split", "first_stage_blocks"),
          _r_last, "0 or a multiple of pipeline_interleaving up to ceil(num_blocks/"
          "pipeline_par), leaving the middle stages an even share"),
    Rule("activation_recompute", (), _r_recompute, ""),
    Rule("recompute_layers", ("pipeline_par", "activation_recompute"), _r_reclayers,
          "fewer than the blocks per stage"),
    Rule("optimizer_sharding", ("data_par", "context_par"), _r_optsh, ""),
    Rule("weight_sharding", ("optimizer_sharding",), _r_wsh, ""),
    Rule("sharding_group", ("data_par", "optimizer_sharding"), _r_group,
          "0 or a divisor of data_par between 1 and data_par"),
    Rule("tensor_par_comm_type", ("tensor_par",), _r_comm, ""),
    Rule("seq_par_ag_redo", ("tensor_par_comm_type", "activation_recompute"), _r_redo, ""),
    Rule("data_par_overlap", ("data_par",), _r_dpov, ""),
    Rule("tensor_par_overlap", ("tensor_par",), _r_tpov, ""),
    Rule("weight_offload", (), _r_woff, ""),
    Rule("activations_offload", ("activation_recompute",), _r_aoff, ""),
    Rule("optimizer_offload", (), _r_ooff, ""),
    Rule("activation_offload_blocks", (), _r_offload_blocks, "0 up to num_blocks - 1"),
    Rule("activation_offload_modules", (), _r_offload_modules,
          "sets of the modules autopar counts (expert ones with experts)"),
    Rule("fused_activation", (), _r_fused, ""),
    Rule("attention_type", (), _r_attn, ""),
    Rule("microbatch_size", ("tensor_par", "data_par", "batch_size"), _r_mbs,
          "must divide batch_size/data_par, with microbatch_size*seq_size "
          "divisible by tensor_par"),
    Rule("tensor_par_net", ("tensor_par",), _r_net("tensor_par"), "network tier"),
    Rule("pipeline_par_net", ("pipeline_par",), _r_net("pipeline_par"), "network tier"),
    Rule("data_par_net", ("data_par",), _r_net("data_par"), "network tier"),
    Rule("attention_impl", (), _r_impl, ""),
    Rule("fused_norm", (), _r_fused, ""),
    Rule("unsharded_grads", ("optimizer_sharding", "weight_sharding"), _r_unsharded, ""),
    Rule("context_par_net", ("context_par",), _r_net("context_par"), "network tier"),
    Rule("context_par_comm", ("tensor_par", "context_par"), _r_cpcomm, ""),
    Rule("fp8_recipe", (), _r_fp8, ""),
    Rule("bf16_first_blocks", (), _r_bf16_blocks, "0 up to num_blocks"),
    Rule("bf16_last_blocks", (), _r_bf16_blocks, "0 up to num_blocks"),
    Rule("fp32_grads", (), _r_fp32grads, ""),
    Rule("param_gather_overlap", ("optimizer_sharding", "weight_sharding"), _r_pgo, ""),
    Rule("recompute_moe_act", ("activation_recompute",), _r_recompute_moe_act, ""),
    Rule("recompute_mla_up_proj", ("activation_recompute",), _r_recompute_up_proj, ""),
    Rule("optimizer_outer_sharding", ("data_par", "weight_sharding", "sharding_group"),
         _r_outer, ""),
    Rule("expert_par_net", ("expert_par",), _r_net("expert_par"), "network tier"),
    Rule("expert_tensor_par_net", ("expert_tensor_par",), _r_net("expert_tensor_par"),
          "network tier"),
    Rule("moe_dispatcher", ("expert_par", "expert_tensor_par"), _r_dispatch, ""),
    Rule("moe_overlap", ("expert_par", "expert_tensor_par"), _r_moe_overlap, ""),
)
assert tuple(r.name for r in RULES if r.name not in DERIVED) == PARAMS
