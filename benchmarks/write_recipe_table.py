"""Write ``autopar/data/recipes/bridge_dense.csv``: one row per performance
recipe of Megatron-Bridge (``src/megatron/bridge/perf_recipes/<family>/<gpu>/
*.py``) for the dense and hybrid families (Llama 3 8B / 70B, Llama 3.1 405B,
Nemotron-H 56B; the Nemotron 3 rows of the ``nemotronh`` files are MoE and
are written too, for ``autopar.studies.recipes_moe``).

    python benchmarks/write_recipe_table.py [--repo GIT_DIR] [--commit SHA]
                                            [--output CSV]

How the table was produced: the recipe files are read from a bare clone of
NVIDIA-NeMo/Megatron-Bridge (``git show COMMIT:PATH``; default the mirror at
/work/.mirror/NVIDIA-NeMo+Megatron-Bridge/repo at 067f987) and never
imported (they need torch and Megatron-Core).  A small interpreter walks each
recipe function's syntax tree (``ast``): assignments ``cfg.a.b = value``,
calls of other functions of the repository (the base recipe it starts from,
e.g. ``recipes/llama/h100/llama3.py llama3_70b_pretrain_32gpu_h100_bf16_config``,
``_perf_precision``, ``_benchmark_common``, ``_llama_benchmark_common``,
``_enable_overlap_param_gather_with_optimizer_step``,
``_with_global_batch_size``), each followed through its imports and run on
the same configuration object, ``if`` statements whose test can be decided
from the configuration (else skipped and noted in ``extra`` as
``unresolved_if``).  What a call outside the repository returns (a
``CommOverlapConfig(...)``, ``bf16_mixed()``, a model provider, a Hugging
Face bridge) is an object with the call's name and keyword arguments.  The
GPU count is the recipe name's ``<N>gpu``.  GPUs without a system file in
autopar (vr200, r100) are left out.

Columns (shared with the MoE helper's table; empty: the recipe does not set
it): ``recipe,family,model,gpu,precision,n_gpus,tp,pp,cp,vp,ep,etp,mbs,gbs,
seq,sp,recompute_granularity,recompute_modules,recompute_num_layers,
recompute_method,offload,cuda_graph,dispatcher,extra,source``;
``recompute_modules`` and ``extra`` are ``;``-separated (``extra``: ``k=v``).

The ``model`` column: a Hugging Face id or provider class of ``MODELS``, a
dense hybrid provider by its (layers, hidden) (``SHAPES``), Nemotron 3 Nano's
MoE hybrid provider by its layer pattern, hidden and experts (``MOE_SHAPES``);
a provider that names its own checkpoint (``hf_model_id``: Nemotron 3.5
Lightning) by that id; else the call's name.
"""
from __future__ import annotations

import argparse
import ast
import csv
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPO = Path("/work/.mirror/NVIDIA-NeMo+Megatron-Bridge/repo")
COMMIT = "067f987df03b8355b03192d88d70f1709fedf51a"
PERF = "src/megatron/bridge/perf_recipes"
FAMILIES = ("llama", "nemotronh")
# Megatron-Bridge GPU folder -> autopar system file (vr200 / r100: none).
GPUS = {"h100": "h100_80g_nvl8", "b200": "b200_nvl8", "b300": "b300_nvl8",
        "gb200": "gb200_nvl72", "gb300": "gb300_nvl72"}
COLUMNS = ("recipe,family,model,gpu,precision,n_gpus,tp,pp,cp,vp,ep,etp,mbs,gbs,seq,sp,"
           "recompute_granularity,recompute_modules,recompute_num_layers,recompute_method,"
           "offload,cuda_graph,dispatcher,extra,source").split(",")
