"""Validation of the model against published measurements.

``megatron(system)`` predicts the Megatron-LM figures of Korthikanti et al.
(per-GPU memory, activation memory by recompute mode, time per batch) from the
layouts that produced them, and reports the errors.
"""
from __future__ import annotations

import dataclasses
import json
from importlib import resources

import numpy as np
import pandas as pd

from autopar.model import evaluate_one
from autopar.io.specs import SpecError, SystemSpec, load_model

GIB = 1024 ** 3


def megatron_data() -> dict:
    """The published figures and the layouts behind them (shipped with autopar)."""
    text = resources.files("autopar").joinpath("data/megatron_seqsel.json").read_text()
    return json.loads(text)


def unbounded(system: SystemSpec) -> SystemSpec:
    """The system with memory tiers too large to fill (to read requirements)."""
    big = 1 << 40
    return dataclasses.replace(system, mem1=dataclasses.replace(system.mem1, GiB=big),
                               mem2=dataclasses.replace(system.mem2, GiB=big))


def megatron(system: SystemSpec) -> pd.DataFrame:
    """One row per published figure: figure, model, variant, published, predicted, error."""
    data = megatron_data()
    models = {m: load_model(dict(shape, name=m), source=f"megatron:{m}")
              for m, shape in data["models"].items()}
    free = unbounded(system)
    rows = []

    def act(s):
        return (s["act_space"] + s["act_checkpoint_size"]) / GIB

    for m, variants in data["fig1_memory_gib"].items():
        for v, pub in variants.items():
            s = evaluate_one(models[m], free, data["layouts"]["fig1"][m][v])
            par_opt = (s["weight_space"] + s["weight_grad_space"] + s["optimizer_space"]) / GIB
            rows.append(("fig1_activation_memory_gib", m, v, pub["act"], act(s)))
            rows.append(("fig1_weights_grads_optimizer_gib", m, v, pub["par_opt"], par_opt))
    for m, variants in data["fig7_activation_memory_percent_of_none"].items():
        base = act(evaluate_one(models[m], free, data["layouts"]["fig7"][m]["none"]))
        for v, pub in variants.items():
            s = evaluate_one(models[m], free, data["layouts"]["fig7"][m][v])
            rows.append(("fig7_activation_memory_percent", m, v, pub, 100 * act(s) / base))
    for m, variants in data["tab5_batch_time_s"].items():
        for v, pub in variants.items():
            s = evaluate_one(models[m], system, data["layouts"]["tab5"][m][v])
            pred = s["total_time"] if s["feasible"] else np.nan
            rows.append(("tab5_batch_time_s", m, v, pub, pred))
    table = pd.DataFrame(rows, columns=["figure", "model", "variant", "published", "predicted"])
    table["error_pct"] = 100 * (table["predicted"] - table["published"]).abs() / table["published"]
    return table


def summarize(table: pd.DataFrame) -> pd.DataFrame:
    """Mean and max absolute error (%) per figure."""
    g = table.groupby("figure", sort=False)["error_pct"]
    return pd.DataFrame({"mean_error_pct": g.mean(), "max_error_pct": g.max(),
                         "points": g.size()})


# ----------------------------------------------------------------------------
# Measured sweeps (the column format of the LLaMA sweeps).

SWEEP_COLUMNS = ("sweep", "model", "seq_size", "global_batch", "world_size", "tensor_par",
                 "pipeline_par", "microbatch_size", "checkpointing", "kernel",
                 "sequence_parallel", "status", "step_time_s", "mfu")

# kernel column -> (attention_impl, fused_norm)
KERNELS = {
    "torch": ("unfused", False),
    "fused": ("fused_softmax", False),
    "flash_attentionv1.0.8": ("flash_v1", False),
    "flash_attention2": ("flash_v2", False),
    "flash_attention2 + RMS kernel": ("flash_v2", True),
}
CHECKPOINTING = {"disabled": "none", "every_layer": "full", "selective": "attn_only"}
# Columns a sweep row may leave blank when predicted as a partial layout
# (``validate_sweep(partial=True)``), the execution fields a blank leaves
# unknown, and a placeholder that builds the rest of the row's execution.
SWEEP_UNSTATED = {"microbatch_size": (("microbatch_size",), 1),
                  "checkpointing": (("activation_recompute",), "disabled"),
                  "kernel": (("attention_impl", "fused_norm"), "torch"),
                  "sequence_parallel": (("tensor_par_comm_type",), False)}
