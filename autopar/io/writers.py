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


@contextlib.contextmanager
def atomic_path(path):
    """Yield a temporary path; on success it replaces ``path``."""
    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())     # mkstemp makes 0600; outputs are ordinary files
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