# Model source (Hugging Face id or provider class) -> autopar models/ name.
MODELS = {"meta-llama/Meta-Llama-3-8B": "llama3-8B", "meta-llama/Meta-Llama-3-70B": "llama3-70B",
          "meta-llama/Meta-Llama-3.1-405B": "llama3-405B",
          "meta-llama/Llama-3.1-405B": "llama3-405B",
          "NemotronHModelProvider56B": "nemotron-h-56B",
          "NemotronHModelProvider47B": "nemotron-h-47B",
          "NemotronHModelProvider8B": "nemotron-h-8B",
          # the Nano provider with its MTP module (nemotron_3_5_lightning_pretrain_config;
          # models/nemotron3.5-lightning-30B-A3B.json)
          "nvidia/NVIDIA-Nemotron-3.5-Lightning-30B-A3B-BF16": "nemotron3.5-lightning-30B-A3B",
          # the checkpoints the Super / Ultra recipes read with AutoBridge (their shapes:
          # Megatron-LM's examples/post_training/modelopt/conf/nvidia/*.sh;
          # models/nemotron3-super-120B-A12B.json, models/nemotron3-ultra-550B-A55B.json)
          "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16": "nemotron3-super-120B-A12B",
          "nvidia/NVIDIA-Nemotron-3-Ultra-550B-A55B-BF16": "nemotron3-ultra-550B-A55B"}
PRECISIONS = {"bf16_mixed": "bf16", "bf16_with_fp8_current_scaling_mixed": "fp8_cs",
              "bf16_with_fp8_delayed_scaling_mixed": "fp8_ds", "bf16_with_mxfp8_mixed": "fp8_mx",
              "bf16_with_nvfp4_mixed": "nvfp4",
              "nemotron_3_super_bf16_with_nvfp4_mixed": "nvfp4"}
# Settings beyond the named columns that change memory or time, kept in ``extra``.
EXTRA = ("model.pipeline_model_parallel_layout", "model.account_for_embedding_in_pipeline_split",
         "model.account_for_loss_in_pipeline_split", "model.should_pad_vocab",
         "tokenizer.vocab_size", "model.cross_entropy_fusion_impl",
         "model.disable_parameter_transpose_cache", "model.gradient_accumulation_fusion",
         "model.moe_router_force_load_balancing", "model.moe_expert_capacity_factor",
         "model.moe_pad_expert_input_to_capacity",
         "mixed_precision.fp8_param_gather", "mixed_precision.fp4_param_gather",
         "mixed_precision.reuse_grad_buf_for_mxfp8_param_ag",
         "mixed_precision.first_last_layers_bf16", "mixed_precision.grad_reduce_in_fp32",
         "ddp.grad_reduce_in_fp32", "ddp.use_distributed_optimizer", "ddp.use_megatron_fsdp",
         "ddp.data_parallel_sharding_strategy", "ddp.num_distributed_optimizer_instances",
         "ddp.keep_fp8_transpose_cache", "ddp.fsdp_double_buffer", "ddp.overlap_grad_reduce", "ddp.overlap_param_gather",
         "ddp.fp8_param_gather", "ddp.reuse_grad_buf_for_mxfp8_param_ag",
         "optimizer.use_precision_aware_optimizer", "optimizer.main_params_dtype",
         "optimizer.main_grads_dtype", "optimizer.exp_avg_dtype", "optimizer.exp_avg_sq_dtype",
         "optimizer.overlap_param_gather_with_optimizer_step",
         "comm_overlap", "comm_overlap.tp_comm_overlap", "comm_overlap.tp_comm_overlap_cfg",
         "comm_overlap.tp_comm_overlap_cfg.proj_fprop", "comm_overlap.tp_comm_overlap_cfg.fc2_fprop",
         "comm_overlap.defer_embedding_wgrad_compute", "comm_overlap.wgrad_deferral_limit",
         "comm_overlap.overlap_param_gather_with_optimizer_step", "peft", "peft.target_modules",
         "peft.dim",
         "dataset.dataset_kwargs")


class NS:
    """A configuration object: a name (the call that made it) and attributes."""

    def __init__(self, name: str = "", **attrs):
        self.name = name
        self.attrs = dict(attrs)
        self.made_by: list[str] = []     # repository functions that returned it, innermost first


class Opaque(str):
    """A value the interpreter cannot compute (its source text)."""


