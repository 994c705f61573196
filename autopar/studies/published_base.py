"""The registry of published measurement tables and what their row functions
share: ``Table`` (a CSV file, the rows it keeps, its row function),
``register``/``TABLES``, a row's ``PublishedCase`` or ``Skip``, the model,
system and Megatron-style execution builders, and ``cases`` (a table's rows
through its row function, each execution checked as a user's file).  The
tables themselves are registered by ``autopar.studies.published`` (dense),
``published_moe`` and ``published_foundry``; ``published`` predicts and
reports them.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pandas as pd

from autopar.io.errors import SpecError
from autopar.io.frameworks import load_framework, with_framework
from autopar.io.shipped import shipped_dir
from autopar.io.specs import (ModelSpec, SystemSpec, TimeOverhead, load_execution, load_model,
                              load_system)

GIB = 1024 ** 3
_ROOT = Path(__file__).resolve().parent.parent.parent
MODELS = shipped_dir("models")
SYSTEMS = shipped_dir("systems")
FRAMEWORKS = shipped_dir("frameworks")
# Megatron-Core's recompute choices (none, selective = attention core, full).
MCORE_RECOMPUTE = ("none", "attn_only", "full")
# autopar's own tables, written from the published figures
# (benchmarks/write_published_tables.py; autopar/data/published/README.md)
PACKAGED = Path(__file__).resolve().parent.parent / "data" / "published"


def published_dir() -> Path:
    """Where the published tables are: $AUTOPAR_PUBLISHED, else the package's
    own (``autopar/data/published``, in a clone and in an installed wheel)."""
    env = os.environ.get("AUTOPAR_PUBLISHED")
    if env:
        return Path(env)
    return PACKAGED


def shared_reference() -> Path:
    """The shared reference data (``../shared/reference`` from the project
    root, or from the working directory), which holds measurements autopar
    does not ship (the LLaMA sweeps); it may be absent."""
    for base in (_ROOT, Path.cwd()):
        p = base.parent / "shared" / "reference"
        if p.is_dir():
            return p
    return _ROOT.parent / "shared" / "reference"


@dataclass(frozen=True)
class PublishedCase:
    """One published row, ready to predict."""
    model: ModelSpec
    system: SystemSpec
    execution: dict
    # Measured figures: tokens_per_s_per_gpu (always), peak_mem_gib (optional)
    measured: dict
    label: str = ""


@dataclass(frozen=True)
class Skip:
    """A row autopar cannot predict yet, and why."""
    reason: str
    label: str = ""


@dataclass(frozen=True)
class Table:
    name: str
    csv: str                                   # file name in published_dir()
    row: Callable[[pd.Series], "PublishedCase | Skip"]
    framework: str
    description: str = ""
    keep: Callable[[pd.DataFrame], pd.Series] | None = None   # rows the table uses
    search_space: dict = field(default_factory=dict)           # overrides for ranking
    # Execution fields the source does not state, each with the values the
    # framework can take for it (None: every value autopar's rules allow):
    # ``predict(partial=True)`` searches them instead of the row's defaults.
    unstated: dict = field(default_factory=dict)


TABLES: dict[str, Table] = {}


def register(table: Table) -> Table:
    """Add a table to the registry (other modules add theirs, e.g. MoE rows)."""
    TABLES[table.name] = table
    return table


# ----------------------------------------------------------------------------
# Shared helpers for row functions

_model_cache: dict = {}
_system_cache: dict = {}


def model(name: str, **changes) -> ModelSpec:
    """A model of ``models/`` with some fields changed (seq_size, vocab, ...)."""
    if name not in _model_cache:
        _model_cache[name] = load_model(MODELS / f"{name}.json")
    m = _model_cache[name]
    return dataclasses.replace(m, **changes) if changes else m


def system(name: str, framework: str | None = None) -> SystemSpec:
    """The system file ``systems/<name>.json`` under the framework file
    ``frameworks/<framework>.json`` (``autopar.io.frameworks.with_framework``;
    None: the system file alone)."""
    key = (name, framework)
    if key not in _system_cache:
        fw = None if framework is None else load_framework(FRAMEWORKS / f"{framework}.json")
        _system_cache[key] = with_framework(load_system(SYSTEMS / f"{name}.json"), fw)
    return _system_cache[key]


# A published backward rate of a fused attention kernel counts the kernel's
# backward as this many forwards (2 for the input gradients + 0.5 for the
# recomputed scores: flash-attention's benchmarks/benchmark_flash_attention.py
# ``flops()``); the model counts 3 (``layers.flash_attention``: input
# gradients 2 x forward + the recomputed forward), so a published backward
# rate r runs the model's backward at r x 3 / 2.5.
KERNEL_BACKWARD_WORK = 2.5
MODEL_BACKWARD_WORK = 3.0


@functools.cache
def system_attention_at(name: str, framework: str | None, rate: float,
                        backward: float | None = None, tile: int = 0) -> SystemSpec:
    """``system(name, framework)`` with its fused attention kernel at a
    published rate: ``time_overhead.attention_speed`` = ``rate`` (a fraction
    of the GPU's dense bf16 peak) over the file's bf16 matrix plateau; where
    the forward and backward rates are published apart,
    ``attention_backward_speed`` = the ``backward`` rate on the model's count
    of the backward's work; ``attention_tile``: the kernel's causal tile."""
    sy = system(name, framework)
    plateau = max(e for _, e in sy.matrix["bfloat16"].gflops_efficiency)
    t = sy.time_overhead or TimeOverhead()
    bw = 0.0 if backward is None else round(
        backward * MODEL_BACKWARD_WORK / KERNEL_BACKWARD_WORK / plateau, 4)
    return dataclasses.replace(sy, time_overhead=dataclasses.replace(
        t, attention_speed=round(rate / plateau, 4), attention_backward_speed=bw,
        attention_tile=tile))


# NeMo 1.x (containers up to 24.07) trains bf16 models with Apex's distributed
# Adam: frameworks/nemo1-apex.json (2 bytes of fp32 master copy per parameter,
# the bf16 weight being the other half).  NeMo 2.3 (container 25.04): NeMo's own
# recipes on Megatron-Core 0.12 and Transformer Engine before 2.3
# (frameworks/nemo2-25-04.json).  From 25.09: Megatron-Bridge's recipes
# (frameworks/megatron-bridge.json).
NEMO1 = "nemo1-apex"
NEMO2_2504 = "nemo2-25-04"
# SimuMax's B200 runs (Megatron-LM @23e00ed0, TE 2.11) with TE's fused
# cross-entropy ("_cef": --cross-entropy-loss-fusion
# --cross-entropy-fusion-impl te, SimuMax docs/strategy.md):
# frameworks/megatron-core-te-ce.json.
SIMUMAX_FRAMEWORK = "megatron-core-te-ce"


def gpt_model(name: str, hidden: int, blocks: int, heads: int, seq: int, vocab: int,
              feedforward: int | None = None) -> ModelSpec:
    """A GPT model built from a table row's shape (Megatron's GPT: GeLU MLP of 4x)."""
    return load_model({"hidden": hidden, "feedforward": feedforward or 4 * hidden,
                       "seq_size": seq, "attn_heads": heads, "attn_size": hidden // heads,
                       "num_blocks": blocks, "vocab_size": vocab, "name": name},
                      source=f"published:{name}")


def tiers(system_: SystemSpec, tp: int, cp: int, dp: int, pp: int) -> dict:
    """Megatron's rank order (tensor fastest, then context, data, pipeline):
    each parallelism goes on the first network tier that holds it with the
    ones inside it."""
    tier = system_.tier_holding

    return {"tensor_par_net": tier(tp) if tp > 1 else 0,
            "context_par_net": tier(tp * cp) if cp > 1 else 0,
            "data_par_net": tier(tp * cp * dp) if dp > 1 else 0,
            "pipeline_par_net": tier(tp * cp * dp * pp) if pp > 1 else 0}


def megatron_execution(system_: SystemSpec, *, n: int, tp: int, pp: int, dp: int, cp: int = 1,
                       gbs: int, mbs: int, vp: int = 1, datatype: str = "bfloat16",
                       recompute: str = "none", sp: bool | None = None,
                       tp_overlap: bool = False, dist_opt: bool = True,
                       dp_overlap: bool = True, fp8: str = "none", flash: bool = True,
                       cp_comm: str = "p2p", fused: bool = True, fsdp: bool = False,
                       fp32_grads: bool | None = None) -> dict:
    """A Megatron-style execution from a table's layout; options as named.
    Gradients are accumulated and reduced in fp32 with bf16 (Megatron-LM
    forces it for bf16; NeMo's and torchtitan's bf16 mixed precision reduce in
    fp32) unless ``fp32_grads`` says otherwise."""
    fp32_grads = datatype == "bfloat16" if fp32_grads is None else fp32_grads
    sp = tp > 1 if sp is None else sp
    ex = {"num_procs": n, "tensor_par": tp, "pipeline_par": pp, "data_par": dp,
          "batch_size": gbs, "microbatch_size": mbs, "datatype": datatype,
          "fused_activation": fused, "attention_type": "multihead",
          "activation_recompute": recompute, "pipeline_interleaving": vp,
          "optimizer_sharding": (dist_opt or fsdp) and dp * cp > 1,
          "tensor_par_comm_type": "rs_ag" if sp and tp > 1 else "ar",
          "tensor_par_overlap": "ring" if tp_overlap and tp > 1 else "none",
          "seq_par_ag_redo": False, "data_par_overlap": dp_overlap and dp > 1,
          "weight_offload": False, "activations_offload": False,
          "optimizer_offload": False, "training": True,
          "attention_impl": "flash_v2" if flash else "unfused", "fused_norm": fused,
          "unsharded_grads": dist_opt and not fsdp and dp * cp > 1,
          "context_par": cp, "context_par_comm": cp_comm,
          "weight_sharding": fsdp and dp * cp > 1, "fp8_recipe": fp8,
          "fp32_grads": fp32_grads,
          # Megatron's overlap_param_gather goes with the overlapped grad reduce.
          "param_gather_overlap": dist_opt and not fsdp and dp_overlap and dp * cp > 1}
    ex.update(tiers(system_, tp, cp, dp, pp))
    return ex


def te_gathers_again(ex: dict) -> dict:
    """Sequence parallelism as Transformer Engine runs it: a column-parallel
    GEMM saves the shard of its input and all-gathers it again in backward
    for the weight gradient (NVIDIA/TransformerEngine v2.11
    transformer_engine/pytorch/module/layernorm_linear.py and linear.py:
    ``ctx.ln_out_needs_gather`` / the saved local ``inputmat``, gathered in
    ``backward``), i.e. ``seq_par_ag_redo`` where the tensor ranks split the
    sequence.  (``ex`` changed in place and returned.)"""
    ex["seq_par_ag_redo"] = ex["tensor_par"] > 1 and ex["tensor_par_comm_type"] == "rs_ag"
    return ex


def flops_per_token(m: ModelSpec) -> float:
    """Model FLOPs of one token, forward and backward, no recompute (the
    formula Megatron-Core r0.8 and NeMo reported TFLOP/s with; NeMo's until
    August 2025):
    12 L h^2 (1 + kv/heads) for the attention projections, 12 L s h for the
    attention core (the whole s x s square, causal or not: NVIDIA/NeMo
    nemo/utils/flops_formulas.py ``llama2`` / ``llama3`` at v2.3.0, the
    ``12 * enc_seq_len / hs`` term; the causal half arrived with 6251117f4c,
    2025-08-09), 12 L h f (x 1.5 gated) for the MLP and 6 h V for the
    output layer."""
    h, L, s, f = m.hidden, m.num_blocks, m.seq_size, m.feedforward
    q = m.attn_heads * m.attn_size
    kv = (m.kv_heads or m.attn_heads) * m.attn_size
    gated = 1.5 if m.block == "llama" else 1.0
    attn = 6 * L * (2 * h * q + 2 * h * kv)
    core = 12 * L * s * q
    mlp = 12 * L * h * f * gated
    return attn + core + mlp + 6 * h * m.vocab_size


def number_or_none(v) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(x) else x


def int_or_none(v) -> int | None:
    x = number_or_none(v)
    return None if x is None else int(x)


# ----------------------------------------------------------------------------
# Reading and predicting

def read_table(table: Table) -> pd.DataFrame:
    path = published_dir() / table.csv
    try:
        frame = pd.read_csv(path)
    except FileNotFoundError:
        raise SpecError(str(path), "(file)", "no such file (the published tables are "
                        "autopar/data/published, or the folder AUTOPAR_PUBLISHED names)") from None
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        raise SpecError(str(path), "(file)", f"not a readable CSV: {e}") from None
    if table.keep is not None:
        frame = frame[table.keep(frame)]
    return frame


def cases(table: Table) -> list[tuple[int, "PublishedCase | Skip"]]:
    """Every kept row of the table as (CSV row index, case or skip)."""
    frame = read_table(table)
    out = []
    for idx, row in frame.iterrows():
        try:
            c = table.row(row)
        except KeyError as e:
            raise SpecError(str(published_dir() / table.csv), str(e.args[0]),
                            "missing column") from None
        if isinstance(c, PublishedCase):
            # The execution goes through the same checks as a user's file.
            ex = load_execution(c.execution, system=c.system, model=c.model,
                                source=f"{table.csv} row {idx}")
            c = dataclasses.replace(c, execution=ex)
        out.append((int(idx), c))
    return out
