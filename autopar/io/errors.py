"""Bad input: the one error type every reader raises, naming the file and the field."""
from __future__ import annotations


# Counts beyond these are not layouts anyone runs, and the divisor searches
# over them would take hours or overflow 64-bit columns: the command line and
# every file that gives such a count hold it to these.
MAX_PROCS = 1 << 24
MAX_BATCH = 1 << 32
# Points of one co-design or cliffs range, and systems of a whole hardware grid.
MAX_RANGE_POINTS = 100_000
MAX_GRID_SYSTEMS = 1_000_000


def brief(v) -> str:
    """A value as an error message quotes it: its repr, cut to 40 characters."""
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


class SpecError(ValueError):
    """Bad input: names the file (or 'dict') and the field."""

    def __init__(self, source: str, field: str, message: str):
        self.source, self.field, self.message = source, field, message
        super().__init__(f"{source}: {field}: {message}")

    def __reduce__(self):
        # raised in a pool process or a Ray task, it comes back as itself
        return type(self), (self.source, self.field, self.message)
