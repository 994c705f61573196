"""The system as columns: compute engines, memory tiers and network tiers.

Follows Calculon's ``processor.py``, ``memory.py`` and ``network.py``: a
compute engine (matrix or vector) runs FLOPs at its peak times an efficiency
read from a table of (GFLOP threshold, efficiency); a memory tier moves bytes
at its bandwidth times an efficiency read from a table of (MB threshold,
efficiency); a network tier runs a collective in ``latency + bytes * scale
(+ offset per peer) / (bandwidth * efficiency)``.

Every lookup is per layout: the datatype (and the tier a parallelism is
assigned to) differs from row to row, so the constants are gathered to
columns.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from autopar.io.layouts import CHOICES

# Network tiers a layout may name (reasons and block keys are sized for them).
MAX_TIERS = 16


def efficiency_curve(table) -> tuple[np.ndarray, np.ndarray]:
    """(thresholds ascending, efficiencies) from a descending (x, eff) table."""
    thresholds = np.array([x for x, _ in table][::-1], dtype=float)
    efficiencies = np.array([e for _, e in table][::-1], dtype=float)
    return thresholds, efficiencies


def efficiency_at(thresholds: np.ndarray, efficiencies: np.ndarray,
                  size: np.ndarray) -> np.ndarray:
    """Efficiency of the largest threshold <= size (tables end at 0)."""
    idx = np.searchsorted(thresholds, size, side="right") - 1
    return efficiencies[np.maximum(idx, 0)]


class ComputeEngine:
    """Throughput of one compute engine (matrix or vector) per row's datatype."""

    def __init__(self, procs: Mapping, datatype: np.ndarray, datatypes: list[int]):
        self.datatype = datatype
        # (datatype code, peak FLOP/s, FLOP thresholds, efficiencies)
        self.parts = []
        for dt in datatypes:
            p = procs[CHOICES["datatype"][dt]]
            thresholds, efficiencies = efficiency_curve(p.gflops_efficiency)
            self.parts.append((dt, p.tflops * 1e12, thresholds * 1e9, efficiencies))
        self.single = len(self.parts) == 1
        if self.single:
            self.peak = self.parts[0][1]
        else:
            self.peak = np.zeros(len(datatype))
            for dt, peak, _, _ in self.parts:
                self.peak[datatype == dt] = peak

    def time(self, flops: np.ndarray) -> np.ndarray:
        """Seconds to run ``flops`` (per row) at this engine's efficiency."""
        flops = np.asarray(flops, dtype=float)
        if self.single:
            _, peak, thresholds, efficiencies = self.parts[0]
            return flops / (peak * efficiency_at(thresholds, efficiencies, flops))
        out = np.empty(len(self.datatype))
        flops = np.broadcast_to(flops, self.datatype.shape)
        for dt, peak, thresholds, efficiencies in self.parts:
            rows = self.datatype == dt
            out[rows] = flops[rows] / (peak * efficiency_at(thresholds, efficiencies,
                                                            flops[rows]))
        return out


class MemoryTier:
    """Capacity and transfer time of one memory tier (HBM, or the offload tier)."""

    def __init__(self, mem):
        self.capacity = mem.GiB * 1024 ** 3
        self.bandwidth = mem.GBps * 1e9
        thresholds, efficiencies = efficiency_curve(mem.MB_efficiency)
        self.thresholds, self.efficiencies = thresholds * 1e6, efficiencies

    def time(self, nbytes: np.ndarray) -> np.ndarray:
        nbytes = np.asarray(nbytes, dtype=float)
        if self.bandwidth <= 0:
            return np.where(nbytes > 0, np.inf, 0.0)
        return nbytes / (self.bandwidth * efficiency_at(self.thresholds, self.efficiencies,
                                                        nbytes))


class NetworkTier:
    """The network tier each row assigns to one parallelism.

    Per-tier constants are gathered to rows lazily, on first use.
    """

    def __init__(self, networks, tier: np.ndarray):
        self.tier = np.clip(tier, 0, len(networks) - 1)
        self._networks = networks
        self._columns: dict = {}

    def _column(self, name, value_of):
        if name not in self._columns:
            per_tier = np.array([value_of(n) for n in self._networks], dtype=float)
            self._columns[name] = per_tier[self.tier]
        return self._columns[name]

    @property
    def processor_usage(self):
        """Fraction of the processor a collective on this tier occupies."""
        return self._column("usage", lambda n: n.processor_usage)

    def time(self, op: str, nbytes, peers) -> np.ndarray:
        """Seconds for collective ``op`` over ``nbytes`` among ``peers``."""
        latency = self._column("latency", lambda n: n.latency)
        rate = self._column("rate", lambda n: n.bandwidth * 1e9 * n.efficiency)
        offset = self._column("offset_" + op, lambda n: n.ops[op][1] or 0.0)
        size = nbytes * self.scale(op)
        size = size + size / peers * offset
        return latency + size / rate

    def scale(self, op: str):
        """Bytes on the wire per byte of payload for collective ``op``."""
        return self._column("scale_" + op, lambda n: n.ops[op][0])
