"""benchmarks/memory_flips.py: the LLaMA sweeps' out-of-memory flips under the
counted framework and the counted terms of Megatron-LM 2023 (issue #24;
docs/validation.md, "Counted terms, round 2")."""
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.fixture(scope="module")
def flips_module(reference):
    import memory_flips
    return memory_flips


@pytest.fixture(scope="module")
def counted(flips_module):
    return flips_module.report("megatron-llama-sweeps")


def test_counted_framework_flips(flips_module, counted):
    """The counted framework misjudges 66 layouts, before its unfused SwiGLU
    (63 predicted to fit ran out of memory, 3 that ran are predicted not to
    fit) and after (60 and 6); the fitted one 24.  The flips are the rows
    where the predicted fit and the label disagree."""
    _, sweep, f = counted
    fl = flips_module.flips(f)
    assert (len(fl), int((fl.status == "oom").sum())) == (66, 60)
    assert float((f.fits == f.ran).mean()) == pytest.approx(0.8905, abs=5e-4)
    assert ((fl.need_gib <= 80) == (fl.status == "oom")).all()
    _, _, before = flips_module.report("megatron-llama-sweeps", defaults=False)
    fb = flips_module.flips(before)
    assert (len(fb), int((fb.status == "oom").sum())) == (66, 63)
    # the unfused SwiGLU only adds memory: no row needs less
    assert (f.need_gib >= before.need_gib - 1e-9).all() and (f.need_gib > before.need_gib).any()
    _, _, g = flips_module.report("megatron-llama-sweeps-fitted")
    assert len(flips_module.flips(g)) == 24
    # Where they fall: more on pipeline 1 (one stage, loss and embedding on
    # the same GPU) than on the first stage of a pipeline, per row.
    counts = flips_module.pattern_counts(f)
    assert counts["bind"]["one"] == "32/169" and counts["bind"]["first"] == "28/400"


def test_no_counted_megatron_term_reaches_the_fitted_agreement(flips_module, counted):
    """Each term Megatron-LM 2023 holds that autopar does not (or counts
    differently) leaves the out-of-memory agreement at or below the counted
    framework's 0.891, far from the fitted 0.960: the missing ~1-2.7 MiB per
    token of a micro-batch is not one of them."""
    system, sweep, f = counted
    base = flips_module.agreement(sweep, f, 0.0, 0.0)[0]
    total = [0.0, 0.0]
    for name, src, (a, b), adds in flips_module.terms(sweep, system):
        assert "@" in src or "v1.0.8" in src, name        # each names its source
        if adds is None:             # counted in the spec already (the SwiGLU)
            assert flips_module.agreement(sweep, f, -a, -b)[0] == pytest.approx(base)
            continue
        agree = flips_module.agreement(sweep, f, a, b)[0]
        assert agree <= base + 1e-9, name
        total = [total[0] + a, total[1] + b]
    assert flips_module.agreement(sweep, f, *total)[0] < 0.95


def test_swiglu_term_counts_the_silu_output_by_hand(flips_module, counted):
    """Megatron's unfused SwiGLU keeps silu(gate) (f / tensor_par bf16
    elements a token) beside the GEMM output: with every block recomputed
    one block's worth, grown by the allocator fraction, on a stage without
    pipelining.  The counted framework holds it (``defaults``)."""
    system, sweep, f = counted
    name, _, (first, last), adds = flips_module.terms(sweep, system)[0]
    assert name.startswith("SwiGLU") and adds is None
    row = f.index[(f.model == "llama-13B") & (f.seq_size == 2048) & (f.tensor_par == 2)
                  & (f.pipeline_par == 1) & (f.microbatch_size == 4)
                  & (f.checkpointing == "every_layer") & (f.kernel == "torch")][0]
    grow = 1.0 + system.memory_overhead.fraction
    by_hand = 13824 / 2 * 2 * 2048 * 4 * grow
    assert last[row] == pytest.approx(by_hand, rel=1e-9)
    assert first[row] == pytest.approx(by_hand, rel=1e-9)
    # Without recompute every block keeps it: 40 blocks on one stage.
    row = f.index[(f.model == "llama-13B") & (f.seq_size == 2048) & (f.tensor_par == 2)
                  & (f.pipeline_par == 1) & (f.microbatch_size == 4)
                  & (f.checkpointing == "disabled")
                  & (f.kernel == "flash_attention2 + RMS kernel")][0]
    assert np.isclose(last[row], 40 * by_hand, rtol=1e-9)


def test_vocabulary_lead(flips_module):
    """A lead, not adopted: the loss counted as a plain PyTorch cross
    entropy on gathered logits (bf16 + three fp32 copies) reaches the
    fitted framework's out-of-memory agreement on both sizes only with a
    vocabulary about four times the 32,000 the sweeps' reference states;
    at 32,000 it is no better than the counted Megatron loss."""
    at32 = flips_module.vocabulary_lead(32000)
    at128 = flips_module.vocabulary_lead(128000)
    assert at32["overall"] < 0.90
    assert at128["overall"] >= 0.95
    assert at128["llama-13B"] > at32["llama-13B"] + 0.05 and at128["llama-65B"] >= 0.95
