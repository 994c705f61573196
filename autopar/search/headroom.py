"""Memory headroom: a recommendation is the fastest layout that fits with a
margin below the first tier's capacity.

The margin is ``--memory-headroom GiB`` on the command line, else the
system's ``memory_headroom.GiB`` (written by ``autopar calibrate`` from the
out-of-memory labels of measured sweeps), else none.  The predicted peak is
reported with the system's uncertainty band (``memory_headroom.band_GiB``).
"""
from __future__ import annotations

import dataclasses

from autopar.io.errors import SpecError
from autopar.io.specs import SystemSpec

GIB = 1024 ** 3
PEAK = "proc_mem_tier1_cap_req"


def headroom_gib(system: SystemSpec, asked=None, source="command line") -> float:
    """The headroom in GiB: ``asked`` when given, else the system's default."""
    if asked is None:
        return system.memory_headroom.GiB if system.memory_headroom is not None else 0.0
    h = float(asked)
    if not 0 <= h < system.mem1.GiB:
        raise SpecError(source, "--memory-headroom",
                        f"must be in [0, {system.mem1.GiB:g}) GiB (mem1), got {asked}")
    return h


def band_gib(system: SystemSpec) -> float:
    return system.memory_headroom.band_GiB if system.memory_headroom is not None else 0.0


def with_headroom(system: SystemSpec, gib: float) -> SystemSpec:
    """The system whose first tier is ``gib`` smaller: a layout is feasible on
    it when it fits on ``system`` with that headroom."""
    if gib <= 0:
        return system
    return dataclasses.replace(system, memory_headroom=None, mem1=dataclasses.replace(
        system.mem1, GiB=system.mem1.GiB - gib))


def fits(peak_bytes, system: SystemSpec, gib: float):
    """Whether a predicted peak fits with ``gib`` of headroom."""
    return peak_bytes <= (system.mem1.GiB - gib) * GIB


def peak_text(peak_bytes: float, system: SystemSpec, gib: float) -> str:
    """'72.31 GiB +-4.98 (of 80; headroom 5: fits)'."""
    band = band_gib(system)
    b = f" +-{band:.2f}" if band > 0 else ""
    ok = "fits" if fits(peak_bytes, system, gib) else "does not fit"
    return (f"{peak_bytes / GIB:.2f} GiB{b} of {system.mem1.GiB:g}; "
            f"headroom {gib:g} GiB: {ok}")


def difference_text(rate_with: float, rate_without: float) -> str:
    """How much faster the fastest layout without headroom is."""
    if not rate_with > 0:
        return "no layout fits with the headroom"
    return f"{100 * (rate_without / rate_with - 1):.1f}% faster without the headroom"