# The values the sweep's format can express for those fields.
# Execution fields the sweep's format does not state and ``sweep_execution``
# assumes (Megatron's fused activation); a framework's ``defaults`` for them
# replace the assumption (``defaults=`` of ``sweep_execution``,
# ``sweep_groups``, ``validate_sweep`` and ``calibrate.Sweep``).
SWEEP_ASSUMED = ("fused_activation",)
SWEEP_OPTIONS = {"microbatch_size": None,
                 "activation_recompute": tuple(dict.fromkeys(CHECKPOINTING.values())),
                 "attention_impl": tuple(dict.fromkeys(k[0] for k in KERNELS.values())),
                 "fused_norm": (False, True), "tensor_par_comm_type": ("ar", "rs_ag")}


def sweep_execution(row, system: SystemSpec, defaults=None) -> dict:
    """The execution a measured row ran: Megatron-style placement and options.

    Ranks are laid out as Megatron does (tensor fastest, then data, then
    pipeline): tensor parallelism stays inside a node (tier 0), data
    parallelism goes on the first tier that holds tensor x data ranks, and
    pipeline parallelism on the tier that holds the whole world.  With dp > 1 the
    optimizer state is sharded across data parallelism and the weight
    gradients are not (Megatron's distributed optimizer).  A framework's
    ``defaults`` replace the assumptions of ``SWEEP_ASSUMED`` (the fused
    activation) where they name them.
    """
    tp, pp = int(row.tensor_par), int(row.pipeline_par)
    world = int(row.world_size)
    dp = world // (tp * pp)
    impl, fused_norm = KERNELS[row.kernel]
    tier = system.tier_holding

    ex = {
        "num_procs": world, "tensor_par": tp, "pipeline_par": pp, "data_par": dp,
        "tensor_par_net": 0, "data_par_net": tier(tp * dp), "pipeline_par_net": tier(world),
        "batch_size": int(row.global_batch), "microbatch_size": int(row.microbatch_size),
        "datatype": "bfloat16", "fused_activation": True, "attention_type": "multihead",
        "activation_recompute": CHECKPOINTING[row.checkpointing],
        "pipeline_interleaving": 1, "optimizer_sharding": dp > 1,
        "tensor_par_comm_type": "rs_ag" if _truthy(row.sequence_parallel) else "ar",
        "tensor_par_overlap": "none", "seq_par_ag_redo": False,
        "data_par_overlap": dp > 1, "weight_offload": False, "activations_offload": False,
        "optimizer_offload": False, "training": True,
        "attention_impl": impl, "fused_norm": fused_norm, "unsharded_grads": dp > 1,
    }
    for f in SWEEP_ASSUMED:
        if defaults and f in defaults:
            ex[f] = defaults[f]
    return ex


def _truthy(v) -> bool:
    return str(v).strip().lower() in ("true", "1", "yes")


def read_sweep(path, blanks: tuple = ()) -> pd.DataFrame:
    """A measured sweep, checked; the columns of ``blanks`` may hold blank
    cells (a partial layout's unstated fields)."""
    from autopar.io.specs import regular_input

    regular_input(path)
    try:
        frame = pd.read_csv(path)
    except FileNotFoundError:
        raise SpecError(str(path), "(file)", "no such file") from None
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        raise SpecError(str(path), "(file)", f"not a readable CSV: {e}") from None
    frame.attrs["source"] = str(path)
    missing = [c for c in SWEEP_COLUMNS if c not in frame.columns]
    if missing:
        raise SpecError(str(path), missing[0], "missing column")
    def blank(col):
        return frame[col].isna() if col in blanks else False

    bad = ~frame["kernel"].isin(list(KERNELS)) & ~blank("kernel")
    if bad.any():
        raise SpecError(str(path), "kernel", f"unknown kernel {frame.kernel[bad].iloc[0]!r} "
                                              f"(one of: {', '.join(KERNELS)})")
    bad = ~frame["checkpointing"].isin(list(CHECKPOINTING)) & ~blank("checkpointing")
    if bad.any():
        raise SpecError(str(path), "checkpointing",
                        f"unknown value {frame.checkpointing[bad].iloc[0]!r}")
    for col in ("world_size", "tensor_par", "pipeline_par", "microbatch_size", "global_batch",
                "seq_size"):
        if col in blanks and frame[col].isna().any():
            v = frame[col].dropna()
            if v.dtype.kind not in "iuf" or (v <= 0).any() or (v != v.round()).any():
                raise SpecError(str(path), col, "expected positive integers or blanks")
            continue
        if frame[col].dtype.kind not in "iu" or (frame[col] <= 0).any():
            raise SpecError(str(path), col, "expected positive integers")
    for col in ("step_time_s", "mfu"):
        # measured figures: empty where the run did not finish, else a number > 0
        given = frame[col].notna()
        values = pd.to_numeric(frame[col], errors="coerce")
        bad = given & ~(values > 0)
        if bad.any():
            at = int(np.flatnonzero(bad.to_numpy())[0])
            raise SpecError(str(path), col, f"row {at + 2}: expected a positive number, "
                                            f"got {frame[col].iloc[at]!r}")
        frame[col] = values
    return frame


