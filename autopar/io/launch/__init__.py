"""Launch configs: the training frameworks' own config formats, out and in.

One module per format, each a ``LaunchFormat`` (``autopar.io.launch.base``):
its name, the file suffix it writes, the framework spec it stands for
(``frameworks/*.json``), what of a model and a search space it cannot express
(refused in one line before any search), how it writes one layout and how it
reads one back.  The registry imports a format's module only when it is asked
for.

* ``megatron``: Megatron-LM / Megatron-Core command-line arguments.
* ``bridge``: Megatron-Bridge / NeMo 2 recipe overrides (``key=value`` lines).
* ``torchtitan``: torchtitan's TOML job config.
* ``deepspeed``: a DeepSpeed ``ds_config`` JSON with the launcher's parallel sizes.
* ``hf``: a Hugging Face ``config.json`` (read only: a model, not a layout).
"""
from __future__ import annotations

import importlib

from autopar.io.errors import SpecError

# name -> module under autopar.io.launch
_MODULES = {"megatron": "megatron", "bridge": "bridge", "torchtitan": "torchtitan",
            "deepspeed": "deepspeed", "hf": "hf"}
LAUNCH_FORMATS = ("megatron", "bridge", "torchtitan", "deepspeed")   # written and read
READ_FORMATS = LAUNCH_FORMATS + ("hf",)                            # read by `autopar import`


def get(name: str, source: str = "command line", field: str = "--format"):
    """The ``LaunchFormat`` called ``name``."""
    if name not in _MODULES:
        raise SpecError(source, field, f"expected one of {', '.join(_MODULES)}, got {name!r}")
    return importlib.import_module(f"autopar.io.launch.{_MODULES[name]}").FORMAT
