"""The samplers a search can run, by name: one module per sampler family.

Each family module defines ``SAMPLER``, an ``autopar.search.samplers.base.Sampler``
that states its name, what it needs (its default encoding, whether it needs a
static space, the optional package it imports and the pip requirement that
brings it) and how it builds its Optuna sampler (``optuna``) and its Ray Tune
searcher (``ray``).  ``REGISTRY`` maps each name to its module; a module is
imported when its sampler is first asked for, and the heavy packages (Optuna,
Ray, hpbandster, SMAC3) only when a sampler is built.

Skeleton search (``autopar.search.skeleton``) wraps a sampler instead of being
one: ``parse("skeleton-tpe")`` is ``Choice(tpe, skeleton=True)``.  The names
users write (``tpe``, ``skeleton-tpe``) are parsed here once, at the edge; the
rest of the search reads the ``Choice``.

Adding a sampler ``foo``: a module ``foo.py`` with ``SAMPLER = Foo()`` (a
``Sampler`` subclass) and the line ``"foo": ("foo", True)`` in the registry,
``autopar.io.sampler_names.REGISTRY`` (the names files and the command line
may use, read by the io layer without importing this one);
``tests/test_samplers_registry.py`` checks that the line and the module
agree.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from autopar.io.errors import SpecError

from autopar.io import sampler_names
from autopar.io.sampler_names import SKELETON_PREFIX  # noqa: F401  (the wrapper's names)

# sampler name -> its module under autopar/search/samplers/ (the registry:
# autopar.io.sampler_names)
REGISTRY: dict[str, str] = {n: m for n, (m, _) in sampler_names.REGISTRY.items()}


def get(name: str):
    """The ``Sampler`` of a family name (its module imported on first use)."""
    if name not in REGISTRY:
        raise KeyError(name)
    return importlib.import_module(f"{__name__}.{REGISTRY[name]}").SAMPLER


def families() -> tuple:
    """Every registered ``Sampler``, in registry order."""
    return tuple(get(n) for n in REGISTRY)


@dataclass(frozen=True)
class Choice:
    """A sampler as a search runs it: the family, alone or wrapped by
    skeleton search (a trial proposes a skeleton; the array model evaluates
    every completion of it)."""
    sampler: object                  # a samplers.base.Sampler
    skeleton: bool = False

    @property
    def name(self) -> str:
        """The user-facing name (``tpe``, ``skeleton-tpe``)."""
        return (SKELETON_PREFIX if self.skeleton else "") + self.sampler.name

    def default_encoding(self) -> str:
        return self.sampler.skeleton_encoding if self.skeleton else self.sampler.encoding

    def problem_encoding(self, encoding: str) -> str:
        """The encoding a problem carries (``skeleton-index`` for a skeleton
        search: the encoder of skeletons, see ``trainable.make_encoder``)."""
        return (SKELETON_PREFIX if self.skeleton else "") + encoding


def user_names() -> tuple[str, ...]:
    """Every name a user may write: the families, then their skeleton forms."""
    fams = families()
    return (tuple(f.name for f in fams)
            + tuple(SKELETON_PREFIX + f.name for f in fams if f.skeleton_encoding))


def parse(name, source: str = "arguments", field: str = "sampler") -> Choice:
    """A user-facing sampler name -> its ``Choice``; an unknown name raises
    ``SpecError(source, field, ...)``."""
    if isinstance(name, str):
        skeleton = name.startswith(SKELETON_PREFIX)
        base = name[len(SKELETON_PREFIX):] if skeleton else name
        if base in REGISTRY:
            sampler = get(base)
            if not skeleton or sampler.skeleton_encoding:
                return Choice(sampler, skeleton)
    raise SpecError(source, field, f"expected one of {', '.join(user_names())}, got {name!r}")


def default_encodings() -> dict[str, str]:
    """Per family, the encoding it searches layouts in by default."""
    return {f.name: f.encoding for f in families()}


def run_seed(seed: int | None, done: int, rank: int = 0) -> int | None:
    """The sampler seed of a run that finds ``done`` trials finished in its
    study and is the ``rank``-th of the runs on it now: a resumed run, and
    each of several runs sharing one study, draws new numbers (the same
    seed alone on a new study is the seed itself)."""
    if seed is None:
        return None
    if done == 0 and rank == 0:
        return seed
    return (seed * 1_000_003 + done + 7_919 * rank) % (2 ** 32)


def __getattr__(name):
    # SAMPLERS: the user-facing names, computed from the registry on first use
    if name == "SAMPLERS":
        return user_names()
    raise AttributeError(name)
