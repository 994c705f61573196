"""The shipped LLaMA 13B/65B sweep, for the benchmarks that calibrate or
examine memory on it (``calibrate.py``, ``memory_transfer.py``,
``memory_residuals.py``): their common ``--system`` argument and the sweep's
path, which needs ../shared/reference beside the repository; for the two
memory benchmarks, the system and the sweep loaded (``load``)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SWEEP = ROOT.parent / "shared/reference/measured/llama-sweeps/llama_13B_65B_a100.csv"


def arguments(description: str):
    """The command line (``--system``, default the DGX base system, and
    ``--framework``, default the sweeps' framework before calibration), or
    None after saying why when the sweep is absent."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--system", default=str(ROOT / "systems/a100_80g_dgx_hdr200_base.json"))
    p.add_argument("--framework", default="megatron-llama-sweeps-base")
    args = p.parse_args()
    if not SWEEP.is_file():
        print(f"no sweep at {SWEEP}", file=sys.stderr)
        return None
    return args


def load(description: str):
    """``arguments``, then the ``--system`` file and the sweep read against
    it (``autopar.studies.calibrate.Sweep``): (system, sweep), or None."""
    args = arguments(description)
    if args is None:
        return None
    sys.path.insert(0, str(ROOT))
    from autopar.io.frameworks import load_framework, system_under
    from autopar.studies.calibrate import Sweep
    framework = load_framework(args.framework)
    system = system_under(args.system, framework)
    return system, Sweep(SWEEP, system, ROOT / "models", framework.defaults)
