"""Partial layouts (issue 24): unknown execution fields searched over their
options (``autopar.search.partial``), in files, ``estimate`` and
``validate published --partial``."""
from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import one_proc_execution

from autopar.io.errors import SpecError
from autopar.io.specs import load_execution, load_model, load_partial_execution, load_system
from autopar.model import evaluate_one
from autopar.search.partial import complete, default_options

GIB = 1024 ** 3
MODEL = "models/megatron-126M.json"
SYSTEM = "systems/a100_80g.json"
RECOMPUTE = ("none", "attn_only", "full")
MICRO = (1, 2, 4, 8)


@pytest.fixture(scope="module")
def specs(repo_root):
    return load_model(repo_root / MODEL), load_system(repo_root / SYSTEM)


def _one_proc(**kw):
    return one_proc_execution(batch_size=8, microbatch_size=1, datatype="bfloat16", **kw)


def _memories(model, system, base):
    """Tier-1 need of every (recompute, micro-batch) completion, by evaluating
    each full layout on its own."""
    out = {}
    for r, m in itertools.product(RECOMPUTE, MICRO):
        s = evaluate_one(model, system, dict(base, activation_recompute=r, microbatch_size=m))
        out[(r, m)] = s["proc_mem_tier1_cap_req"]
    return out


def test_only_one_completion_fits_and_it_is_found(specs):
    model, system = specs
    base = _one_proc()
    need = _memories(model, system, base)
    order = sorted(need, key=need.get)
    assert need[order[0]] < need[order[1]]             # a unique lowest need
    # A first tier between the lowest need and the next: one completion fits.
    cap = (need[order[0]] + need[order[1]]) / 2 / GIB
    tight = dataclasses.replace(system, mem1=dataclasses.replace(system.mem1, GiB=cap))
    stated, unknown = load_partial_execution(
        dict(base, activation_recompute="?", microbatch_size=None), system=tight, model=model)
    assert unknown == ("microbatch_size", "activation_recompute")
    res = complete(model, tight, stated, unknown,
                   {"activation_recompute": RECOMPUTE, "microbatch_size": MICRO})
    assert res.completions == len(need)
    assert res.fits and res.feasible == 1
    want = {"activation_recompute": order[0][0], "microbatch_size": order[0][1]}
    assert res.best.chosen == want and res.lowest_memory.chosen == want
    assert res.best.mem_gib * GIB == pytest.approx(need[order[0]])
    lo, med, hi = res.spread["mem_gib"]
    assert lo == med == hi == pytest.approx(need[order[0]] / GIB)
    # The same layout stated in full evaluates to the best completion.
    full = load_execution(res.best.execution, system=tight, model=model)
    s = evaluate_one(model, tight, full)
    assert s["feasible"] and s["sample_rate"] == pytest.approx(res.best.sample_rate)


def test_best_is_fastest_and_spread_covers_every_fitting_completion(specs):
    model, system = specs
    base = _one_proc()
    rates = []
    for r, m in itertools.product(RECOMPUTE, MICRO):
        s = evaluate_one(model, system, dict(base, activation_recompute=r, microbatch_size=m))
        if s["feasible"]:
            rates.append(((r, m), s["sample_rate"]))
    stated, unknown = load_partial_execution(
        dict(base, activation_recompute="?", microbatch_size="?"), system=system)
    res = complete(model, system, stated, unknown,
                   {"activation_recompute": RECOMPUTE, "microbatch_size": MICRO})
    assert res.feasible == len(rates)
    top = max(v for _, v in rates)
    assert res.best.sample_rate == pytest.approx(top)
    assert res.spread["sample_rate"] == pytest.approx(
        (min(v for _, v in rates), float(np.median([v for _, v in rates])), top))


