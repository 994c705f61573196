"""Which LLaMA-sweep layouts does the counted framework misjudge, and does
any term that Megatron-LM of 2023 holds (and autopar does not count) explain
them?  (Issue #24: retire the fitted 17 fp32 logits copies by counted terms.)

1. The flips: layouts predicted to fit that ran out of memory, or the
   reverse, under ``--framework`` (default the counted
   ``megatron-llama-sweeps``) on the calibrated DGX A100 system, with the
   need of the first and the last pipeline stage (``stage_needs``), the stage
   that binds ("one" without pipelining), and how the flips fall by kernel,
   checkpointing, sequence parallelism, tensor / pipeline parallelism and
   micro-batch; then the same for the fitted spec.
2. The terms of the Megatron-LM of mid-2023 (and the kernels it calls) that
   autopar's count leaves out or counts differently, each with its source,
   its size per row (GiB on the first and the last stage; transient terms
   grown by the framework's allocator fraction) and the out-of-memory
   agreement when it is added alone and all together.  Each is counted, none
   fitted: a term's size follows from the layout and the model's shape.
3. The counted framework's out-of-memory agreement on each model size: its
   memory has no free constant, so leaving a size out changes nothing but the
   band (the headroom), and the per-size agreement is the leave-one-size-out
   figure.
4. A lead, not adopted: the same agreement with the loss counted as a plain
   PyTorch cross entropy on gathered logits, by vocabulary size.

Memory only (no step times); needs ../shared/reference.

    python benchmarks/memory_flips.py [--framework megatron-llama-sweeps]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama_sweep import SWEEP  # noqa: E402
from autopar.io.frameworks import system_under  # noqa: E402
from autopar.io.layouts import to_columns  # noqa: E402
from autopar.model.evaluate import evaluate_columns  # noqa: E402
from autopar.model.memory import MEMORY_PARTS, stage_needs  # noqa: E402
from autopar.studies.calibrate import Sweep  # noqa: E402
from autopar.studies.validate import GIB, unbounded  # noqa: E402

SYSTEM = ROOT / "systems/a100_80g_dgx_hdr200.json"
PATTERN = ("model", "seq_size", "kernel", "checkpointing", "sequence_parallel",
           "tensor_par", "pipeline_par", "microbatch_size", "bind")
MB4 = "NVIDIA/Megatron-LM@b90fb26 (2023-06)"


def stages(sweep: Sweep, system) -> pd.DataFrame:
    """The sweep with each row's first- and last-stage need (GiB), the
    stage that binds, whether it is predicted to fit and whether it ran."""
    first, last = stage_needs(sweep.parts, system.memory_overhead)
    f = sweep.frame.copy()
    f["first_gib"], f["last_gib"] = first / GIB, last / GIB
    f["need_gib"] = np.maximum(first, last) / GIB
    f["bind"] = np.where(f.pipeline_par == 1, "one", np.where(last > first, "last", "first"))
    f["fits"] = sweep.structural & (f.need_gib <= sweep.capacity)
    f["ran"] = sweep.ran
    return f


def flips(f: pd.DataFrame) -> pd.DataFrame:
    return f[f.fits != f.ran]


def pattern_counts(f: pd.DataFrame) -> dict:
    """column -> {value: 'flips/rows'}."""
    fl = flips(f)
    out = {}
    for c in PATTERN:
        n, k = f.groupby(c).size(), fl.groupby(c).size()
        out[c] = {v: f"{int(k.get(v, 0))}/{int(n[v])}" for v in n.index}
    return out


def shapes(sweep: Sweep) -> dict:
    """Per-row model shape and layout arrays the terms are counted from."""
    n = len(sweep.frame)
    out = {k: np.zeros(n) for k in ("h", "f", "heads", "d", "blocks")}
    for rows, model, _ in sweep.groups:
        at = rows.index.to_numpy()
        out["h"][at], out["f"][at] = model.hidden, model.feedforward
        out["heads"][at], out["d"][at] = model.attn_heads, model.attn_size
        out["blocks"][at] = model.num_blocks
    fr = sweep.frame
    tp = fr.tensor_par.to_numpy(float)
    pp = fr.pipeline_par.to_numpy(float)
    b = fr.microbatch_size.to_numpy(float)
    s = fr.seq_size.to_numpy(float)
    dp = fr.world_size.to_numpy(float) / (tp * pp)
    m = fr.global_batch.to_numpy(float) / (dp * b)
    out.update(tp=tp, pp=pp, b=b, s=s, tok=b * s,
               in_flight=np.minimum(m, pp),          # 1F1B, first stage (Calculon's)
               per_stage=np.ceil(out["blocks"] / pp),
               full=(fr.checkpointing == "every_layer").to_numpy(),
               flash=fr.kernel.str.startswith("flash").to_numpy(),
               rms_kernel=(fr.kernel == "flash_attention2 + RMS kernel").to_numpy(),
               # Megatron's fused scale-mask-softmax runs only for keys <= 4096
               # (fused_softmax.py is_kernel_available); above, the torch path.
               torch_softmax=((fr.kernel == "torch")
                              | ((fr.kernel == "fused") & (s > 4096))).to_numpy())
    return out


def _per_block(x: dict, per_token_block, grow):
    """A tensor of ``per_token_block`` bytes that each block keeps for
    backward: every block of the stage and micro-batch in flight without
    recompute (first stage: ``in_flight``; last: one), one block's (the one
    recomputed) under full recompute; grown by the allocator fraction."""
    keep = per_token_block * x["tok"]
    first = np.where(x["full"], keep, keep * x["per_stage"] * x["in_flight"])
    last = np.where(x["full"], keep, keep * x["per_stage"])
    return first * grow, last * grow


def _needs_with(sweep: Sweep, system, **fields):
    """(first, last) stage needs (bytes) with ``fields`` set in every row's
    execution."""
    n = len(sweep.frame)
    parts = {p: np.full(n, np.nan) for p in MEMORY_PARTS}
    free = unbounded(system)
    for rows, model, exes in sweep.groups:
        at = rows.index.to_numpy()
        r = evaluate_columns(model, free, to_columns([dict(e, **fields) for e in exes]),
                             stats=MEMORY_PARTS)
        for p in MEMORY_PARTS:
            parts[p][at] = r[p]
    return stage_needs(parts, system.memory_overhead)


def swiglu_unfused(sweep: Sweep, system):
    """The model's own count of the unfused activation against the fused
    one (``fused_activation`` false minus true: first, last stage), bytes."""
    a = _needs_with(sweep, system, fused_activation=False)
    b = _needs_with(sweep, system, fused_activation=True)
    return a[0] - b[0], a[1] - b[1]


def in_spec(sweep: Sweep) -> bool:
    """Whether the sweep's executions already count the unfused SwiGLU (the
    framework's ``defaults.fused_activation`` false)."""
    return all(not e["fused_activation"] for _, _, exes in sweep.groups for e in exes)