class Source:
    """Modules of the repository at one commit, parsed once."""

    def __init__(self, repo: Path, commit: str):
        self.repo, self.commit = repo, commit
        self.trees: dict = {}

    def tree(self, path: str):
        if path not in self.trees:
            try:
                text = subprocess.run(["git", "-C", str(self.repo), "show", f"{self.commit}:{path}"],
                                      check=True, capture_output=True, text=True).stdout
            except subprocess.CalledProcessError:
                self.trees[path] = None
            else:
                self.trees[path] = ast.parse(text)
        return self.trees[path]

    def module_path(self, module: str) -> str | None:
        base = "src/" + module.replace(".", "/")
        for p in (base + ".py", base + "/__init__.py"):
            if self.tree(p) is not None:
                return p
        return None

    def resolve(self, path: str, name: str, depth: int = 0):
        """(path, FunctionDef) or (path, constant node) of ``name`` as seen
        from module ``path``, following ``from X import a as b``."""
        tree = self.tree(path)
        if tree is None or depth > 8:
            return None
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return path, node
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name
                                                    for t in node.targets):
                return path, node.value
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                    and node.target.id == name and node.value is not None:
                return path, node.value
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megatron.bridge"):
                for a in node.names:
                    if (a.asname or a.name) == name:
                        mp = self.module_path(node.module)
                        return self.resolve(mp, a.name, depth + 1) if mp else None
        return None


