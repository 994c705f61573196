"""The torchtitan published table (issue 24): the rows whose page does not
state the sequence length take their train config's (read at the commit the
page cites), and the table's peak-memory figures (docs/validation.md,
"torchtitan: recipe defaults and memory, counted")."""
from __future__ import annotations

import pandas as pd

from autopar.studies import published as P


def _titan_cases():
    return P.cases(P.TABLES["torchtitan"])


def test_rows_without_a_sequence_length_take_their_configs():
    """The async-TP page (torchtitan 820504e) and the Trainy page (e7c0cae)
    ran llama3_8b.toml / llama3_70b.toml, whose training.seq_len is 8192:
    every such row is predicted at 8192 and says where the figure came from."""
    frame = P.read_table(P.TABLES["torchtitan"])
    unstated = frame.index[frame["seq_len"].isna()]
    assert len(unstated) == 14          # 12 async-TP rows, 2 Trainy rows
    got = dict(_titan_cases())
    for i in unstated:
        case = got[i]
        assert isinstance(case, P.PublishedCase), (i, case)
        assert case.model.seq_size == 8192
        commit = "820504e" if "asyncTP" in frame.loc[i, "table"] else "e7c0cae"
        toml = "llama3_70b.toml" if "70B" in frame.loc[i, "model"] else "llama3_8b.toml"
        assert f"from {toml} @{commit}" in case.label
    assert not any(isinstance(c, P.Skip) for _, c in got.items())


def test_a_row_whose_page_has_no_config_is_still_skipped():
    frame = P.read_table(P.TABLES["torchtitan"])
    row = frame[frame["seq_len"].isna()].iloc[0].copy()
    row["source"] = "github:pytorch/torchtitan benchmarks/some_other_page.md @b5bcd76c66"
    case = P._titan(pd.Series(row))
    assert isinstance(case, P.Skip) and case.reason == "sequence length not stated"