def sweep_groups(frame: pd.DataFrame, system: SystemSpec, models_dir="models", defaults=None):
    """The rows of a sweep by (model, sequence): [(rows, model, executions)].

    A pipeline that does not divide the blocks is kept: Megatron then places
    fewer blocks on some stages, which the model counts as Calculon does
    (every stage holds ``ceil(blocks / pipeline_par)`` blocks' memory, the
    stages lacking blocks shorten the bubble)."""
    groups = []
    for (mname, seq), rows in frame.groupby(["model", "seq_size"], sort=False):
        model = sweep_model(mname, seq, models_dir, frame.attrs.get("source", "sweep"),
                            int(rows.index[0]) + 2)
        groups.append((rows, model, [sweep_execution(r, system, defaults)
                                     for r in rows.itertuples()]))
    return groups


def sweep_model(name: str, seq: int, models_dir="models", source: str = "sweep",
                row: int | None = None):
    """A sweep's model file at the sweep's sequence length (SpecError naming
    the sweep, its model column and ``row`` when autopar has no such file)."""
    from pathlib import Path

    path = Path(models_dir) / f"{name}.json"
    if not path.is_file():
        at = f"row {row}: " if row is not None else ""
        raise SpecError(source, "model", f"{at}no model file {path} for {name!r}")
    model = load_model(path)
    if model.seq_size != seq:
        model = dataclasses.replace(model, seq_size=int(seq))
    return model


def headroom_of(system: SystemSpec, headroom_gib=None) -> float:
    """The memory headroom (GiB) asked for, else the system's default, else 0."""
    if headroom_gib is not None:
        return float(headroom_gib)
    return system.memory_headroom.GiB if system.memory_headroom is not None else 0.0


def validate_sweep(path, system: SystemSpec, models_dir="models",
                   headroom_gib=None, partial: bool = False,
                   options: dict | None = None, defaults=None) -> pd.DataFrame:
    """Predict every row of a measured sweep: adds pred_feasible, pred_reason,
    pred_step_time_s, pred_mem_gib and pred_fits_headroom (feasible with
    ``headroom_gib`` to spare; default: the system's ``memory_headroom``).

    With ``partial``, a row may leave the columns of ``SWEEP_UNSTATED``
    blank: such a row is predicted over every completion of the fields its
    blanks leave unknown (``SWEEP_OPTIONS``, or ``options`` per field), its
    predictions are the best completion's (pred_feasible: some completion
    fits), ``pred_partial`` marks it and ``pred_chosen`` names the values
    chosen.  ``defaults``: a framework's recipe defaults (``SWEEP_ASSUMED``)."""
    from autopar.model.frame import evaluate

    frame = read_sweep(path, blanks=tuple(SWEEP_UNSTATED) if partial else ())
    out = []
    blank = (frame[list(SWEEP_UNSTATED)].isna().any(axis=1) if partial
             else pd.Series(False, index=frame.index))
    if blank.any():
        out.append(_partial_rows(frame[blank], system, models_dir, options, defaults))
    for rows, model, exes in sweep_groups(frame[~blank], system, models_dir, defaults):
        pred = evaluate(model, system, exes)
        part = rows.copy()
        part["pred_feasible"] = pred["feasible"].to_numpy()
        part["pred_reason"] = pred["reason"].astype(object).to_numpy()
        part["pred_step_time_s"] = pred["total_time"].to_numpy()
        part["pred_mem_gib"] = pred["proc_mem_tier1_cap_req"].to_numpy() / GIB
        if partial:
            part["pred_partial"], part["pred_chosen"] = False, ""
        out.append(part)
    rows = pd.concat(out).loc[frame.index]
    limit = system.mem1.GiB - headroom_of(system, headroom_gib)
    rows["pred_fits_headroom"] = rows["pred_feasible"] & (rows["pred_mem_gib"] <= limit)
    return rows