class Interpreter:
    def __init__(self, source: Source):
        self.src = source
        self.notes: list[str] = []

    def call_function(self, path: str, fn: ast.FunctionDef, args: list, kwargs: dict):
        env: dict = {}
        params = [a.arg for a in fn.args.args]
        defaults = fn.args.defaults
        for p, d in zip(params[len(params) - len(defaults):], defaults):
            env[p] = self.expr(d, {}, path)
        for p, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults):
            if d is not None:
                env[p.arg] = self.expr(d, {}, path)
        for p, v in zip(params, args):
            env[p] = v
        names = set(params) | {a.arg for a in fn.args.kwonlyargs}
        env.update({k: v for k, v in kwargs.items() if k in names})
        try:
            self.block(fn.body, env, path)
        except _Return as r:
            if isinstance(r.value, NS):
                r.value.made_by.append(fn.name)
            return r.value
        return None

    def block(self, body, env, path):
        for st in body:
            self.stmt(st, env, path)

    def stmt(self, st, env, path):
        if isinstance(st, ast.Return):
            raise _Return(self.expr(st.value, env, path) if st.value is not None else None)
        if isinstance(st, ast.Assign):
            value = self.expr(st.value, env, path)
            for t in st.targets:
                self.assign(t, value, env, path)
        elif isinstance(st, ast.AnnAssign) and st.value is not None:
            self.assign(st.target, self.expr(st.value, env, path), env, path)
        elif isinstance(st, ast.Expr) and isinstance(st.value, ast.Call):
            self.expr(st.value, env, path)
        elif isinstance(st, ast.If):
            test = self.expr(st.test, env, path)
            if isinstance(test, Opaque):
                self.notes.append(f"unresolved_if:{ast.unparse(st.test)[:60]}")
                return
            self.block(st.body if test else st.orelse, env, path)

    def assign(self, target, value, env, path):
        if isinstance(target, ast.Name):
            env[target.id] = value
        elif isinstance(target, ast.Attribute):
            obj = self.expr(target.value, env, path, create=True)
            if isinstance(obj, NS):
                obj.attrs[target.attr] = value
        elif isinstance(target, ast.Tuple) and isinstance(value, (tuple, list)):
            for t, v in zip(target.elts, value):
                self.assign(t, v, env, path)
        elif isinstance(target, ast.Tuple):
            for t in target.elts:
                self.assign(t, value, env, path)

    def expr(self, e, env, path, create=False):
        if isinstance(e, ast.Constant):
            return e.value
        if isinstance(e, (ast.List, ast.Tuple)):
            return [self.expr(x, env, path) for x in e.elts]
        if isinstance(e, ast.Name):
            if e.id in env:
                return env[e.id]
            if e.id in ("True", "False", "None"):
                return {"True": True, "False": False, "None": None}[e.id]
            found = self.src.resolve(path, e.id)
            if found and not isinstance(found[1], ast.FunctionDef):
                return self.expr(found[1], {}, found[0])
            return Opaque(e.id)
        if isinstance(e, ast.Attribute):
            obj = self.expr(e.value, env, path, create=create)
            if isinstance(obj, NS):
                if e.attr not in obj.attrs and create:
                    obj.attrs[e.attr] = NS(e.attr)
                return obj.attrs.get(e.attr)
            if obj is None:
                return None
            return Opaque(ast.unparse(e))
        if isinstance(e, ast.BoolOp):
            vals = [self.expr(v, env, path) for v in e.values]
            if any(isinstance(v, Opaque) for v in vals):
                return Opaque(ast.unparse(e))
            return all(vals) if isinstance(e.op, ast.And) else any(vals)
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.USub) \
                and isinstance(e.operand, ast.Constant) and isinstance(e.operand.value, int):
            return -e.operand.value
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not):
            v = self.expr(e.operand, env, path)
            return v if isinstance(v, Opaque) else (not v)
        if isinstance(e, ast.Compare) and len(e.ops) == 1:
            a, b = self.expr(e.left, env, path), self.expr(e.comparators[0], env, path)
            if isinstance(a, (Opaque, NS)) or isinstance(b, (Opaque, NS)):
                if isinstance(e.ops[0], (ast.Is, ast.IsNot)) and (a is None or b is None):
                    same = a is b
                    return same if isinstance(e.ops[0], ast.Is) else not same
                return Opaque(ast.unparse(e))
            op = e.ops[0]
            try:
                if isinstance(op, (ast.Eq, ast.Is)):
                    return a == b
                if isinstance(op, (ast.NotEq, ast.IsNot)):
                    return a != b
                if isinstance(op, ast.In):
                    return a in (b or ())
                if isinstance(op, ast.NotIn):
                    return a not in (b or ())
                if isinstance(op, ast.Gt):
                    return a > b
                if isinstance(op, ast.GtE):
                    return a >= b
                if isinstance(op, ast.Lt):
                    return a < b
                if isinstance(op, ast.LtE):
                    return a <= b
            except TypeError:
                pass
            return Opaque(ast.unparse(e))
        if isinstance(e, ast.BinOp):
            a, b = self.expr(e.left, env, path), self.expr(e.right, env, path)
            if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
                ops = {ast.Mult: lambda x, y: x * y, ast.Add: lambda x, y: x + y,
                       ast.FloorDiv: lambda x, y: x // y, ast.Sub: lambda x, y: x - y}
                f = ops.get(type(e.op))
                if f:
                    return f(a, b)
            return Opaque(ast.unparse(e))
        if isinstance(e, ast.Call):
            return self.call(e, env, path)
        if isinstance(e, ast.ListComp) and len(e.generators) == 1:
            return self.list_comp(e, env, path)
        if isinstance(e, ast.Subscript):
            obj, key = self.expr(e.value, env, path), self.expr(e.slice, env, path)
            if isinstance(obj, Opaque) and isinstance(key, str) and not isinstance(key, Opaque):
                # an enum member by name (Megatron-Core's CudaGraphScope[name] /
                # CudaGraphModule[name]): the member's name
                return key
            if isinstance(obj, list) and isinstance(key, int) and -len(obj) <= key < len(obj):
                return obj[key]
        return Opaque(ast.unparse(e))

    def list_comp(self, e: ast.ListComp, env, path):
        """``[elt for name in iterable]`` (no conditions) over a list the
        interpreter knows: the elements, each with ``name`` bound."""
        gen = e.generators[0]
        items = self.expr(gen.iter, env, path)
        if gen.ifs or not isinstance(gen.target, ast.Name) or not isinstance(items, list):
            return Opaque(ast.unparse(e))
        out = []
        for item in items:
            v = self.expr(e.elt, {**env, gen.target.id: item}, path)
            if isinstance(v, Opaque):
                return Opaque(ast.unparse(e))
            out.append(v)
        return out

    def call(self, e: ast.Call, env, path):
        args = [self.expr(a, env, path) for a in e.args]
        kwargs = {k.arg: self.expr(k.value, env, path) for k in e.keywords if k.arg}
        f = e.func
        if isinstance(f, ast.Name):
            if f.id == "getattr" and len(args) >= 2:
                obj = args[0]
                if isinstance(obj, NS):
                    return obj.attrs.get(args[1], args[2] if len(args) > 2 else None)
                return Opaque(ast.unparse(e))
            if f.id == "isinstance" and len(args) == 2 and args[1] in ("str", "int", "bool",
                                                                      "list"):
                return type(args[0]).__name__ == args[1] and not isinstance(args[0], Opaque)
            if f.id == "isinstance" and len(args) == 2 and not isinstance(args[0], (NS, Opaque)):
                return False        # a plain value is no instance of a repository class
            if f.id == "hasattr" and len(args) == 2:
                return isinstance(args[0], NS) and args[1] in args[0].attrs
            if f.id in ("max", "min") and all(isinstance(a, int) for a in args):
                return (max if f.id == "max" else min)(args)
            found = self.src.resolve(path, f.id)
            if found and isinstance(found[1], ast.FunctionDef):
                return self.call_function(found[0], found[1], args, kwargs)
            return NS(f.id, **kwargs)
        if isinstance(f, ast.Attribute) and f.attr in ("lower", "upper") and not args:
            v = self.expr(f.value, env, path)
            if isinstance(v, str) and not isinstance(v, Opaque):
                return v.lower() if f.attr == "lower" else v.upper()
        if isinstance(f, ast.Attribute) and f.attr in ("split", "rsplit") and not kwargs \
                and all(isinstance(a, (str, int)) and not isinstance(a, Opaque) for a in args):
            v = self.expr(f.value, env, path)
            if isinstance(v, str) and not isinstance(v, Opaque):
                return getattr(v, f.attr)(*args)
        text = ast.unparse(f)
        m = re.search(r"from_hf_pretrained", text)
        if m and isinstance(f, ast.Attribute):
            inner = f.value
            if isinstance(inner, ast.Call) and inner.args:
                hf = self.expr(inner.args[0], env, path)
                return NS(f"hf:{hf}")
        return NS(text, **kwargs)


class _Return(Exception):
    def __init__(self, value):
        self.value = value


def flatten(ns: NS, prefix: str = "", out: dict | None = None) -> dict:
    out = {} if out is None else out
    for k, v in ns.attrs.items():
        key = f"{prefix}{k}"
        if isinstance(v, NS):
            out[key] = v.name
            flatten(v, key + ".", out)
        else:
            out[key] = v
    return out


def text(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, (list, tuple)):
        return ";".join(text(x) for x in v)
    if isinstance(v, dict):
        return ";".join(f"{k}:{text(x)}" for k, x in v.items())
    return str(v)


# A model provider's (layers, hidden) -> autopar models/ name.
SHAPES = {(118, 8192): "nemotron-h-56B", (98, 8192): "nemotron-h-47B", (52, 4096): "nemotron-h-8B"}
# A hybrid MoE provider's (layer pattern, hidden, experts) -> autopar models/ name: Nemotron 3
# Nano 30B-A3B, the provider recipes/nemotronh/h100/nemotron_3_nano.py
# nemotron_3_nano_pretrain_8gpu_h100_bf16_config builds (tests/test_recipes_moe.py checks
# its settings against models/nemotron3-nano-30B-A3B.json).
MOE_SHAPES = {("MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME", 2688, 128):
              "nemotron3-nano-30B-A3B"}


def model_name(flat: dict) -> str:
    src = str(flat.get("model", ""))
    shape = (flat.get("model.num_layers"), flat.get("model.hidden_size"))
    if src == "HybridModelProvider" and flat.get("model.hf_model_id"):
        # A provider that names its own checkpoint (Nemotron 3.5 Lightning: the Nano
        # provider with MTP layers, nemotron_3_5_lightning_pretrain_config) is that model.
        src = str(flat["model.hf_model_id"])
    elif src == "HybridModelProvider" and not flat.get("model.num_moe_experts") \
            and shape in SHAPES:
        return SHAPES[shape]
    elif src == "HybridModelProvider" and not flat.get("model.mtp_num_layers"):
        key = (flat.get("model.hybrid_layer_pattern"), flat.get("model.hidden_size"),
               flat.get("model.num_moe_experts"))
        if key in MOE_SHAPES:
            return MOE_SHAPES[key]
    if src.startswith("hf:"):
        src = src[3:]
    for k, v in MODELS.items():
        if src == k or src.endswith(k):
            return v
    return src


def recipe_rows(source: Source, family: str, gpu: str, path: str) -> list[dict]:
    tree = source.tree(path)
    rows = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        interp = Interpreter(source)
        cfg = interp.call_function(path, node, [], {})
        if not isinstance(cfg, NS):
            continue
        flat = flatten(cfg)
        m = re.search(r"_(\d+)gpu_", node.name)
        prec = cfg.attrs.get("mixed_precision")
        names = ([str(prec)] if not isinstance(prec, NS)
                 else list(reversed(prec.made_by)) + [prec.name])
        precision = next((PRECISIONS[n] for n in names if n in PRECISIONS), names[0])
        g = flat.get
        sp = g("model.sequence_parallel")
        offload = []
        if g("model.fine_grained_activation_offloading"):
            offload.append("activations:" + text(g("model.offload_modules")))
        if g("model.cpu_offloading"):
            what = "weights+activations" if g("model.cpu_offloading_weights") else "activations"
            offload.append(f"cpu_{what}:layers={text(g('model.cpu_offloading_num_layers'))}")
        offload = ";".join(offload)
        cuda = g("model.cuda_graph_impl")
        cuda_graph = "" if cuda in (None, "none") else f"{cuda}:{text(g('model.cuda_graph_scope'))}"
        extra = [f"{k}={text(g(k))}" for k in EXTRA if g(k) is not None and text(g(k)) != ""]
        # Bridge's training/setup.py _validate_and_set_vocab_size: a vocabulary
        # the model sets (a Hugging Face config's, a provider's vocab_size) is
        # used as it is, unpadded; else the tokenizer's, padded.
        model_ns = cfg.attrs.get("model")
        preset = isinstance(model_ns, NS) and (model_ns.name.startswith("hf:")
                                               or model_ns.attrs.get("vocab_size") is not None)
        extra.append(f"model_vocab={'preset' if preset else 'tokenizer'}")
        extra += sorted(set(interp.notes))
        rows.append({
            "recipe": node.name, "family": Path(path).stem, "model": model_name(flat), "gpu": gpu,
            "precision": precision, "n_gpus": m.group(1) if m else "",
            "tp": text(g("model.tensor_model_parallel_size")),
            "pp": text(g("model.pipeline_model_parallel_size")),
            "cp": text(g("model.context_parallel_size")),
            "vp": text(g("model.virtual_pipeline_model_parallel_size")),
            "ep": text(g("model.expert_model_parallel_size")),
            "etp": text(g("model.expert_tensor_parallel_size")),
            "mbs": text(g("train.micro_batch_size")), "gbs": text(g("train.global_batch_size")),
            "seq": text(g("model.seq_length")), "sp": text(sp),
            "recompute_granularity": text(g("model.recompute_granularity")),
            "recompute_modules": text(g("model.recompute_modules")),
            "recompute_num_layers": text(g("model.recompute_num_layers")),
            "recompute_method": text(g("model.recompute_method")),
            "offload": offload, "cuda_graph": cuda_graph,
            "dispatcher": text(g("model.moe_token_dispatcher_type")),
            "extra": ";".join(extra),
            "source": f"NVIDIA-NeMo/Megatron-Bridge@{source.commit[:7]} {path} {node.name}"})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, default=REPO)
    ap.add_argument("--commit", default=COMMIT)
    ap.add_argument("--output", type=Path,
                    default=ROOT / "autopar" / "data" / "recipes" / "bridge_dense.csv")
    args = ap.parse_args(argv)
    source = Source(args.repo, args.commit)
    files = subprocess.run(["git", "-C", str(args.repo), "ls-tree", "-r", "--name-only",
                            args.commit, PERF], check=True, capture_output=True,
                           text=True).stdout.split()
    rows, skipped = [], set()
    for f in sorted(files):
        parts = f[len(PERF) + 1:].split("/")
        if len(parts) != 3 or parts[0] not in FAMILIES or not f.endswith(".py") \
                or parts[2] == "__init__.py":
            continue
        family, gpu = parts[0], parts[1]
        if gpu not in GPUS:
            skipped.add(gpu)
            continue
        rows += recipe_rows(source, family, gpu, f)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with open(args.output, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS, lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    print(f"{len(rows)} recipes -> {args.output}; GPUs without a system file, left out: "
          f"{', '.join(sorted(skipped))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
