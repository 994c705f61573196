"""Write ``autopar/data/recipes/bridge_moe.csv``: one row per MoE performance
recipe function of Megatron-Bridge (``src/megatron/bridge/perf_recipes/
<family>/<gpu>/*.py`` at ``NVIDIA-NeMo/Megatron-Bridge@067f987``), for the
GPUs autopar has a system file for.

How it reads them: each recipe function is a plain Python function that
builds a config object field by field (its base recipe, the family's
``common.py`` helpers, ``perf_recipes/_common.py``).  Rather than parse that
code, this script runs it: the modules of ``perf_recipes/`` and ``recipes/``
(and ``training/mixed_precision.py`` and ``training/flex_dispatcher_backend.py``)
are read from a local bare mirror of the repository (``git show``) and
executed with every other import (torch, Megatron-Core, Bridge's config
classes, model providers, AutoBridge) replaced by a recording stand-in: a
config object that keeps the fields assigned to it and reads ``None`` for
the others.  A field the recipe (or the base recipe / helpers it calls)
never sets is left empty in the table.  Nothing of Bridge is copied; the
table is the output.

Usage (the CSV is committed; CI has no mirror):

    PYTHONPATH=$PWD python benchmarks/write_recipe_table_moe.py \
        [--mirror /work/.mirror/NVIDIA-NeMo+Megatron-Bridge/repo]

VR200 recipes are skipped: autopar has no VR200 system file.
"""
from __future__ import annotations

import argparse
import csv
import importlib.abc
import importlib.util
import re
import subprocess
import sys
import types
from pathlib import Path

COMMIT = "067f987df03b8355b03192d88d70f1709fedf51a"
SHORT = COMMIT[:7]
DEFAULT_MIRROR = "/work/.mirror/NVIDIA-NeMo+Megatron-Bridge/repo"
OUT = Path(__file__).resolve().parent.parent / "autopar" / "data" / "recipes" / "bridge_moe.csv"

# The shared schema (with the dense table): do not change the names.
COLUMNS = ["recipe", "family", "model", "gpu", "precision", "n_gpus", "tp", "pp", "cp", "vp",
           "ep", "etp", "mbs", "gbs", "seq", "sp", "recompute_granularity", "recompute_modules",
           "recompute_num_layers", "recompute_method", "offload", "cuda_graph", "dispatcher",
           "extra", "source"]
# Families and files of the MoE recipes.
FAMILIES = {"deepseek": ("deepseek_v3", "deepseek_v4"), "kimi": ("kimi_k2",),
            "qwen": ("qwen3_moe",), "gpt_oss": ("gpt_oss",), "glm_moe_dsa": ("glm5",)}
GPUS = ("h100", "b200", "b300", "gb200", "gb300")     # vr200: no system file
# Recipe-name prefix -> autopar model name (``models/<name>.json`` where it
# exists; the others are listed and skipped by autopar.studies.recipes_moe).
MODELS = (("deepseek_v3", "deepseek-v3"), ("deepseek_v4", "deepseek-v4"),
          ("kimi_k2", "kimi-k2"), ("qwen3_30b_a3b", "qwen3-30B-A3B"),
          ("qwen3_235b_a22b", "qwen3-235B-A22B"), ("qwen3_next_80b_a3b", "qwen3-next-80B-A3B"),
          ("gpt_oss_120b", "gpt-oss-120B"), ("gpt_oss_20b", "gpt-oss-20B"), ("glm5", "glm5"))
# Bridge modules run for real (the rest are stand-ins).
REAL = ("megatron.bridge.perf_recipes", "megatron.bridge.recipes",
        "megatron.bridge.training.mixed_precision",
        "megatron.bridge.training.flex_dispatcher_backend")
