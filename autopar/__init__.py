"""autopar: plan large-model training layouts.

The public API::

    model = autopar.load_model(path_or_dict)       # Calculon application JSON
    system = autopar.load_system(path_or_dict)     # Calculon system JSON
    framework = autopar.load_framework(name_or_path)   # frameworks/ (optional)
    table = autopar.evaluate(model, system, executions, framework=None)
    table, summary = autopar.exhaustive(model, system, num_procs=..., ...)
    trials = autopar.tune(model, system, num_procs=..., sampler=..., ...)

Search, tuning and comparison are imported on first use, so ``import
autopar`` stays light (no ray, no optuna).
"""
from __future__ import annotations


from autopar.io.frameworks import load_framework
from autopar.io.specs import SpecError, load_execution, load_model, load_system
from autopar.model.frame import evaluate

__all__ = ["SpecError", "load_model", "load_system", "load_execution", "load_framework",
           "evaluate", "exhaustive", "tune", "compare"]

_LAZY = {
    "exhaustive": ("autopar.search.exhaustive", "exhaustive"),
    "tune": ("autopar.search.tune", "tune_arguments"),
    "compare": ("autopar.studies.compare", "compare"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")