def terms(sweep: Sweep, system) -> list:
    """(name, source, (first, last) bytes per row, adds) for each counted
    term; ``adds``: the term is memory autopar leaves out (else a count
    autopar holds above Megatron's, negative); None: the framework spec
    counts it already."""
    x = shapes(sweep)
    grow = 1.0 + system.memory_overhead.fraction
    tp = x["tp"]
    scores = x["b"] * x["heads"] / tp * x["s"] * x["s"]          # per block
    sp = sweep.frame.sequence_parallel.astype(str).str.lower().eq("true").to_numpy()
    buf = np.where(x["flash"], 0.0, scores * 2)
    dq = np.where(x["flash"], x["tok"] * x["heads"] * x["d"] / tp * 4 * grow, 0.0)
    rms = np.where(x["rms_kernel"], 0.0, -2 * 4 * x["h"] / np.where(sp, tp, 1.0))
    soft = np.where(x["torch_softmax"], -2 * scores / x["tok"], 0.0)
    return [
        ("SwiGLU unfused: silu(gate) kept beside gate and up",
         f"{MB4} megatron/model/transformer.py ParallelMLP (swiglu = torch.chunk, "
         "F.silu(x[0]) * x[1]; fused bias_swiglu from 8503f75, 2023-11)",
         swiglu_unfused(sweep, system), None if in_spec(sweep) else True),
        ("non-flash attention: persistent scores buffer (b np/t s s, bf16)",
         f"{MB4} megatron/model/transformer.py CoreAttention.forward "
         "(mpu.get_global_memory_buffer().get_tensor(..., 'mpu') for baddbmm); "
         "megatron/core/utils.py GlobalMemoryBuffer.get_tensor (kept, never freed; its "
         "instance in megatron/core/parallel_state.py)",
         (buf, buf), True),
        ("flash backward: fp32 dq accumulator (one block)",
         "Dao-AILab/flash-attention v1.0.8 csrc/flash_attn/fmha_api.cpp mha_bwd "
         "(dq_tmp fp32 when seqlen_k > blocksize); v2 csrc/flash_attn/flash_api.cpp "
         "mha_bwd (dq_accum fp32)",
         (dq, dq), True),
        ("RMSNorm without the kernel: Megatron's keeps fp32 x and bf16 x/rms "
         "(autopar's unfused count keeps 4 B an element more, two norms a block)",
         "NVIDIA/Megatron-LM@4dc0715 (2023-09) megatron/model/rms_norm.py RMSNorm.forward "
         "(self._norm(x.float()).type_as(x) * self.weight)",
         _per_block(x, rms, grow), False),
        ("torch softmax: Megatron's keeps fp32 probs and their bf16 cast, 6 B a score "
         "(autopar's unfused LLaMA count 8 B)",
         f"{MB4} megatron/model/fused_softmax.py forward_torch_softmax "
         "(softmax_in_fp32 with apply_query_key_layer_scaling, the default)",
         _per_block(x, soft, grow), False),
    ]


