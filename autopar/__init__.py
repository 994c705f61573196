"""autopar: plan large-model training layouts.

The public API::

    model = autopar.load_model(path_or_dict)       # Calculon application JSON
    system = autopar.load_system(path_or_dict)     # Calculon system JSON
    table = autopar.evaluate(model, system, executions)
    table, summary = autopar.exhaustive(model, system, num_procs=..., ...)
    trials = autopar.tune(model, system, num_procs=..., sampler=..., ...)

Search, tuning and comparison are imported on first use, so ``import
autopar`` stays light (no ray, no optuna).
"""
from __future__ import annotations

from typing import Iterable, Mapping

from .specs import SpecError, load_execution, load_model, load_system

__all__ = ["SpecError", "load_model", "load_system", "load_execution",
           "evaluate", "exhaustive", "tune", "compare"]

_LAZY = {
    "exhaustive": ("autopar.exhaustive", "exhaustive"),
    "tune": ("autopar.tune", "tune"),
    "compare": ("autopar.compare", "compare"),
}


def _callable_module(module_name: str, function) -> None:
    """Make a submodule callable as its namesake function.

    ``autopar.tune`` (and ``exhaustive``, ``compare``) is a function of the
    package and also a submodule; importing the submodule rebinds the package
    attribute to the module, so the module forwards calls to the function.
    """
    import sys
    import types

    class _Module(types.ModuleType):
        def __call__(self, *args, **kwargs):
            return function(*args, **kwargs)

    sys.modules[module_name].__class__ = _Module


def __getattr__(name):
    if name in _LAZY:
        import importlib
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")


def evaluate(model, system, executions):
    """Predict every layout of ``executions``.

    ``model`` and ``system`` are specs or anything ``load_model`` /
    ``load_system`` accept (a path or a dict).  ``executions`` is a pandas
    DataFrame with Calculon's execution fields as columns, a list of
    execution dicts, or one execution dict.  Returns a DataFrame, one row per
    execution in the same order, with ``feasible``, ``reason`` ('' when
    feasible, else "invalid: ..." or "infeasible: ...") and every statistic of
    ``autopar.model.STATS`` (NaN where the layout cannot run).
    """
    import numpy as np
    import pandas as pd

    from . import model as _model
    from .layouts import from_frame

    if not isinstance(model, _model.ModelSpec):
        model = load_model(model)
    if not isinstance(system, _model.SystemSpec):
        system = load_system(system)
    if isinstance(executions, Mapping):
        executions = [executions]
    if not isinstance(executions, pd.DataFrame):
        executions = _records_frame(executions, model)
    cols = from_frame(executions)
    out = _model.evaluate_columns(model, system, cols)
    # The statistics share one (statistic, layout) buffer: wrap it, no copy.
    first = out[_model.STATS[0]]
    block = first.base if first.base is not None and first.base.shape[0] == len(
        _model.STATS) else np.stack([out[name] for name in _model.STATS])
    table = pd.DataFrame(block.T, columns=list(_model.STATS), index=executions.index,
                         copy=False)
    table.insert(0, "reason", _model.reason_text(out, system))
    table.insert(0, "feasible", out["feasible"])
    return table


def _records_frame(records: Iterable[Mapping], model):
    import pandas as pd

    from .layouts import ALL_FIELDS, EXT_DEFAULTS
    rows = []
    for i, rec in enumerate(records):
        rows.append({**EXT_DEFAULTS, **load_execution(dict(rec), source=f"executions[{i}]",
                                                   model=model)})
    return pd.DataFrame(rows, columns=list(ALL_FIELDS))
