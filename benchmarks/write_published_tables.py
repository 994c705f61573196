"""Write autopar's own published tables (``autopar/data/published/``) from the
published measurements under ``../shared/reference/measured/published``.

    python benchmarks/write_published_tables.py [--from DIR]

``autopar validate published`` reads its tables from the package
(``autopar.studies.published.published_dir``), so that it runs from a clone
without ``../shared`` and from an installed wheel.  For each registered table
this keeps every row and only the figures autopar reads -- the columns its
row function and row filter use, found by running them over the source
table -- plus ``source`` (the repository and commit, or the paper, each
figure is from).  The measured numbers are published facts and are copied as
they are; the reference's own ``notes`` prose is not.  tests/test_published_data.py
checks that every packaged table gives the same cases as its source.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autopar.studies import published as P  # noqa: E402
import autopar.studies.published_foundry  # noqa: E402,F401  (registers its tables)
import autopar.studies.published_moe  # noqa: E402,F401


def used_columns(table, frame: pd.DataFrame) -> list[str]:
    """The columns of ``frame`` the table's row function and filter read."""
    seen: set = set()

    class Row(pd.Series):
        @property
        def _constructor(self):
            return Row

        def __getitem__(self, k):
            if isinstance(k, str):
                seen.add(k)
            return super().__getitem__(k)

        def __getattr__(self, k):
            if k in self.index:
                seen.add(k)
            return super().__getattr__(k)

        def get(self, k, default=None):
            seen.add(k)
            return super().get(k, default)

    class Frame(pd.DataFrame):
        def __getitem__(self, k):
            if isinstance(k, str):
                seen.add(k)
            return super().__getitem__(k)

        def __getattr__(self, k):
            if k in self.columns:
                seen.add(k)
            return super().__getattr__(k)

    kept = frame
    if table.keep is not None:
        kept = frame[table.keep(Frame(frame))]
    for _, row in kept.iterrows():
        table.row(Row(row))
    return [c for c in frame.columns if c in seen or c == "source"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--from", dest="src", type=Path,
                    default=ROOT.parent / "shared" / "reference" / "measured" / "published")
    args = ap.parse_args()
    out = P.PACKAGED
    out.mkdir(parents=True, exist_ok=True)
    for name, table in P.TABLES.items():
        frame = pd.read_csv(args.src / table.csv)
        cols = used_columns(table, frame)
        frame[cols].to_csv(out / table.csv, index=False)
        print(f"{name}: {table.csv}: {len(frame)} rows, {len(cols)} of "
              f"{len(frame.columns)} columns")
    return 0


if __name__ == "__main__":
    sys.exit(main())