def agreement(sweep: Sweep, f: pd.DataFrame, first, last) -> tuple:
    """(OOM agreement, predicted fit but ran out, predicted out but ran)."""
    need = np.maximum(f.first_gib.to_numpy() + first / GIB, f.last_gib.to_numpy() + last / GIB)
    fits = sweep.structural & (need <= sweep.capacity)
    ran = sweep.ran
    return float((fits == ran).mean()), int((fits & ~ran).sum()), int((~fits & ran).sum())


def markdown(system, sweep: Sweep, f: pd.DataFrame, other: pd.DataFrame,
             before: pd.DataFrame) -> str:
    """The flips of ``f``, of ``before`` (the spec without its recipe
    defaults) and of ``other`` (the fitted spec) as a Markdown table: each
    row's layout, label, first/last-stage need under ``f`` (GiB), the stage
    that binds, and whether it is a flip before, after, with the counted
    terms autopar leaves out added ("+terms") and under the other spec."""
    add = [0.0, 0.0]
    for _, _, (a, b), adds in terms(sweep, system):
        if adds:
            add = [add[0] + a, add[1] + b]
    need = np.maximum(f.first_gib + add[0] / GIB, f.last_gib + add[1] / GIB)
    plus = (sweep.structural & (need <= sweep.capacity)) != f.ran
    fo = other.fits != other.ran
    fb = before.fits != before.ran
    rows = f[(f.fits != f.ran) | fo | plus | fb]
    kern = {"torch": "torch", "fused": "fused", "flash_attentionv1.0.8": "flash1",
            "flash_attention2": "flash2", "flash_attention2 + RMS kernel": "flash2+RMS"}
    out = ["| model | seq | tp | pp | mb | recompute | kernel | SP | status | first | last "
           "| binds | before | after | +terms | fitted |", "|" + "---|" * 16]
    yes = {True: "flip", False: "ok"}
    for i, r in rows.sort_values(["status", "model", "seq_size", "kernel", "tensor_par",
                                  "pipeline_par", "microbatch_size"]).iterrows():
        out.append(f"| {r.model[6:]} | {r.seq_size // 1024}k | {r.tensor_par} | "
                   f"{r.pipeline_par} | {r.microbatch_size} | "
                   f"{'full' if r.checkpointing == 'every_layer' else 'none'} | "
                   f"{kern[r.kernel]} | {'y' if str(r.sequence_parallel) == 'True' else 'n'} | "
                   f"{r.status} | {r.first_gib:.1f} | {r.last_gib:.1f} | {r.bind} | "
                   f"{yes[bool(fb[i])]} | {yes[bool(r.fits != r.ran)]} | {yes[bool(plus[i])]} | "
                   f"{yes[bool(fo[i])]} |")
    return "\n".join(out)


