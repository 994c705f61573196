"""The model on a table: executions as a pandas DataFrame in, predictions out.

``evaluate`` is the public ``autopar.evaluate``: it reads executions in any of
the forms users hold them (a DataFrame, a list of dicts, one dict), runs
``autopar.model.evaluate_columns`` and returns one row per execution.
"""
from __future__ import annotations

from typing import Iterable, Mapping

from autopar.io.frameworks import check_options, load_framework, with_framework
from autopar.io.specs import ModelSpec, SystemSpec, load_execution, load_model, load_system


def evaluate(model, system, executions, framework=None):
    """Predict every layout of ``executions``.

    ``model`` and ``system`` are specs or anything ``load_model`` /
    ``load_system`` accept (a path or a dict).  ``framework`` (a spec, a
    shipped name, a path or a dict; ``autopar.io.frameworks``) replaces the
    system's memory and time records with the framework's, fills the
    execution fields a layout does not state with the framework's recipe
    defaults, and refuses values the framework cannot express; None (the
    default) leaves everything as the system and the layouts say.  ``executions`` is a pandas
    DataFrame with Calculon's execution fields as columns, a list of
    execution dicts, or one execution dict.  Returns a DataFrame, one row per
    execution in the same order, with ``feasible``, ``reason`` ('' when
    feasible, else "invalid: ..." or "infeasible: ...") and every statistic of
    ``autopar.model.STATS`` (NaN where the layout cannot run).
    """
    import numpy as np
    import pandas as pd

    from autopar.model.evaluate import STATS, evaluate_columns, reason_text
    from autopar.io.layouts import from_frame

    if not isinstance(model, ModelSpec):
        model = load_model(model)
    if not isinstance(system, SystemSpec):
        system = load_system(system)
    if framework is not None:
        framework = load_framework(framework)
        system = with_framework(system, framework)
    if isinstance(executions, Mapping):
        executions = [executions]
    if not isinstance(executions, pd.DataFrame):
        executions = _records_frame(executions, model, framework)
    elif framework is not None:
        executions = _frame_defaults(executions, framework)
    cols = from_frame(executions)
    out = evaluate_columns(model, system, cols)
    # The statistics share one (statistic, layout) buffer: wrap it, no copy.
    first = out[STATS[0]]
    block = first.base if first.base is not None and first.base.shape[0] == len(
        STATS) else np.stack([out[name] for name in STATS])
    table = pd.DataFrame(block.T, columns=list(STATS), index=executions.index,
                         copy=False)
    table.insert(0, "reason", reason_text(out, system))
    table.insert(0, "feasible", out["feasible"])
    return table


def _records_frame(records: Iterable[Mapping], model, framework=None):
    import pandas as pd

    from autopar.io.layouts import ALL_FIELDS, EXT_DEFAULTS
    rows = []
    for i, rec in enumerate(records):
        ex = load_execution(dict(rec), source=f"executions[{i}]", model=model,
                            defaults=framework.defaults if framework is not None else None)
        check_options(framework, ex, f"executions[{i}]")
        rows.append({**EXT_DEFAULTS, **ex})
    return pd.DataFrame(rows, columns=list(ALL_FIELDS))


def _frame_defaults(frame, framework):
    """A DataFrame of executions with the framework's defaults as the columns
    it lacks, and its values checked against the framework's options."""
    from autopar.io.layouts import CHOICES
    missing = {f: v for f, v in framework.defaults.items() if f not in frame.columns}
    if missing:
        frame = frame.assign(**missing)
    for f, allowed in framework.options.items():
        if f in frame.columns:
            values = frame[f]
            if f in CHOICES and values.dtype.kind in "iu":
                values = values.map(lambda c: CHOICES[f][c])
            bad = ~values.isin(list(allowed))
            if bad.any():
                check_options(framework, {f: values[bad].iloc[0]}, "executions")
    return frame
