"""The time breakdown of a batch: which statistics add up to ``total_time``.

Each row is (label, the statistics summed); the rows of ``TIME_ROWS`` add up
to ``total_time`` (Calculon's breakdown); ``EXTRA_TIME_ROWS`` are the
extensions' exposed times, shown where a layout has them.  ``autopar
estimate`` prints them as a table and ``autopar report`` draws them as
stacked bars.
"""
from __future__ import annotations

TIME_ROWS = (
    ("forward", ("fw_time",)),
    ("backward", ("bw_time",)),
    ("recompute", ("recompute_time", "recomm_exposed_time")),
    ("optimizer step", ("optim_step_time",)),
    ("pipeline bubble", ("bubble_time",)),
    ("TP comm exposed", ("tp_comm_exposed_time",)),
    ("PP comm exposed", ("pp_comm_exposed_time",)),
    ("DP comm exposed", ("dp_comm_exposed_time",)),
    ("offload exposed", ("fw_offload_exposed_time", "bw_offload_exposed_time")),
)
EXTRA_TIME_ROWS = (
    ("CP comm exposed", ("cp_comm_exposed_time",)),
    ("weight gathers exposed", ("weight_gather_exposed_time",)),
)