# A plain PyTorch cross entropy on the logits gathered whole on every
# tensor rank (Megatron's parallel_output=False gathers them with
# gather_from_tensor_model_parallel_region): beside the bf16 logits, the
# backward peak holds the saved fp32 log-probabilities, nll_loss's fp32
# gradient and log_softmax's fp32 gradient (three fp32 copies).
GATHERED_TORCH_LOSS = {"logits_gathered": True, "logits_fp32_copies": 3.0}
GATHERED_TORCH_LOSS_SOURCE = (
    "pytorch/pytorch aten/src/ATen/native/LossNLL.cpp cross_entropy_loss "
    "(log_softmax, then nll_loss), tools/autograd/derivatives.yaml _log_softmax "
    "(backward from the result), aten/src/ATen/native/cuda/Loss.cu "
    "nll_loss_backward_out_cuda (grad_input.zero_(): a gradient of the input's shape)")


def vocabulary_lead(vocab: int, framework: str = "megatron-llama-sweeps") -> dict:
    """OOM agreement (overall and per model size) of ``framework`` with its
    loss replaced by ``GATHERED_TORCH_LOSS`` and the sweep's models given a
    vocabulary of ``vocab`` (embedding, output layer and logits): the lead
    that the fitted 17 gathered copies of a 32,000-entry vocabulary (70 B a
    token and entry) are the counted 14 B of a gathered PyTorch loss over a
    vocabulary about four times as large.  Memory only."""
    import dataclasses
    import json
    import tempfile

    from autopar.io.frameworks import load_framework

    fw = load_framework(framework)
    fw = dataclasses.replace(fw, memory_overhead=dataclasses.replace(
        fw.memory_overhead, **GATHERED_TORCH_LOSS))
    system = system_under(SYSTEM, fw)
    with tempfile.TemporaryDirectory() as d:
        for name in ("llama-13B", "llama-65B"):
            m = json.loads((ROOT / "models" / f"{name}.json").read_text())
            (Path(d) / f"{name}.json").write_text(json.dumps(dict(m, vocab_size=int(vocab))))
        sweep = Sweep(SWEEP, system, d, fw.defaults)
    f = stages(sweep, system)
    ok = f.fits == f.ran
    out = {"overall": float(ok.mean())}
    out.update({m: float(ok[f.model == m].mean()) for m in f.model.unique()})
    return out


