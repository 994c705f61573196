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


# Keys that tell a JSON file's format when --format is not given.
_HF_KEYS = ("model_type", "architectures")
_DEEPSPEED_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "zero_optimization",
                   "gradient_accumulation_steps", "autopar_launcher")


def detect(text: str, path: str) -> str:
    """The format of a config file's ``text``: a ``.toml`` is torchtitan's; a
    JSON object is a Hugging Face config.json (``model_type`` or
    ``architectures``) or a DeepSpeed ds_config (its batch or ZeRO keys); other
    text is Megatron-LM arguments (``--`` options) or Megatron-Bridge / NeMo
    overrides (``key=value`` lines).  SpecError when none fits."""
    import json
    if str(path).endswith(".toml"):
        return "torchtitan"
    stripped = text.lstrip()
    if stripped.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise SpecError(str(path), "(file)", f"invalid JSON at line {e.lineno} column "
                            f"{e.colno}: {e.msg}") from None
        if isinstance(data, dict) and any(k in data for k in _HF_KEYS):
            return "hf"
        if isinstance(data, dict) and any(k in data for k in _DEEPSPEED_KEYS):
            return "deepspeed"
        raise SpecError(str(path), "(file)", "a JSON object that is neither a Hugging Face "
                        "config.json (model_type) nor a DeepSpeed ds_config (train_batch_size, "
                        "zero_optimization, ...); give --format")
    if stripped.startswith("[") or "\n[" in text:
        return "torchtitan"
    words = text.split()
    if any(w.startswith("--") for w in words):
        return "megatron"
    if any("=" in w and not w.startswith("#") for w in words):
        return "bridge"
    raise SpecError(str(path), "(file)", f"cannot tell the format (one of "
                    f"{', '.join(READ_FORMATS)}); give --format")


def read_config(path, fmt: str | None = None, num_procs: int | None = None):
    """Read a framework config file -> ``(fmt, Imported)``: ``fmt`` as given
    (checked) or detected from the file (``detect``).  ``num_procs``: the
    run's processors, for a format whose file may leave them to the launcher
    (torchtitan's ``data_parallel_shard_degree = -1``).  SpecError naming the
    file and key on bad input."""
    from autopar.io.specs import regular_input
    source = str(path)
    if fmt is not None and fmt not in READ_FORMATS:
        raise SpecError("command line", "--format",
                        f"expected one of {', '.join(READ_FORMATS)}, got {fmt!r}")
    p = regular_input(path, source)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(source, "(file)", f"cannot read: {e}") from None
    fmt = fmt or detect(text, source)
    try:
        form = get(fmt)
    except ModuleNotFoundError as e:
        if e.name != f"autopar.io.launch.{_MODULES[fmt]}":
            raise
        raise SpecError(source, "--format", f"{fmt}: this autopar has no reader for it "
                        "yet") from None
    import inspect
    if num_procs is not None and "num_procs" in inspect.signature(form.read).parameters:
        return fmt, form.read(text, source, num_procs=num_procs)
    return fmt, form.read(text, source)


def settle(fmt: str, execution: dict, model) -> dict:
    """An imported execution with what needs the model settled (the format
    module's ``settle``, e.g. torchtitan's own pipeline split); as it is for
    formats that need nothing."""
    mod = importlib.import_module(f"autopar.io.launch.{_MODULES[fmt]}")
    fn = getattr(mod, "settle", None)
    return fn(execution, model) if fn is not None else dict(execution)