def test_ties_go_to_the_options_listed_first(specs):
    model, system = specs
    # fused_activation does not move a layout's time or memory in every case;
    # whichever is listed first must win where the two tie.
    stated, unknown = load_partial_execution(dict(_one_proc(), fused_activation=None))
    a = complete(model, system, stated, unknown, {"fused_activation": (True, False)})
    b = complete(model, system, stated, unknown, {"fused_activation": (False, True)})
    ra = {v: evaluate_one(model, system, dict(_one_proc(), fused_activation=v))["sample_rate"]
          for v in (True, False)}
    if ra[True] == pytest.approx(ra[False], rel=1e-12):
        assert a.best.chosen["fused_activation"] is True
        assert b.best.chosen["fused_activation"] is False
    else:
        fastest = max(ra, key=ra.get)
        assert a.best.chosen["fused_activation"] is fastest is b.best.chosen["fused_activation"]


def test_defaults_first_moves_the_default_to_the_front():
    from autopar.search.partial import defaults_first
    got = defaults_first({"activation_recompute": ("none", "attn_only", "full"),
                          "microbatch_size": None, "fp32_grads": (False, True)},
                         {"activation_recompute": "full", "microbatch_size": 2,
                          "fp32_grads": None})
    assert got == {"activation_recompute": ("full", "none", "attn_only"),
                   "microbatch_size": None, "fp32_grads": (False, True)}


def test_no_completion_fits_reports_the_memory_lowest(specs):
    model, system = specs
    tiny = dataclasses.replace(system, mem1=dataclasses.replace(system.mem1, GiB=0.01))
    stated, unknown = load_partial_execution(dict(_one_proc(), activation_recompute="?"),
                                             system=tiny)
    res = complete(model, tiny, stated, unknown)
    assert not res.fits and res.feasible == 0 and res.best is None
    assert res.completions == 4                        # every recompute choice
    assert res.lowest_memory is not None and not res.lowest_memory.feasible
    assert "mem tier1" in res.reason and "mem tier1" in res.lowest_memory.reason


def test_dependent_unknowns_follow_the_domain_rules(repo_root):
    model = load_model(repo_root / "models/gpt3-175B.json")
    system = load_system(repo_root / SYSTEM)
    ex = {"num_procs": 64, "tensor_par": 8, "pipeline_par": 8, "batch_size": 64,
          "datatype": "float16", "training": True}
    stated, unknown = load_partial_execution(ex, system=system, model=model,
                                             missing_unknown=True)
    opts = default_options(unknown, "calculon")
    opts["microbatch_size"] = (1,)
    res = complete(model, system, stated, unknown, opts)
    assert res.completions > 0
    # interleaving ranges over the divisors of the blocks per stage (96 / 8)
    assert opts["pipeline_interleaving"] is None
    inter = {c for c in (1, 2, 3, 4, 6, 12)}
    seen = set()
    for v in inter:
        one = complete(model, system, stated, unknown, dict(opts, pipeline_interleaving=(v,)))
        if one.completions:
            seen.add(v)
    assert seen == inter
    assert complete(model, system, stated, unknown,
                    dict(opts, pipeline_interleaving=(5,))).completions == 0


def test_stated_conflict_with_unknown_is_not_a_completion(specs):
    model, system = specs
    # data_par_overlap needs data_par > 1; with 1 processor no completion
    # keeps the stated overlap.
    stated, unknown = load_partial_execution(
        dict(_one_proc(), data_par_overlap=True, activation_recompute="?"))
    res = complete(model, system, stated, unknown)
    assert res.completions == 0 and not res.fits
    assert "data_par_overlap" in res.reason


# ------------------------------------------------------------ input


def test_null_and_question_mark_are_unknown():
    stated, unknown = load_partial_execution(
        dict(one_proc_execution(), microbatch_size=None, tensor_par_overlap="?",
             fp8_recipe=None))
    assert unknown == ("microbatch_size", "tensor_par_overlap", "fp8_recipe")
    assert "microbatch_size" not in stated and stated["tensor_par"] == 1
    assert stated["attention_impl"] == "unfused"           # an extension at its default