def report(framework: str, defaults: bool = True) -> tuple:
    """(system, sweep, ``stages``) under ``framework``; without ``defaults``
    the framework's recipe defaults are left out (the sweep's own
    assumptions: the spec before issue #24's round 2)."""
    from autopar.io.frameworks import load_framework

    fw = load_framework(framework)
    system = system_under(SYSTEM, fw)
    sweep = Sweep(SWEEP, system, ROOT / "models", fw.defaults if defaults else None)
    return system, sweep, stages(sweep, system)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--framework", default="megatron-llama-sweeps")
    p.add_argument("--compare", default="megatron-llama-sweeps-fitted")
    p.add_argument("--markdown", action="store_true",
                   help="print only the row-level table of flips (docs/validation.md)")
    args = p.parse_args()
    if not SWEEP.is_file():
        print(f"no sweep at {SWEEP}", file=sys.stderr)
        return 1
    pd.set_option("display.width", 250)
    pd.set_option("display.max_rows", 500)
    system, sweep, f = report(args.framework)
    fl = flips(f)
    if args.markdown:
        print(markdown(system, sweep, f, report(args.compare)[2],
                       report(args.framework, defaults=False)[2]))
        return 0
    cols = ["model", "seq_size", "tensor_par", "pipeline_par", "microbatch_size",
            "checkpointing", "kernel", "sequence_parallel", "status", "first_gib",
            "last_gib", "bind"]
    print(f"1. Flips under {args.framework}: {len(fl)} of {len(f)} "
          f"({int((fl.status == 'oom').sum())} ran out of memory, predicted to fit; "
          f"{int((fl.status == 'ok').sum())} ran, predicted not to)")
    print(fl[cols].sort_values(["status", "model", "seq_size", "kernel"]).round(1).to_string())
    for c, v in pattern_counts(f).items():
        print(f"   {c}: " + ", ".join(f"{k} {n}" for k, n in v.items()))
    _, _, g = report(args.compare)
    both = fl.index.intersection(flips(g).index)
    print(f"   under {args.compare}: {len(flips(g))} flips, {len(both)} of them shared")
    tok = (fl.seq_size * fl.microbatch_size).to_numpy(float)
    short = (fl.need_gib.to_numpy() - sweep.capacity) / tok * 1024
    oom = (fl.status == "oom").to_numpy()
    print(f"   missing per token of a micro-batch on the out-of-memory flips (MiB): median "
          f"{np.median(-short[oom]):.2f}, largest {np.max(-short[oom]):.2f}")

    print(f"\n2. Counted terms of Megatron-LM 2023 (alone: OOM agreement, fit-but-oom, "
          f"oom-but-ran; base {agreement(sweep, f, 0.0, 0.0)})")
    tot_add, tot_all = [0.0, 0.0], [0.0, 0.0]
    for name, src, (a, b), adds in terms(sweep, system):
        big = np.maximum(np.abs(a), np.abs(b)) / GIB
        if adds is None:
            print(f"   = {name} (in the spec)\n       {src}\n       size GiB median "
                  f"{np.median(big):.2f}, largest {big.max():.2f}; without it "
                  f"{agreement(sweep, f, -a, -b)}")
            continue
        print(f"   {'+' if adds else '-'} {name}\n       {src}\n       size GiB median "
              f"{np.median(big):.2f}, largest {big.max():.2f}; alone "
              f"{agreement(sweep, f, a, b)}")
        if adds:
            tot_add = [tot_add[0] + a, tot_add[1] + b]
        tot_all = [tot_all[0] + a, tot_all[1] + b]
    print(f"   the terms autopar leaves out, together: {agreement(sweep, f, *tot_add)}")
    print(f"   every term (Megatron's count throughout): {agreement(sweep, f, *tot_all)}")

    print("\n3. OOM agreement per model size (no free memory constant: the "
          "leave-one-size-out figure)")
    for m, g in f.groupby("model"):
        print(f"   {m}: {float((g.fits == g.ran).mean()):.3f} ({len(g)} rows)")

    print("\n4. A lead, not adopted: the loss as a plain PyTorch cross entropy on "
          "gathered logits (bf16 + 3 fp32 copies, counted from\n   "
          f"{GATHERED_TORCH_LOSS_SOURCE}),\n   by vocabulary size "
          "(the sweeps' reference states 32,000): OOM agreement overall, 13B, 65B")
    for v in (32000, 64000, 96000, 128000, 160000):
        r = vocabulary_lead(v, args.framework)
        print(f"   {v:>7}: {r['overall']:.3f}  {r['llama-13B']:.3f}  {r['llama-65B']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
