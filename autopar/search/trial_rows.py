"""A trial's result row: the objective (``METRIC``), the breakdown reported
with it (``BREAKDOWN``, Calculon's names) and the row of a pruned trial; what
the trainable (``autopar.search.trainable``) and skeleton search
(``autopar.search.skeleton``) both write."""
from __future__ import annotations

import math
from typing import Mapping

from autopar.io.layouts import ALL_FIELDS, EXT_DEFAULTS

METRIC = "sample_rate"
# The breakdown reported with every trial (Calculon's names).
BREAKDOWN: tuple[str, ...] = (
    "total_time", "proc_mem_tier1_cap_req", "proc_mem_tier2_cap_req",
    "compute_efficiency", "system_efficiency", "total_efficiency",
)


def pruned_row(reason: str, execution: Mapping | None = None) -> dict:
    row = {"state": "PRUNED", "feasible": False, "reason": reason, METRIC: math.nan}
    row.update({k: math.nan for k in BREAKDOWN})
    if execution:
        row.update({f: execution.get(f, EXT_DEFAULTS.get(f)) for f in ALL_FIELDS})
    else:
        row.update({f: None for f in ALL_FIELDS})
    return row
