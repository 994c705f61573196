"""Row functions of the published tables' mixture-of-experts rows.

``autopar.studies.published`` owns the registry; its SimuMax and
Megatron-Bridge tables hand their MoE rows here:

* ``simumax_moe(row)``: DeepSeek-V2 / V3 truncated to ``layers_truncated_to``
  blocks (the first dense: "DeepSeekV3 formal rows use dense_layers=1", and
  V2's own first block is dense) on 8 B200, bf16, Megatron-LM with expert
  parallelism ``ep`` over the data-parallel ranks; measured step time and
  peak allocated memory.
* ``bridge_qwen3(row)``: Qwen3-30B-A3B rows of Megatron-Bridge's
  performance summary (tokens/s/GPU with full layouts) on the datasheet
  system files (GB300, GB200, B300, B200, H100) with one fitted constant,
  the host time per op issued after each MoE block's token-count sync
  (``MOE_HOST_OP_S``; ``fit_bridge_host_op_time``).  Every release's rows
  are predicted by the same model: the table repeats layouts over releases
  whose throughput moves up to 1.9x, and docs/validation.md reports the
  error by release.

What the tables do not state takes Megatron's defaults, as the dense rows of
the same tables do (``published.megatron_execution``): the distributed
optimizer, fp32 gradient buffers with bf16, flash attention, fused kernels,
no recompute.  Megatron-Bridge's Qwen3-30B-A3B performance recipes
(scripts/performance/configs/qwen) add: no recompute, gradients reduced in
bf16, ``moe_router_force_load_balancing``, the ``flex`` dispatcher with the
HybridEP backend (``deepep`` here), no ``moe_a2a_overlap``; the recipes of
today are applied to every release's rows.  MoE specifics of the SimuMax
runs: Megatron's ``alltoall`` dispatcher, not overlapped with compute
(communication overlap is off in those runs);
balanced routing (the Bridge page: "token distribution force-balanced across
experts"; the SimuMax runs do not say), dropless (no capacity padding), no
multi-token prediction in the truncated DeepSeek runs.
"""
from __future__ import annotations

import dataclasses

from autopar.io.frameworks import load_framework
from autopar.io.specs import TimeOverhead
from autopar.studies import published_base as P

SIMUMAX_MOE_MODELS = {"deepseekv2": "deepseek-v2", "deepseekv3": "deepseek-v3"}

# Host time per op that Megatron's dropless MoE layers issue after their
# token-count sync (``time_overhead.moe_host_op_s``; the ops counted by
# autopar.model.overhead.moe_sync_ops, applied by autopar.model.moe.host_sync).
# One constant, fitted by ``fit_bridge_host_op_time`` on the two
# ``BRIDGE_FIT_ROWS`` of the Bridge table (26.04.01 GB200 and B200) and held
# out on its other 34 rows and on SimuMax's 12 DeepSeek rows; refitted on
# those DeepSeek rows alone (``fit_simumax_host_op_time``) it predicts the
# Bridge table for its leave-one-table-out figure (docs/validation.md, "MoE
# host time, counted").  It is the ``moe_host_op_s`` of
# frameworks/megatron-core.json and megatron-bridge.json.
MOE_HOST_OP_S = load_framework(P.FRAMEWORKS / "megatron-core.json").time_overhead.moe_host_op_s
BRIDGE_FIT_ROWS = r"^26\.04\.01 DGX-(GB200|B200) "
HOST_OP_GRID = tuple(round(0.5e-6 * i, 8) for i in range(121))      # 0 to 60 us


def fit_host_op_time(cases, grid=HOST_OP_GRID) -> tuple[float, dict]:
    """The grid value of the host time per op after the MoE sync that
    minimises the mean |tokens/s error| on ``cases``, and that mean for
    every grid value (the ties go to the smaller value)."""
    from autopar.model import evaluate_one
    scores = {}
    for h in grid:
        errs = []
        for c in cases:
            s = evaluate_one(c.model, with_moe_host_op_time(c.system, h), c.execution)
            tok = s["sample_rate"] * c.model.seq_size / c.execution["num_procs"]
            errs.append(abs(tok / c.measured["tokens_per_s_per_gpu"] - 1))
        scores[h] = sum(errs) / len(errs)
    best = min(scores, key=lambda h: (round(scores[h], 6), h))
    return best, scores


def bridge_fit_cases() -> list:
    """The Bridge table's ``BRIDGE_FIT_ROWS`` (the tables are registered
    once ``autopar.studies.published`` is imported)."""
    import re

    return [c for _, c in P.cases(P.TABLES["bridge_qwen3_moe"])
            if isinstance(c, P.PublishedCase) and re.match(BRIDGE_FIT_ROWS, c.label)]