def test_missing_fields_are_unknown_only_with_partial():
    ex = {"num_procs": 1, "batch_size": 4, "datatype": "float16", "training": True,
          "tensor_par": 1}
    with pytest.raises(SpecError) as e:
        load_partial_execution(ex)
    assert e.value.field == "pipeline_par"
    stated, unknown = load_partial_execution(ex, missing_unknown=True)
    assert "pipeline_par" in unknown and "tensor_par" not in unknown
    assert "attention_impl" not in unknown                  # extensions keep defaults


@pytest.mark.parametrize("field,value,named", [
    ("num_procs", "?", "num_procs"),                 # the case cannot be unknown
    ("batch_size", None, "batch_size"),
    ("datatype", "?", "datatype"),
    ("microbatch_size", "??", "microbatch_size"),    # only "?" and null mean unknown
    ("tensor_par_overlap", "maybe", "tensor_par_overlap"),
    ("pipeline_par", 0, "pipeline_par"),
    ("layers", "?", "layers"),                       # not a field
])
def test_bad_partial_input_names_the_field(field, value, named):
    with pytest.raises(SpecError) as e:
        load_partial_execution(dict(one_proc_execution(), **{field: value}))
    assert e.value.field == named


def test_bad_option_values_name_the_field(specs):
    model, system = specs
    stated, unknown = load_partial_execution(dict(_one_proc(), activation_recompute="?"))
    with pytest.raises(SpecError) as e:
        complete(model, system, stated, unknown, {"activation_recompute": ("sometimes",)},
                 options_source="framework")
    assert e.value.source == "framework" and "activation_recompute" in e.value.field


def test_too_many_completions_is_an_error(specs):
    model, system = specs
    stated, unknown = load_partial_execution(dict(_one_proc(), activation_recompute="?",
                                                  microbatch_size="?"))
    with pytest.raises(SpecError) as e:
        complete(model, system, stated, unknown, limit=3)
    assert e.value.field == "(unknown fields)" and "limit" in e.value.message


# ------------------------------------------------------------ estimate


def _write(path: Path, data) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_estimate_partial_exit_codes_and_output(cli, repo_root, tmp_path):
    exe = _write(tmp_path / "p.json", dict(_one_proc(), activation_recompute=None,
                                          microbatch_size="?"))
    r = cli("estimate", MODEL, SYSTEM, exe)
    assert r.returncode == 0, r.stderr
    assert "unknown  activation_recompute:" in r.stdout and "fits     yes" in r.stdout
    assert "best completion:" in r.stdout
    j = cli("estimate", MODEL, SYSTEM, exe, "--json")
    assert j.returncode == 0
    out = json.loads(j.stdout)
    assert out["partial"] is True and out["fits"] is True
    assert set(out["best"]["chosen"]) == {"activation_recompute", "microbatch_size"}
    assert out["best_stats"]["sample_rate"] == pytest.approx(out["best"]["sample_rate"])
    assert out["feasible_completions"] <= out["completions"]

    # a space narrows the options (calculon's, with two parameters narrowed)
    import yaml
    sp = tmp_path / "s.yaml"
    base = yaml.safe_load((repo_root / "search_spaces/calculon.yaml").read_text())
    base["params"]["activation_recompute"] = ["full"]
    base["params"]["microbatch_size"] = [2]
    sp.write_text(yaml.safe_dump(base))
    j = cli("estimate", MODEL, SYSTEM, exe, "--json", "--space", sp)
    assert j.returncode == 0, j.stderr
    out = json.loads(j.stdout)
    assert out["completions"] == 1
    assert out["best"]["chosen"] == {"activation_recompute": "full", "microbatch_size": 2}

    # none fits: exit 1
    tight = dict(_one_proc(), activation_recompute="?", batch_size=8)
    sy = json.loads((repo_root / SYSTEM).read_text())
    sy["mem1"]["GiB"] = 0.01
    r = cli("estimate", MODEL, _write(tmp_path / "sy.json", sy), _write(tmp_path / "t.json",
                                                                       tight))
    assert r.returncode == 1, r.stderr
    assert "fits     no" in r.stdout and "mem tier1" in r.stdout


