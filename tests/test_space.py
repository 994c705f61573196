"""Search spaces: loading, derived domains, enumeration, choices and check."""
from __future__ import annotations

import copy
import dataclasses
import itertools
import json

import numpy as np
import pytest

from autopar.search import space as space_mod
from autopar.io.layouts import ALL_FIELDS, EXT_DEFAULTS, to_records
from autopar.search.space import OPTIONAL, PARAMS, Case, divisors, load_space
from autopar.io.specs import SpecError, load_model, load_system

from conftest import REPO_ROOT

SPACES = REPO_ROOT / "search_spaces"


def _model(hidden=1024, heads=16, blocks=24, seq=2048, ff=None):
    return load_model({"hidden": hidden, "feedforward": ff or 4 * hidden, "seq_size": seq,
                       "attn_heads": heads, "attn_size": hidden // heads if hidden % heads == 0 else 64,
                       "num_blocks": blocks})


@pytest.fixture(scope="module")
def a100():
    return load_system(REPO_ROOT / "systems" / "a100_80g.json")


@pytest.fixture(scope="module")
def three_tiers_no_mem2(a100):
    """Three network tiers and no second memory tier."""
    data = json.loads((REPO_ROOT / "systems" / "a100_80g.json").read_text())
    data["networks"].append(copy.deepcopy(data["networks"][1]))
    sys3 = load_system(data)
    return dataclasses.replace(sys3, mem2=dataclasses.replace(sys3.mem2, GiB=0))


