"""What do the fitted loss buffers of the calibrated DGX A100 system stand for?

The calibrated ``systems/a100_80g_dgx_hdr200.json`` charges the last pipeline
stage ``logits_fp32_copies`` (17) fp32 copies of one micro-batch's gathered
logits: 17 x 4 B x 32000 = 2.1 MiB per token.  This script looks at the
LLaMA 13B/65B sweeps' out-of-memory labels for what that term stands for
(issue #12: count memory from first principles so that fitted constants
shrink).  Memory only, no step times; the counted reserve and fragmentation
of the base system are kept throughout.  Needs ../shared/reference.

1. Which stage sets the predicted peak, and where the calibrated system is
   wrong.
2. The budget each layout leaves on its last stage, per token of a
   micro-batch, bracketed by the layouts that ran and those that ran out of
   memory (a term charged per token on the last stage must lie inside), and
   the loss buffers fitted on parts of the sweep (by model, sequence,
   tensor and pipeline parallelism, recompute).
3. Candidate terms, each a count of something a Megatron-style framework
   may hold that the model leaves out or counts differently, fitted alone
   and together with the loss buffers by the likelihood of the labels (the
   calibrate code path: a logistic chance of running out given the need):
   the negative log-likelihood (lower is better), the fitted coefficient
   and the out-of-memory agreement.
4. The vocabulary: the term is identified as bytes per token, so the same
   fit with a larger vocabulary (fewer copies of larger logits, and larger
   embedding and output matrices) is scored too.

    python benchmarks/memory_residuals.py [--system systems/a100_80g_dgx_hdr200_base.json]
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autopar.io.layouts import to_columns  # noqa: E402
from autopar.model.evaluate import evaluate_columns  # noqa: E402
from autopar.studies import calibrate as C  # noqa: E402
from llama_sweep import SWEEP, load  # noqa: E402
from autopar.studies.validate import GIB, sweep_groups, unbounded  # noqa: E402

BLOCK_STATS = ("block_act_storage_space", "block_act_working_space",
               "block_act_checkpoint_size", "weight_grad_space", "weight_space")
COPIES = np.arange(0.0, 32.01, 0.5)


def block_stats(sweep: C.Sweep, system, models_dir) -> dict:
    """Per-block statistics of every row (bytes), and the rows' shapes."""
    f = sweep.frame
    out = {s: np.full(len(f), np.nan) for s in BLOCK_STATS}
    out["hidden"] = np.zeros(len(f))
    out["vocab"] = np.zeros(len(f))
    out["blocks"] = np.zeros(len(f))
    out["heads"] = np.zeros(len(f))
    for rows, model, exes in sweep_groups(f, system, models_dir):
        at = rows.index.to_numpy()
        r = evaluate_columns(model, unbounded(system), to_columns(exes), stats=BLOCK_STATS)
        for s in BLOCK_STATS:
            out[s][at] = r[s]
        out["hidden"][at] = model.hidden
        out["vocab"][at] = model.vocab_size
        out["blocks"][at] = model.num_blocks
        out["heads"][at] = model.attn_heads
    return out


def candidate_terms(sweep: C.Sweep, st: dict) -> dict:
    """name -> (GiB on the first stage, GiB on the last stage) per unit of
    the coefficient; transient (grown by the fragmentation) unless named in
    STATIC."""
    f = sweep.frame
    tp = f["tensor_par"].to_numpy(float)
    pp = f["pipeline_par"].to_numpy(float)
    tok = (f["seq_size"] * f["microbatch_size"]).to_numpy(float)
    seq = f["seq_size"].to_numpy(float)
    dp = f["world_size"].to_numpy(float) / (tp * pp)
    m = f["global_batch"].to_numpy(float) / (dp * f["microbatch_size"].to_numpy(float))
    in_flight = np.minimum(m, pp)
    per_stage = np.ceil(st["blocks"] / pp)
    full = (f["checkpointing"] == "every_layer").to_numpy()
    flash = f["kernel"].str.startswith("flash").to_numpy()
    # One micro-batch's activations of a whole stage: its blocks' checkpoints
    # under full recompute, else their stored activations.
    one_mb = np.where(full, st["block_act_checkpoint_size"], st["block_act_storage_space"]) \
        * per_stage / GIB
    logits32 = tok * st["vocab"] * 4 / GIB
    zero = np.zeros(len(f))
    return {
        "loss buffers, gathered (fp32 logits copies; shipped)": (zero, logits32),
        "loss buffers (fp32 copies) split over tensor ranks": (zero, logits32 / tp),
        "loss-sized buffers on the first stage": (logits32, zero),
        "loss-sized buffers on every stage": (logits32, logits32),
        "per token x hidden (bf16) on the last stage": (zero, tok * st["hidden"] * 2 / GIB),
        "s x s per sequence (bf16, a mask) on the last stage": (zero, tok * seq * 2 / GIB),
        "stored activations / checkpoints x factor": (one_mb * in_flight, one_mb),
        "one more block working set": (st["block_act_working_space"] / GIB,) * 2,
        "non-flash attention scores (bf16, per head)":
            (np.where(flash, 0.0, tok * seq * st["heads"] / tp * 2 / GIB),) * 2,
        "one more micro-batch on the first stage (pipelined)":
            (np.where(pp > 1, one_mb, 0.0), zero),
        "one more micro-batch on the last stage (pipelined)":
            (zero, np.where(pp > 1, one_mb, 0.0)),
        # Static: fp32 main_grad (Megatron's accumulate in fp32) doubles the
        # bf16 gradients; charged without fragmentation (see fit below).
        "gradients in fp32 (main_grad) instead of bf16":
            (st["weight_grad_space"] / GIB, st["weight_grad_space"] / GIB),
        # The embedding's (first stage) and the output layer's (last) weight
        # gradient in fp32, V x h / tp.
        "embedding / output-layer gradient in fp32":
            (st["vocab"] * st["hidden"] * 4 / tp / GIB,) * 2,
        # A second bf16 copy of the stage's weights (a distributed optimizer's
        # parameter buffer for its all-gather).
        "a second bf16 copy of the weights":
            (st["weight_space"] / GIB, st["weight_space"] / GIB),
    }


