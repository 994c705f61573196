"""What every launch format states and does (see ``autopar.io.launch``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


# Fields a search space may leave "derived" whose values follow the case's
# system (fp8_recipe: the recipes whose rates the system lists): under a
# launch format they are cut to what the format writes before the search
# (``autopar.io.export.format_space``) rather than refused.
SYSTEM_DERIVED = ("fp8_recipe",)


@dataclass(frozen=True)
class Imported:
    """What a framework config says: the execution fields it sets (a field it
    leaves unstated is absent, or ``None`` where the format states that it is
    unknown), the model fields it sets (``autopar`` model-file names), and the
    framework spec its defaults come from."""
    execution: dict
    model: dict = field(default_factory=dict)
    framework: str | None = None
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class LaunchFormat:
    """A framework's config format.

    ``refuse_model(model) -> str | None`` and ``refuse_space(model, space) ->
    str | None``: why the format cannot express this model / a layout this
    space may choose (``None``: it can), checked before any search.
    ``refuse_layout(model, execution) -> str | None``: the same for one found
    layout, before anything is written.  ``write(model, execution) -> str``:
    the file's text.  ``read(text, source) -> Imported``: the inverse, where
    ``source`` names the file in errors.  ``refuse_datatype`` (optional):
    the run's datatype, before any search.
    """
    name: str
    suffix: str
    framework: str
    refuse_model: Callable
    refuse_space: Callable
    refuse_layout: Callable
    write: Callable
    read: Callable
    describe: str = ""
    # ``refuse_datatype(datatype, space) -> str | None``: why the run's
    # datatype cannot be written (checked before any search; None: any can).
    refuse_datatype: Callable | None = None
    # ``writes(field, value) -> bool``: whether the format can state that
    # value of a field (None: every value it does not refuse by the checks
    # above).  Used to cut a space's derived fields (values that follow the
    # case, e.g. fp8_recipe from the system's rates) to what it can launch.
    writes: Callable | None = None
    # ``cut_space(space) -> {field: values}``: the values of other fields a
    # layout of this space can take to be written, where the space's choice
    # of one field implies them (e.g. Megatron-Core's Muon runs without
    # Megatron-FSDP: unsharded_grads true); the search keeps to them
    # (``autopar.io.export.format_space``).  None: nothing implied.
    cut_space: Callable | None = None