def test_estimate_missing_field_needs_partial(cli, tmp_path):
    ex = _one_proc()
    del ex["microbatch_size"]
    exe = _write(tmp_path / "m.json", ex)
    r = cli("estimate", MODEL, SYSTEM, exe)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        f"autopar: error: {exe}: microbatch_size: missing key"]
    r = cli("estimate", MODEL, SYSTEM, exe, "--partial")
    assert r.returncode == 0, r.stderr
    assert "unknown  microbatch_size:" in r.stdout


def test_estimate_space_needs_a_partial_layout(cli, tmp_path):
    exe = _write(tmp_path / "f.json", _one_proc())
    r = cli("estimate", MODEL, SYSTEM, exe, "--space", "calculon")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert r.stderr.startswith("autopar: error: command line: --space: ")


@pytest.mark.parametrize("change,field", [
    ({"num_procs": "?"}, "num_procs"),
    ({"activation_recompute": "sometimes"}, "activation_recompute"),
])
def test_estimate_bad_partial_input_exits_2(cli, tmp_path, change, field):
    exe = _write(tmp_path / "b.json", dict(_one_proc(), microbatch_size="?", **change))
    r = cli("estimate", MODEL, SYSTEM, exe)
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"autopar: error: {exe}: {field}: ")


# ------------------------------------------------------------ published tables


def test_published_partial_is_a_superset_of_the_defaults(reference):
    from autopar.studies.published import TABLES, predict
    rows = predict(TABLES["mcore_h100"], rank=False, partial=True)
    pred = rows[rows.status == "predicted"]
    assert len(pred)
    feasible = pred.feasible.astype(bool)
    anyfit = pred.feasible_any.astype(bool)
    assert (anyfit | ~feasible).all()                 # every default fit is kept
    # The default completion is one of the completions: the best is no slower.
    ok = pred[feasible]
    assert (ok.best_pred_tokens_per_s_per_gpu >= ok.pred_tokens_per_s_per_gpu * (1 - 1e-9)).all()
    assert (pred.completions > 1).all()
    assert pred.chosen.str.contains("microbatch_size=").all()


def test_published_partial_finds_a_completion_the_default_misses(tmp_path, monkeypatch,
                                                                 repo_root):
    """A table whose assumed default (no recompute) does not fit, while a
    completion of its unstated recompute does."""
    import pandas as pd

    from autopar.studies import published as P

    model = load_model(repo_root / "models/gpt3-20B.json")
    system = load_system(repo_root / SYSTEM)

    def row(r):
        ex = dict(one_proc_execution(), num_procs=8, tensor_par=8, data_par=1,
                  batch_size=int(r.mbs), microbatch_size=int(r.mbs), datatype="bfloat16",
                  tensor_par_comm_type="rs_ag")
        return P.PublishedCase(model, system, ex, {"tokens_per_s_per_gpu": 100.0},
                               f"mbs {int(r.mbs)}")

    # the micro-batch at which no recompute stops fitting and full still fits
    mbs = None
    for m in (1, 2, 4, 8, 16, 32, 64):
        ex = row(pd.Series({"mbs": m})).execution
        none = evaluate_one(model, system, ex)["feasible"]
        full = evaluate_one(model, system, dict(ex, activation_recompute="full"))["feasible"]
        if not none and full:
            mbs = m
            break
    assert mbs is not None
    pd.DataFrame({"mbs": [1, mbs]}).to_csv(tmp_path / "t.csv", index=False)
    monkeypatch.setenv("AUTOPAR_PUBLISHED", str(tmp_path))
    table = P.Table("t", "t.csv", row, "test",
                    unstated={"activation_recompute": ("none", "attn_only", "full")})
    rows = P.predict(table, rank=False, partial=True)
    assert list(rows.feasible) == [True, False]
    assert list(rows.feasible_any) == [True, True]
    assert "activation_recompute=" in rows.chosen[1]
    assert "activation_recompute=none" not in rows.chosen[1]
    s = P.summarize(rows)
    assert s["feasible"] == 1 and s["feasible_any"] == 2
    # without partial the summary is today's
    plain = P.summarize(P.predict(table, rank=False))
    assert "feasible_any" not in plain and plain["feasible"] == 1