STATIC = {"gradients in fp32 (main_grad) instead of bf16",
          "embedding / output-layer gradient in fp32", "a second bf16 copy of the weights"}


def fit_terms(sweep: C.Sweep, k: C.Constants, terms: list, grids: list):
    """Best (nll, coefficients, slope, agreement) over the grid product,
    with the counted reserve and fragmentation of ``k``."""
    P = sweep.parts
    use = sweep.labelled & sweep.structural
    y = (~sweep.ran[use]).astype(float)
    grow = 1.0 + k.fraction
    first0 = (P["mem_static_first"] + P["mem_transient_first"] * grow) / GIB + k.reserved_GiB
    last0 = (P["mem_static_last"] + P["mem_transient_last"] * grow) / GIB + k.reserved_GiB
    mesh = (np.array(np.meshgrid(*grids, indexing="ij")).reshape(len(grids), -1)
            if grids else np.zeros((0, 1)))
    first = np.repeat(first0[use][None], mesh.shape[1], 0)
    last = np.repeat(last0[use][None], mesh.shape[1], 0)
    for (name, (a, b)), c in zip(terms, mesh):
        g = 1.0 if name in STATIC else grow
        first = first + c[:, None] * a[use][None] * g
        last = last + c[:, None] * b[use][None] * g
    need = np.maximum(first, last)
    slope, nll = C._logistic_slopes(need - sweep.capacity, y)
    i = int(np.argmin(nll))
    agree = float(((need[i] <= sweep.capacity) == (y == 0)).mean())
    return float(nll[i]), mesh[:, i], float(slope[i]), agree


def grid_for(values_first, values_last) -> np.ndarray:
    """Coefficients from 0 to the one that adds 80 GiB to the median row."""
    v = np.nanmedian(np.where(values_last > 0, values_last, values_first))
    top = 80.0 / v if v > 0 else 1.0
    return np.concatenate([[0.0], np.geomspace(top / 2000, top, 60)])


