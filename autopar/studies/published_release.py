"""Megatron-LM's release (convergence) tests as a published table:
``megatron_release`` (``autopar/data/published/megatron_release.csv``,
written by ``benchmarks/write_megatron_release_table.py`` from a mirror of
NVIDIA/Megatron-LM).

Each row is one release case on one machine: the case's exact
``pretrain_gpt.py`` arguments, read by autopar's Megatron-LM importer
(``autopar.io.launch.megatron.read``, the reader of ``autopar import``), the
measured peak allocated memory of rank ``world_size - 1`` (the last pipeline
stage) and the median steady step time.  A row is a ``Skip`` where the
importer refuses its arguments (the reason is the importer's), where the
number of GPUs is not stated (the release recipes are not public: the CSV's
``n_gpus_source``), where its golden values are a byte-identical copy of
another case's (``copy_of``), where its machine has no system file, or where the model
needs what the table does not give (the vocabulary of a tokenizer not in
``TOKENIZER_VOCAB``).  Nothing here is fitted to the table.
"""
from __future__ import annotations

import dataclasses

from autopar.io.errors import SpecError
from autopar.io.frameworks import load_framework
from autopar.io.launch import megatron as megatron_launch
from autopar.io.specs import load_model
from autopar.studies import published_base as P

# Machines of the golden-value files -> system files.
RELEASE_SYSTEMS = {"dgx_h100": "h100_80g_nvl8", "dgx_gb200": "gb200_nvl72",
                   "dgx_a100": "a100_80g"}
# Vocabulary of a tokenizer model the arguments name (the file's name states
# it: Nemotron-2's 256k SentencePiece model, 256,000 pieces), before
# Megatron's padding to a multiple of --make-vocab-size-divisible-by (128) x
# TP (megatron/training/tokenizer/tokenizer.py ``_vocab_size_with_padding``).
TOKENIZER_VOCAB = {"nemotron_2_256k.model": 256000}


def padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron's padded vocabulary (``_vocab_size_with_padding``)."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def framework_for(args: str) -> str:
    """megatron-core-te-ce where the arguments fuse the cross-entropy with
    Transformer Engine's kernel (``--cross-entropy-loss-fusion
    --cross-entropy-fusion-impl te``), else megatron-core."""
    words = args.split()
    te_ce = "--cross-entropy-loss-fusion" in words and any(
        a == "--cross-entropy-fusion-impl" and b == "te" for a, b in zip(words, words[1:]))
    return "megatron-core-te-ce" if te_ce else "megatron-core"


def _arg(args: str, name: str) -> str | None:
    words = args.split()
    for a, b in zip(words, words[1:]):
        if a == name:
            return b
    return None


def release_row(row) -> "P.PublishedCase | P.Skip":
    label = f"{row.case} {row.environment} {row.machine}"
    args = str(row.megatron_args)
    n = P.int_or_none(row.n_gpus)
    text = (f"NUM_GPUS={n}\n" if n else "") + args
    try:
        imp = megatron_launch.read(text, f"megatron_release.csv: {row.case}")
    except SpecError as e:
        return P.Skip(f"the Megatron-LM importer refuses it: {e.message}", label)
    copy_of = row.get("copy_of")
    if isinstance(copy_of, str) and copy_of:
        return P.Skip(f"golden values byte-identical to {copy_of} (a copy, not a run of "
                      "these arguments)", label)
    if n is None:
        return P.Skip(f"GPU count {row.n_gpus_source}", label)
    sys_name = RELEASE_SYSTEMS.get(str(row.machine))
    if sys_name is None:
        return P.Skip(f"no system file for {row.machine}", label)
    fields = dict(imp.model)
    tokenizer = str(row.tokenizer) if isinstance(row.tokenizer, str) else ""
    if "vocab_size" not in fields:
        if tokenizer not in TOKENIZER_VOCAB:
            return P.Skip(f"vocabulary of the tokenizer {tokenizer or '(none)'} not stated", label)
        tp = imp.execution.get("tensor_par", 1)
        div = P.int_or_none(_arg(args, "--make-vocab-size-divisible-by")) or 128
        fields["vocab_size"] = padded_vocab(TOKENIZER_VOCAB[tokenizer], div, tp)
    fields.setdefault("feedforward", 4 * fields["hidden"])     # Megatron's default
    m = load_model({**fields, "name": row.case}, source=f"megatron_release.csv: {row.case}")
    fw = framework_for(args)
    sy = P.system(sys_name, fw)
    ex = dict(load_framework(P.FRAMEWORKS / f"{fw}.json").defaults)
    ex.update({k: v for k, v in imp.execution.items() if v is not None})
    gbs = P.int_or_none(row.gbs)
    if gbs is None:
        return P.Skip("global batch size not stated", label)
    ex["batch_size"] = gbs
    # Megatron-Core's column-parallel GEMMs keep the sequence-parallel shard
    # and gather it again in backward (autopar.io.launch.mcore NOT_SETTINGS)
    P.te_gathers_again(ex)
    ex.update(P.tiers(sy, ex.get("tensor_par", 1), ex.get("context_par", 1),
                      ex["data_par"], ex.get("pipeline_par", 1)))
    step = float(row.iteration_time_s)
    tok = gbs * m.seq_size / step / n
    return P.PublishedCase(m, sy, ex, {"tokens_per_s_per_gpu": tok,
                                       "peak_mem_gib": float(row.peak_mem_bytes) / P.GIB,
                                       # the last rank's: compared with the last stage
                                       "mem_stage": "last"}, label)


P.register(P.Table(
    "megatron_release", "megatron_release.csv", release_row, "Megatron-LM (release tests)",
    "Megatron-LM's release tests (GPT 15B, Mixtral, DeepSeek-V3 proxy, Nemotron 3 Super) on "
    "H100/GB200/A100: measured peak allocated memory of the last rank and steady step time"))
