"""``recompute_layers`` above the blocks of a pipeline stage (issue 27): refused
in one line naming the field for a given execution, infeasible with its
reason in the model (Megatron-Core's TransformerConfig takes
recompute_num_layers up to num_layers // pipeline_model_parallel_size)."""
from __future__ import annotations

import json

import pytest

from autopar.cli import main
from autopar.io.specs import SpecError, load_execution, load_model, load_system
from autopar.model import REASONS, evaluate_one

from conftest import REPO_ROOT, one_proc_execution

MODEL = REPO_ROOT / "models/gpt3-13B.json"          # 40 blocks
SYSTEM = REPO_ROOT / "systems/a100_80g.json"


def _execution(k: int, pp: int = 4) -> dict:
    return one_proc_execution(num_procs=pp, pipeline_par=pp, batch_size=16, microbatch_size=1,
                              activation_recompute="full", recompute_layers=k)


@pytest.mark.parametrize("k, pp, ok", [(10, 4, True), (11, 4, False), (40, 1, True),
                                       (41, 1, False), (5, 8, True), (6, 8, False)])
def test_io_refuses_more_recomputed_blocks_than_a_stage_has(k, pp, ok):
    model = load_model(MODEL)
    if ok:
        assert load_execution(_execution(k, pp), model=model)["recompute_layers"] == k
    else:
        with pytest.raises(SpecError) as e:
            load_execution(_execution(k, pp), model=model, source="ex.json")
        assert e.value.field == "recompute_layers" and f"{40 // pp} blocks" in e.value.message


def test_estimate_names_the_file_and_field_in_one_line(tmp_path, capsys):
    f = tmp_path / "ex.json"
    f.write_text(json.dumps(_execution(11)))
    assert main(["estimate", str(MODEL), str(SYSTEM), str(f)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(f) in err[0] and "recompute_layers" in err[0]


def test_the_model_says_why_for_a_layout_it_is_given():
    model, system = load_model(MODEL), load_system(SYSTEM)
    bad = evaluate_one(model, system, _execution(11))
    assert not bad["feasible"]
    assert REASONS[bad["reason_code"]].startswith("invalid: recompute_layers exceeds")
    good = evaluate_one(model, system, _execution(10))
    assert REASONS[good["reason_code"]] != REASONS[bad["reason_code"]]


def test_a_searched_space_never_proposes_it():
    from autopar.search.exhaustive import exhaustive
    _, s = exhaustive(MODEL, SYSTEM, 16, 16, "float16", space="modern", progress=False)
    assert not any("recompute_layers exceeds" in r for r in s["infeasible"])
