"""``--format bridge``: Megatron-Bridge (NeMo 2) recipe overrides, one
``key=value`` per line in the Hydra override syntax that Megatron-Bridge's
``scripts/training/run_recipe.py`` takes after the recipe
(NVIDIA-NeMo/Megatron-Bridge@067f987, ``ConfigContainer`` of
src/megatron/bridge/training/config.py: ``model.*``, ``train.*``, ``ddp.*``,
``optimizer.*``, ``dataset.*``, ``mixed_precision``).

The settings are Megatron-Core's (``autopar.io.launch.mcore``) under the
container's section names.  Precision is a named recipe of
src/megatron/bridge/training/mixed_precision.py (``bf16_mixed``,
``bf16_with_fp8_current_scaling_mixed``, ...), which also sets
``grad_reduce_in_fp32`` (true for bf16, false for fp16): a layout whose
``fp32_grads`` differs, or a float32 one, is refused.  Megatron-Bridge's GPT
providers build Transformer Engine's layer spec, so ``fused_norm`` false (the
local spec) is refused.  Every expressible field is written, since the recipe
under the overrides has its own defaults; reading leaves a key that is not
there out (the recipe's default, ``frameworks/megatron-bridge.json``).  The
number of GPUs is the comment ``# NUM_GPUS=N`` (the launcher's, not an
override).
"""
from __future__ import annotations

import re

from autopar.io.errors import SpecError
from autopar.io.launch import mcore
from autopar.io.launch.base import Imported, LaunchFormat

NAME = "bridge"
# (datatype, fp8_recipe) -> Megatron-Bridge's mixed-precision recipe
PRECISION = {
    ("bfloat16", "none"): "bf16_mixed", ("float16", "none"): "fp16_mixed",
    ("bfloat16", "tensorwise"): "bf16_with_fp8_current_scaling_mixed",
    ("float16", "tensorwise"): "fp16_with_fp8_current_scaling_mixed",
    ("bfloat16", "rowwise"): "bf16_with_fp8_subchannel_scaling_mixed",
    ("float16", "rowwise"): "fp16_with_fp8_subchannel_scaling_mixed",
    ("bfloat16", "mxfp8"): "bf16_with_mxfp8_mixed", ("float16", "mxfp8"): "fp16_with_mxfp8_mixed",
}
# recipes read back (delayed scaling is per-tensor: tensorwise in autopar)
READ_PRECISION = {v: k for k, v in PRECISION.items()}
READ_PRECISION.update({"bf16_with_fp8_delayed_scaling_mixed": ("bfloat16", "tensorwise"),
                       "fp16_with_fp8_delayed_scaling_mixed": ("float16", "tensorwise")})
for _name in list(READ_PRECISION):
    READ_PRECISION[_name.replace("_", "-")] = READ_PRECISION[_name]
# settings not written as one override of their own
SPECIAL = ("mixed_precision.dtype", "model.fp8", "model.fp8_recipe", "ddp.grad_reduce_in_fp32",
           "model.transformer_impl", "model.masked_softmax_fusion", "_num_procs")


# LoRA (NVIDIA-NeMo/Megatron-Bridge@067f987 src/megatron/bridge/peft/lora.py
# ``LoRA``: ``dim``, ``target_modules`` of Megatron-Core's linear layers): the
# adapters of autopar's targets.  LoRA on the fused ``linear_qkv`` is one
# adapter for q, k and v (one A of hidden x rank where autopar counts three;
# likewise gate and up in a SwiGLU block's linear_fc1: docs/validation.md);
# q and v alone (``qv``) are inside that fused layer: not expressible.
LORA_TARGETS = {"all": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
                "attention": ["linear_qkv", "linear_proj"],
                # one adapter on the fused projection (NeMo's default target)
                "qkv": ["linear_qkv"]}
READ_TARGETS = {tuple(sorted(v)): k for k, v in LORA_TARGETS.items()}

