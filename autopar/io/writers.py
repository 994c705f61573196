"""Output files, written whole or not at all.

Every file autopar writes goes through ``atomic_path``: the content is written
to a temporary file beside the target and renamed over it only when complete,
so an error or an interrupt never leaves a half-written result.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from pathlib import Path


def target_of(path) -> Path:
    """The file an output path names: a symlink's target (the link is kept and
    the file it points to is written), and never a device, FIFO or folder
    (replacing those by a renamed file would destroy them: SpecError)."""
    from autopar.io.errors import SpecError
    path = Path(path)
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    if path.exists() and not path.is_file():
        what = "a folder" if path.is_dir() else "not a regular file (a device, FIFO or socket)"
        raise SpecError(str(path), "(output)", f"is {what}; autopar writes whole files only")
    return path


# Called before each output is put in place; raising there removes the
# temporary file and leaves the target as it was.  The command line sets it
# to refuse outputs once its stdout's reader has gone away.
before_commit = None


class _Outputs:
    """The outputs of one run held back until it has succeeded: complete
    temporary files waiting to be renamed over their targets, and the
    folders made for them."""

    def __init__(self):
        self.pending: list[tuple[str, Path]] = []
        self.folders: list[Path] = []

    def commit(self) -> None:
        if before_commit is not None and self.pending:
            before_commit()
        for tmp, path in self.pending:
            os.replace(tmp, path)
        self.pending = []

    def discard(self) -> None:
        for tmp, _ in self.pending:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        for d in reversed(self.folders):          # deepest first; only empty ones
            with contextlib.suppress(OSError):
                d.rmdir()


_held: _Outputs | None = None


@contextlib.contextmanager
def all_or_nothing():
    """Every output written inside (through ``atomic_path`` and
    ``make_folder``) is put in place when the block ends without an error,
    and none is when it raises: no file of a failed run, no folder made for
    it.  (The command line runs each command inside one.)"""
    global _held
    if _held is not None:          # nested: the outer block decides
        yield
        return
    _held = held = _Outputs()
    try:
        yield
        held.commit()
    except BaseException:
        held.discard()
        raise
    finally:
        _held = None


def put_in_place(tmp, path) -> None:
    """A complete temporary file (written beside ``path`` by other means, e.g.
    in parts) replaces ``path``: at once, or, inside ``all_or_nothing``, with
    the run's other outputs when it succeeds (removed when it fails)."""
    if _held is not None:
        _held.pending.append((str(tmp), Path(path)))
        return
    if before_commit is not None:
        before_commit()
    os.replace(tmp, path)


def make_folder(folder) -> Path:
    """Make ``folder`` and its missing parents; inside ``all_or_nothing``,
    they are removed again (when empty) if the run fails."""
    folder = Path(folder)
    missing = [d for d in (folder, *folder.parents) if not d.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    if _held is not None:
        _held.folders.extend(reversed(missing))   # outermost first
    return folder


@contextlib.contextmanager
def atomic_path(path, now: bool = False):
    """Yield a temporary path; on success it replaces ``path`` (see
    ``target_of``: a symlink's target is written, the link kept), at once or,
    inside ``all_or_nothing``, when that block ends.  ``now``: at once in any
    case, for state a run keeps while it runs (what a killed run is resumed
    from), not a result."""
    path = target_of(path)
    if path.parent and not path.parent.exists():
        make_folder(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())     # mkstemp makes 0600; outputs are ordinary files
        if _held is not None and not now:
            _held.pending.append((tmp, path))
            return
        if before_commit is not None:
            before_commit()
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json(obj, path) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2, default=_plain)
            f.write("\n")


def write_atomic_csv(frame, path) -> None:
    with atomic_path(path) as tmp:
        frame.to_csv(tmp, index=False)


def write_table(frame, path) -> None:
    """A DataFrame as CSV (``.csv``) or Parquet (anything else)."""
    with atomic_path(path) as tmp:
        if str(path).endswith(".csv"):
            frame.to_csv(tmp, index=False)
        else:
            frame.to_parquet(tmp, index=False)


def _plain(v):
    """JSON for numpy scalars."""
    if hasattr(v, "item"):
        return v.item()
    raise TypeError(f"not JSON serializable: {type(v).__name__}")


def json_value(v):
    """A numpy scalar as a JSON value: a Python number, NaN and infinities as null."""
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def file_ref(target, out_dir):
    """How an output in ``out_dir`` names an input file: its path relative to
    that folder, so it resolves from the output file itself wherever the
    output is read.  A mapping (an inline model or system) is kept as it is;
    anything not a path gives None."""
    if isinstance(target, dict):
        return target
    if not isinstance(target, (str, os.PathLike)) or not str(target):
        return None
    p = Path(target)
    if not p.is_file():
        return None
    return Path(os.path.relpath(p.resolve(), Path(out_dir).resolve())).as_posix()


NO_OUTPUT = "none"


def output_dir_arg(value):
    """``--output-dir``: a folder relative to the current one, or ``none``
    (any case): write nothing, only print.  ``./none`` names a folder called none."""
    if value is None:
        return None
    if str(value).strip().lower() == NO_OUTPUT:
        return NO_OUTPUT
    return Path(value)


def write_text(text: str, path) -> None:
    """A text file (a launch config), atomically as every output."""
    with atomic_path(path) as tmp:
        with open(tmp, "w") as f:
            f.write(text)
