"""A Hugging Face ``config.json`` (a model card's architecture) read as an
autopar model (read only: a model, not a layout).

The keys are those of the ``transformers`` configuration classes of each
``model_type`` (``LlamaConfig``, ``MistralConfig``, ``MixtralConfig``,
``Qwen2Config``, ``Qwen3Config``, ``Qwen3MoeConfig``, ``Qwen3NextConfig``,
``DeepseekV2Config``/``DeepseekV3Config``, ``GptOssConfig``):

* every architecture: ``hidden_size`` (``hidden``), ``intermediate_size``
  (``feedforward``), ``num_attention_heads`` (``attn_heads``), ``head_dim``
  (``attn_size``; default hidden_size / heads), ``num_hidden_layers``
  (``num_blocks``), ``num_key_value_heads`` (``kv_heads``), ``vocab_size``,
  ``max_position_embeddings`` (``seq_size``, the context: a training run's
  sequence is usually shorter, set by the launch config or ``--seq-len``);
  all are LLaMA-style blocks (RMSNorm, rotary embeddings, a gated SiLU MLP:
  ``block: llama``);
* Mixtral and gpt-oss: ``num_local_experts``, ``num_experts_per_tok`` (and
  the expert's ``intermediate_size``); Qwen3-MoE: ``num_experts``,
  ``num_experts_per_tok``, ``moe_intermediate_size``, ``decoder_sparse_step``
  (1: every block) and ``mlp_only_layers`` (dense blocks: a leading run is
  ``moe.first_dense``);
* Qwen3-Next: the Qwen3-MoE keys with ``shared_expert_intermediate_size``,
  ``layer_types`` / ``full_attention_interval`` (the hybrid pattern: 'G'
  Gated DeltaNet or '*' gated attention, then 'E', per layer) and
  ``linear_num_key_heads``, ``linear_num_value_heads``,
  ``linear_key_head_dim``, ``linear_value_head_dim``,
  ``linear_conv_kernel_dim`` (``gdn``);
* DeepSeek-V2/V3: ``n_routed_experts``, ``n_shared_experts``,
  ``moe_intermediate_size``, ``num_experts_per_tok``,
  ``first_k_dense_replace`` (``moe.first_dense``), ``moe_layer_freq`` (1:
  every later block), ``scoring_func`` (``moe.router``), the latent attention
  ``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``,
  ``qk_rope_head_dim``, ``v_head_dim`` (``mla``; ``attn_size`` is the value
  size, as the shipped files have it) and ``num_nextn_predict_layers``
  (``mtp``);
* Nemotron-H / Nemotron 3 (``nemotron_h``, as Megatron-Bridge's
  ``NemotronHBridge`` converts it): ``hybrid_override_pattern`` (or
  ``layers_block_type``), ``mamba_num_heads``, ``mamba_head_dim``,
  ``ssm_state_size``, ``n_groups``, ``conv_kernel``, ``chunk_size``, the
  experts (``n_routed_experts``, ``num_experts_per_tok``,
  ``moe_intermediate_size``, ``n_shared_experts``,
  ``moe_shared_expert_intermediate_size``, a sigmoid router),
  ``moe_latent_size`` (``moe.latent_size``) and ``num_nextn_predict_layers``
  MTP depths of ``mtp_hybrid_override_pattern`` (one repeated module, Bridge's
  default); squared-ReLU (``mlp_hidden_act`` relu2) as the ``gpt`` block.

What autopar cannot state is one line naming the key (another activation
than SiLU, MoE on every n-th block only, dense blocks other than a leading
run); what it leaves out is a note (a sliding window on every block, exact
for sequences up to the window; gpt-oss's banded attention on every other
block, attention sinks and biases; tied embeddings; quantized checkpoints).
"""
from __future__ import annotations


from autopar.io.launch.base import Imported, LaunchFormat
from autopar.io.launch.expressible import Keys, json_object

