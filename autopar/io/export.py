"""Which format an execution is written in: autopar's own, Calculon's, or a
training framework's launch config (``autopar.io.launch``).

* ``autopar`` (the default): Calculon's 23 execution fields plus every
  extension field that differs from its default (``attention_impl``,
  ``fused_norm``, ``unsharded_grads``).  ``autopar estimate`` reads it back
  exactly; a plain layout of a plain model is already a Calculon file.
* ``calculon``: exactly what Calculon's ``llm`` command reads and means the
  same by.  Refused, in one line and before any search, when Calculon cannot
  represent the run: a model with ``block: llama``, ``kv_heads`` or
  ``vocab_size`` (Calculon ignores them: its prediction would silently differ),
  or a search space that can choose an extension field's non-default value
  (Calculon rejects or ignores those fields).  A layout found with an extension
  field set is refused too, before anything is written.
* ``megatron``, ``bridge``, ``torchtitan``, ``deepspeed``: the framework's own
  launch config (``autopar.io.launch``; docs/launch.md maps every field).  What
  the framework cannot express is refused in one line before any search
  (``check_run``) and, for a found layout, before anything is written.

``check_run`` checks before a search and ``written`` gives a layout's file
text with its suffix, for JSON and launch formats alike.
"""
from __future__ import annotations

from typing import Mapping

from autopar.io.errors import SpecError
from autopar.io.launch import LAUNCH_FORMATS
from autopar.io.layouts import EXT_DEFAULTS, FIELDS

JSON_FORMATS = ("autopar", "calculon")
FORMATS = JSON_FORMATS + LAUNCH_FORMATS
DEFAULT_FORMAT = "autopar"
HELP = ("how executions are written: autopar (default) keeps every field, the "
        "extensions (attention_impl, fused_norm, unsharded_grads) included; calculon "
        "writes exactly Calculon's 23 fields and refuses a model or layout Calculon "
        "cannot represent (block llama, kv_heads, vocab_size, extension fields); "
        "megatron, bridge, torchtitan, deepspeed write the framework's launch config "
        "(docs/launch.md) and refuse what it cannot express")
ADVICE = "Calculon's format cannot represent it; use --format autopar"


def model_extensions(model) -> list[str]:
    """The model fields Calculon's application format lacks, as ``name=value``."""
    out = []
    if getattr(model, "block", "gpt") != "gpt":
        out.append(f"block={model.block}")
    if getattr(model, "kv_heads", None) is not None:
        out.append(f"kv_heads={model.kv_heads}")
    if getattr(model, "vocab_size", 0):
        out.append(f"vocab_size={model.vocab_size}")
    if getattr(model, "hybrid_pattern", ""):
        out.append(f"hybrid_override_pattern={model.hybrid_pattern}")
    return out


def check_format(fmt: str, source: str, field: str = "--format") -> str:
    if fmt not in FORMATS:
        raise SpecError(source, field, f"expected one of {', '.join(FORMATS)}, got {fmt!r}")
    return fmt


def check_calculon_run(fmt: str, model, space=None, source: str = "command line",
                       field: str = "--format") -> None:
    """Before a search: refuse ``calculon`` for what Calculon cannot represent."""
    if check_format(fmt, source, field) != "calculon":
        return
    ext = model_extensions(model)
    if ext:
        raise SpecError(source, field, f"calculon: the model {model.name or ''} has "
                        f"{', '.join(ext)}; {ADVICE}")
    if space is not None:
        for f, default in EXT_DEFAULTS.items():
            if f in space.fixed and space.fixed[f] != default:
                raise SpecError(source, field, f"calculon: space {space.name} fixes "
                                f"{f}={space.fixed[f]}; {ADVICE}")
            allowed = space.allowed.get(f)
            if allowed is not None and _allows_other(allowed, f, default):
                raise SpecError(source, field, f"calculon: space {space.name} searches "
                                f"{f}; {ADVICE}")


def _allows_other(allowed, field: str, default) -> bool:
    """Whether a space's ``allowed`` values of ``field`` hold one other than
    its default (integer fields by their list or range: a count such as
    first_stage_blocks is not a flag)."""
    from autopar.io.layouts import BOOL_FIELDS, CHOICES
    if field in CHOICES or field in BOOL_FIELDS:
        return any(allowed.ok(v) for v in _others(field, default))
    if allowed.values is not None:
        return any(v != default for v in allowed.values)
    return allowed.high is None or allowed.high != default \
        or (allowed.low is not None and allowed.low != default)