# what Megatron-Bridge's overrides cannot say beyond Megatron-Core's
UNEXPRESSED = {**mcore.UNEXPRESSED,
               "adapter": {"qlora": "Megatron-Bridge's PEFT (src/megatron/bridge/peft) has "
                                    "LoRA and DoRA adapters but no 4-bit (NF4) base weights"},
               "adapter_targets": {"qv": "Megatron-Bridge's LoRA targets Megatron-Core's "
                                         "fused linear_qkv: q and v alone are not a module"},
               "fp8_recipe": {**mcore.UNEXPRESSED["fp8_recipe"],
                              "nvfp4": "autopar does not write Megatron-Bridge's fp4 "
                                       "mixed-precision recipe yet"},
               "fused_norm": {False: "Megatron-Bridge's GPT providers build Transformer "
                                     "Engine's layer spec (norm fused into the linear layer)"},
               "attention_impl": {v: "Megatron-Bridge's Transformer Engine layer spec is "
                                     "written with the flash attention backend only"
                                  for v in ("unfused", "fused_softmax", "flash_v1")}}


def refuse_model(model):
    return mcore.refuse_model(model, NAME, chunk_setting=True)


def refuse_space(model, space):
    return mcore.refuse_space(space, NAME, UNEXPRESSED)


def refuse_datatype(datatype, space=None):
    if datatype not in ("bfloat16", "float16"):
        return (f"{NAME}: datatype={datatype} cannot be written: Megatron-Bridge's precision "
                f"recipes are bf16 or fp16 (mixed_precision.py)")
    fp32 = datatype == "bfloat16"       # what the recipes set (grad_reduce_in_fp32)
    if space is not None and mcore.space_allows(space, "fp32_grads", not fp32):
        return (mcore.refusal("fp32_grads", str(not fp32).lower(), NAME,
                              f"Megatron-Bridge's {datatype} precision recipes set "
                              f"grad_reduce_in_fp32={str(fp32).lower()}")
                + f" (space {space.name} can choose it)")
    return None


def refuse_layout(model, execution):
    why = mcore.refuse_layout(model, execution, NAME, UNEXPRESSED, te_only=True)
    if why:
        return why
    dt = execution.get("datatype")
    why = refuse_datatype(dt)
    if why:
        return why
    fp32 = bool(execution.get("fp32_grads", False))
    if fp32 != (dt == "bfloat16"):
        return mcore.refusal("fp32_grads", str(fp32).lower(), NAME,
                             f"Megatron-Bridge's {dt} precision recipes set "
                             f"grad_reduce_in_fp32={str(dt == 'bfloat16').lower()}")
    return None


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, list):
        return "[" + ",".join(str(x) for x in v) + "]"
    text = str(v)
    if re.search(r"[|()\[\]*+,\s]", text):
        return "'" + text + "'"
    return text


def write(model, execution) -> str:
    why = refuse_layout(model, execution)
    if why:
        raise SpecError("command line", "--format", why)
    s = mcore.settings(model, execution)
    lines = [f"# Megatron-Bridge recipe overrides written by autopar: model "
             f"{model.name or '(unnamed)'}, data-parallel size {execution['data_par']}",
             "# (the launcher's GPUs / (TP x PP x CP)); network tiers are where the launcher "
             "places the ranks.",
             f"# NUM_GPUS={execution['num_procs']}"]
    for key, v in s.items():
        if key in SPECIAL:
            continue
        lines.append(f"{key}={_value(v)}")
        if key == "model.seq_length":
            lines.append(f"dataset.seq_length={v}")
        if key == "model.mamba_num_groups":
            # HybridModelProvider.mamba_chunk_size (src/megatron/bridge/models/
            # hybrid/hybrid_provider.py): the SSD chunk of the model file
            lines.append(f"model.mamba_chunk_size={model.mamba.chunk}")
        if key == "ddp.use_distributed_optimizer":
            lines.append(f"optimizer.use_distributed_optimizer={_value(v)}")
    lines.append("mixed_precision="
                 + PRECISION[(execution["datatype"], execution.get("fp8_recipe", "none"))])
    if s.get("model.fine_grained_activation_offloading"):
        # (Megatron-LM's validate_args asserts it with TE >= 2.10; Bridge's
        # recipes that offload set it in their env_vars)
        lines[3:3] = ["# environment: NVTE_CPU_OFFLOAD_V1=1 (fine-grained activation "
                      "offloading on Transformer Engine's v1 offload path)"]
    if execution.get("adapter", "none") == "lora":
        # ConfigContainer.peft: the recipe loaded in its lora mode (run_recipe.py's
        # mode option, a launcher flag and not an override) builds LoRA()
        lines[3:3] = ["# PEFT: launch the recipe in run_recipe.py's lora mode (mode lora)"]
        lines.append(f"peft.dim={int(execution.get('adapter_rank', 16))}")
        lines.append("peft.target_modules="
                     + _value(LORA_TARGETS[execution.get("adapter_targets", "all")]))
    return "\n".join(lines) + "\n"