DENSE = ("llama", "mistral", "qwen2", "qwen3")
MOE = ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v2", "deepseek_v3", "gpt_oss",
       "qwen3_next", "deepseek_v32", "glm_moe_dsa")
# DeepSeek-V3's architecture with DeepSeek Sparse Attention's indexer
# (DeepSeek-V3.2; GLM-5's GlmMoeDsaConfig)
SPARSE = ("deepseek_v32", "glm_moe_dsa")
HYBRID = ("nemotron_h",)
MODEL_TYPES = DENSE + MOE + HYBRID
ACTIVATIONS = ("silu", "swiglu")


def read(text: str, source: str) -> Imported:
    data, k = json_object(text, source, "a Hugging Face config.json")
    mt = k.raw("model_type")
    if mt is None:
        k.fail("model_type", "missing key (a Hugging Face config.json names its model_type)")
    mt = k.choice("model_type", MODEL_TYPES)
    notes: list[str] = []
    hidden = k.int("hidden_size", minimum=1)
    heads = k.int("num_attention_heads", minimum=1)
    layers = k.int("num_hidden_layers", minimum=1)
    head_dim = k.raw("head_dim")
    attn_size = k.int("head_dim", minimum=1) if head_dim is not None else hidden // heads
    if head_dim is None and hidden % heads:
        k.fail("num_attention_heads", f"does not divide hidden_size {hidden} and no head_dim "
               "is given")
    model: dict = {"hidden": hidden, "feedforward": k.int("intermediate_size", minimum=1),
                   "seq_size": k.int("max_position_embeddings", minimum=1),
                   "attn_heads": heads, "attn_size": attn_size, "num_blocks": layers,
                   "block": "llama", "vocab_size": k.int("vocab_size", minimum=1)}
    if mt in HYBRID:
        _nemotron_h(k, model, layers, heads)
        return Imported(execution={}, model=model, framework=None, notes=tuple(notes))
    act = k.raw("hidden_act", "silu")
    if act not in ACTIVATIONS:
        k.fail("hidden_act", f"{act!r}: autopar's LLaMA-style block is a gated SiLU MLP")
    _window(k, mt, notes)
    if mt in ("deepseek_v2", "deepseek_v3") + SPARSE:
        _deepseek(k, model, layers)
        if mt in SPARSE:
            _sparse_index(k, model)
    else:
        kv = k.int("num_key_value_heads", heads, minimum=1)
        if heads % kv:
            k.fail("num_key_value_heads", f"{kv} does not divide num_attention_heads {heads}")
        model["kv_heads"] = kv
    if mt in ("mixtral", "gpt_oss"):
        model["moe"] = {"experts": k.int("num_local_experts", minimum=1),
                        "top_k": k.int("num_experts_per_tok", minimum=1),
                        "expert_feedforward": model["feedforward"]}
    elif mt in ("qwen3_moe", "qwen2_moe", "qwen3_next"):
        model["moe"] = _qwen_moe(k, mt, layers)
    if mt == "qwen3_next":
        _qwen3_next(k, model, layers, notes)
    if mt == "gpt_oss":
        notes.append("gpt-oss: the banded (sliding_window) attention of every other block, the "
                     "attention sinks and the biases are not modelled")
    if k.raw("tie_word_embeddings", False) is True:
        notes.append("tie_word_embeddings: autopar counts the embedding and the output "
                     "layer's weights apart (one copy more than the model has)")
    if k.raw("quantization_config") is not None:
        notes.append("quantization_config: the checkpoint's storage format; the layout's "
                      "datatype decides the training precision")
    if "moe" in model and model["moe"]["top_k"] > model["moe"]["experts"]:
        k.fail("num_experts_per_tok", "exceeds the number of experts")
    return Imported(execution={}, model=model, framework=None, notes=tuple(notes))