# Model fields recorded in ``extra`` where the recipe sets them.
EXTRA_MODEL = ("pipeline_model_parallel_layout", "num_layers_in_first_pipeline_stage",
               "num_layers_in_last_pipeline_stage", "account_for_embedding_in_pipeline_split",
               "account_for_loss_in_pipeline_split", "mtp_num_layers", "num_layers",
               "moe_shared_expert_overlap", "moe_permute_fusion", "moe_router_dtype",
               "moe_router_fusion", "moe_router_force_load_balancing",
               "moe_expert_rank_capacity_factor", "moe_paged_stash",
               "moe_paged_stash_buffer_size_factor_cuda", "moe_paged_stash_buffer_size_factor_cpu",
               "moe_pad_experts_for_cuda_graph_inference", "moe_hybridep_num_sms",
               "moe_router_padding_for_quantization", "moe_router_padding_for_fp8",
               "fp8_param_gather", "fp8_param", "fp8_output_proj",
               "use_transformer_engine_op_fuser", "moe_mlp_glu_interleave_size",
               "cpu_offloading", "cpu_offloading_num_layers", "cpu_offloading_activations",
               "fine_grained_offloading_max_inflight_offloads", "vocab_size",
               "make_vocab_size_divisible_by", "kv_channels", "bias_activation_fusion",
               "apply_rope_fusion", "gradient_accumulation_fusion", "init_model_with_meta_device",
               "overlap_dispatch_backward_with_experts_wgrad", "high_priority_a2a_comm_stream",
               "qk_clip", "attention_backend", "cross_entropy_fusion_impl", "cp_comm_type")
EXTRA_PRECISION = ("fp8_recipe", "fp4_recipe", "fp8_param_gather", "fp8_param", "fp4_param",
                   "fp4_param_gather", "first_last_layers_bf16", "num_layers_at_start_in_bf16",
                   "num_layers_at_end_in_bf16", "fp8_dot_product_attention",
                   "reuse_grad_buf_for_mxfp8_param_ag", "grad_reduce_in_fp32")
EXTRA_DDP = ("use_distributed_optimizer", "use_megatron_fsdp", "data_parallel_sharding_strategy",
             "overlap_grad_reduce", "overlap_param_gather", "grad_reduce_in_fp32",
             "outer_dp_sharding_strategy", "num_distributed_optimizer_instances",
             "reuse_grad_buf_for_mxfp8_param_ag", "fsdp_double_buffer",
             "keep_fp8_transpose_cache")
EXTRA_OPT = ("optimizer", "use_precision_aware_optimizer", "main_grads_dtype", "main_params_dtype",
             "exp_avg_dtype", "exp_avg_sq_dtype", "overlap_param_gather_with_optimizer_step")
EXTRA_OVERLAP = ("tp_comm_overlap", "overlap_moe_expert_parallel_comm", "delay_wgrad_compute")


# ----------------------------------------------------------------------------
# Stand-ins

class Rec:
    """A config object: keeps what is assigned, reads None for the rest."""

    def __init__(self, *args, **kwargs):
        object.__setattr__(self, "_f", dict(kwargs))

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._f.get(name)

    def __setattr__(self, name, value):
        self._f[name] = value

    def __repr__(self):
        return f"Rec({self._f})"


class ModelRec(Rec):
    """A model provider: an MoE model (num_moe_experts set, so that
    ``apply_flex_dispatcher_backend`` goes on) whose other fields the recipe
    sets."""

    def __getattr__(self, name):
        if name == "num_moe_experts" and name not in self._f:
            return 1
        return super().__getattr__(name)


class ContainerRec(Rec):
    """The ConfigContainer: a sub-config it was not built with (rng, dist,
    rerun_state_machine, ...) is a fresh config on first read."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name not in self._f:
            self._f[name] = Rec()
        return self._f[name]


class Stub:
    """Any imported name that is not run for real: callable (-> a Rec of its
    keyword arguments), subscriptable, with attributes that are stubs."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Stub(f"{self._name}.{name}")

    def __call__(self, *args, **kwargs):
        if self._name.endswith("from_hf_pretrained"):
            return Stub(f"provider:{args[0] if args else ''}")
        if self._name.endswith("ConfigContainer"):
            return ContainerRec(**kwargs)
        if self._name.endswith("to_megatron_provider") or "ModelProvider" in self._name:
            return ModelRec(**kwargs)
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]                     # a decorator
        return Rec(*args, **kwargs)

    def __getitem__(self, item):
        return self

    def __or__(self, other):                   # ``A | B`` annotations
        return self

    __ror__ = __or__

    def __mro_entries__(self, bases):
        return (Rec,)

    def __repr__(self):
        return f"Stub({self._name})"