def _partial_rows(frame: pd.DataFrame, system: SystemSpec, models_dir, options,
                  defaults=None) -> pd.DataFrame:
    """Sweep rows with blank cells, each predicted over the completions of
    the fields its blanks leave unknown (``autopar.search.partial``)."""
    from autopar.io.layouts import ALL_FIELDS, EXT_DEFAULTS
    from autopar.search.partial import complete

    part = frame.copy()
    cols = {"pred_feasible": [], "pred_reason": [], "pred_step_time_s": [],
            "pred_mem_gib": [], "pred_chosen": []}
    for _, row in frame.iterrows():
        model = sweep_model(row.model, row.seq_size, models_dir,
                            frame.attrs.get("source", "sweep"), int(row.name) + 2)
        filled, unknown = row.copy(), []
        for col, (fields, placeholder) in SWEEP_UNSTATED.items():
            if pd.isna(row[col]):
                filled[col] = placeholder
                unknown += fields
        ex = sweep_execution(filled, system, defaults)
        stated = {f: ex.get(f, EXT_DEFAULTS.get(f)) for f in ALL_FIELDS
                  if f not in unknown and (f in ex or f in EXT_DEFAULTS)}
        opts = {f: (options or {}).get(f, SWEEP_OPTIONS[f]) for f in unknown}
        res = complete(model, system, stated, unknown, opts, source=f"sweep row {row.name}")
        best = res.best
        cols["pred_feasible"].append(res.fits)
        cols["pred_reason"].append(res.reason)
        cols["pred_step_time_s"].append(ex["batch_size"] / best.sample_rate if best else np.nan)
        cols["pred_mem_gib"].append(best.mem_gib if best else np.nan)
        cols["pred_chosen"].append(", ".join(f"{f}={v}" for f, v in best.chosen.items())
                                   if best else "")
    for k, v in cols.items():
        part[k] = v
    part["pred_partial"] = True
    return part


def sweep_report(rows: pd.DataFrame) -> pd.DataFrame:
    """Per sweep and overall: OOM agreement, Spearman, median |error|, top-1 regret."""
    recs = []
    for name, g in list(rows.groupby("sweep", sort=False)) + [("overall", rows)]:
        ran = g["status"] == "ok"
        agree = (g["pred_feasible"] == ran).mean()
        both = g[ran & g["pred_feasible"]]
        err = ((both.pred_step_time_s - both.step_time_s).abs() / both.step_time_s)
        if name == "overall":
            rhos = [r["spearman"] for r in recs if not np.isnan(r["spearman"])]
            rho = float(np.mean(rhos)) if rhos else np.nan
            regret = float(np.mean([r["top1_regret"] for r in recs]))
        else:
            rho = (both.step_time_s.rank().corr(both.pred_step_time_s.rank())
                   if len(both) > 2 else np.nan)
            regret = _regret(g)
        recs.append({"sweep": name, "rows": len(g), "oom_agreement": agree,
                     "spearman": rho, "median_abs_error": float(err.median()),
                     "top1_regret": regret})
    return pd.DataFrame(recs).set_index("sweep")


def _regret(g: pd.DataFrame) -> float:
    """Measured MFU lost by running the model's favourite layout of the sweep:
    the fastest predicted to fit with the headroom (``pred_fits_headroom``)
    where the table has it, else the fastest predicted to fit."""
    best = g.loc[g.status == "ok", "mfu"].max()
    cands = g[g["pred_fits_headroom"] if "pred_fits_headroom" in g else g.pred_feasible]
    if not len(cands) or not best > 0:
        return 1.0
    fav = cands.loc[cands.pred_step_time_s.idxmin()]
    if fav.status != "ok":
        return 1.0
    return float((best - fav.mfu) / best)