def _others(field: str, default) -> tuple:
    from autopar.io.layouts import CHOICES
    if field in CHOICES:
        return tuple(v for v in CHOICES[field] if v != default)
    return (not default,)


def export_execution(execution: Mapping, fmt: str, source: str = "command line",
                     field: str = "--format") -> dict:
    """The execution as written in ``fmt`` (see the module docstring)."""
    if check_format(fmt, source, field) == "autopar":
        return dict(execution)
    extra = {k: v for k, v in execution.items()
             if k not in FIELDS and EXT_DEFAULTS.get(k, object()) != v}
    if extra:
        shown = ", ".join(f"{k}={v}" for k, v in extra.items())
        raise SpecError(source, field, f"calculon: the layout has {shown}; {ADVICE}")
    return {k: execution[k] for k in FIELDS}


def launch_format(fmt: str, source: str = "command line", field: str = "--format"):
    """The ``LaunchFormat`` of a launch format's name; one line (not a
    traceback) where its module is not in this install."""
    from autopar.io.launch import get
    try:
        return get(fmt, source, field)
    except ModuleNotFoundError as err:
        if not (err.name or "").startswith("autopar.io.launch"):
            raise
        raise SpecError(source, field, f"{fmt}: this autopar has no writer for it yet "
                        f"(autopar/io/launch/{fmt}.py is missing)") from None


def check_run(fmt: str, model, space=None, datatype: str | None = None,
              source: str = "command line", field: str = "--format") -> None:
    """Before a search: refuse ``fmt`` for a model, space or datatype it
    cannot write (JSON formats: ``check_calculon_run``)."""
    if check_format(fmt, source, field) in JSON_FORMATS:
        check_calculon_run(fmt, model, space, source, field)
        return
    lf = launch_format(fmt, source, field)
    why = lf.refuse_model(model)
    if why is None and space is not None:
        why = lf.refuse_space(model, space)
    if why is None and datatype is not None and lf.refuse_datatype is not None:
        why = lf.refuse_datatype(datatype, space)
    if why:
        raise SpecError(source, field, why)


def format_space(fmt: str, space):
    """``space`` with its derived fields (their values follow the case, e.g.
    fp8_recipe from the system's rates) cut to the values launch format
    ``fmt`` writes, and the fields its recipe implies cut as the format says
    (``LaunchFormat.cut_space``), so that a search under ``--format``
    recommends a layout the framework can launch (a searched or fixed value it cannot write is
    refused before the search instead: ``check_run``).  JSON formats: the
    space as it is."""
    if fmt in JSON_FORMATS or space is None:
        return space
    lf = launch_format(fmt)
    if lf.writes is None and lf.cut_space is None:
        return space
    from autopar.io.launch.base import SYSTEM_DERIVED
    from autopar.io.layouts import CHOICES
    cut = {}
    for f, allowed in space.allowed.items():
        derived = allowed.values is None and allowed.low is None and allowed.high is None
        if derived and f in SYSTEM_DERIVED and lf.writes is not None:
            ok = tuple(v for v in CHOICES[f] if lf.writes(f, v))
            if len(ok) < len(CHOICES[f]):
                cut[f] = ok
    if lf.cut_space is not None:
        cut.update(lf.cut_space(space))
    return space.within(cut, f"--format {fmt}") if cut else space


def json_execution(execution: Mapping, fmt: str, source: str = "command line",
                   field: str = "--format") -> dict:
    """The execution as a JSON file of results carries it (``--top``, an
    optimum's record): in ``fmt`` for the JSON formats, autopar's own beside a
    launch config."""
    return export_execution(execution, fmt if fmt in JSON_FORMATS else DEFAULT_FORMAT,
                            source, field)


def written(execution: Mapping, fmt: str, model=None, source: str = "command line",
            field: str = "--format") -> tuple[str, str]:
    """A layout's file in ``fmt``: (text, suffix).  Launch formats need the
    model; a layout the format cannot express is one ``SpecError``."""
    import json
    if check_format(fmt, source, field) in JSON_FORMATS:
        return json.dumps(export_execution(execution, fmt, source, field), indent=2) + "\n", \
            ".json"
    lf = launch_format(fmt, source, field)
    why = lf.refuse_layout(model, execution)
    if why:
        raise SpecError(source, field, why)
    return lf.write(model, execution), lf.suffix
