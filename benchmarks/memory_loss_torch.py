"""The loss's peak memory measured with PyTorch on CPU, held against the
torchtitan framework specs' count (issue #24; docs/validation.md,
"torchtitan: recipe defaults and memory, counted").

torchtitan's loss is ``cross_entropy(pred.flatten(0, 1).float(), labels)``
on the (vocabulary shard of the) logits, eager (``frameworks/torchtitan.json``)
or, where a run compiles and its commit compiles the loss too, under
``torch.compile`` (``frameworks/torchtitan-compile.json``).  This runs the
output projection, that loss and its backward at a small shape and reads the
process's resident-memory high-water mark (``VmHWM``, reset through
``/proc/self/clear_refs`` after a warm-up step at the same shape): the peak
above the step's start, per logit element.  Tensors this large are
``mmap``-ed by the C allocator and returned on free, so the resident set
follows the live tensors.

Cases: ``eager`` (the logits deleted before backward, as torchtitan's train
loop does without pipeline stages), ``eager-kept`` (the logits alive through
backward, as a pipeline stage caches its output), ``compiled`` (inductor).
What it covers: the loss's own tensors (the weight and input gradients of
the projection are a few per cent of a logit element at these shapes and are
printed).  What it cannot: the CUDA caching allocator (rounding, reserved
segments) and GPU kernels' workspaces; inductor on CPU decides what the
compiled loss saves as on GPU (the same partitioner), but its kernels are
CPU ones.  Linux only (``/proc``).

Run: ``python benchmarks/memory_loss_torch.py [--tokens N] [--vocab V]``
(needs the optional ``measure`` extra, torch).
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

HIDDEN = 64
CASES = ("eager", "eager-kept", "compiled")


def counted(case: str) -> float:
    """Bytes per logit element at the loss's peak as the framework spec
    counts them (bf16 logits where alive, plus the fp32 copies)."""
    root = Path(__file__).resolve().parents[1] / "frameworks"
    name = "torchtitan-compile" if case == "compiled" else "torchtitan"
    over = json.loads((root / f"{name}.json").read_text())["memory_overhead"]
    kept = over.get("logits_kept", "always") == "always" or case == "eager-kept"
    return 2.0 * kept + 4.0 * over["logits_fp32_copies"]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _hwm() -> int:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM"))
    return int(line.split()[1]) * 1024


def measure(case: str, tokens: int = 2048, vocab: int = 16384) -> float:
    """Peak bytes per logit element above the step's start (see the module
    docstring); ``case`` one of ``CASES``."""
    import torch

    torch.manual_seed(0)

    def ce(pred, labels):
        return torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(),
                                                 labels.flatten(0, 1))

    fn = torch.compile(ce, dynamic=False) if case == "compiled" else ce
    w = torch.randn(vocab, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(1, tokens, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens))

    def step():
        pred = torch.nn.functional.linear(x, w)
        loss = fn(pred, labels)
        if case != "eager-kept":
            del pred
            loss.backward()
        else:
            loss.backward()
            del pred
        w.grad = None
        x.grad = None

    step()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _rss()
    step()
    return (_hwm() - base) / (tokens * vocab)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=16384)
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("needs torch (the optional 'measure' extra)", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {args.tokens} tokens x {args.vocab} vocabulary, "
          f"bytes per logit element at the loss's peak")
    print(f"{'case':<12} {'measured':>9} {'counted':>8}   (projection's gradients: "
          f"{HIDDEN * 2 / args.tokens + HIDDEN * 2 / args.vocab:.3f})")
    for case in CASES:
        print(f"{case:<12} {measure(case, args.tokens, args.vocab):>9.2f} "
              f"{counted(case):>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