def _oracle(model, system, num_procs, max_batch, datatype, fused=(True,), policy="max"):
    """Calculon's search restated as plain nested loops (in its order)."""
    nets = len(system.networks)
    mem2 = system.mem2.GiB > 0
    tf = [True, False]
    for tp in divisors(num_procs):
        if model.hidden % tp or model.attn_heads % tp:
            continue
        for pp in divisors(num_procs // tp):
            if model.num_blocks % pp:
                continue
            dp = num_procs // (tp * pp)
            for ppint in ([1] if pp == 1 else divisors(model.num_blocks // pp)):
                if policy == "max":
                    if dp > max_batch:
                        continue
                    batch = max_batch // dp * dp
                else:
                    if max_batch % dp:
                        continue
                    batch = max_batch
                for ar, osh, comm in itertools.product(
                        ["full", "attn_only", "none"], tf if dp > 1 else [False],
                        ["ar", "p2p_rs_ag", "rs_ag"]):
                    redo_ok = comm == "rs_ag" and ar != "full"
                    for redo, dpo, tpo, wo, ao, oo, fa in itertools.product(
                            tf if redo_ok else [False], tf if dp > 1 else [False],
                            ["none", "ring", "pipe"] if tp > 1 else ["none"],
                            tf if mem2 else [False],
                            tf if mem2 and ar != "full" else [False],
                            tf if mem2 else [False], fused):
                        mbss = [m for m in divisors(batch // dp) if m * model.seq_size % tp == 0]
                        for mbs, tn, pn, dn in itertools.product(
                                mbss, range(nets) if tp > 1 else [0],
                                range(nets) if pp > 1 else [0], range(nets) if dp > 1 else [0]):
                            yield dict(num_procs=num_procs, tensor_par=tp, pipeline_par=pp,
                                       data_par=dp, tensor_par_net=tn, pipeline_par_net=pn,
                                       data_par_net=dn, batch_size=batch, microbatch_size=mbs,
                                       datatype=datatype, fused_activation=fa,
                                       attention_type="multihead", activation_recompute=ar,
                                       pipeline_interleaving=ppint, optimizer_sharding=osh,
                                       tensor_par_comm_type=comm, tensor_par_overlap=tpo,
                                       seq_par_ag_redo=redo, data_par_overlap=dpo,
                                       weight_offload=wo, activations_offload=ao,
                                       optimizer_offload=oo, training=True)


def _all(space, case, chunk=1 << 20):
    return [r for chunk_ in space.enumerate(case, chunk) for r in to_records(chunk_)]


# ------------------------------------------------------------------ loading

def test_shipped_spaces_load():
    cal = load_space(SPACES / "calculon.yaml")
    assert cal.name == "calculon" and cal.batch_policy == "max"
    assert set(cal.searched) == set(PARAMS) - {"fused_activation", "attention_type",
                                               *OPTIONAL}
    assert cal.fixed == {"fused_activation": True, "attention_type": "multihead",
                         **EXT_DEFAULTS}
    assert cal.searched == tuple(p for p in PARAMS if p in cal.searched)   # define-by-run
    default = load_space("default")           # a bare name resolves to search_spaces/
    assert "fused_activation" in default.searched
    assert default.fixed == {"attention_type": "multihead", **EXT_DEFAULTS}
    small = load_space(str(SPACES / "small.yaml"))
    assert small.allowed["microbatch_size"].high == 8
    # a Space round-trips through its dict form (what Ray workers receive)
    again = load_space(cal.to_dict())
    assert again.to_dict() == cal.to_dict()


def _base():
    return load_space(SPACES / "calculon.yaml").to_dict()


BAD = [
    ("unknown top-level key", lambda d: d.update(extra=1), "extra", "unknown key"),
    ("unknown param", lambda d: d["params"].update(tensor_parallel="derived"),
     "params.tensor_parallel", "unknown parameter"),
    ("derived field", lambda d: d["fixed"].update(data_par=4), "fixed.data_par", "derived"),
    ("case field", lambda d: d["params"].update(num_procs=[8]), "params.num_procs", "given by the case"),
    ("wrong value type", lambda d: d["params"].update(tensor_par=[1, "two"]),
     "params.tensor_par[1]", "integer"),
    ("unknown choice", lambda d: d["params"].update(activation_recompute=["all"]),
     "params.activation_recompute[0]", "expected one of"),
    ("bool as string", lambda d: d["fixed"].update(fused_activation="yes please"),
     "fixed.fused_activation", "true or false"),
    ("missing param", lambda d: d["params"].pop("microbatch_size"), "params",
     "neither searched nor fixed: microbatch_size"),
    ("both", lambda d: d["fixed"].update(tensor_par=8), "fixed.tensor_par", "not both"),
    ("bad policy", lambda d: d.update(batch_policy="min"), "batch_policy", "max or fixed"),
    ("min above max", lambda d: d["params"].update(microbatch_size={"min": 8, "max": 2}),
     "params.microbatch_size", "above max"),
    ("range on categorical", lambda d: d["params"].update(tensor_par_comm_type={"max": 2}),
     "params.tensor_par_comm_type", "integer parameters only"),
    ("empty list", lambda d: d["params"].update(pipeline_par=[]), "params.pipeline_par", "empty list"),
    ("negative tier", lambda d: d["params"].update(data_par_net=[-1]), "params.data_par_net[0]", ">= 0"),
    ("params not a mapping", lambda d: d.update(params=["tensor_par"]), "params", "mapping"),
]


@pytest.mark.parametrize("label,edit,field,words", BAD, ids=[b[0] for b in BAD])
def test_malformed_space_files_name_file_and_field(tmp_path, label, edit, field, words):
    import yaml
    d = _base()
    edit(d)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    with pytest.raises(SpecError) as e:
        load_space(path)
    assert e.value.source == str(path)
    assert e.value.field == field
    assert words in e.value.message


def test_unreadable_space_files(tmp_path):
    with pytest.raises(SpecError) as e:
        load_space(tmp_path / "nope.yaml")
    assert e.value.field == "file" and "no such" in e.value.message
    bad = tmp_path / "broken.yaml"
    bad.write_text("params:\n  tensor_par: [1, 2\n")
    with pytest.raises(SpecError) as e:
        load_space(bad)
    assert e.value.source == str(bad) and e.value.field.startswith("line ")
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("just a string\n")
    with pytest.raises(SpecError) as e:
        load_space(scalar)
    assert e.value.field == "space"


# -------------------------------------------------------- the reference counts

@pytest.mark.parametrize("model,procs,batch,count", [
    ("turing-530B", 5128, 2520, 10_944),
    ("gpt3-175B", 4096, 1536, 7_474_752),
])
def test_reference_counts(a100, model, procs, batch, count):
    cal = load_space(SPACES / "calculon.yaml")
    case = Case(load_model(REPO_ROOT / "models" / f"{model}.json"), a100, procs, batch, "float16")
    assert cal.size(case) == count
    # the memoised tree count agrees with the enumeration plan
    assert cal._count(space_mod.layout_context(case, cal), 0, ()) == count
    # the wider default doubles it (fused_activation both ways)
    assert load_space("default").size(case) == 2 * count


def test_turing_enumeration_is_unique_and_complete(a100):
    cal = load_space(SPACES / "calculon.yaml")
    case = Case(load_model(REPO_ROOT / "models" / "turing-530B.json"), a100, 5128, 2520, "float16")
    chunks = list(cal.enumerate(case, 4000))
    assert [len(c["tensor_par"]) for c in chunks] == [4000, 4000, 2944]
    for c in chunks:
        assert set(c) == set(ALL_FIELDS)
        assert c["tensor_par"].dtype == np.int64 and c["datatype"].dtype == np.int8
        assert c["weight_offload"].dtype == bool
        assert np.all(c["tensor_par"] * c["pipeline_par"] * c["data_par"] == 5128)
    rows = {tuple(r.values()) for c in chunks for r in to_records(c)}
    assert len(rows) == 10_944


# ------------------------------------------------ enumeration = the oracle

ORACLE_CASES = [
    # (hidden, heads, blocks, seq, procs, batch): awkward sizes
    (1024, 16, 24, 2048, 4, 6),        # powers of two
    (1000, 10, 15, 1023, 20, 30),      # heads 10 (tp 4 divides hidden, not heads), odd seq
    (1536, 12, 105, 2048, 14, 5),      # blocks 3*5*7, procs 2*7
    (1536, 12, 96, 2048, 7, 5),        # prime procs, data_par 7 > batch 5 for tp=pp=1
    (768, 12, 12, 512, 6, 3),
]


@pytest.mark.parametrize("shape", ORACLE_CASES, ids=lambda s: "x".join(map(str, s)))
def test_enumeration_matches_nested_loops(a100, three_tiers_no_mem2, shape):
    hidden, heads, blocks, seq, procs, batch = shape
    m = _model(hidden, heads, blocks, seq)
    cal = load_space(SPACES / "calculon.yaml")
    for system in (a100, three_tiers_no_mem2):
        case = Case(m, system, procs, batch, "float16")
        want = list(_oracle(m, system, procs, batch, "float16"))
        assert _all(cal, case) == want        # same layouts, same order
        assert _all(cal, case, chunk=97) == want
        assert cal.size(case) == len(want)
        fixed = Case(m, system, procs, batch, "float16", batch_policy="fixed")
        assert _all(cal, fixed) == list(_oracle(m, system, procs, batch, "float16", policy="fixed"))


def test_default_space_adds_fused_activation(a100):
    m = _model(1024, 16, 24, 2048)
    case = Case(m, a100, 4, 4, "bfloat16")
    got = _all(load_space("default"), case)
    want = list(_oracle(m, a100, 4, 4, "bfloat16", fused=(True, False)))
    assert got == want


def test_small_pattern_cap_gives_same_enumeration(a100, monkeypatch):
    m = _model(1024, 16, 24, 2048)
    case = Case(m, a100, 4, 4, "float16")
    want = _all(load_space("calculon"), case)
    from autopar.search import enumeration
    monkeypatch.setattr(enumeration, "_PATTERN_ROWS", 5)
    monkeypatch.setattr(enumeration, "_PATTERN_TOTAL", 50)
    assert _all(load_space("calculon"), case, chunk=1000) == want


# ------------------------------------------------------------ derived domains

def test_derived_domains_on_awkward_sizes(a100, three_tiers_no_mem2):
    cal = load_space("calculon")
    # prime processor count: nothing but tp = pp = 1
    c = Case(_model(1536, 12, 96), a100, 7, 64, "float16")
    assert cal.choices(c, "tensor_par", {}) == [1]
    assert cal.choices(c, "pipeline_par", {"tensor_par": 1}) == [1]
    # heads 10 do not allow tp 4 though hidden 1000 does; procs 20 = 2*2*5
    c = Case(_model(1000, 10, 15, 1024), a100, 20, 40, "float16")
    assert cal.choices(c, "tensor_par", {}) == [1, 2, 5, 10]
    # uneven blocks (15 = 3*5): pp divides both 20/tp and 15
    assert [cal.choices(c, "pipeline_par", {"tensor_par": t}) for t in (1, 2, 5, 10)] == \
        [[1, 5], [1, 5], [1], [1]]
    # interleaving divides blocks/pp; only 1 when pp is 1
    assert cal.choices(c, "pipeline_interleaving", {"tensor_par": 1, "pipeline_par": 5}) == [1, 3]
    assert cal.choices(c, "pipeline_interleaving", {"tensor_par": 2, "pipeline_par": 1}) == [1]
    # micro-batches divide the local batch (40/4 = 10) and mbs*seq must split over tp 5
    part = {"tensor_par": 5, "pipeline_par": 1, "pipeline_interleaving": 1,
            "activation_recompute": "none", "optimizer_sharding": True,
            "tensor_par_comm_type": "rs_ag", "seq_par_ag_redo": True,
            "data_par_overlap": True, "tensor_par_overlap": "ring",
            "weight_offload": False, "activations_offload": False,
            "optimizer_offload": False}
    assert cal.choices(c, "microbatch_size", part) == [5, 10]
    # odd seq 1023 and odd local batches: tp > 1 leads nowhere, so it is not offered
    odd = Case(_model(1000, 10, 15, 1023), a100, 20, 30, "float16")
    assert cal.choices(odd, "microbatch_size", {**part, "tensor_par": 2}) == []
    assert cal.choices(odd, "tensor_par", {}) == [1]
    # offload flags only with a second memory tier; three tiers offered
    c3 = Case(_model(1024, 16, 24), three_tiers_no_mem2, 8, 16, "float16")
    flat = cal.flat_domains(c3)
    assert flat["weight_offload"] == [False] and flat["optimizer_offload"] == [False]
    assert flat["tensor_par_net"] == [0, 1, 2]
    flat2 = cal.flat_domains(Case(_model(1024, 16, 24), a100, 8, 16, "float16"))
    assert flat2["weight_offload"] == [True, False] and flat2["tensor_par_net"] == [0, 1]
    # activations offload never with full recompute; redo only with rs_ag, not full
    c2 = Case(_model(1024, 16, 24), a100, 8, 16, "float16")
    base = {"tensor_par": 2, "pipeline_par": 2, "pipeline_interleaving": 1,
            "optimizer_sharding": True, "seq_par_ag_redo": False, "data_par_overlap": True,
            "tensor_par_overlap": "none", "weight_offload": True}
    assert cal.choices(c2, "activations_offload",
                       {**base, "activation_recompute": "full", "tensor_par_comm_type": "rs_ag"}) == [False]
    assert cal.choices(c2, "activations_offload",
                       {**base, "activation_recompute": "none", "tensor_par_comm_type": "ar"}) == [True, False]
    assert cal.choices(c2, "seq_par_ag_redo",
                       {**base, "activation_recompute": "attn_only", "tensor_par_comm_type": "rs_ag"}) == [True, False]
    assert cal.choices(c2, "seq_par_ag_redo",
                       {**base, "activation_recompute": "full", "tensor_par_comm_type": "rs_ag"}) == [False]


def test_batch_policy(a100):
    cal = load_space("calculon")
    m = _model(1024, 16, 24)
    mx = Case(m, a100, 12, 10, "float16")
    fx = Case(m, a100, 12, 10, "float16", batch_policy="fixed")
    batches = {(int(d), int(b)) for ch in cal.enumerate(mx) for d, b in zip(ch["data_par"], ch["batch_size"])}
    assert batches == {(1, 10), (2, 10), (3, 9), (4, 8), (6, 6)}    # dp 12 > 10: none
    batches = {(int(d), int(b)) for ch in cal.enumerate(fx) for d, b in zip(ch["data_par"], ch["batch_size"])}
    assert batches == {(1, 10), (2, 10)}
    # the space's own default policy applies when the case names none
    d = cal.to_dict() | {"batch_policy": "fixed"}
    assert load_space(d).size(mx) == cal.size(fx)


def test_narrowed_space(a100):
    d = load_space("calculon").to_dict()
    d["params"]["tensor_par"] = [2, 4, 3]          # 3 is never valid: just ignored
    d["params"]["microbatch_size"] = {"min": 2, "max": 4}
    sp = load_space(d)
    c = Case(_model(1024, 16, 24), a100, 8, 32, "float16")
    flat = sp.flat_domains(c)
    assert flat["tensor_par"] == [2, 4]
    assert flat["microbatch_size"] == [2, 4]
    for ch in sp.enumerate(c):
        assert set(np.unique(ch["tensor_par"])) <= {2, 4}
        assert ch["microbatch_size"].min() >= 2 and ch["microbatch_size"].max() <= 4


# --------------------------------------------------- choices, complete, check

def _walk(space, case):
    """Every layout reached by walking choices define-by-run."""
    out = []

    def rec(i, partial):
        if i == len(space.searched):
            out.append(space.complete(case, partial))
            return
        p = space.searched[i]
        for v in space.choices(case, p, partial):
            rec(i + 1, {**partial, p: v})

    rec(0, {})
    return out


@pytest.mark.parametrize("name", ["calculon", "small", "default"])
def test_choices_walk_equals_enumeration(a100, name):
    sp = load_space(name)
    case = Case(_model(1000, 10, 15, 1023), a100, 20, 30, "float16")
    walked = _walk(sp, case)
    enumerated = _all(sp, case)
    assert walked == enumerated and len(walked) > 50
    flat = sp.flat_domains(case)
    for p in sp.searched:
        assert set(flat[p]) == {r[p] for r in enumerated}


def test_check_accepts_every_layout_and_explains_the_rest(a100):
    sp = load_space("calculon")
    case = Case(_model(1024, 16, 24), a100, 4, 4, "float16")
    rows = _all(sp, case)
    assert all(sp.check(case, r) == "" for r in rows[::7])
    ok = dict(rows[-1])
    assert ok["tensor_par"] > 1 and ok["data_par"] >= 1
    searched_only = {p: ok[p] for p in sp.searched}
    assert sp.check(case, searched_only) == ""
    assert sp.complete(case, searched_only) == ok

    def why(**changes):
        return sp.check(case, {**ok, **changes})

    assert why(tensor_par=3).startswith("invalid: tensor_par 3 must divide")
    assert why(tensor_par=4, pipeline_par=2).startswith("invalid: pipeline_par 2 must divide")
    assert why(data_par=5).startswith("invalid: data_par 5")
    assert "batch_size" in why(batch_size=15)
    assert why(fused_activation=False) == \
        "invalid: fused_activation False is not the space's fixed value True"
    assert "network tier" in why(tensor_par_net=2)
    assert why(num_procs=16).startswith("invalid: num_procs")
    assert why(datatype="float32").startswith("invalid: datatype")
    assert "not a valid" in why(tensor_par="8")
    tp1 = next(r for r in rows if r["tensor_par"] == 1)
    assert sp.check(case, {**tp1, "tensor_par_overlap": "ring"}) == \
        "invalid: tensor_par_overlap 'ring': must be none when tensor_par is 1"
    assert sp.check(case, {**tp1, "activation_recompute": "full", "activations_offload": True}) \
        .startswith("invalid: activations_offload True: needs a second memory tier")
    # normalize: inactive options take their forced value
    flat = dict(searched_only, tensor_par=1, tensor_par_net=1, tensor_par_overlap="pipe")
    assert sp.check(case, sp.complete(case, flat)) != ""
    norm = sp.complete(case, flat, normalize=True)
    assert norm["tensor_par_net"] == 0 and norm["tensor_par_overlap"] == "none"


def test_choices_skip_dead_ends(a100):
    """A value is offered only when some complete layout follows it."""
    sp = load_space("calculon")
    # heads 10, seq 1023 (odd): tp 2, 10 need an even micro-batch
    case = Case(_model(1000, 10, 15, 1023), a100, 20, 30, "float16")
    rows = _all(sp, case)
    for tp in sp.choices(case, "tensor_par", {}):
        assert any(r["tensor_par"] == tp for r in rows)
    assert sp.choices(case, "tensor_par", {}) == sorted({r["tensor_par"] for r in rows})


def test_bad_case(a100):
    sp = load_space("calculon")
    with pytest.raises(SpecError) as e:
        sp.size(Case(_model(), a100, 0, 8, "float16"))
    assert e.value.field == "num_procs"
    with pytest.raises(SpecError) as e:
        sp.size(Case(_model(), a100, 8, 8, "float12"))
    assert e.value.field == "datatype"
    with pytest.raises(SpecError) as e:
        sp.size(Case(_model(), a100, 8, 8, "float16", batch_policy="min"))
    assert e.value.field == "batch_policy"