def test_validate_published_partial_cli(cli, reference):
    r = cli("validate", "published", "--table", "megatron_2021", "--no-rank", "--partial",
            "--rows")
    assert r.returncode == 0, r.stderr
    assert "feasible_any" in r.stdout and "median_abs_best_tok_error" in r.stdout
    assert "attention_impl=" in r.stdout
    plain = cli("validate", "published", "--table", "megatron_2021", "--no-rank")
    assert "feasible_any" not in plain.stdout


# ------------------------------------------------------------ measured sweeps

SWEEP_HEAD = ("sweep,model,seq_size,global_batch,world_size,tensor_par,pipeline_par,"
              "microbatch_size,checkpointing,kernel,sequence_parallel,status,step_time_s,mfu\n")


def test_sweep_rows_with_blank_cells_are_partial(tmp_path, repo_root, cli):
    from autopar.studies.validate import validate_sweep
    rows = [f"s,llama-7B,2048,512,32,2,1,{m},every_layer,flash_attention2,True,ok,10.0,0.5"
            for m in (1, 2, 4)]
    rows.append("s,llama-7B,2048,512,32,2,1,,every_layer,flash_attention2,True,ok,10.0,0.5")
    rows.append("s,llama-7B,2048,512,32,2,1,2,,flash_attention2,True,ok,10.0,0.5")
    csv = tmp_path / "s.csv"
    csv.write_text(SWEEP_HEAD + "\n".join(rows) + "\n")
    from autopar.io.frameworks import system_under
    system = system_under(repo_root / "systems" / "a100_80g_dgx_hdr200.json",
                          "megatron-llama-sweeps-fitted")
    r = cli("validate", csv, "--system", repo_root / "systems" / "a100_80g_dgx_hdr200.json",
            "--framework", "megatron-llama-sweeps-fitted")
    assert r.returncode == 2 and "checkpointing" in r.stderr       # blanks need --partial
    assert len(r.stderr.strip().splitlines()) == 1
    out = validate_sweep(csv, system, models_dir=repo_root / "models", partial=True)
    assert out.pred_partial.tolist() == [False, False, False, True, True]
    full = out[~out.pred_partial.astype(bool)]
    # The blank micro-batch is searched over every value the rules allow
    # (divisors of the local batch 32): the best is no slower than the three
    # stated ones, and is one of the measured-free choices named.
    assert out.pred_feasible[3]
    assert out.pred_step_time_s[3] <= full.pred_step_time_s.min() * (1 + 1e-9)
    assert out.pred_chosen[3].startswith("microbatch_size=")
    # The blank checkpointing: the best of none / full / selective at micro-batch 2.
    assert out.pred_chosen[4].startswith("activation_recompute=")
    stated = float(out.pred_step_time_s[1])                    # every_layer at mbs 2
    assert out.pred_step_time_s[4] <= stated * (1 + 1e-9)
    r = cli("validate", csv, "--system", repo_root / "systems" / "a100_80g_dgx_hdr200.json",
            "--framework", "megatron-llama-sweeps-fitted", "--partial")
    assert r.returncode == 0, r.stderr
    assert "2 rows with blank cells" in r.stdout and "row 3: microbatch_size=" in r.stdout
