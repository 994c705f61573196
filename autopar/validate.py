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

from .layouts import to_columns
from .model import evaluate_columns
from .specs import ModelSpec, SystemSpec, load_model

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


def _predict(model: ModelSpec, system: SystemSpec, execution: dict) -> dict:
    out = evaluate_columns(model, system, to_columns([execution]))
    return {k: (v[0].item() if hasattr(v[0], "item") else v[0]) for k, v in out.items()}


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
            s = _predict(models[m], free, data["layouts"]["fig1"][m][v])
            par_opt = (s["weight_space"] + s["weight_grad_space"] + s["optimizer_space"]) / GIB
            rows.append(("fig1_activation_memory_gib", m, v, pub["act"], act(s)))
            rows.append(("fig1_weights_grads_optimizer_gib", m, v, pub["par_opt"], par_opt))
    for m, variants in data["fig7_activation_memory_percent_of_none"].items():
        base = act(_predict(models[m], free, data["layouts"]["fig7"][m]["none"]))
        for v, pub in variants.items():
            s = _predict(models[m], free, data["layouts"]["fig7"][m][v])
            rows.append(("fig7_activation_memory_percent", m, v, pub, 100 * act(s) / base))
    for m, variants in data["tab5_batch_time_s"].items():
        for v, pub in variants.items():
            s = _predict(models[m], system, data["layouts"]["tab5"][m][v])
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
