"""Parameter counts of a model, from the model's own weight accounting.

``parameter_counts(model)`` lays out one dense and (for a mixture of
experts) one MoE block on a single processor in float32 and counts their
weights the way the performance model does, so the counts check the layer
sequences against a model's published size: every block, the embedding and
output layer (``vocab_size``), the multi-token-prediction modules; *active*
counts the routed experts a token passes (top-k of them) instead of all.
A hybrid model's MTP modules count the layers of ``mtp_pattern``; a
repeated module (``mtp_repeated``) is counted once.
"""
from __future__ import annotations

from autopar.io.layouts import to_columns
from autopar.io.specs import ModelSpec, SystemSpec
from autopar.model.evaluate import typed_columns
from autopar.model.mamba import hybrid_kinds, layer_kinds
from autopar.model.moe import mtp_layers
from autopar.model.rules import normalize
from autopar.model.speedups import BlockCache


def _one_processor() -> dict:
    return {"num_procs": 1, "tensor_par": 1, "pipeline_par": 1, "data_par": 1,
            "tensor_par_net": 0, "pipeline_par_net": 0, "data_par_net": 0,
            "batch_size": 1, "microbatch_size": 1, "datatype": "float32",
            "fused_activation": True, "attention_type": "multihead",
            "activation_recompute": "none", "pipeline_interleaving": 1,
            "optimizer_sharding": False, "tensor_par_comm_type": "ar",
            "tensor_par_overlap": "none", "seq_par_ag_redo": False,
            "data_par_overlap": False, "weight_offload": False,
            "activations_offload": False, "optimizer_offload": False, "training": True}


def parameter_counts(model: ModelSpec, system: SystemSpec) -> dict:
    """``total`` and ``active`` parameters, and those of one ``dense_block``
    and one ``moe_block`` (its ``routed`` experts apart); a hybrid model's,
    of one layer of each kind (``mamba_block``, ``attention_block``, ...)."""
    cols = typed_columns(normalize(to_columns([_one_processor()])))
    fp32 = [3]                                  # CHOICES["datatype"].index("float32")
    if model.hybrid_pattern:
        return _hybrid_counts(model, system, cols, fp32)
    # (the MTP modules whose weights the model holds: one where a single
    # module runs every depth, autopar.model.moe.mtp_layers)
    held_mtp = 1 if model.mtp_repeated else model.mtp
    dense = BlockCache(model, system, cols, fp32).rows(slice(0, 1))
    per_dense = float(dense.weight_space[0]) / 4
    n_dense = model.num_blocks if model.moe is None else model.moe.first_dense
    out = {"dense_block": per_dense, "moe_block": 0.0, "routed": 0.0}
    total = active = n_dense * per_dense
    if model.moe is not None:
        moe = BlockCache(model, system, cols, fp32, kind="moe").rows(slice(0, 1))
        per_moe = float(moe.weight_space[0]) / 4
        routed = float(moe.x_weight_space[0]) / 4
        shared = per_moe - routed
        blocks = model.num_blocks - n_dense + held_mtp
        total += blocks * per_moe
        active += blocks * (shared + routed * model.moe.top_k / model.moe.experts)
        out.update(moe_block=per_moe, routed=routed)
    elif model.mtp:
        total += held_mtp * per_dense
        active += held_mtp * per_dense
    extra = 2.0 * model.vocab_size * model.hidden + held_mtp * 2.0 * model.hidden ** 2
    out["total"] = total + extra
    out["active"] = active + extra
    return out


def _hybrid_counts(model: ModelSpec, system: SystemSpec, cols: dict, fp32) -> dict:
    """A hybrid model's counts: one layer of each kind (``{kind}_block``),
    times the layers of that kind in its pattern."""
    out = {"routed": 0.0}
    kinds = hybrid_kinds(model)
    _, mtp_held = mtp_layers(model, kinds)
    total = active = 2.0 * model.vocab_size * model.hidden
    if model.mtp:
        # the MTP modules' projections of [hidden; embedding] to hidden
        total = active = total + (1 if model.mtp_repeated else model.mtp) * 2.0 * model.hidden ** 2
    for kind, n_mtp in zip(kinds, mtp_held):
        sums = BlockCache(model, system, cols, fp32, kind=kind).rows(slice(0, 1))
        per = float(sums.weight_space[0]) / 4
        routed = float(sums.x_weight_space[0]) / 4
        n = layer_kinds(model).count(kind) + n_mtp
        out[f"{kind}_block"] = per
        total += n * per
        active += n * (per - routed)
        if kind == "moe":
            out["routed"] = routed
            active += n * routed * model.moe.top_k / model.moe.experts
    out["total"], out["active"] = total, active
    return out