def _fake_torch():
    t = types.ModuleType("torch")
    for d in ("float32", "bfloat16", "float16", "float8_e4m3fn", "int8", "uint8"):
        setattr(t, d, f"torch.{d}")
    cuda = types.SimpleNamespace(is_available=lambda: False, device_count=lambda: 0)
    t.cuda = cuda
    t.nn = Stub("torch.nn")
    t.distributed = Stub("torch.distributed")
    t.Tensor = Rec
    return t


class StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Stub(f"{self.__name__}.{name}")


class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``megatron.*`` and the third-party imports of Bridge's modules: the
    REAL ones from the mirror, the rest stand-ins."""

    def __init__(self, mirror: str):
        self.mirror = mirror
        self.files = set(subprocess.run(
            ["git", "-C", mirror, "ls-tree", "-r", "--name-only", COMMIT, "src/megatron"],
            check=True, capture_output=True, text=True).stdout.split())

    def find_spec(self, fullname, path, target=None):
        top = fullname.split(".")[0]
        if top in ("megatron", "transformer_engine", "omegaconf", "hydra", "transformers",
                   "huggingface_hub", "safetensors", "einops", "apex", "nvidia_resiliency_ext",
                   "modelopt", "wandb", "yaml", "packaging", "tqdm", "datasets",
                   "nvidia_modelopt", "accelerate"):
            return importlib.util.spec_from_loader(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        name = spec.name
        rel = "src/" + name.replace(".", "/")
        real = name.startswith(REAL) and (f"{rel}.py" in self.files)
        mod = types.ModuleType(name) if real else StubModule(name)
        mod.__path__ = []                       # every name may be a package
        mod._real_source = rel + ".py" if real else None
        return mod

    def exec_module(self, mod):
        src = getattr(mod, "_real_source", None)
        if src is None:
            return
        code = subprocess.run(["git", "-C", self.mirror, "show", f"{COMMIT}:{src}"],
                              check=True, capture_output=True, text=True).stdout
        mod.__file__ = src
        exec(compile(code, src, "exec"), mod.__dict__)
        if mod.__name__ == "megatron.bridge.training.mixed_precision":
            mod.MixedPrecisionConfig = Rec     # the dataclass -> a recording config


# ----------------------------------------------------------------------------
# One config -> one row

def _layout_string(layout) -> str:
    """A pipeline_model_parallel_layout as Megatron's string form
    (E: embedding, t: decoder, m: MTP, L: loss, | between virtual stages)."""
    if isinstance(layout, str):
        return layout
    letters = {"embedding": "E", "decoder": "t", "mtp": "m", "loss": "L"}
    return "|".join("".join(letters.get(x, x) for x in stage) for stage in layout)


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return ";".join(_fmt(x) for x in v)
    if isinstance(v, str) and v.startswith("torch."):
        return v[len("torch."):]
    return str(v)


def _precision(mp) -> str:
    if isinstance(mp, str):
        return {"bf16_mixed": "bf16"}.get(mp, mp)
    fp4 = mp.fp4_recipe if mp.fp4 else None
    if fp4:
        return fp4
    r = mp.fp8_recipe if mp.fp8 else None
    return {None: "bf16", "tensorwise": "fp8_cs", "delayed": "fp8_ds", "mxfp8": "fp8_mx",
            "blockwise": "fp8_sc"}.get(r, str(r))


def row_of(cfg, *, recipe: str, family: str, gpu: str, path: str) -> dict:
    m, tr, ddp = cfg.model, cfg.train, cfg.ddp
    mp, opt, co = cfg.mixed_precision, cfg.optimizer, cfg.comm_overlap
    n = re.search(r"_(\d+)gpu_", recipe)
    model = next((name for prefix, name in MODELS if recipe.startswith(prefix)), "")
    gran = m.recompute_granularity
    modules = m.recompute_modules
    offload = ""
    if m.fine_grained_activation_offloading:
        offload = _fmt(m.offload_modules or [])
        offload = f"fine_grained:{offload}"
    graph = ""
    impl = m.cuda_graph_impl
    scope = m.cuda_graph_scope
    if impl and impl != "none":
        graph = impl + (f":{_fmt(scope)}" if scope else "")
    disp = m.moe_token_dispatcher_type or ""
    if disp == "flex" and m.moe_flex_dispatcher_backend:
        disp = f"flex:{m.moe_flex_dispatcher_backend}"
    extra = []

    def put(prefix, obj, names):
        if obj is None or isinstance(obj, str):
            return
        for k in names:
            v = getattr(obj, k)
            if v is None or v == []:
                continue
            if k == "pipeline_model_parallel_layout":
                v = _layout_string(v)
            extra.append(f"{prefix}{k}={_fmt(v).replace(';', ',')}")

    put("", m, EXTRA_MODEL)
    put("mp.", mp, EXTRA_PRECISION)
    put("ddp.", ddp, EXTRA_DDP)
    put("opt.", opt, EXTRA_OPT)
    put("overlap.", co, EXTRA_OVERLAP)
    return {
        "recipe": recipe, "family": family, "model": model, "gpu": gpu,
        "precision": _precision(mp), "n_gpus": n.group(1) if n else "",
        "tp": _fmt(m.tensor_model_parallel_size), "pp": _fmt(m.pipeline_model_parallel_size),
        "cp": _fmt(m.context_parallel_size), "vp": _fmt(m.virtual_pipeline_model_parallel_size),
        "ep": _fmt(m.expert_model_parallel_size), "etp": _fmt(m.expert_tensor_parallel_size),
        "mbs": _fmt(tr.micro_batch_size), "gbs": _fmt(tr.global_batch_size),
        "seq": _fmt(m.seq_length or cfg.dataset.seq_length), "sp": _fmt(m.sequence_parallel),
        # (an empty list, set by the recipe: "none"; not set: empty, which
        # Megatron-Core fills with ["core_attn"] under "selective")
        "recompute_granularity": _fmt(gran),
        "recompute_modules": "none" if modules == [] else _fmt(modules),
        "recompute_num_layers": _fmt(m.recompute_num_layers),
        "recompute_method": _fmt(m.recompute_method), "offload": offload,
        "cuda_graph": graph, "dispatcher": disp, "extra": ";".join(extra),
        "source": f"NVIDIA-NeMo/Megatron-Bridge@{SHORT} {path} {recipe}",
    }


def _where(e: BaseException) -> str:
    tb = e.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"


def recipe_rows(mirror: str) -> tuple[list[dict], list[str]]:
    finder = Finder(mirror)
    saved = {k: v for k, v in sys.modules.items()
             if k == "torch" or k.startswith(("torch.", "megatron"))}
    for k in saved:
        del sys.modules[k]
    sys.modules["torch"] = _fake_torch()
    sys.meta_path.insert(0, finder)
    rows, errors = [], []
    try:
        for family, files in FAMILIES.items():
            for gpu in GPUS:
                for stem in files:
                    path = f"src/megatron/bridge/perf_recipes/{family}/{gpu}/{stem}.py"
                    if path not in finder.files:
                        continue
                    name = f"megatron.bridge.perf_recipes.{family}.{gpu}.{stem}"
                    try:
                        mod = __import__(name, fromlist=["_"])
                    except Exception as e:     # noqa: BLE001 (report and go on)
                        errors.append(f"{path}: import failed: {e!r} at {_where(e)}")
                        continue
                    for fname, fn in sorted(vars(mod).items()):
                        if not (fname.endswith("_config") and callable(fn)
                                and getattr(fn, "__module__", "") == name):
                            continue
                        try:
                            cfg = fn()
                        except Exception as e:   # noqa: BLE001
                            errors.append(f"{path} {fname}: {e!r} at {_where(e)}")
                            continue
                        rows.append(row_of(cfg, recipe=fname, family=family, gpu=gpu, path=path))
    finally:
        sys.meta_path.remove(finder)
        for k in [k for k in sys.modules if k == "torch" or k.startswith(("torch.", "megatron"))]:
            del sys.modules[k]
        sys.modules.update(saved)
    return rows, errors


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mirror", default=DEFAULT_MIRROR)
    ap.add_argument("--output", default=str(OUT))
    a = ap.parse_args(argv)
    rows, errors = recipe_rows(a.mirror)
    for e in errors:
        print("not read:", e, file=sys.stderr)
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    tmp.replace(out)
    print(f"{len(rows)} recipes -> {out} ({len(errors)} not read)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