def read(text: str, source: str = "bridge overrides") -> Imported:
    values: dict = {}
    lines = {}
    gpus = None
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        m = re.fullmatch(r"#\s*NUM_GPUS\s*=\s*(\d+)", line)
        if m:
            gpus = int(m.group(1))
            continue
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        for item in _items(line):
            if "=" not in item:
                continue          # a flag of the launcher, not an override
            key, val = item.split("=", 1)
            key = key.lstrip("+~")
            val = val.strip()
            if len(val) >= 2 and val[0] == val[-1] and val[0] in "'\"":
                val = val[1:-1]
            if "$" in val:
                raise SpecError(source, key, f"{val!r} is an interpolation autopar cannot "
                                "resolve; write the value")
            values[key] = None if val.lower() in ("null", "none") else val
            lines[key] = no
    if "dataset.seq_length" in values and "model.seq_length" not in values:
        values["model.seq_length"] = values["dataset.seq_length"]
    if gpus is not None:
        values["_num_procs"] = gpus
    r = mcore.Reader(values, source, lambda k: "NUM_GPUS" if k == "_num_procs" else k)
    if "mixed_precision" in values:
        name = values.pop("mixed_precision")
        if name not in READ_PRECISION:
            r.fail("mixed_precision", f"autopar reads the recipes "
                   f"{', '.join(sorted(set(k for k in READ_PRECISION if '-' not in k)))}; "
                   f"got {name!r}")
        dt, fp8 = READ_PRECISION[name]
        values["mixed_precision.dtype"] = dt
        values["ddp.grad_reduce_in_fp32"] = dt == "bfloat16"
        values["model.fp8"] = None if fp8 == "none" else "hybrid"
        values["model.fp8_recipe"] = {"none": None, "tensorwise": "tensorwise",
                                      "rowwise": "blockwise", "mxfp8": "mxfp8"}[fp8]
    values["model.transformer_impl"] = "transformer_engine"
    peft = {k: values.pop(k) for k in list(values) if k.startswith("peft.")}
    ex, model = mcore.layout(r, framework_defaults=False)
    if peft:
        ex.update(_read_peft(peft, source))
    notes = () if gpus is not None else (
        "the number of GPUs is not stated (# NUM_GPUS=N): num_procs and data_par are left out",)
    return Imported(execution=ex, model=model, framework="megatron-bridge", notes=notes)


def _read_peft(peft: dict, source: str) -> dict:
    """``peft.*`` overrides -> autopar's LoRA fields (LoRA's own defaults,
    lora.py: dim 32, every linear layer, where a key is absent)."""
    r = mcore.Reader(peft, source, lambda k: k)
    ex = {"adapter": "lora", "adapter_rank": r.int("peft.dim", 32)}
    mods = r.list("peft.target_modules")
    if mods is None:
        ex["adapter_targets"] = "all"
    else:
        t = READ_TARGETS.get(tuple(sorted(mods)))
        if t is None:
            r.fail("peft.target_modules", "autopar models LoRA on "
                   + " or ".join(",".join(v) for v in LORA_TARGETS.values())
                   + f", got {','.join(mods)}")
        ex["adapter_targets"] = t
    return ex


def _items(line: str) -> list[str]:
    """The ``key=value`` items of a line, quotes kept together."""
    out, cur, quote = [], "", None
    for ch in line:
        if quote:
            cur += ch
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
            cur += ch
        elif ch.isspace() or ch == "\\":
            if cur:
                out.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        out.append(cur)
    return out


FORMAT = LaunchFormat(
    name=NAME, suffix=".overrides", framework="megatron-bridge",
    refuse_model=refuse_model, refuse_space=refuse_space, refuse_layout=refuse_layout,
    write=write, read=read, refuse_datatype=refuse_datatype, cut_space=mcore.cut_space,
    writes=lambda f, v: mcore.writes(f, v, UNEXPRESSED),
    describe="Megatron-Bridge / NeMo 2 recipe overrides: key=value lines for "
             "scripts/training/run_recipe.py")