def main() -> int:
    got = load(__doc__.splitlines()[0])
    if got is None:
        return 1
    system, sweep = got
    f = sweep.frame
    k0 = C.base_constants(system)
    use = sweep.labelled & sweep.structural
    k = C.fit_memory(sweep, np.ones(len(f), bool), k0)
    P, grow = sweep.parts, 1.0 + k.fraction
    first = (P["mem_static_first"] + P["mem_transient_first"] * grow) / GIB + k.reserved_GiB
    last_wo = (P["mem_static_last"] + P["mem_transient_last"] * grow) / GIB + k.reserved_GiB
    copy = P["mem_logits_fp32_copy"] / GIB
    last = last_wo + k.logits_fp32_copies * copy * grow
    need = np.maximum(first, last)
    ran = sweep.ran

    print(f"1. Calibrated memory (reserve {k.reserved_GiB:g} GiB, fragmentation "
          f"{k.fraction:g}, fitted loss buffers {k.logits_fp32_copies:g} fp32 copies): "
          f"{int(use.sum())} labelled layouts")
    for name, sel in (("ran", ran), ("ran out of memory", ~ran)):
        s = use & sel
        by_last = s & (last > first)
        print(f"   {name:18s} {int(s.sum()):4d}: peak on the last stage {int(by_last.sum())} "
              f"(over 80 GiB only through the loss buffers: "
              f"{int((by_last & (last > 80) & (np.maximum(first, last_wo) <= 80)).sum())}), "
              f"misjudged {int((s & ((need <= 80) != ran)).sum())}")

    tok = (f["seq_size"] * f["microbatch_size"]).to_numpy(float)
    budget = (sweep.capacity - last_wo) / grow / tok * GIB / 2 ** 20   # MiB per token
    free_first = first <= sweep.capacity
    oom_b = np.sort(budget[use & ~ran & free_first])
    ok_b = np.sort(budget[use & ran])
    row_mib = 4 * 32000 / 2 ** 20
    shipped = k.logits_fp32_copies * row_mib
    print("\n2. Budget left on the last stage per token of a micro-batch (MiB), "
          "without the loss buffers (a last-stage term per token must exceed the first "
          "and stay below the second):")
    print(f"   ran out of memory, first stage fits ({len(oom_b)}): median "
          f"{np.median(oom_b):.2f}, 75th percentile {np.quantile(oom_b, 0.75):.2f}, "
          f"90th {np.quantile(oom_b, 0.9):.2f}, largest {oom_b[-3:].round(2).tolist()}")
    print(f"   ran ({len(ok_b)}): smallest {ok_b[:3].round(2).tolist()}, 10th percentile "
          f"{np.quantile(ok_b, 0.1):.2f}, median {np.median(ok_b):.2f}")
    print(f"   shipped term {shipped:.2f} MiB per token ({k.logits_fp32_copies:g} x fp32 x "
          f"32000): above {int((oom_b < shipped).sum())} of the {len(oom_b)}, below "
          f"{int((ok_b > shipped).sum())} of the {len(ok_b)}")

    print("   fitted copies (the calibrate code path) on parts of the sweep:")
    for col in ("model", "seq_size", "tensor_par", "pipeline_par", "checkpointing"):
        fits = []
        for v in sorted(f[col].unique()):
            part = (f[col] == v).to_numpy()
            fits.append(f"{v} {C.fit_memory(sweep, part, k0).logits_fp32_copies:g}")
        print(f"     {col}: " + ", ".join(fits))

    st = block_stats(sweep, system, ROOT / "models")
    terms = candidate_terms(sweep, st)
    loss_name = next(iter(terms))
    print("\n3. Candidate terms (nll: negative log-likelihood of the 603 labels; "
          "coefficient; OOM agreement)")
    print(f"   {'term':55s} {'alone':>30s}   {'with the gathered loss buffers':>40s}")
    nll0, _, _, ag0 = fit_terms(sweep, k0, [], [])
    print(f"   {'(none: the counted terms only)':55s} {nll0:7.1f}  {'':9s} {ag0:.3f}")
    for name, (a, b) in terms.items():
        grid = COPIES if name == loss_name else grid_for(a, b)
        nll, c, _, ag = fit_terms(sweep, k0, [(name, (a, b))], [grid])
        alone = f"{nll:7.1f}  x{c[0]:<8.3g} {ag:.3f}"
        if name == loss_name:
            both = ""
        else:
            nll2, c2, _, ag2 = fit_terms(sweep, k0, [(loss_name, terms[loss_name]),
                                                    (name, (a, b))], [COPIES, grid])
            both = f"{nll2:7.1f}  copies {c2[0]:<4g} x{c2[1]:<8.3g} {ag2:.3f}"
        print(f"   {name:55s} {alone:>30s}   {both:>40s}")

    print("\n4. Vocabulary (fitted copies of larger logits; embedding and output "
          "matrices grown with it): nll, copies, OOM agreement in sample")
    with tempfile.TemporaryDirectory() as tmp:
        for vocab in (32000, 64000, 128000):
            d = Path(tmp) / str(vocab)
            d.mkdir()
            for mname in f["model"].unique():
                spec = json.loads((ROOT / "models" / f"{mname}.json").read_text())
                (d / f"{mname}.json").write_text(json.dumps(dict(spec, vocab_size=vocab)))
            sv = C.Sweep(SWEEP, system, d)
            nll, c, _, ag = fit_terms(sv, k0, [("copies", (np.zeros(len(f)),
                                                            sv.parts["mem_logits_fp32_copy"]
                                                            / GIB))], [COPIES])
            print(f"   vocabulary {vocab:6d}: nll {nll:6.1f}, copies {c[0]:g}, "
                  f"{c[0] * vocab * 4 / 2 ** 20:.2f} MiB per token, agreement {ag:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