def _window(k: Keys, mt: str, notes: list) -> None:
    """A sliding window on every block narrower than the context cannot be
    stated (gpt-oss's alternate banded blocks are a note)."""
    w = k.raw("sliding_window")
    if w is None or mt == "gpt_oss":
        return
    if mt in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe") and not k.raw("use_sliding_window", False):
        return
    w = k.int("sliding_window", minimum=1)
    if w < k.int("max_position_embeddings", minimum=1):
        notes.append(f"sliding_window {w}: attention is modelled over the whole sequence, "
                     f"which is exact for training sequences up to {w} tokens")


def _qwen_moe(k: Keys, mt: str, layers: int) -> dict:
    step = k.int("decoder_sparse_step", 1, minimum=1)
    if step != 1:
        k.fail("decoder_sparse_step", f"{step}: MoE on every {step}-th block only is not "
               "modelled (autopar's dense blocks are a leading run)")
    dense = k.raw("mlp_only_layers", []) or []
    if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
        k.fail("mlp_only_layers", "expected a list of block numbers")
    if sorted(dense) != list(range(len(dense))):
        k.fail("mlp_only_layers", f"{dense}: dense blocks other than a leading run are not "
               "modelled")
    moe = {"experts": k.int("num_experts", minimum=1),
           "top_k": k.int("num_experts_per_tok", minimum=1),
           "expert_feedforward": k.int("moe_intermediate_size", minimum=1)}
    if mt in ("qwen2_moe", "qwen3_next"):
        shared = k.int("shared_expert_intermediate_size", 0)
        if shared:
            moe.update(shared_experts=1, shared_feedforward=shared)
    if dense:
        moe["first_dense"] = len(dense)
    return moe


def _qwen3_next(k: Keys, model: dict, layers: int, notes: list) -> None:
    """Qwen3-Next (``Qwen3NextConfig``): each layer is a mixer, Gated DeltaNet
    ('G') where ``layer_types`` says ``linear_attention`` (default: every
    ``full_attention_interval``-th layer is full attention), gated softmax
    attention ('*', ``attention_output_gate``) otherwise, then its MoE ('E'):
    a hybrid pattern of two blocks a layer."""
    if model["moe"].get("first_dense"):
        k.fail("mlp_only_layers", "dense layers of a Qwen3-Next model are not modelled")
    types = k.raw("layer_types")
    if types is None:
        every = k.int("full_attention_interval", 4, minimum=1)
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                 for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or \
            not set(types) <= {"linear_attention", "full_attention"}:
        k.fail("layer_types", f"expected {layers} of linear_attention / full_attention")
    model["num_blocks"] = 2 * layers
    model["hybrid_override_pattern"] = "".join(
        ("G" if t == "linear_attention" else "*") + "E" for t in types)
    model["gdn"] = {"key_heads": k.int("linear_num_key_heads", minimum=1),
                    "value_heads": k.int("linear_num_value_heads", minimum=1),
                    "key_head_dim": k.int("linear_key_head_dim", minimum=1),
                    "value_head_dim": k.int("linear_value_head_dim", minimum=1),
                    "conv_kernel": k.int("linear_conv_kernel_dim", 4, minimum=1)}
    model["attention_output_gate"] = True
    notes.append("qwen3_next: the multi-token-prediction layer (not in config.json; the "
                 "Bridge recipes set mtp_num_layers 1: give mtp), q/k RMSNorm and the shared "
                 "expert's gate are not in the model")


