"""The block cache (autopar.model.speedups.BlockCache) evaluates each
distinct block once for tables above 64 rows: every execution field a block
depends on must be in its key, or rows differing only in it share one
block.  Checked for the recipe fields keyed where some row sets them."""
from __future__ import annotations

import json

import numpy as np
import pytest

from autopar.io.layouts import to_columns
from autopar.io.specs import load_execution, load_model, load_system
from autopar.model import evaluate_columns, evaluate_one

from conftest import REPO_ROOT, bf16_one_proc_execution


def _system():
    data = json.loads((REPO_ROOT / "systems/a100_80g.json").read_text())
    data["mem1"]["GiB"] = 100000
    return load_system(data)


@pytest.mark.parametrize("field, model", [
    ("recompute_moe_act", "qwen3-30B-A3B"),
    ("recompute_mla_up_proj", "deepseek-v3"),
])
def test_output_discarding_recompute_is_keyed(field, model):
    m, sy = load_model(REPO_ROOT / "models" / f"{model}.json"), _system()
    rows = [load_execution(bf16_one_proc_execution(attention_impl="flash_v2",
                                                    **{field: bool(i % 2)}))
            for i in range(80)]
    out = evaluate_columns(m, sy, to_columns(rows))
    one = [evaluate_one(m, sy, rows[i]) for i in (0, 1)]
    assert one[0]["proc_mem_tier1_cap_req"] != one[1]["proc_mem_tier1_cap_req"]
    for i in range(4):
        assert out["proc_mem_tier1_cap_req"][i] == pytest.approx(
            one[i % 2]["proc_mem_tier1_cap_req"], rel=1e-12)
        assert np.isclose(out["total_time"][i], one[i % 2]["total_time"], rtol=1e-12)