def simumax_moe_cases() -> list:
    """SimuMax's 12 DeepSeek-V2/V3 rows (Megatron-LM's all-to-all dispatcher
    on ``systems/b200_nvl8_megatron.json``)."""
    return [c for _, c in P.cases(P.TABLES["simumax_b200"])
            if isinstance(c, P.PublishedCase) and c.model.moe is not None]


def fit_bridge_host_op_time(grid=HOST_OP_GRID) -> tuple[float, dict]:
    """``fit_host_op_time`` on the ``BRIDGE_FIT_ROWS`` of the Bridge table:
    how ``MOE_HOST_OP_S`` was fitted."""
    return fit_host_op_time(bridge_fit_cases(), grid)


def fit_simumax_host_op_time(grid=HOST_OP_GRID) -> tuple[float, dict]:
    """``fit_host_op_time`` on SimuMax's 12 DeepSeek rows: the constant
    refitted without the Bridge table, for its leave-one-table-out figure
    (``autopar.studies.crossval``)."""
    return fit_host_op_time(simumax_moe_cases(), grid)


def with_moe_host_op_time(system_, seconds: float | None = None):
    """``system_`` with the host time per op after Megatron's MoE sync
    (``MOE_HOST_OP_S`` unless given) and no stated per-block time; nothing
    else changed (dense blocks have none, so dense predictions on it stay as
    they were)."""
    t = system_.time_overhead or TimeOverhead()
    s = MOE_HOST_OP_S if seconds is None else seconds
    return dataclasses.replace(system_, time_overhead=dataclasses.replace(
        t, moe_host_op_s=s, moe_block_s=0.0))


def expert_fields(system_, *, tp: int, ep: int, etp: int = 1,
                   dispatcher: str = "alltoall") -> dict:
    """Execution fields of expert parallelism: EP ranks follow the tensor
    ranks in Megatron's order, so the EP group spans tp * ep consecutive
    ranks and sits on the first tier that holds them."""
    tier = system_.tier_holding

    return {"expert_par": ep, "expert_tensor_par": etp,
            "expert_par_net": tier(tp * etp * ep) if ep > 1 else 0,
            "expert_tensor_par_net": tier(tp * etp) if etp > 1 else 0,
            "moe_dispatcher": dispatcher if ep * etp > 1 else "alltoall",
            "moe_overlap": False}


def simumax_moe(row) -> "P.PublishedCase | P.Skip":
    label = str(row.case)
    name = SIMUMAX_MOE_MODELS.get(str(row.model))
    if name is None:
        return P.Skip(f"no model file for {row.model}", label)
    base = P.model(name)
    blocks = int(row.layers_truncated_to)
    m = dataclasses.replace(base, seq_size=int(row.seq_len), num_blocks=blocks, mtp=0,
                            moe=dataclasses.replace(base.moe, first_dense=1))
    # The B200 file of SimuMax's measurements, with the MoE blocks' host time
    # per op after the sync (fitted on the Bridge rows).
    sy = P.system("b200_nvl8_megatron", P.SIMUMAX_FRAMEWORK)   # its moe_host_op_s
    n, tp, pp, dp, cp, ep = (int(row.n_gpus), int(row.tp), int(row.pp), int(row.dp),
                             int(row.cp), int(row.ep))
    vp = P.int_or_none(row.vp) or 1
    mbs, mbc = int(row.micro_batch), int(row.microbatch_count)
    gbs = mbs * mbc * dp
    ex = P.megatron_execution(sy, n=n, tp=tp, pp=pp, dp=dp, cp=cp, gbs=gbs, mbs=mbs, vp=vp,
                              dist_opt=True, dp_overlap=False, cp_comm="a2a")
    P.te_gathers_again(ex)
    ex.update(expert_fields(sy, tp=tp, ep=ep))
    step = float(row.real_step_ms) / 1e3
    tok = gbs * m.seq_size / step / n
    return P.PublishedCase(m, sy, ex, {"tokens_per_s_per_gpu": tok,
                                       "peak_mem_gib": float(row.real_peak_alloc_gib)}, label)


# Megatron-Bridge's systems -> autopar's datasheet files.
BRIDGE_SYSTEMS = {"DGX-B200": "b200_nvl8", "DGX-GB200": "gb200_nvl72",
                  "DGX-H100": "h100_80g_nvl8", "DGX-GB300": "gb300_nvl72",
                  "DGX-B300": "b300_nvl8"}
# Precision column -> fp8 recipe.  "FP8" on H100 and "FP8-CS" are current
# (per-tensor) scaling; MXFP8 / FP8-MX are 1x32 block scales.  Rows that do
# not state it (25.09) ran FP8 (the page's footnote compares two FP8
# granularities): MXFP8 on Blackwell, per-tensor on H100.
BRIDGE_FP8 = {"MXFP8": "mxfp8", "FP8-MX": "mxfp8", "FP8": "tensorwise",
              "FP8-CS": "tensorwise"}