def _deepseek(k: Keys, model: dict, layers: int) -> None:
    freq = k.int("moe_layer_freq", 1, minimum=1)
    if freq != 1:
        k.fail("moe_layer_freq", f"{freq}: MoE on every {freq}-th block only is not modelled")
    moe = {"experts": k.int("n_routed_experts", minimum=1),
           "top_k": k.int("num_experts_per_tok", minimum=1),
           "expert_feedforward": k.int("moe_intermediate_size", minimum=1)}
    shared = k.int("n_shared_experts", 0, minimum=0) if k.raw("n_shared_experts") is not None \
        else 0
    if shared:
        moe["shared_experts"] = shared
    first = k.int("first_k_dense_replace", 0, minimum=0)
    if first >= layers:
        k.fail("first_k_dense_replace", f"{first}: no MoE block left of {layers}")
    if first:
        moe["first_dense"] = first
    router = k.choice("scoring_func", ("softmax", "sigmoid"), "softmax")
    if router != "softmax":
        moe["router"] = router
    model["moe"] = moe
    q = k.raw("q_lora_rank")
    mla = {"kv_lora_rank": k.int("kv_lora_rank", minimum=1),
           "qk_nope_head_dim": k.int("qk_nope_head_dim", minimum=1),
           "qk_rope_head_dim": k.int("qk_rope_head_dim", minimum=0),
           "v_head_dim": k.int("v_head_dim", minimum=1)}
    if q is not None:
        mla["q_lora_rank"] = k.int("q_lora_rank", minimum=1)
    model["mla"] = {key: mla[key] for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                              "qk_rope_head_dim", "v_head_dim") if key in mla}
    model["attn_size"] = mla["v_head_dim"]
    mtp = k.int("num_nextn_predict_layers", 0, minimum=0)
    if mtp:
        model["mtp"] = mtp


def _sparse_index(k: Keys, model: dict) -> None:
    """DeepSeek Sparse Attention's indexer: ``index_n_heads``,
    ``index_head_dim``, ``index_topk`` (``mla.sparse_index``).  GLM-5's
    config may normalise ``qk_rope_head_dim`` to ``head_dim``; the rotary
    width is then ``qk_head_dim - qk_nope_head_dim`` (as Megatron-Bridge's
    glm5_bridge.py recovers it).  IndexShare (``index_topk_freq`` > 1,
    GLM-5.2: the top-k reused by the next layers) is refused: autopar runs
    the indexer on every block."""
    mla = model["mla"]
    if k.raw("qk_head_dim") is not None:
        mla["qk_rope_head_dim"] = k.int("qk_head_dim", minimum=1) - mla["qk_nope_head_dim"]
        if mla["qk_rope_head_dim"] < 0:
            k.fail("qk_head_dim", "is smaller than qk_nope_head_dim")
    freq = k.int("index_topk_freq", 1, minimum=1)
    if freq > 1:
        k.fail("index_topk_freq", f"{freq}: the indexer's top-k shared across layers "
               "(IndexShare) is not modelled; autopar runs the indexer on every block")
    mla["sparse_index"] = {"n_heads": k.int("index_n_heads", minimum=1),
                           "head_dim": k.int("index_head_dim", minimum=1),
                           "topk": k.int("index_topk", minimum=1)}


# Nemotron-H's ``layers_block_type`` names -> hybrid_override_pattern symbols
_BLOCK_TYPES = {"mamba": "M", "attention": "*", "mlp": "-", "moe": "E"}


def _layer_pattern(k: Keys, key: str, list_key: str) -> str | None:
    """A Nemotron-H layer pattern: the string ``key`` or the list of block
    names ``list_key`` (newer configs), None where neither is given."""
    if k.raw(key) is not None:
        pattern = k.raw(key)
        if not isinstance(pattern, str):
            k.fail(key, f"expected a string of M, *, - and E, got {pattern!r}")
        return pattern
    names = k.raw(list_key)
    if names is None:
        return None
    if not isinstance(names, list) or any(n not in _BLOCK_TYPES for n in names):
        k.fail(list_key, f"expected a list of {', '.join(_BLOCK_TYPES)}, got {names!r}")
    return "".join(_BLOCK_TYPES[n] for n in names)


