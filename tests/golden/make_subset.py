"""Generate the compact Calculon golden subset that ships in tests/golden/.

    python tests/golden/make_subset.py --calculon PATH/TO/calculon [--per-case 60]

``PATH/TO/calculon`` is a checkout of github:calculon-ai/calculon (Apache-2.0;
the subset was made at commit caa4b11; it imports psutil).  Layouts are drawn with a fixed seed
from autopar's own ``calculon`` search space (Calculon's llm-optimal-execution
space) for a few cases on the project's own ``systems/`` and ``models/``
files; each is run through Calculon's ``Llm`` (``compile`` then ``run``) and
the result is written one JSON object a line to ``calculon_subset.jsonl.gz``:
``case`` (model/system file names, num_procs, batch, datatype), ``execution``
(Calculon's 23 fields), ``ok``, ``error`` (Calculon's message) and ``stats``
(Calculon's ``get_stats_json()``).  tests/test_golden_subset.py checks autopar
against it, so a clone without ``../shared`` still checks agreement.
"""
from __future__ import annotations

import argparse
import gzip
import json
import logging
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
OUT = HERE / "calculon_subset.jsonl.gz"

# (model, system, num_procs, max_batch_size, datatype, training)
CASES = [
    ("gpt3-175B", "a100_80g", 64, 64, "float16", True),
    ("gpt3-13B", "a100_80g", 32, 64, "bfloat16", True),
    ("megatron-1T", "a100_80g", 512, 512, "float16", True),
    ("megatron-22B", "h100_80g_nvl8", 64, 128, "float8", True),
    ("megatron-126M", "a100_80g", 8, 32, "float16", True),
    ("gpt3-175B", "h100_80g_nvl8", 64, 64, "float16", False),
]
# Keys Calculon's files have; the project's files add name/description.
MODEL_KEYS = ("hidden", "feedforward", "seq_size", "attn_heads", "attn_size", "num_blocks")


def calculon_json(kind: str, name: str) -> dict:
    data = json.loads((ROOT / kind / f"{name}.json").read_text())
    if kind == "models":
        return {k: data[k] for k in MODEL_KEYS}
    return {k: v for k, v in data.items() if k not in ("name", "description")}


def layouts(case, n: int, rng) -> list[dict]:
    from autopar.io.layouts import FIELDS, record
    from autopar.io.specs import load_model, load_system
    from autopar.search.space import Case, load_space
    mname, sname, procs, batch, dt, training = case
    c = Case(model=load_model(ROOT / "models" / f"{mname}.json"),
             system=load_system(ROOT / "systems" / f"{sname}.json"),
             num_procs=procs, max_batch_size=batch, datatype=dt, training=training)
    space = load_space("calculon")
    size = space.size(c)
    picks = sorted(set(int(i) for i in rng.integers(0, size, n)))
    out = []
    for i in picks:
        ex = record(space.layouts(c, i, i + 1), 0)
        out.append({f: ex[f] for f in FIELDS})
    return out


def run_calculon(calculon, app: dict, system: dict, ex: dict) -> dict:
    from calculon.llm import Llm
    log = logging.getLogger("calculon")
    try:
        model = Llm(Llm.Application(app), log)
        model.compile(calculon.System(system), Llm.Execution.from_json(ex))
        model.run(calculon.System(system))
    except Llm.Error as e:
        return {"ok": False, "error": str(e), "stats": None}
    stats = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
             for k, v in model.get_stats_json(False).items() if isinstance(v, (int, float))}
    return {"ok": True, "error": None, "stats": stats}


def main(argv=None) -> int:
    import numpy as np
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calculon", required=True, help="a checkout of calculon-ai/calculon")
    ap.add_argument("--per-case", type=int, default=60)
    ap.add_argument("--seed", type=int, default=16)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(Path(args.calculon).resolve()))
    import calculon
    rng = np.random.default_rng(args.seed)
    lines, feasible = [], 0
    for case in CASES:
        mname, sname, procs, batch, dt, training = case
        app, system = calculon_json("models", mname), calculon_json("systems", sname)
        for ex in layouts(case, args.per_case, rng):
            res = run_calculon(calculon, app, system, ex)
            feasible += res["ok"]
            lines.append({"case": {"model": mname, "system": sname, "num_procs": procs,
                                   "max_batch_size": batch, "datatype": dt,
                                   "training": training},
                          "execution": ex, **res})
    with gzip.open(OUT, "wt", encoding="utf-8") as fh:
        for line in lines:
            fh.write(json.dumps(line, sort_keys=True) + "\n")
    print(f"{OUT.relative_to(ROOT)}: {len(lines)} layouts, {feasible} feasible")
    return 0


if __name__ == "__main__":
    sys.exit(main())