# Releases whose Megatron-Bridge ran without gradient-accumulation fusion, so
# without Transformer Engine's cached dummy weight gradients: NeMo 25.11 and
# 26.02 (Bridge r0.2.0 / r0.3.0), whose src/megatron/bridge/utils/fusions.py
# can_enable_gradient_accumulation_fusion checked only for APEX's
# fused_weight_gradient_mlp_cuda, "not installed in TE-based training
# containers" (Bridge 25bc068, 2026-03-23, the fix in r0.4.0 on); their
# performance scripts force the fusion on only under Megatron FSDP
# (scripts/performance/utils/helpers.py @717c62d, overrides.py @21b02e0).  25.09
# (r0.1.0) forced it on for every run (scripts/performance/run_script.py
# @684a686).  Every other term of frameworks/megatron-bridge.json holds for
# every release of the table (docs/validation.md, "Megatron-Bridge: the
# Megatron-Core + TE terms it runs").
BRIDGE_NO_WGRAD_FUSION = ("25.11", "26.02")


def bridge_release_system(system_, release: str):
    """``system_`` (on frameworks/megatron-bridge.json) as the Bridge release
    ``release`` ran it: without TE's cached dummy weight gradients and
    without the fusion's gradients in the buffer (Calculon's count) where the
    release left gradient-accumulation fusion off (``BRIDGE_NO_WGRAD_FUSION``;
    a release "26.02.01" is 26.02's); unchanged otherwise."""
    if not release.startswith(BRIDGE_NO_WGRAD_FUSION):
        return system_
    over = dataclasses.replace(system_.memory_overhead, dummy_wgrad=False,
                               wgrad_accumulation_fusion=False)
    return dataclasses.replace(system_, memory_overhead=over)


def bridge_qwen3(row) -> "P.PublishedCase | P.Skip":
    label = f"{row.release} {row.system} gbs{row.gbs} mbs{row.mbs} pp{row.pp} ep{P.int_or_none(row.ep)}" \
            + (f" vp{P.int_or_none(row.vp)}" if P.int_or_none(row.vp) and P.int_or_none(row.vp) > 1 else "") \
            + (f" {row.variant}" if isinstance(row.variant, str) and row.variant else "")
    sys_name = BRIDGE_SYSTEMS.get(str(row.system))
    if sys_name is None:
        return P.Skip(f"no system file for {row.system}", label)
    # frameworks/megatron-bridge.json (its moe_host_op_s: MOE_HOST_OP_S) as the
    # row's release ran it.
    sy = bridge_release_system(P.system(sys_name, "megatron-bridge"), str(row.release))
    precision = row.precision if isinstance(row.precision, str) else ""
    blackwell = sys_name != "h100_80g_nvl8"
    recipe = BRIDGE_FP8.get(precision) or ("mxfp8" if blackwell else "tensorwise")
    m = P.model("qwen3-30B-A3B", seq_size=int(row.seq_len))
    n, tp, pp, cp = int(row.n_gpus), int(row.tp), int(row.pp), int(row.cp)
    ep = P.int_or_none(row.ep) or 1
    dp = n // (tp * pp * cp)
    vp = P.int_or_none(row.vp) or 1
    if vp > 1 and pp == 1:
        vp = 1
    gbs, mbs = int(row.gbs), int(row.mbs)
    # A row run with Megatron-FSDP (the summary's FSDP column): Bridge's
    # ``optim_grads_params``, weight_sharding with the experts sharded over
    # the expert-data-parallel group (autopar.studies.recipes_moe.megatron_fsdp;
    # no row of the table sets it at 067f987).
    fsdp = bool(P.number_or_none(row.fsdp))
    # Bridge's Qwen3 performance recipes: no recompute, gradients reduced in
    # the working precision (grad_reduce_in_fp32 off), load balancing forced.
    ex = P.megatron_execution(sy, n=n, tp=tp, pp=pp, dp=dp, cp=cp, gbs=gbs, mbs=mbs, vp=vp,
                              dist_opt=True, dp_overlap=True, fp8=recipe, fp32_grads=False,
                              fsdp=fsdp)
    P.te_gathers_again(ex)
    # The recipes' "flex" dispatcher with the HybridEP backend (DeepEP-style).
    ex.update(expert_fields(sy, tp=tp, ep=ep, dispatcher="deepep"))
    tok = float(row.tokens_per_sec_per_gpu)
    return P.PublishedCase(m, sy, ex, {"tokens_per_s_per_gpu": tok}, label)