def _nemotron_h(k: Keys, model: dict, layers: int, heads: int) -> None:
    """Nemotron-H / Nemotron 3 (``model_type`` nemotron_h) as Megatron-Bridge
    converts it (NVIDIA-NeMo/Megatron-Bridge@067f987
    src/megatron/bridge/models/nemotronh/nemotron_h_bridge.py
    ``NemotronHBridge.provider_bridge``): squared-ReLU MLP and experts (the
    ``gpt`` block, as the shipped Nemotron files), the layer pattern, the
    Mamba-2 mixer, a sigmoid router, ``moe_latent_size``, and
    ``num_nextn_predict_layers`` MTP depths of ``mtp_hybrid_override_pattern``
    run by one repeated module unless the config says
    ``mtp_use_repeated_layer`` false."""
    act = k.raw("mlp_hidden_act", "relu2")
    if act != "relu2":
        k.fail("mlp_hidden_act", f"{act!r}: autopar models Nemotron-H's squared-ReLU MLP only")
    model["block"] = "gpt"
    kv = k.int("num_key_value_heads", heads, minimum=1)
    if heads % kv:
        k.fail("num_key_value_heads", f"{kv} does not divide num_attention_heads {heads}")
    model["kv_heads"] = kv
    pattern = _layer_pattern(k, "hybrid_override_pattern", "layers_block_type")
    if pattern is None:
        k.fail("hybrid_override_pattern", "missing key (the layers of a Nemotron-H model)")
    if len(pattern) != layers:
        k.fail("hybrid_override_pattern", f"has {len(pattern)} layers, num_hidden_layers is "
               f"{layers}")
    model["hybrid_override_pattern"] = pattern
    if "M" in pattern:
        model["mamba"] = {"heads": k.int("mamba_num_heads", minimum=1),
                          "head_dim": k.int("mamba_head_dim", minimum=1),
                          "state": k.int("ssm_state_size", minimum=1),
                          "groups": k.int("n_groups", 1, minimum=1),
                          "conv_kernel": k.int("conv_kernel", 4, minimum=1),
                          "chunk": k.int("chunk_size", 128, minimum=1)}
    if "E" in pattern:
        moe = {"experts": k.int("n_routed_experts", minimum=1),
               "top_k": k.int("num_experts_per_tok", minimum=1),
               "expert_feedforward": k.int("moe_intermediate_size", minimum=1),
               "router": "sigmoid"}
        shared = k.int("n_shared_experts", 0, minimum=0) if k.raw("n_shared_experts") \
            is not None else 0
        if shared:
            moe["shared_experts"] = shared
            moe["shared_feedforward"] = k.int("moe_shared_expert_intermediate_size",
                                              minimum=1)
        if k.raw("moe_latent_size") is not None:
            moe["latent_size"] = k.int("moe_latent_size", minimum=1)
        model["moe"] = moe
    mtp = k.int("num_nextn_predict_layers", 0, minimum=0) \
        if k.raw("num_nextn_predict_layers") is not None else 0
    if mtp:
        mp = _layer_pattern(k, "mtp_hybrid_override_pattern", "mtp_layers_block_type")
        if not mp:
            k.fail("mtp_hybrid_override_pattern", "num_nextn_predict_layers > 0 needs the MTP "
                   "module's layers (Megatron-Bridge refuses it without)")
        model["mtp"] = mtp
        model["mtp_hybrid_override_pattern"] = mp
        if k.raw("mtp_use_repeated_layer", True) is not False:
            model["mtp_use_repeated_layer"] = True


def _refuse(*_args) -> str:
    return "hf: a Hugging Face config.json holds a model, not a layout (read only)"


def _write(model, execution) -> str:
    from autopar.io.errors import SpecError
    raise SpecError("command line", "--format", _refuse())


FORMAT = LaunchFormat(name="hf", suffix=".json", framework="", refuse_model=_refuse,
                      refuse_space=_refuse, refuse_layout=_refuse, write=_write, read=read,
                      describe="a Hugging Face config.json (read only: a model, not a layout)")
