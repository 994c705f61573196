"""Bad input: the one error type every reader raises, naming the file and the field."""
from __future__ import annotations


def brief(v) -> str:
    """A value as an error message quotes it: its repr, cut to 40 characters."""
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


class SpecError(ValueError):
    """Bad input: names the file (or 'dict') and the field."""

    def __init__(self, source: str, field: str, message: str):
        self.source, self.field, self.message = source, field, message
        super().__init__(f"{source}: {field}: {message}")
