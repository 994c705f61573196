"""The files autopar ships and commands default to: search spaces, systems, models,
frameworks.

In the project they are the top-level folders ``search_spaces/``,
``systems/``, ``models/`` and ``frameworks/`` (the project's layout).  A wheel carries them as
package data under ``autopar/_shipped/<folder>/`` (pyproject.toml maps each
folder to that package path), so an installed autopar finds them wherever it
runs.  ``shipped_dir(kind)`` is where one folder is; ``resolve(path)`` is the
one lookup every command makes for a path the user gave: a path that exists
from the current folder is taken as it is; otherwise a relative path that
starts with one of the folders (``systems/a100_80g.json``) names the shipped
file, and for a ``kind`` a bare name (``calculon``) names
``<folder>/<name><suffix>``.  Reference data inside the package
(``autopar/data/``) is read with ``importlib.resources``.
"""
from __future__ import annotations

import os
from pathlib import Path

KINDS = {"search_spaces": ".yaml", "systems": ".json", "models": ".json",
         "frameworks": ".json"}
_PKG = Path(__file__).resolve().parent.parent          # the autopar package


def shipped_dir(kind: str) -> Path:
    """The folder of shipped ``kind`` files: the wheel's package data, else the
    project's top-level folder (a source checkout or an editable install)."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}")
    installed = _PKG / "_shipped" / kind
    if installed.is_dir():
        return installed
    tree = _PKG.parent / kind
    if (_PKG.parent / "pyproject.toml").is_file() and tree.is_dir():
        return tree
    return installed


def resolve(path: str | os.PathLike, kind: str | None = None) -> Path:
    """The file a user's ``path`` names (see the module docstring).  A path
    found nowhere is returned as given, so the caller's error names it."""
    p = Path(path)
    parts = p.parts
    bare = kind is not None and len(parts) == 1
    if p.is_absolute() or p.is_file() or (p.exists() and not bare):
        return p                   # (a bare name that is a folder here names a shipped file)
    if parts and parts[0] in KINDS and len(parts) > 1:
        alt = shipped_dir(parts[0]).joinpath(*parts[1:])
        if alt.exists():
            return alt
    if bare:
        for name in (parts[0], parts[0] + KINDS[kind]):
            alt = shipped_dir(kind) / name
            if alt.is_file():
                return alt
    return p


def names(kind: str) -> list[str]:
    """The shipped ``kind`` files' names without suffix (``calculon``, ...)."""
    d = shipped_dir(kind)
    return sorted(f.name.removesuffix(KINDS[kind]) for f in d.glob("*" + KINDS[kind])) \
        if d.is_dir() else []
