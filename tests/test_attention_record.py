"""The system files' measured attention kernel rates (``attention`` record,
``autopar.io.specs.read_attention``; ``layers.measured_attention``)."""
from __future__ import annotations

import dataclasses
import json

import pytest

B200 = "systems/b200_nvl8.json"


def _flash(system, s, cp=1, tp=1, mbs=1):
    """The finished flash layer of Llama 3 8B (32 heads, 8 KV heads, head
    size 128) at ``s`` local queries attending to ``cp * s`` keys, and its
    context."""
    from autopar.io.layouts import to_columns
    from autopar.io.specs import load_model
    from autopar.model.context import LayoutContext
    from autopar.model.evaluate import normalize, typed_columns
    from autopar.model.layers import finish, flash_attention
    from conftest import one_proc_execution

    m = load_model("models/llama3-8B.json")
    ex = one_proc_execution(num_procs=tp, tensor_par=tp, datatype="bfloat16",
                            batch_size=mbs, microbatch_size=mbs)
    cols = typed_columns(normalize(to_columns([ex])))
    ctx = LayoutContext(m, system, cols, [2])
    heads = 32 // tp
    L = finish(ctx, flash_attention(ctx, float(mbs), float(heads), float(s), 128.0,
                                    float(8 // tp * 128), 3, sk=float(cp * s)))
    return ctx, L


def test_record_lookup_by_hand_on_two_shapes():
    """Two shapes read off systems/b200_nvl8.json's record by hand (SimuMax's
    measured TE attention on B200, halved for the causal half):

    * 8192 tokens, 32 heads, head size 128, one sequence: one call executes
      8192^2 x 32 x 256 = 549.75 GFLOP -> the 549.75 threshold: forward
      0.4858, backward 0.414 of 2250 TFLOP/s (backward work 2.5 forwards);
    * 2048 local queries of 16384 (context parallel 8): each ring step's
      call is the causal-equivalent block of the local queries, 2048^2 x 32
      x 256 = 34.35 GFLOP -> the 34.35 threshold: 0.1563 / 0.3219.
    """
    from autopar.io.specs import load_system

    sy = load_system(B200)
    rec = sy.attention["bfloat16"][128]
    for s, cp, gflop, fwd, bwd in ((8192, 1, 549.75, 0.4858, 0.414),
                                   (2048, 8, 34.35, 0.1563, 0.3219)):
        assert (gflop, fwd) in rec["fwd"] and (gflop, bwd) in rec["bwd"]
        assert s * s * 32 * 256 / 1e9 == pytest.approx(gflop, abs=0.01)
        ctx, L = _flash(sy, s, cp)
        executed = 0.5 * 4 * 32 * s * (cp * s) * 128         # causal half, FLOPs
        assert float(L["flops_time_fw"][0]) == pytest.approx(executed / (2250e12 * fwd), rel=1e-9)
        assert float(L["flops_time_agrad"][0]) == pytest.approx(
            2.5 * executed / (2250e12 * bwd), rel=1e-9)
    # a head size the record does not list keeps the model's default
    # (0.75 of the matrix curve, both passes on the model's count)
    bare = dataclasses.replace(sy, attention=None)
    other = dataclasses.replace(sy, attention={"bfloat16": {64: rec}})
    for s in (8192, 2048):
        _, a = _flash(bare, s)
        _, b = _flash(other, s)
        for p in ("fw", "agrad"):
            assert float(a["flops_time_" + p][0]) == float(b["flops_time_" + p][0])
        _, c = _flash(sy, s)
        assert float(c["flops_time_fw"][0]) != pytest.approx(float(a["flops_time_fw"][0]))


def test_framework_stated_kernel_wins_over_the_record():
    """A stated kernel rate (time_overhead.attention_speed: the NeMo 1.x
    launcher's FlashAttention-2, llm-foundry's) is the framework's kernel:
    the system's record does not replace it."""
    from autopar.io.specs import TimeOverhead, load_system

    sy = load_system(B200)
    stated = dataclasses.replace(sy, time_overhead=TimeOverhead(attention_speed=0.5))
    bare = dataclasses.replace(stated, attention=None)
    _, a = _flash(stated, 8192)
    _, b = _flash(bare, 8192)
    assert float(a["flops_time_fw"][0]) == float(b["flops_time_fw"][0])
    assert float(a["flops_time_agrad"][0]) == float(b["flops_time_agrad"][0])


def test_record_files_hold_the_published_measurements():
    """Only the B200 files carry the record, and it is SimuMax's measurement
    as ``benchmarks/simumax_b200_system.py`` derives it (checked against the
    shipped record's structure here; the script checks it against the
    SimuMax file)."""
    from autopar.io.specs import load_system

    for f in ("b200_nvl8", "b200_nvl8_megatron"):
        a = load_system(f"systems/{f}.json").attention
        assert set(a) == {"bfloat16"} and set(a["bfloat16"]) == {128, 192}
        fwd = dict(a["bfloat16"][128]["fwd"])
        # SimuMax's 32k, 8 heads call (60.1%) and 4k, 8 heads (15.6%)
        assert fwd[2199.02] == 0.6009 and fwd[34.35] == 0.1563
    for f in ("b300_nvl8", "gb200_nvl72", "gb300_nvl72", "h100_80g_nvl8"):
        assert load_system(f"systems/{f}.json").attention is None


def test_record_survives_the_json_round_trip():
    from autopar.io.specs import load_system, system_to_json

    sy = load_system(B200)
    again = load_system(system_to_json(sy), source="round trip")
    assert again.attention == sy.attention


@pytest.mark.parametrize("record, field, words", [
    ({"bfloat16": {"128": {"fwd": [[10, 0.5], [0, 0.4]]}}}, "attention.bfloat16.128.bwd",
     "missing key"),
    ({"bf17": {"128": {}}}, "attention.bf17", "unknown datatype"),
    ({"bfloat16": {"x": {}}}, "attention.bfloat16.x", "head size"),
    ({"bfloat16": {"128": {"fwd": [[10, 0.5], [0, 0.4]], "bwd": [[10, 1.5], [0, 0.4]]}}},
     "attention.bfloat16.128.bwd[0]", "efficiency"),
    ({"bfloat16": {"128": {"fwd": [[10, 0.5], [20, 0.4]], "bwd": [[0, 0.4]]}}},
     "attention.bfloat16.128.fwd[1]", "descending"),
    ({"bfloat16": {"128": {"fwd": [[10, 0.5]], "bwd": [[0, 0.4]]}}},
     "attention.bfloat16.128.fwd[0]", "must be 0"),
    ([], "attention", "expected an object"),
])
def test_bad_record_is_a_spec_error(tmp_path, record, field, words):
    from autopar.io.errors import SpecError
    from autopar.io.specs import load_system

    spec = json.loads(open(B200).read())
    spec["attention"] = record
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(spec))
    with pytest.raises(SpecError) as e:
        load_system(str(p))
    assert e.value.field == field and words in str(e.value)
    assert str(p) in str(e.value)
