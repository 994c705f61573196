"""The two tables of the shipped framework files, rendered from the files:
frameworks/README.md's one row per file (the values that differ from
Calculon's count) and docs/validation.md's one row per term ("Framework
specs": file, term, value, counted or fitted, the citation).

tests/test_frameworks.py checks that both documents carry exactly these
rows.  After changing a framework file, print the rows to paste with
``PYTHONPATH=$PWD python tests/framework_tables.py``.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from autopar.io.specs import MemoryOverhead, TimeOverhead

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ("memory_overhead", "time_overhead", "memory_headroom", "defaults", "options")
# Each record key's default (the file's adapter_elementwise_bytes object is
# TimeOverhead.adapter_bytes; it and the speed-up tables default to empty).
_DEFAULTS = {
    "memory_overhead": {f.name: f.default for f in dataclasses.fields(MemoryOverhead)},
    "time_overhead": {**{f.name: f.default for f in dataclasses.fields(TimeOverhead)},
                      "adapter_elementwise_bytes": {}, "fp8_linear_speedup": {}},
}


def framework_files() -> list[Path]:
    return sorted((ROOT / "frameworks").glob("*.json"))


def _value(v) -> str:
    """A record value as the README shows it (strings bare, the adapter bytes
    as four numbers, a speed-up table by its recipes)."""
    if isinstance(v, str):
        return v
    if isinstance(v, dict):
        if all(isinstance(t, dict) and "speedup" in t for t in v.values()):
            return " / ".join(f"{r} table" for r in v)
        return " / ".join(json.dumps(x) for x in v.values())
    return json.dumps(v)


def _differs(record: str, key: str, v) -> bool:
    default = _DEFAULTS[record].get(key)
    if isinstance(v, dict):
        return any(v.values()) if key == "adapter_elementwise_bytes" else bool(v)
    return v != default


def readme_rows() -> list[str]:
    """frameworks/README.md's table rows, one a file."""
    rows = []
    for path in framework_files():
        d = json.loads(path.read_text())
        cells = [f"`{path.name}`"]
        for rec in ("memory_overhead", "time_overhead"):
            vals = [f"{k} {_value(v)}" for k, v in d.get(rec, {}).items()
                    if _differs(rec, k, v)]
            cells.append(", ".join(vals) or "-")
        head = d.get("memory_headroom")
        cells.append(f"{_value(head.get('GiB', 0))} (band +-{_value(head.get('band_GiB', 0))})"
                     if head else "-")
        cells.append(", ".join(f"{k}={_value(v)}" for k, v in d.get("defaults", {}).items())
                     or "-")
        cells.append(", ".join(f"{k} in {json.dumps(v)}" for k, v in d.get("options", {}).items())
                     or "any")
        cells.append(", ".join(d.get("free", [])) or "-")
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def term_rows() -> list[str]:
    """docs/validation.md's "Framework specs" rows: every term a file states
    (fitted where it is free, else counted, with its citation), then the
    citations of terms it leaves at their default (notes)."""
    rows = []
    for path in framework_files():
        d = json.loads(path.read_text())
        cites, free = d.get("citations", {}), set(d.get("free", []))
        stated = []
        for rec in RECORDS:
            for k, v in d.get(rec, {}).items():
                term = f"{rec}.{k}"
                stated.append(term)
                if term in free:
                    kind, why = "fitted", cites.get(term,
                                                   "free constant, fitted by `autopar calibrate`")
                else:
                    kind, why = "counted", cites.get(term, "")
                shown = (_value(v) if k == "fp8_linear_speedup" else json.dumps(v))
                rows.append(f"| `{path.name}` | `{term}` | {shown} | {kind} | {why} |")
        for term, why in cites.items():
            if term not in stated:
                rows.append(f"| `{path.name}` | {term} | - | (note) | {why} |")
    return rows


if __name__ == "__main__":
    print("frameworks/README.md:\n")
    print("\n".join(readme_rows()))
    print("\ndocs/validation.md, Framework specs:\n")
    print("\n".join(term_rows()))
