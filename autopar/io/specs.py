"""Typed specs: the model (application), the system and the execution.

The three inputs are read in Calculon's JSON formats, unchanged:

* model ("application"): ``hidden, feedforward, seq_size, attn_heads,
  attn_size, num_blocks``; optional extension keys ``block`` ("gpt" |
  "llama"), ``kv_heads``, ``vocab_size``, ``moe`` (mixture of experts,
  ``MoESpec``), ``mla`` (multi-head latent attention, ``MLASpec``), ``mtp``
  (multi-token-prediction modules), ``hybrid_override_pattern`` (layer kinds,
  Megatron's notation) with ``mamba`` (Mamba-2 mixers, ``MambaSpec``) and
  ``gdn`` (Gated DeltaNet mixers, ``GatedDeltaNetSpec``),
  ``attention_output_gate``, ``name`` and ``description``.
* system: ``matrix, vector, mem1, mem2, processing_mode, networks``; optional
  top-level ``name`` and ``description`` strings.
* execution: exactly Calculon's 23 fields (``autopar.io.layouts.FIELDS``).

Every value is checked here, once, and any problem raises ``SpecError(source,
field, message)`` naming the file (or "dict") and a dotted field path such as
``networks[1].ops.all_reduce``.  Rules that tie several execution fields
together (tensor*pipeline*data == num_procs, divisibility, options that need
others) are the model's business: it reports them as "invalid: ..." results.
"""
from __future__ import annotations

import gzip
import json
import math
import os
import stat
from dataclasses import dataclass, fields as dataclass_fields
from pathlib import Path
from typing import Any, Mapping

from autopar.io.errors import SpecError, brief  # noqa: F401  (re-exported)
from autopar.io.layouts import (ALL_FIELDS, BOOL_FIELDS, CHOICES, EXT_DEFAULTS, FIELDS,
                               MOMENT_BYTES, offload_modules_value, EXPERT_OFFLOAD_MODULES,
                                GEMM_ONLY_DATATYPES, INT_FIELDS, decoder_layer_counts,
                               layout_code, layout_problem, parse_layout)


@dataclass(frozen=True)
class MoESpec:
    """Mixture-of-experts feed-forward (the ``moe`` object of a model file).

    ``experts`` routed experts of ``expert_feedforward`` each, ``top_k`` of
    them per token, plus ``shared_experts`` that every token passes
    (``shared_feedforward`` wide in all, default shared_experts x
    expert_feedforward).  The first ``first_dense`` blocks keep the dense
    MLP of the model's ``feedforward``.  ``router`` scores tokens by softmax
    or sigmoid; ``capacity_factor`` pads every expert to that multiple of
    the balanced load (None: dropless, no padding); ``imbalance`` is the
    load of the busiest expert relative to the balanced load (1.0: balanced
    routing, the default assumption).  ``latent_size`` (0: off) is
    LatentMoE (Nemotron 3 Super / Ultra; Megatron-Core's ``moe_latent_size``):
    the routed experts run on a projection of the hidden state down to this
    width, dispatched and combined at it, and projected back up after the
    combine; the router and the shared experts keep the hidden size
    (``autopar.model.moe.routed_experts``).
    """
    experts: int
    top_k: int
    expert_feedforward: int
    shared_experts: int = 0
    shared_feedforward: int = 0
    first_dense: int = 0
    router: str = "softmax"
    capacity_factor: float | None = None
    imbalance: float = 1.0
    latent_size: int = 0

    @property
    def load(self) -> float:
        """Tokens an expert processes relative to the balanced load."""
        return self.capacity_factor if self.capacity_factor is not None else self.imbalance


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3; the ``mla`` object).

    Queries are compressed to ``q_lora_rank`` (0: no query compression),
    keys and values jointly to ``kv_lora_rank``; each head's query/key has
    ``qk_nope_head_dim`` dimensions without and ``qk_rope_head_dim`` with
    rotary embedding (the rotary key is shared by the heads), and its value
    ``v_head_dim``.
    """
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0
    # DeepSeek Sparse Attention (``mla.sparse_index``; None: every query
    # attends to every earlier key, as DeepSeek-V3's MLA)
    sparse_index: "SparseIndexSpec | None" = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class SparseIndexSpec:
    """DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2, GLM-5;
    the ``mla.sparse_index`` object; Megatron-Core's
    ``experimental_attention_variant "dsa"`` with ``dsa_indexer_n_heads``,
    ``dsa_indexer_head_dim``, ``dsa_indexer_topk``; Hugging Face's
    ``index_n_heads``, ``index_head_dim``, ``index_topk``).  The indexer
    scores every earlier key for each query with ``n_heads`` small heads of
    ``head_dim``; the attention then runs over the ``topk`` best keys only.
    ``loss``: the indexer is trained by its KL loss against the attention's
    scores (Megatron's ``dsa_indexer_loss_coeff`` > 0; Bridge's GLM-5
    bridge sets 0.001); false: it runs without gradients."""
    n_heads: int
    head_dim: int
    topk: int
    loss: bool = True


@dataclass(frozen=True)
class MambaSpec:
    """Mamba-2 mixers of a hybrid model (the ``mamba`` object of a model file;
    Megatron-Core's ``mamba_num_heads``, ``mamba_head_dim``,
    ``mamba_state_dim``, ``mamba_num_groups``, the causal convolution's
    ``d_conv`` and the SSD kernel's ``chunk_size``).  The inner width is
    ``heads x head_dim``; B and C are shared by the heads of a group."""
    heads: int
    head_dim: int
    state: int
    groups: int = 1
    conv_kernel: int = 4
    chunk: int = 128

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim


@dataclass(frozen=True)
class GatedDeltaNetSpec:
    """Gated DeltaNet linear-attention mixers of a hybrid model (the ``gdn``
    object of a model file; Megatron-Core's ``linear_num_key_heads``,
    ``linear_num_value_heads``, ``linear_key_head_dim``,
    ``linear_value_head_dim``, ``linear_conv_kernel_dim``; Hugging Face's
    keys of the same names).  ``chunk`` is the chunked delta-rule kernel's
    chunk (fla ``chunk_gated_delta_rule``: 64 tokens).  Query and key heads
    are repeated to the value heads (``value_heads % key_heads == 0``)."""
    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4
    chunk: int = 64


# The layer kinds of a hybrid pattern (Megatron-Core's hybrid_layer_allocation
# Symbols: M Mamba, G Gated DeltaNet, * attention, - MLP, E mixture of
# experts), by the block kind the model evaluates for each.
HYBRID_SYMBOLS = {"M": "mamba", "G": "gdn", "*": "attention", "-": "mlp", "E": "moe"}


@dataclass(frozen=True)
class ModelSpec:
    hidden: int
    feedforward: int
    seq_size: int
    attn_heads: int
    attn_size: int
    num_blocks: int
    # Extensions (all optional; defaults keep Calculon's meaning).
    block: str = "gpt"            # "gpt" | "llama"
    kv_heads: int | None = None   # None: as attention_type says (multihead/multiquery)
    vocab_size: int = 0           # 0: embeddings/output layer not modelled (as Calculon)
    moe: MoESpec | None = None    # None: every block has the dense MLP (as Calculon)
    mla: MLASpec | None = None    # None: attention as attention_type says
    mtp: int = 0                  # multi-token-prediction modules (DeepSeek-V3: 1)
    # "": every block is attention + MLP (Calculon); else one layer kind per
    # block (HYBRID_SYMBOLS), as Megatron's hybrid_override_pattern
    hybrid_pattern: str = ""
    mamba: MambaSpec | None = None
    gdn: GatedDeltaNetSpec | None = None
    # Qwen3-Next's gated attention (Megatron-Core attention_output_gate): the
    # query projection also gives a per-element gate on the attention output
    attention_output_gate: bool = False
    # A hybrid model's MTP module: its layers (HYBRID_SYMBOLS), as Megatron's
    # mtp_hybrid_override_pattern; "" with ``mtp`` on a non-hybrid model
    # (DeepSeek-V3's: one block of the model's MoE kind)
    mtp_pattern: str = ""
    # Megatron's mtp_use_repeated_layer: one MTP module (its weights) run
    # ``mtp`` times; False: ``mtp`` modules of their own
    mtp_repeated: bool = False
    name: str = ""
    source: str = "dict"
    description: str = ""


@dataclass(frozen=True)
class ProcessorSpec:
    tflops: float
    # ((gflops_threshold, efficiency), ...) in the file's (descending) order
    gflops_efficiency: tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class MemorySpec:
    GiB: float
    GBps: float
    MB_efficiency: tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class NetworkSpec:
    bandwidth: float          # GB/s
    efficiency: float
    size: int
    latency: float            # s
    ops: dict                 # op -> (scale, offset); offset 0.0 for p2p (null in JSON)
    must_be_filled: bool
    processor_usage: float


@dataclass(frozen=True)
class MemoryOverhead:
    """Memory a training framework needs beyond the model's own tensors:
    ``reserved_GiB`` (CUDA context, communication buffers, workspaces) and
    ``fraction`` (allocator fragmentation and temporary buffers, relative to
    the counted requirement)."""
    reserved_GiB: float = 0.0
    fraction: float = 0.0
    # The loss's fp32 copies of one micro-batch's logits, and whether the
    # framework gathers the logits whole on every tensor-parallel rank.
    logits_fp32_copies: float = 1.0
    logits_gathered: bool = False
    # Full-recompute checkpoints kept split over tensor_par where sequence
    # parallelism splits the block's input (Megatron, torchtitan); Calculon
    # keeps them whole.
    checkpoint_split: bool = False
    # Bytes per parameter of the optimizer's master copy of the weights when
    # the working datatype is narrower than fp32: 4, a whole fp32 copy
    # (Calculon, Megatron's distributed optimizer); 2, bf16 weights with the
    # low 16 bits of their fp32 values kept apart (Apex / Transformer
    # Engine ``store_param_remainders``, which NeMo 1.x's distributed Adam
    # turns on for bf16 models): the fp32 master is the bf16 weight and its
    # remainder.
    master_weight_bytes: float = 4.0
    # Activations the tensor-parallel GEMMs and the MoE router keep counted
    # as autograd keeps them (Megatron; measured with PyTorch,
    # benchmarks/memory_torch.py): a GEMM's input once, the all-gather's
    # shard only where the gather is redone in backward, the QKV GEMMs'
    # input under selective recompute without sequence parallelism, and the
    # router's input where no shared expert keeps it.  False: Calculon's
    # count (the shard beside the gathered input; no QKV input under
    # attn_only).
    autograd_inputs: bool = False
    # Weight sharding (ZeRO-3 / FSDP): when the gathered weights of a block
    # are freed again.  "always": after the block's forward (and backward), so
    # the gathered block and the prefetched next one are resident (FSDP2's
    # reshard_after_forward=True; the count without this field); "never":
    # kept from forward to backward, every block of the stage gathered;
    # "unless_pipelined": "never" with pipeline stages, "always" without
    # (torchtitan's default policy).
    fsdp_reshard: str = "always"
    # Transformer Engine's cached dummy weight gradients (True): with
    # Megatron's gradient-accumulation fusion a TE linear layer (and, with TE
    # installed, Megatron's own column-parallel output layer) accumulates its
    # weight gradient straight into the fp32 main_grad and hands autograd a
    # placeholder of the weight's shape and dtype, one per distinct
    # (shape, dtype), allocated once and kept
    # (transformer_engine/pytorch/module/base.py get_dummy_wgrad): a stage
    # holds one block's GEMM weights in the working precision per distinct
    # block kind, and the output layer's on the last stage.  False: none
    # (Calculon's count).
    dummy_wgrad: bool = False
    # Megatron's gradient-accumulation fusion (True): a linear layer's
    # weight-gradient GEMM writes straight into the weight's slot of the
    # framework's gradient buffer (``main_grad``, in the buffer's datatype:
    # NVIDIA/TransformerEngine module/linear.py, ``out=main_grad`` under
    # ``fuse_wgrad_accumulation``; Megatron-Core passes its
    # ``gradient_accumulation_fusion``), so where the gradients stay whole
    # (unsharded) no block's gradient exists beside the buffer.  False:
    # Calculon's count, one block's gradient whole in fp32 beside the others.
    wgrad_accumulation_fusion: bool = False
    # Gradients alive in the backward pass beside the saved activations.
    # "block": Calculon's count (the output gradients of every layer of a
    # block, and the block's working space in place of its saved
    # activations); "op": as autograd frees them, the input and output
    # gradients of the one op running (the largest of a block's ops, or the
    # output layer's input gradient on the last stage), every block keeping
    # just what it saved.
    backward_transient: str = "block"
    # Where a mixture of experts applies the routing probabilities.  False
    # (the count without this field): in the combine, which keeps the
    # experts' outputs for the probabilities' gradient (Megatron-Core up to
    # 0.13: the unpermute with probs).  True: in the experts' activation
    # (Megatron-Core 0.14 on: megatron/core/transformer/moe/experts.py
    # TEGroupedMLP, weighted_bias_swiglu_impl), which keeps the
    # probabilities only; the combine keeps nothing.
    moe_probs_in_activation: bool = False
    # All-to-all context parallelism (context_par_comm "a2a") as Transformer
    # Engine 2.8 on runs it: the attention saves its output in the
    # head-split layout, before the all-to-all back, beside the sequence-split
    # output the projection after it saves (True; transformer_engine/pytorch/
    # attention/dot_product_attention/context_parallel.py
    # AttnFuncWithCPAndQKVOA2A, ``out_part``).  False: one copy.
    cp_a2a_output_copy: bool = False
    # Weight sharding with pipeline stages: where a block's gradients are
    # between the micro-batches of a step.  "sharded": reduce-scattered after
    # each micro-batch's backward (the count without this field); "whole":
    # no gradient sync until the step's last backward, so every block of the
    # stage accumulates its whole (tensor-parallel shard of the) gradient in
    # the reduce datatype (torch.distributed.pipelining's
    # PipelineStage.backward_maybe_with_nosync turns FSDP2's gradient sync off
    # for every backward but the last; FSDP2's
    # FSDPParam.to_accumulated_grad_if_needed accumulates the unsharded
    # gradient in reduce_dtype).
    pipeline_grads: str = "sharded"
    # When the working-datatype logits are alive at the loss's peak beside
    # its fp32 copies: "always" (the count without this field); "pipelined":
    # only with pipeline stages (torchtitan's train loop deletes the logits
    # before backward; a pipeline stage caches its output until the
    # micro-batch's backward).
    logits_kept: str = "always"
    # What a block keeps under selective (mlp_only) recompute: "layers", the
    # model's per-layer count (Megatron's selective MLP recompute; the count
    # without this field); "op_eager" / "op_compiled": torchtitan's per-op
    # policy (activation_checkpoint.selective_ac_option = "op"), which saves
    # the outputs of the SDPA kernel, of the reduce-scatters and of every
    # odd-numbered matmul of the block and recomputes everything else, run
    # eagerly or under torch.compile (which drops the last matmul's output,
    # no backward needs it): autopar.model.block.op_policy_saves.
    selective_saves: str = "layers"
    # Whether an fp8 / fp4 recipe keeps the quantized copy of each weight
    # beside the high-precision one (Transformer Engine's weight workspace,
    # reused across micro-batches; the count without this field); False:
    # the weight is cast at each use and the cast freed (torchao's dynamic
    # float8 scaling, torchtitan's).
    fp8_weight_copy: bool = True
    # Whether that quantized weight is the only copy of a block's linear
    # weight (no working-precision one beside it): Megatron-Core's
    # ``fp8_param_gather`` / ``fp4_param_gather`` ("keep the compute param in
    # fp8 (do not use any other intermediate dtype) and perform the param
    # all-gather in fp8", NVIDIA/Megatron-LM@2a75ac1 megatron/core/distributed/
    # distributed_data_parallel_config.py), which Megatron-Bridge's fp8 / fp4
    # precision recipes turn on (src/megatron/bridge/training/mixed_precision.py
    # bf16_with_fp8_current_scaling_mixed, bf16_with_mxfp8_mixed,
    # bf16_with_nvfp4_mixed).  The fp32 master copy stays with the optimizer.
    # Only with ``fp8_weight_copy``; False (the count without this field): the
    # quantized copy beside the working-precision weight.
    fp8_primary_weights: bool = False
    # Whether, under an fp8 / fp4 recipe, the attention's output projection
    # keeps its input in the working precision (the tensor the attention
    # core already saves for its own backward) instead of its quantized
    # cast: Megatron-Core's ``Attention.__init__`` calls
    # ``set_save_original_input(self.linear_proj)`` for fp8 recipes other
    # than delayed scaling (TE >= 2.6) and for fp4 (TE >= 2.7)
    # (NVIDIA/Megatron-LM@2a75ac1 megatron/core/transformer/attention.py;
    # TE's ``Linear`` then saves ``inp``: NVIDIA/TransformerEngine@d0067d0
    # transformer_engine/pytorch/module/linear.py ``save_original_input``).
    # False (the count without this field): the quantized cast is saved.
    proj_saves_original: bool = False
    # Bytes per trained parameter that the optimizer step allocates as
    # temporaries, after the batch's last backward (activations, logits and
    # the loss's buffers freed): a second peak, the static state and these
    # (``autopar.model.memory.stage_needs``).  PyTorch 2.0's foreach AdamW
    # (torch/optim/adamw.py ``_multi_tensor_adamw``: ``exp_avg_sq_sqrt =
    # _foreach_sqrt(exp_avg_sqs)`` and ``denom = _foreach_add(exp_avg_sq_sqrt,
    # eps)``, both the parameters' size and dtype) on fp32 parameters: 8.
    # 0: not counted (Calculon's meaning).
    optimizer_step_bytes: float = 0.0
    # Bytes per element of a LoRA adapter's input that the framework's
    # adapter keeps for backward beyond the base layer's saved input (added
    # to the adapter layer's activations, ``autopar.model.adapters``).  PEFT
    # 0.5 with lora_dropout > 0 under bf16 autocast (peft/tuners/lora.py
    # ``Linear.forward``: the fp32 input through ``nn.Dropout`` keeps its
    # 1-byte mask, and lora_A's autocast keeps the bf16 cast of the
    # dropped-out input, 2 bytes): 3.  0: the adapter's GEMM shares the base
    # layer's saved input (the count without the field).
    adapter_saved_bytes: float = 0.0
    # Micro-batches a pipeline's first stage holds with interleaving:
    # "calculon", Calculon's p + (p - 1) / v of the stage's blocks (the count
    # without this field); "capped": that, at most the step's micro-batches
    # (the schedule's warm-up runs no more forwards than the m * v there
    # are: torch.distributed.pipelining ScheduleInterleaved1F1B
    # ``get_rank_warmup_ops``, as Megatron's interleaved schedule;
    # autopar.model.memory.first_stage_in_flight).
    pipeline_in_flight: str = "calculon"
    # Whether a pipeline stage keeps a receive buffer per micro-batch of the
    # step for its input and for its output's gradient, per model chunk,
    # allocated when the schedule is set up and kept (torch.distributed.
    # pipelining's PipelineStage ``_prepare_forward_infra`` /
    # ``_prepare_backward_infra``; autopar.model.memory.pipeline_recv_buffers).
    # False: not counted (Calculon's meaning).
    pipeline_recv_buffers: bool = False
    # Transformer Engine's userbuffers for tensor-parallel communication
    # overlap (True): where a row overlaps its tensor-parallel communication
    # (tensor_par > 1, tensor_par_overlap not "none"), Megatron-LM / Bridge
    # ``_initialize_tp_communicators`` calls TE's ``initialize_ub`` with the
    # shape [seq x micro-batch / context_par, hidden], which registers one
    # buffer of that shape for each of TE's 12 overlapped GEMMs and keeps
    # them for the run (autopar.model.memory.userbuffer_bytes).  False: not
    # counted (Calculon's meaning).
    te_userbuffers: bool = False
    # How those userbuffers run the reduce-scatter of the attention's and
    # the MLP's output projections (proj_fprop, fc2_fprop), as a
    # tensor-parallel overlap config sets it: "pipeline" (TE's default:
    # one bf16 buffer of the shape each), "pipeline_fp8" (Megatron-Bridge's
    # PipelineOverlapCfg, whose fp8_buf default is the tuple (False,), which
    # TE reads as true: fp8 buffers in fp8 mode), "ring_exchange" (Bridge's
    # RingExchangeOverlapCfg: TE's CommOverlapP2P reduce-scatter, 2 tp - 1
    # chunks of a tensor_par-th of the shape each, bf16).
    te_userbuffers_rs: str = "pipeline"
    # CUDA graphs (Megatron-Core ``cuda_graph_impl`` / ``cuda_graph_scope``)
    # and what a captured graph keeps beyond eager execution
    # (autopar.model.block.framework_terms, autopar.model.memory):
    # "none" (Calculon's meaning) and "full_iteration" (one graph of the
    # whole forward-backward step: nothing beyond eager counted); "scoped"
    # (TE's make_graphed_callables over parts of each layer: attention,
    # router, MLP or Mamba mixer, the rest eager): the graphs' shared memory
    # pool and the caching allocator keep their free blocks apart, so in
    # backward the largest op of the captured part and of the eager part
    # are both held; "layers" (whole layers captured, Megatron's "local"
    # impl or TE's without a scope): the blocks' largest op beside the
    # eager output layer's on the last stage; "te_layers" (TE's whole-layer
    # graphs, chained graph to graph): that, and each graph's static output
    # held from its forward to its micro-batch's backward beside the next
    # graph's static input it is copied into: one block input per block per
    # micro-batch in flight.
    cuda_graphs: str = "none"
    # Megatron-FSDP's ``optim_grads_params`` (``weight_sharding``) shards the
    # embedding's and the output layer's weights as it shards the blocks'
    # (every parameter group's model-weight buffer is distributed, NVIDIA/
    # Megatron-LM@2a75ac1 megatron/core/distributed/fsdp/src/megatron_fsdp/
    # param_and_grad_buffer.py), and gathers a module outside the FSDP units
    # (the embedding, the output layer) only around its own forward and
    # backward (megatron_fsdp.py ``_param_list_for_submodule_unshard``: a
    # non-unit module unshards its direct parameters;
    # ``release_module_parameters`` after): the head's matrices held as
    # 1 / weight shards each, the output layer's whole weight gathered at
    # the last stage's peak (its forward and backward run around the loss).
    # False: the head's weights whole where the blocks' are sharded
    # (today's count).
    head_weights_sharded: bool = False


@dataclass(frozen=True)
class TimeOverhead:
    """Time a training framework spends beyond the model's own work:
    with pipeline_par > 1 a step takes ``pipeline_fraction`` longer, as the
    stages wait for each other at every synchronising point-to-point
    exchange.  ``moe_block_s``: host time exposed per mixture-of-experts
    block and micro-batch (forward and backward together; a third in the
    forward): dropless routing copies the per-expert token counts to the host
    in every MoE block, which drains the GPU's queue of launched kernels, so
    the block's launches after it are not hidden behind earlier work.
    ``moe_host_op_s``: the same exposure counted instead of stated: host
    time per op the host issues after that sync in one MoE block and
    micro-batch, the ops counted from the framework's MoE layer
    (``autopar.model.overhead.moe_sync_ops``: per local expert, the grouped
    GEMMs' one GEMM each, forward, input- and weight-gradient, and the fp8
    recipes' per-expert quantisations; plus the dispatcher's fixed ops);
    added to ``moe_block_s``.  0: nothing counted.
    ``launch_s``: host time to issue one GPU kernel in an eager framework
    (PyTorch's per-op dispatch and the CUDA launch); a block pass whose
    kernels (counted from its ops, ``autopar.model.overhead``) take less GPU
    time than the host needs to issue them runs at the host's pace.  0: the
    host keeps ahead of the GPU (Calculon's meaning).
    ``attention_speed``: the speed of the framework's fused (Flash)
    attention kernel relative to the system's matrix curve, where the
    framework's kernel is known to run slower or faster than the model's
    default for the execution's ``attention_impl`` (0: that default).
    ``attention_backward_speed``: the same for the kernel's backward pass
    (its counted work: the attention's input gradients and the recomputed
    scores), where the kernel's backward runs at another rate than its
    forward (0: ``attention_speed`` for both passes).
    ``attention_tile``: the query/key tile (tokens) of the fused kernel's
    causal loop: a tile that straddles the diagonal is computed whole, so a
    causal kernel executes (n + 1) / 2n of the dense work for n tiles along
    the keys, not a half (0: exactly a half, the model's count).
    ``grad_accum_bytes``: bytes of memory traffic per weight, per
    micro-batch, of a framework that accumulates each weight gradient
    outside the GEMM that computes it (an optimizer hook adding the fresh
    16-bit gradient into an fp32 buffer: read 2 + read 4 + write 4 = 10);
    added to every weighted layer's weight-gradient pass.  0: the GEMM
    writes or accumulates its gradient in place (Calculon's meaning).
    ``grad_accum_in_gemm``: the framework's weight-gradient GEMMs of the
    linear layers accumulate into the fp32 buffer themselves (Apex's
    gradient-accumulation fusion: ``wgrad_gemm_accum_fp32`` writes into
    ``main_grad``, the layer returns no gradient, so the hook has nothing
    to add), so ``grad_accum_bytes`` applies only to the weighted layers
    that are not GEMMs (norms).  False: to every weighted layer.
    ``adapter_bytes``: bytes the framework's LoRA adapter moves beyond its
    two GEMMs, per element of the adapted layer's input and output, in the
    forward and in the backward pass -- (forward_input, forward_output,
    backward_input, backward_output): its casts, dropout, scaling and the
    add into the base layer's output (``autopar.model.adapters``; zeros:
    the GEMMs only).
    ``tp_overlap_chunks``: the framework overlaps tensor-parallel
    communication (``tensor_par_overlap`` ring / pipe) by decomposing each
    linear layer's GEMM into ``tensor_par`` per-rank chunks, each launched on
    its own as its shard arrives (torch's micro-pipelined async TP,
    ``torch.distributed._symmetric_memory``): each chunk runs at the
    efficiency of its own size on the matrix curve.  False: the overlapped
    GEMM runs at the efficiency of the whole GEMM (Calculon's meaning).
    ``tp_gather_fp8``: with the ``tensorwise`` fp8 recipe the framework
    casts a tensor-parallel all-gather's input to float8 before gathering
    it (the block input before the column-parallel GEMMs in the forward and
    its recompute, the output gradient before the row-parallel GEMMs'
    backward: torchao's Float8ColwiseParallel / Float8RowwiseParallel /
    PrepareFloat8ModuleInput, which torchtitan applies for tensorwise
    float8), so those all-gathers move 1 byte an element; reduce-scatters
    stay in the working precision.  False: every TP collective moves the
    working precision (Calculon's meaning).
    ``fp8_linear_speedup``: a published microbenchmark of the framework's
    low-precision linear layer, per recipe: its forward + backward speed-up
    over the same layer in bf16 on a grid of forward GEMM shapes (M tokens,
    K input and N output features), casts included.  Where a row's recipe
    has one, each of the block's linear layers takes the model's bf16 time
    of that layer divided by the speed-up at the nearest grid shape (log
    scale, clamped to the grid; M of the whole GEMM where it runs as
    per-rank chunks, whose efficiency is in that bf16 time), instead of the
    recipe's matrix rate and counted casts.  Held as ``((recipe, Ms, Ks, Ns, speedups flattened M-major),
    ...)``; empty: the counted rate and casts (Calculon-style).
    ``separate_projections``: the framework's model runs the query, key and
    value projections, and a gated MLP's gate and up projections, as
    separate linear layers (torchtitan's Llama: wq, wk, wv, w1, w3): each
    runs at the efficiency of its own size on the matrix curve (and of its
    own per-rank chunks under ``tp_overlap_chunks``), and a published
    ``fp8_linear_speedup`` is read at each one's shape, combined by its
    share of the work; False: one GEMM of the model's (fused where the model
    fuses them, Calculon's meaning).
    ``cp_ring_impl``: whose ring attention runs a ``context_par_comm: p2p``
    row's context parallelism.  ``te`` (the default): Transformer Engine's
    ``AttnFuncWithCPAndKVP2P`` (Megatron-Core's, Calculon's ring);
    ``torch_allgather`` / ``torch_alltoall``: PyTorch's own
    (``torch.distributed.tensor.experimental.context_parallel``,
    ``_templated_ring_attention``), which rotates K/V by one all-gather or by
    an all-to-all permute per step, merges the steps' outputs in fp32 and
    passes the fp32 dK/dV round the ring in backward
    (``communication.context_exchange``, ``layers.context_parallel_elementwise``)."""
    pipeline_fraction: float = 0.0
    moe_block_s: float = 0.0
    launch_s: float = 0.0
    attention_speed: float = 0.0
    attention_backward_speed: float = 0.0
    attention_tile: int = 0
    grad_accum_bytes: float = 0.0
    grad_accum_in_gemm: bool = False
    adapter_bytes: tuple = (0.0, 0.0, 0.0, 0.0)
    tp_overlap_chunks: bool = False
    tp_gather_fp8: bool = False
    fp8_linear_speedup: tuple = ()
    separate_projections: bool = False
    moe_host_op_s: float = 0.0
    cp_ring_impl: str = "te"


# ``TimeOverhead.cp_ring_impl``: whose context-parallel ring runs.
CP_RING_IMPLS = ("te", "torch_allgather", "torch_alltoall")


@dataclass(frozen=True)
class MemoryHeadroom:
    """How sure the model is of its memory need on this system (written by
    ``autopar calibrate`` from the out-of-memory labels of measured sweeps):
    ``band_GiB``, the half-width of the band of predicted peaks in which the
    measured layouts went either way (between 25% and 75% estimated chance
    of running out), and ``GiB``, the margin below capacity a recommended
    layout keeps by default."""
    GiB: float = 0.0
    band_GiB: float = 0.0


@dataclass(frozen=True)
class SystemSpec:
    matrix: dict              # datatype -> ProcessorSpec
    vector: dict              # datatype -> ProcessorSpec
    mem1: MemorySpec
    mem2: MemorySpec
    processing_mode: str      # "roofline" | "no_overlap"
    networks: tuple           # tuple[NetworkSpec, ...]
    name: str = ""
    source: str = "dict"
    description: str = ""
    # Extension: framework memory overheads on tier 1 (None: Calculon's count).
    memory_overhead: MemoryOverhead | None = None
    # Extension: framework time overheads (None: none, as Calculon).
    time_overhead: TimeOverhead | None = None
    # Extension: the default memory headroom and the uncertainty of the need.
    memory_headroom: MemoryHeadroom | None = None
    # Extension: measured fused-attention kernel rates by the size of a call
    # (None: the matrix curve's, as Calculon; ``read_attention``).
    attention: dict | None = None

    @property
    def datatypes(self) -> tuple[str, ...]:
        """Datatypes the system can run: listed in both matrix and vector."""
        return tuple(d for d in CHOICES["datatype"]
                     if d in self.matrix and d in self.vector and d not in GEMM_ONLY_DATATYPES)

    def tier_holding(self, group: int) -> int:
        """The first network tier that holds ``group`` processors (the last
        tier when none does)."""
        for i, net in enumerate(self.networks):
            if group <= net.size:
                return i
        return len(self.networks) - 1


MODEL_KEYS = ("hidden", "feedforward", "seq_size", "attn_heads", "attn_size",
              "num_blocks")
MODEL_EXTENSION_KEYS = ("block", "kv_heads", "vocab_size", "moe", "mla", "mtp",
                        "hybrid_override_pattern", "mamba", "gdn", "attention_output_gate",
                        "mtp_hybrid_override_pattern", "mtp_use_repeated_layer",
                        "name", "description")
GDN_KEYS = ("key_heads", "value_heads", "key_head_dim", "value_head_dim")
GDN_OPTIONAL_KEYS = ("conv_kernel", "chunk")
MAMBA_KEYS = ("heads", "head_dim", "state")
MAMBA_OPTIONAL_KEYS = ("groups", "conv_kernel", "chunk")
MOE_KEYS = ("experts", "top_k", "expert_feedforward")
MOE_OPTIONAL_KEYS = ("shared_experts", "shared_feedforward", "first_dense", "router",
                     "capacity_factor", "imbalance", "latent_size")
ROUTERS = ("softmax", "sigmoid")
MLA_KEYS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
MLA_OPTIONAL_KEYS = ("q_lora_rank", "sparse_index")
SPARSE_INDEX_KEYS = ("n_heads", "head_dim", "topk")
SPARSE_INDEX_OPTIONAL_KEYS = ("loss",)
BLOCK_TYPES = ("gpt", "llama")
SYSTEM_KEYS = ("matrix", "vector", "mem1", "mem2", "processing_mode", "networks")
SYSTEM_EXTENSION_KEYS = ("name", "description", "memory_overhead", "time_overhead",
                         "memory_headroom", "attention")
PROCESSING_MODES = ("roofline", "no_overlap")
FSDP_RESHARD = ("always", "never", "unless_pipelined")
BACKWARD_TRANSIENT = ("block", "op")
PIPELINE_GRADS = ("sharded", "whole")
LOGITS_KEPT = ("always", "pipelined")
PIPELINE_IN_FLIGHT = ("calculon", "capped")
CUDA_GRAPHS = ("none", "full_iteration", "scoped", "layers", "te_layers")
USERBUFFERS_RS = ("pipeline", "pipeline_fp8", "ring_exchange")
SELECTIVE_SAVES = ("layers", "op_eager", "op_compiled")
NETWORK_KEYS = ("bandwidth", "efficiency", "size", "latency", "ops",
                "must_be_filled", "processor_usage")
NETWORK_OPS = ("p2p", "reduce_scatter", "all_gather", "all_reduce")
# Execution integer fields that count things (>= 1); the *_net tiers are >= 0.
_COUNT_FIELDS = (INT_FIELDS - {"tensor_par_net", "pipeline_par_net", "data_par_net"}) \
    | {"context_par", "expert_par", "expert_tensor_par", "adapter_rank", "sequence_fill"}
# The matrix datatype whose rate an fp8 recipe's GEMMs run at.
FP8_MATRIX = {"tensorwise": "float8", "rowwise": "float8", "mxfp8": "mxfp8",
              "nvfp4": "nvfp4", "mxfp4": "mxfp4"}


# --------------------------------------------------------------------------
# Reading files

def _no_constants(name: str):
    raise ValueError(f"{name} is not a valid JSON number")


def _unique_keys(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def regular_input(path, source: str | None = None, field: str = "(file)") -> Path:
    """An input path that names a regular file (a symlink's target counts), or
    SpecError: a FIFO or a device would block the read or never end, and a
    symlink loop names no file."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise SpecError(source or str(path), field, "no such file") from None
    except OSError as e:
        raise SpecError(source or str(path), field, f"cannot read: {e.strerror or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise SpecError(source or str(path), field, "is a directory, not a file")
    if not stat.S_ISREG(st.st_mode):
        raise SpecError(source or str(path), field,
                        "is not a regular file (a FIFO, device or socket)")
    return p


def read_json(path: str | os.PathLike) -> Any:
    """Parse a JSON (or .json.gz) file; SpecError on any problem."""
    source = str(path)
    p = regular_input(path)
    try:
        if p.suffix == ".gz":
            with gzip.open(p, "rt", encoding="utf-8") as fh:
                text = fh.read()
        else:
            text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(source, "(file)", "no such file") from None
    except IsADirectoryError:
        raise SpecError(source, "(file)", "is a directory, not a file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(source, "(file)", f"cannot read: {e}") from None
    try:
        return json.loads(text, parse_constant=_no_constants,
                          object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as e:
        raise SpecError(source, "(file)",
                        f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}"
                        ) from None
    except ValueError as e:
        raise SpecError(source, "(file)", f"invalid JSON: {e}") from None


def read_yaml(path: str | os.PathLike, source: str, field: str = "(file)",
              syntax_field: str | None = None) -> Any:
    """Parse a YAML file; SpecError naming the line of a syntax error (or
    ``syntax_field`` when YAML gives none) or ``field`` when unreadable."""
    import yaml
    regular_input(path, source, field)
    try:
        return yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f"line {mark.line + 1}" if mark is not None else (syntax_field or field)
        raise SpecError(source, at, f"not valid YAML: {getattr(e, 'problem', None) or e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(source, field, f"cannot read: {e}") from None


def _open(path_or_dict, source: str | None, what: str) -> tuple[dict, str]:
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict), source or "dict"
    if isinstance(path_or_dict, (str, os.PathLike)):
        from autopar.io.shipped import resolve
        path = resolve(path_or_dict)        # systems/..., models/...: shipped ones too
        data, src = read_json(path), source or str(path)
        if not isinstance(data, dict):
            raise SpecError(src, "(root)",
                            f"expected a JSON object ({what}), got {kind_of(data)}")
        return data, src
    raise SpecError(source or "dict", "(root)",
                    f"expected a file path or an object ({what}), got {kind_of(path_or_dict)}")


# --------------------------------------------------------------------------
# Field checks

def kind_of(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, (list, tuple)):
        return "a list"
    if isinstance(v, Mapping):
        return "an object"
    return type(v).__name__


class Checker:
    """Typed getters that raise SpecError naming ``source`` and the field."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, field: str, message: str):
        raise SpecError(self.source, field, message)

    def keys(self, obj, path: str, required, optional=()):
        if not isinstance(obj, Mapping):
            self.fail(path or "(root)", f"expected an object, got {kind_of(obj)}")
        prefix = f"{path}." if path else ""
        for k in obj:
            if k not in required and k not in optional:
                allowed = ", ".join(list(required) + list(optional))
                self.fail(f"{prefix}{k}", f"unknown key (expected: {allowed})")
        for k in required:
            if k not in obj:
                self.fail(f"{prefix}{k}", "missing key")

    def int(self, v, field: str, minimum: int | None = None) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            self.fail(field, f"expected an integer, got {kind_of(v)} {_show(v)}")
        if minimum is not None and v < minimum:
            self.fail(field, f"must be >= {minimum}, got {v}")
        if abs(v) > 2 ** 53:           # the model computes in float64 and int64 columns
            self.fail(field, f"must be at most 2**53, got {v}")
        return int(v)

    def number(self, v, field: str) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            self.fail(field, f"expected a number, got {kind_of(v)} {_show(v)}")
        if not math.isfinite(v):
            self.fail(field, f"must be finite, got {v}")
        return float(v)

    def positive(self, v, field: str) -> float:
        x = self.number(v, field)
        if x <= 0:
            self.fail(field, f"must be > 0, got {_show(v)}")
        return x

    def non_negative(self, v, field: str) -> float:
        x = self.number(v, field)
        if x < 0:
            self.fail(field, f"must be >= 0, got {_show(v)}")
        return x

    def efficiency(self, v, field: str) -> float:
        x = self.number(v, field)
        if not 0 < x <= 1:
            self.fail(field, f"efficiency must be in (0, 1], got {_show(v)}")
        return x

    def within(self, v, field: str, low: float, high: float, unit: str = "",
               high_open: bool = False) -> float:
        """A number in [low, high] ([low, high) with ``high_open``); ``unit``
        follows the range in the message ("seconds", "bytes a parameter")."""
        x = self.number(v, field)
        if not (low <= x < high if high_open else low <= x <= high):
            self.fail(field, f"must be in [{low}, {high}{')' if high_open else ']'}"
                             f"{' ' + unit if unit else ''}, got {_show(v)}")
        return x

    def bool(self, v, field: str) -> bool:
        if not isinstance(v, bool):
            self.fail(field, f"expected true or false, got {kind_of(v)} {_show(v)}")
        return v

    def str(self, v, field: str) -> str:
        if not isinstance(v, str):
            self.fail(field, f"expected a string, got {kind_of(v)} {_show(v)}")
        return v

    def choice(self, v, field: str, choices) -> str:
        self.str(v, field)
        if v not in choices:
            self.fail(field, f"unknown value {v!r} (expected one of: {', '.join(choices)})")
        return v

    def table(self, v, field: str, unit: str) -> tuple[tuple[float, float], ...]:
        """An efficiency table: [[threshold, efficiency], ...], thresholds
        strictly descending and ending at 0 so every size is covered."""
        if not isinstance(v, list) or not v:
            self.fail(field, f"expected a non-empty list of [{unit}, efficiency] pairs, "
                             f"got {kind_of(v)}")
        rows = []
        for i, row in enumerate(v):
            f = f"{field}[{i}]"
            if not isinstance(row, list) or len(row) != 2:
                self.fail(f, f"expected a [{unit}, efficiency] pair, got {_show(row)}")
            t = self.number(row[0], f)
            if t < 0:
                self.fail(f, f"{unit} threshold must be >= 0, got {_show(row[0])}")
            e = self.efficiency(row[1], f)
            if rows and t >= rows[-1][0]:
                self.fail(f, f"{unit} thresholds must be strictly descending "
                             f"({_show(row[0])} after {_show(v[i - 1][0])})")
            rows.append((t, e))
        if rows[-1][0] != 0:
            self.fail(f"{field}[{len(rows) - 1}]",
                      f"the last {unit} threshold must be 0 so that every size is "
                      f"covered, got {_show(v[-1][0])}")
        return tuple(rows)


def _show(v) -> str:
    s = json.dumps(v, default=repr) if not isinstance(v, float) or math.isfinite(v) else str(v)
    return s if len(s) <= 40 else s[:37] + "..."


# --------------------------------------------------------------------------
# Model

def load_model(path_or_dict, source: str | None = None) -> ModelSpec:
    """A model ("application") file or dict -> ModelSpec."""
    if isinstance(path_or_dict, ModelSpec):
        return path_or_dict
    data, src = _open(path_or_dict, source, "a model")
    c = Checker(src)
    c.keys(data, "", MODEL_KEYS, MODEL_EXTENSION_KEYS)
    vals = {k: c.int(data[k], k, minimum=1) for k in MODEL_KEYS}
    block = c.choice(data.get("block", "gpt"), "block", BLOCK_TYPES)
    kv_heads = None
    if data.get("kv_heads") is not None:
        kv_heads = c.int(data["kv_heads"], "kv_heads", minimum=1)
        if vals["attn_heads"] % kv_heads:
            c.fail("kv_heads", f"must divide attn_heads ({vals['attn_heads']}), got {kv_heads}")
    vocab = c.int(data.get("vocab_size", 0), "vocab_size", minimum=0)
    moe = _moe(c, data["moe"], vals) if data.get("moe") is not None else None
    mla = _mla(c, data["mla"]) if data.get("mla") is not None else None
    mtp = c.int(data.get("mtp", 0), "mtp", minimum=0)
    pattern, mamba = _hybrid(c, data, vals, moe, mla, mtp)
    gdn = _gdn(c, data, pattern)
    gate = c.bool(data.get("attention_output_gate", False), "attention_output_gate")
    if gate and not pattern:
        c.fail("attention_output_gate", "is modelled for hybrid models (a pattern with '*')")
    mtp_pattern, mtp_repeated = _hybrid_mtp(c, data, pattern, mtp)
    if "name" in data:
        name = c.str(data["name"], "name")
    else:
        name = _stem(path_or_dict)
    desc = c.str(data.get("description", ""), "description")
    return ModelSpec(**vals, block=block, kv_heads=kv_heads, vocab_size=vocab, moe=moe,
                     mla=mla, mtp=mtp, hybrid_pattern=pattern, mamba=mamba, gdn=gdn,
                     attention_output_gate=gate, mtp_pattern=mtp_pattern,
                     mtp_repeated=mtp_repeated, name=name,
                     source=src, description=desc)


def _hybrid_mtp(c: Checker, data: dict, pattern: str, mtp: int) -> tuple[str, bool]:
    """A model file's ``mtp_hybrid_override_pattern`` (the layers of a hybrid
    model's MTP module, Megatron's name and symbols; each of its kinds must
    be one the model's own pattern has) and ``mtp_use_repeated_layer`` (one
    module run ``mtp`` times), checked."""
    repeated = c.bool(data.get("mtp_use_repeated_layer", False), "mtp_use_repeated_layer")
    if repeated and not mtp:
        c.fail("mtp_use_repeated_layer", "needs mtp >= 1 (the passes of the shared module)")
    raw = data.get("mtp_hybrid_override_pattern")
    if raw is None:
        if mtp and pattern and ("*" not in pattern or not set(pattern) & {"E", "-"}):
            # without its own pattern a hybrid model's mtp module is one
            # transformer layer, an attention and an MoE / MLP layer
            # (autopar.model.moe.mtp_layers; Megatron-Core's GPT MTP layer,
            # as Qwen3-Next runs it)
            c.fail("mtp", "beside hybrid_override_pattern needs attention (*) and MoE (E) or "
                          "MLP (-) layers in the pattern, or mtp_hybrid_override_pattern")
        return "", repeated
    mp = c.str(raw, "mtp_hybrid_override_pattern")
    if not pattern or not mtp:
        c.fail("mtp_hybrid_override_pattern", "needs hybrid_override_pattern and mtp >= 1")
    bad = sorted(set(mp) - set(pattern))
    if not mp or bad:
        c.fail("mtp_hybrid_override_pattern",
               f"must be layers of the kinds hybrid_override_pattern has "
               f"({''.join(sorted(set(pattern)))!r}), got {mp!r}")
    return mp, repeated


def _hybrid(c: Checker, data: dict, vals: dict, moe, mla, mtp) -> tuple[str, "MambaSpec | None"]:
    """The ``hybrid_override_pattern`` and ``mamba`` of a model file, checked:
    one symbol of ``HYBRID_SYMBOLS`` per block (no '|' stage separators: the
    pipeline splits the layers as it splits blocks), Mamba layers need
    ``mamba``, MoE layers ``moe``."""
    mamba = None
    if data.get("mamba") is not None:
        v = data["mamba"]
        c.keys(v, "mamba", MAMBA_KEYS, MAMBA_OPTIONAL_KEYS)
        heads = c.int(v["heads"], "mamba.heads", minimum=1)
        groups = c.int(v.get("groups", 1), "mamba.groups", minimum=1)
        if heads % groups:
            c.fail("mamba.groups", f"must divide mamba.heads ({heads}), got {groups}")
        mamba = MambaSpec(heads=heads, head_dim=c.int(v["head_dim"], "mamba.head_dim", minimum=1),
                          state=c.int(v["state"], "mamba.state", minimum=1), groups=groups,
                          conv_kernel=c.int(v.get("conv_kernel", 4), "mamba.conv_kernel",
                                            minimum=1),
                          chunk=c.int(v.get("chunk", 128), "mamba.chunk", minimum=1))
    if data.get("hybrid_override_pattern") is None:
        if mamba is not None:
            c.fail("mamba", "needs hybrid_override_pattern (which layers are Mamba layers)")
        return "", None
    pattern = c.str(data["hybrid_override_pattern"], "hybrid_override_pattern")
    bad = sorted(set(pattern) - set(HYBRID_SYMBOLS))
    if bad:
        c.fail("hybrid_override_pattern",
               f"unknown layer symbols {''.join(bad)!r}: one of M (Mamba), G (Gated "
               f"DeltaNet), * (attention), "
               f"- (MLP), E (MoE) per layer; '|' stage separators are not supported")
    if len(pattern) != vals["num_blocks"]:
        c.fail("hybrid_override_pattern",
               f"has {len(pattern)} layers, num_blocks is {vals['num_blocks']}")
    if "M" in pattern and mamba is None:
        c.fail("mamba", "the pattern has Mamba layers (M): give mamba.heads, head_dim, state")
    if "E" in pattern and moe is None:
        c.fail("moe", "the pattern has MoE layers (E): give the moe object")
    if moe is not None and "E" not in pattern:
        c.fail("moe", "the pattern has no MoE layers (E)")
    if moe is not None and moe.first_dense:
        c.fail("moe.first_dense", "a hybrid pattern says which layers are dense: leave it out")
    if mla is not None:
        c.fail("hybrid_override_pattern", "not supported with mla")
    return pattern, mamba


def _gdn(c: Checker, data: dict, pattern: str) -> "GatedDeltaNetSpec | None":
    """The ``gdn`` object of a model file, checked against its pattern."""
    if data.get("gdn") is None:
        if "G" in pattern:
            c.fail("gdn", "the pattern has Gated DeltaNet layers (G): give gdn.key_heads, "
                          "value_heads, key_head_dim, value_head_dim")
        return None
    if "G" not in pattern:
        c.fail("gdn", "needs hybrid_override_pattern with Gated DeltaNet layers (G)")
    v = data["gdn"]
    c.keys(v, "gdn", GDN_KEYS, GDN_OPTIONAL_KEYS)
    kh = c.int(v["key_heads"], "gdn.key_heads", minimum=1)
    vh = c.int(v["value_heads"], "gdn.value_heads", minimum=1)
    if vh % kh:
        # (Megatron-Core _GDNBase._prepare_input_for_gated_delta_rule repeats
        # the query and key heads to the value heads)
        c.fail("gdn.value_heads", f"must be a multiple of gdn.key_heads ({kh}), got {vh}")
    return GatedDeltaNetSpec(
        key_heads=kh, value_heads=vh,
        key_head_dim=c.int(v["key_head_dim"], "gdn.key_head_dim", minimum=1),
        value_head_dim=c.int(v["value_head_dim"], "gdn.value_head_dim", minimum=1),
        conv_kernel=c.int(v.get("conv_kernel", 4), "gdn.conv_kernel", minimum=1),
        chunk=c.int(v.get("chunk", 64), "gdn.chunk", minimum=1))


def _moe(c: Checker, v, vals: dict) -> MoESpec:
    c.keys(v, "moe", MOE_KEYS, MOE_OPTIONAL_KEYS)
    experts = c.int(v["experts"], "moe.experts", minimum=1)
    top_k = c.int(v["top_k"], "moe.top_k", minimum=1)
    if top_k > experts:
        c.fail("moe.top_k", f"must be <= moe.experts ({experts}), got {top_k}")
    ffe = c.int(v["expert_feedforward"], "moe.expert_feedforward", minimum=1)
    shared = c.int(v.get("shared_experts", 0), "moe.shared_experts", minimum=0)
    shared_ff = c.int(v.get("shared_feedforward", shared * ffe), "moe.shared_feedforward",
                      minimum=0)
    if shared_ff and not shared:
        c.fail("moe.shared_feedforward", "needs moe.shared_experts >= 1")
    if shared and not shared_ff:
        c.fail("moe.shared_feedforward", "must be >= 1 with shared experts")
    first_dense = c.int(v.get("first_dense", 0), "moe.first_dense", minimum=0)
    if first_dense >= vals["num_blocks"]:
        c.fail("moe.first_dense", f"must be < num_blocks ({vals['num_blocks']}), "
                                  f"got {first_dense}")
    router = c.choice(v.get("router", "softmax"), "moe.router", ROUTERS)
    cap = None
    if v.get("capacity_factor") is not None:
        cap = c.positive(v["capacity_factor"], "moe.capacity_factor")
    imbalance = c.number(v.get("imbalance", 1.0), "moe.imbalance")
    if imbalance < 1.0:
        c.fail("moe.imbalance", f"must be >= 1 (1 = balanced routing), got {_show(v['imbalance'])}")
    if imbalance * top_k > experts:
        c.fail("moe.imbalance", f"the busiest expert cannot take more than every token: "
                                f"imbalance * top_k must be <= experts ({experts})")
    latent = c.int(v.get("latent_size", 0), "moe.latent_size", minimum=0)
    return MoESpec(experts=experts, top_k=top_k, expert_feedforward=ffe,
                   shared_experts=shared, shared_feedforward=shared_ff,
                   first_dense=first_dense, router=router, capacity_factor=cap,
                   imbalance=imbalance, latent_size=latent)


def _mla(c: Checker, v) -> MLASpec:
    c.keys(v, "mla", MLA_KEYS, MLA_OPTIONAL_KEYS)
    a = _mla_fields(c, v)
    d = a.sparse_index
    if d is not None and d.head_dim < a.qk_rope_head_dim:
        # the indexer rotates the first qk_rope_head_dim of its head
        # (megatron/core/transformer/experimental_attention_variant/dsa.py
        # DSAIndexer._apply_rope)
        c.fail("mla.sparse_index.head_dim",
               f"must be >= mla.qk_rope_head_dim ({a.qk_rope_head_dim})")
    return a


def _mla_fields(c: Checker, v) -> MLASpec:
    return MLASpec(kv_lora_rank=c.int(v["kv_lora_rank"], "mla.kv_lora_rank", minimum=1),
                   qk_nope_head_dim=c.int(v["qk_nope_head_dim"], "mla.qk_nope_head_dim",
                                          minimum=1),
                   qk_rope_head_dim=c.int(v["qk_rope_head_dim"], "mla.qk_rope_head_dim",
                                          minimum=0),
                   v_head_dim=c.int(v["v_head_dim"], "mla.v_head_dim", minimum=1),
                   q_lora_rank=c.int(v.get("q_lora_rank", 0), "mla.q_lora_rank", minimum=0),
                   sparse_index=(_sparse_index(c, v["sparse_index"])
                                 if v.get("sparse_index") is not None else None))


def _sparse_index(c: Checker, v) -> SparseIndexSpec:
    f = "mla.sparse_index"
    c.keys(v, f, SPARSE_INDEX_KEYS, SPARSE_INDEX_OPTIONAL_KEYS)
    return SparseIndexSpec(n_heads=c.int(v["n_heads"], f + ".n_heads", minimum=1),
                           head_dim=c.int(v["head_dim"], f + ".head_dim", minimum=1),
                           topk=c.int(v["topk"], f + ".topk", minimum=1),
                           loss=c.bool(v.get("loss", True), f + ".loss"))


def model_to_json(model: ModelSpec) -> dict:
    """ModelSpec -> Calculon application dict (extension keys only when set)."""
    out = {k: getattr(model, k) for k in MODEL_KEYS}
    if model.block != "gpt":
        out["block"] = model.block
    if model.kv_heads is not None:
        out["kv_heads"] = model.kv_heads
    if model.vocab_size:
        out["vocab_size"] = model.vocab_size
    if model.moe is not None:
        m = model.moe
        moe = {"experts": m.experts, "top_k": m.top_k, "expert_feedforward": m.expert_feedforward}
        if m.shared_experts:
            moe["shared_experts"] = m.shared_experts
            if m.shared_feedforward != m.shared_experts * m.expert_feedforward:
                moe["shared_feedforward"] = m.shared_feedforward
        if m.first_dense:
            moe["first_dense"] = m.first_dense
        if m.router != "softmax":
            moe["router"] = m.router
        if m.capacity_factor is not None:
            moe["capacity_factor"] = _num(m.capacity_factor)
        if m.imbalance != 1.0:
            moe["imbalance"] = _num(m.imbalance)
        if m.latent_size:
            moe["latent_size"] = m.latent_size
        out["moe"] = moe
    if model.mla is not None:
        a = model.mla
        out["mla"] = {"kv_lora_rank": a.kv_lora_rank, "qk_nope_head_dim": a.qk_nope_head_dim,
                      "qk_rope_head_dim": a.qk_rope_head_dim, "v_head_dim": a.v_head_dim}
        if a.q_lora_rank:
            out["mla"]["q_lora_rank"] = a.q_lora_rank
        if a.sparse_index is not None:
            d = a.sparse_index
            out["mla"]["sparse_index"] = {"n_heads": d.n_heads, "head_dim": d.head_dim,
                                          "topk": d.topk}
            if not d.loss:
                out["mla"]["sparse_index"]["loss"] = False
    if model.mtp:
        out["mtp"] = model.mtp
    if model.hybrid_pattern:
        out["hybrid_override_pattern"] = model.hybrid_pattern
    if model.mtp_pattern:
        out["mtp_hybrid_override_pattern"] = model.mtp_pattern
    if model.mtp_repeated:
        out["mtp_use_repeated_layer"] = True
    if model.mamba is not None:
        mb = model.mamba
        out["mamba"] = {"heads": mb.heads, "head_dim": mb.head_dim, "state": mb.state,
                        "groups": mb.groups, "conv_kernel": mb.conv_kernel, "chunk": mb.chunk}
    if model.gdn is not None:
        g = model.gdn
        out["gdn"] = {"key_heads": g.key_heads, "value_heads": g.value_heads,
                      "key_head_dim": g.key_head_dim, "value_head_dim": g.value_head_dim,
                      "conv_kernel": g.conv_kernel, "chunk": g.chunk}
    if model.attention_output_gate:
        out["attention_output_gate"] = True
    if model.name:
        out["name"] = model.name
    if model.description:
        out["description"] = model.description
    return out


def _stem(path_or_dict) -> str:
    if isinstance(path_or_dict, (str, os.PathLike)):
        name = Path(path_or_dict).name
        for suffix in (".gz", ".json"):
            name = name.removesuffix(suffix)
        return name
    return ""


# --------------------------------------------------------------------------
# System

def _processor(c: Checker, v, path: str) -> dict:
    if not isinstance(v, Mapping):
        c.fail(path, f"expected an object of datatypes, got {kind_of(v)}")
    if not v:
        c.fail(path, "lists no datatype")
    out = {}
    for dt, spec in v.items():
        f = f"{path}.{dt}"
        if dt not in CHOICES["datatype"]:
            c.fail(f, f"unknown datatype (expected one of: {', '.join(CHOICES['datatype'])})")
        c.keys(spec, f, ("tflops", "gflops_efficiency"))
        out[dt] = ProcessorSpec(
            tflops=c.positive(spec["tflops"], f"{f}.tflops"),
            gflops_efficiency=c.table(spec["gflops_efficiency"],
                                      f"{f}.gflops_efficiency", "GFLOP"))
    return out


def _memory(c: Checker, v, path: str, optional: bool = False) -> MemorySpec:
    """A memory tier; an ``optional`` tier (mem2) may be absent: GiB 0."""
    c.keys(v, path, ("GiB", "GBps", "MB_efficiency"))
    size = c.positive if not optional else c.non_negative
    return MemorySpec(GiB=size(v["GiB"], f"{path}.GiB"),
                      GBps=size(v["GBps"], f"{path}.GBps"),
                      MB_efficiency=c.table(v["MB_efficiency"],
                                            f"{path}.MB_efficiency", "MB"))


def _network(c: Checker, v, path: str) -> NetworkSpec:
    c.keys(v, path, NETWORK_KEYS)
    ops_path = f"{path}.ops"
    c.keys(v["ops"], ops_path, NETWORK_OPS)
    ops = {}
    for op in NETWORK_OPS:
        f = f"{ops_path}.{op}"
        pair = v["ops"][op]
        if not isinstance(pair, list) or len(pair) != 2:
            c.fail(f, f"expected a [scale, offset] pair, got {_show(pair)}")
        scale = c.positive(pair[0], f)
        if op == "p2p":
            if pair[1] is not None:
                c.fail(f, f"p2p takes no offset: write [scale, null], got {_show(pair)}")
            offset = 0.0
        else:
            if pair[1] is None:
                c.fail(f, f"{op} needs a numeric offset, got null")
            offset = c.number(pair[1], f)
        ops[op] = (scale, offset)
    usage = c.within(v["processor_usage"], f"{path}.processor_usage", 0, 1, high_open=True)
    latency = c.number(v["latency"], f"{path}.latency")
    if latency < 0:
        c.fail(f"{path}.latency", f"must be >= 0, got {_show(v['latency'])}")
    return NetworkSpec(
        bandwidth=c.positive(v["bandwidth"], f"{path}.bandwidth"),
        efficiency=c.efficiency(v["efficiency"], f"{path}.efficiency"),
        size=c.int(v["size"], f"{path}.size", minimum=1),
        latency=latency,
        ops=ops,
        must_be_filled=c.bool(v["must_be_filled"], f"{path}.must_be_filled"),
        processor_usage=usage)


def load_system(path_or_dict, source: str | None = None) -> SystemSpec:
    """A system file or dict -> SystemSpec."""
    if isinstance(path_or_dict, SystemSpec):
        return path_or_dict
    data, src = _open(path_or_dict, source, "a system")
    c = Checker(src)
    c.keys(data, "", SYSTEM_KEYS, SYSTEM_EXTENSION_KEYS)
    matrix = _processor(c, data["matrix"], "matrix")
    vector = _processor(c, data["vector"], "vector")
    mem1 = _memory(c, data["mem1"], "mem1")
    mem2 = _memory(c, data["mem2"], "mem2", optional=True)
    mode = c.choice(data["processing_mode"], "processing_mode", PROCESSING_MODES)
    nets = data["networks"]
    if not isinstance(nets, list) or not nets:
        c.fail("networks", f"expected a non-empty list of networks, got {_show(nets)}")
    networks = tuple(_network(c, n, f"networks[{i}]") for i, n in enumerate(nets))
    name = c.str(data["name"], "name") if "name" in data else _stem(path_or_dict)
    desc = c.str(data.get("description", ""), "description")
    overhead = read_memory_overhead(c, data["memory_overhead"]) \
        if "memory_overhead" in data else None
    time_overhead = read_time_overhead(c, data["time_overhead"]) \
        if "time_overhead" in data else None
    headroom = read_memory_headroom(c, data["memory_headroom"], mem1.GiB) \
        if "memory_headroom" in data else None
    attention = read_attention(c, data["attention"]) if "attention" in data else None
    spec = SystemSpec(matrix=matrix, vector=vector, mem1=mem1, mem2=mem2,
                      processing_mode=mode, networks=networks, name=name,
                      source=src, description=desc, memory_overhead=overhead,
                      time_overhead=time_overhead, memory_headroom=headroom,
                      attention=attention)
    if not spec.datatypes:
        c.fail("vector", "no datatype is listed in both matrix and vector")
    return spec


def _num(x: float):
    """JSON-friendly number: integral floats written as ints (312 not 312.0)."""
    return int(x) if float(x).is_integer() and abs(x) < 2**53 else x


def system_to_json(system: SystemSpec) -> dict:
    """SystemSpec -> Calculon system dict."""
    def proc(p: dict) -> dict:
        return {dt: {"tflops": _num(s.tflops),
                     "gflops_efficiency": [[_num(t), e] for t, e in s.gflops_efficiency]}
                for dt, s in p.items()}

    def mem(m: MemorySpec) -> dict:
        return {"GiB": _num(m.GiB), "GBps": _num(m.GBps),
                "MB_efficiency": [[_num(t), e] for t, e in m.MB_efficiency]}

    def net(n: NetworkSpec) -> dict:
        ops = {op: [n.ops[op][0], None if op == "p2p" else _num(n.ops[op][1])]
               for op in NETWORK_OPS}
        return {"bandwidth": _num(n.bandwidth), "efficiency": n.efficiency,
                "size": n.size, "latency": n.latency, "ops": ops,
                "must_be_filled": n.must_be_filled,
                "processor_usage": n.processor_usage}

    out: dict = {}
    if system.name:
        out["name"] = system.name
    if system.description:
        out["description"] = system.description
    out.update({"matrix": proc(system.matrix), "vector": proc(system.vector),
                "mem1": mem(system.mem1), "mem2": mem(system.mem2),
                "processing_mode": system.processing_mode,
                "networks": [net(n) for n in system.networks]})
    if system.memory_overhead is not None:
        out["memory_overhead"] = memory_overhead_json(system.memory_overhead)
    if system.time_overhead is not None:
        out["time_overhead"] = time_overhead_json(system.time_overhead)
    if system.memory_headroom is not None:
        out["memory_headroom"] = memory_headroom_json(system.memory_headroom)
    if system.attention is not None:
        out["attention"] = attention_json(system.attention)
    return out


ATTENTION_PASSES = ("fwd", "bwd")


def read_attention(c: "Checker", o, path: str = "attention") -> dict:
    """A system's ``attention`` record -> ``{datatype: {head_dim: {"fwd":
    table, "bwd": table}}}``: the fused (causal) attention kernel's measured
    rate, a fraction of the datatype's matrix peak on the work it executes
    (FlashAttention's count: forward 2 x (d + dv) x b x h x s^2 / 2, backward
    2.5 x the forward), by the GFLOP of one forward call (that executed
    forward work), per query/key head size ``head_dim``.  Tables as the
    matrix curves' (descending GFLOP thresholds ending at 0).  A row whose
    datatype or head size the record does not list keeps the matrix curve's
    rate (``layers.flash_attention``)."""
    if not isinstance(o, Mapping) or not o:
        c.fail(path, f"expected an object of datatypes, got {_show(o)}")
    out = {}
    for dt, by_dim in o.items():
        f = f"{path}.{dt}"
        if dt not in CHOICES["datatype"]:
            c.fail(f, f"unknown datatype (expected one of: {', '.join(CHOICES['datatype'])})")
        if not isinstance(by_dim, Mapping) or not by_dim:
            c.fail(f, f"expected an object of head sizes, got {_show(by_dim)}")
        out[dt] = {}
        for dim, passes in by_dim.items():
            g = f"{f}.{dim}"
            if not (isinstance(dim, str) and dim.isdigit() and int(dim) > 0):
                c.fail(g, f"expected a positive head size, got {_show(dim)}")
            c.keys(passes, g, ATTENTION_PASSES)
            out[dt][int(dim)] = {p: c.table(passes[p], f"{g}.{p}", "GFLOP")
                                 for p in ATTENTION_PASSES}
    return out


def attention_json(a: dict) -> dict:
    """The ``attention`` record as its file writes it."""
    return {dt: {str(d): {p: [[_num(t), e] for t, e in tab[p]] for p in ATTENTION_PASSES}
                 for d, tab in by_dim.items()} for dt, by_dim in a.items()}


# --------------------------------------------------------------------------
# The software records a system file may carry and a framework file carries
# (autopar.io.frameworks): read once here, for both.

def read_memory_overhead(c: "Checker", o, path: str = "memory_overhead") -> MemoryOverhead:
    """A ``memory_overhead`` object -> MemoryOverhead (fields as the class says)."""
    c.keys(o, path, (), ("reserved_GiB", "fraction", "logits_fp32_copies",
                         "logits_gathered", "checkpoint_split", "master_weight_bytes",
                         "autograd_inputs", "fsdp_reshard", "dummy_wgrad",
                         "wgrad_accumulation_fusion",
                         "backward_transient", "moe_probs_in_activation",
                         "cp_a2a_output_copy", "pipeline_grads",
                         "logits_kept", "selective_saves", "fp8_weight_copy",
                         "fp8_primary_weights", "proj_saves_original",
                         "optimizer_step_bytes",
                         "adapter_saved_bytes", "pipeline_in_flight",
                         "pipeline_recv_buffers", "te_userbuffers", "te_userbuffers_rs",
                         "cuda_graphs", "head_weights_sharded"))
    reserved = c.number(o.get("reserved_GiB", 0.0), f"{path}.reserved_GiB")
    fraction = c.within(o.get("fraction", 0.0), f"{path}.fraction", 0, 1, high_open=True)
    if reserved < 0:
        c.fail(f"{path}.reserved_GiB", f"must be >= 0, got {reserved}")
    copies = c.number(o.get("logits_fp32_copies", 1.0), f"{path}.logits_fp32_copies")
    if copies < 0:
        c.fail(f"{path}.logits_fp32_copies", f"must be >= 0, got {copies}")
    gathered = c.bool(o.get("logits_gathered", False), f"{path}.logits_gathered")
    split = c.bool(o.get("checkpoint_split", False), f"{path}.checkpoint_split")
    master = c.within(o.get("master_weight_bytes", 4.0), f"{path}.master_weight_bytes", 0, 4)
    autograd = c.bool(o.get("autograd_inputs", False), f"{path}.autograd_inputs")
    reshard = c.choice(o.get("fsdp_reshard", "always"), f"{path}.fsdp_reshard", FSDP_RESHARD)
    dummy = c.bool(o.get("dummy_wgrad", False), f"{path}.dummy_wgrad")
    fusion = c.bool(o.get("wgrad_accumulation_fusion", False),
                    f"{path}.wgrad_accumulation_fusion")
    transient = c.choice(o.get("backward_transient", "block"), f"{path}.backward_transient",
                         BACKWARD_TRANSIENT)
    probs = c.bool(o.get("moe_probs_in_activation", False), f"{path}.moe_probs_in_activation")
    a2a_copy = c.bool(o.get("cp_a2a_output_copy", False), f"{path}.cp_a2a_output_copy")
    grads = c.choice(o.get("pipeline_grads", "sharded"), f"{path}.pipeline_grads",
                     PIPELINE_GRADS)
    kept = c.choice(o.get("logits_kept", "always"), f"{path}.logits_kept", LOGITS_KEPT)
    saves = c.choice(o.get("selective_saves", "layers"), f"{path}.selective_saves",
                     SELECTIVE_SAVES)
    fp8_copy = c.bool(o.get("fp8_weight_copy", True), f"{path}.fp8_weight_copy")
    fp8_primary = c.bool(o.get("fp8_primary_weights", False), f"{path}.fp8_primary_weights")
    proj_original = c.bool(o.get("proj_saves_original", False),
                           f"{path}.proj_saves_original")
    step = c.within(o.get("optimizer_step_bytes", 0.0), f"{path}.optimizer_step_bytes", 0, 64,
                    "bytes a parameter")
    saved = c.within(o.get("adapter_saved_bytes", 0.0), f"{path}.adapter_saved_bytes", 0, 64,
                     "bytes an element")
    in_flight = c.choice(o.get("pipeline_in_flight", "calculon"), f"{path}.pipeline_in_flight",
                         PIPELINE_IN_FLIGHT)
    recv = c.bool(o.get("pipeline_recv_buffers", False), f"{path}.pipeline_recv_buffers")
    ub = c.bool(o.get("te_userbuffers", False), f"{path}.te_userbuffers")
    graphs = c.choice(o.get("cuda_graphs", "none"), f"{path}.cuda_graphs", CUDA_GRAPHS)
    ub_rs = c.choice(o.get("te_userbuffers_rs", "pipeline"), f"{path}.te_userbuffers_rs",
                     USERBUFFERS_RS)
    head_sharded = c.bool(o.get("head_weights_sharded", False), f"{path}.head_weights_sharded")
    return MemoryOverhead(reserved, fraction, copies, gathered, split, master, autograd,
                          reshard, dummy_wgrad=dummy, backward_transient=transient,
                          moe_probs_in_activation=probs, cp_a2a_output_copy=a2a_copy,
                          pipeline_grads=grads, logits_kept=kept, selective_saves=saves,
                          fp8_weight_copy=fp8_copy, fp8_primary_weights=fp8_primary,
                          proj_saves_original=proj_original,
                          optimizer_step_bytes=step, adapter_saved_bytes=saved,
                          pipeline_in_flight=in_flight, pipeline_recv_buffers=recv,
                          wgrad_accumulation_fusion=fusion, te_userbuffers=ub,
                          te_userbuffers_rs=ub_rs, cuda_graphs=graphs,
                          head_weights_sharded=head_sharded)


def read_time_overhead(c: "Checker", o, path: str = "time_overhead") -> TimeOverhead:
    """A ``time_overhead`` object -> TimeOverhead."""
    c.keys(o, path, (), ("pipeline_fraction", "moe_block_s", "launch_s", "attention_speed",
                         "attention_backward_speed", "attention_tile", "grad_accum_bytes",
                         "grad_accum_in_gemm", "adapter_elementwise_bytes", "tp_overlap_chunks",
                         "tp_gather_fp8", "fp8_linear_speedup", "separate_projections",
                         "moe_host_op_s", "cp_ring_impl"))
    frac = c.within(o.get("pipeline_fraction", 0.0), f"{path}.pipeline_fraction", 0, 1,
                    high_open=True)
    moe_s = c.within(o.get("moe_block_s", 0.0), f"{path}.moe_block_s", 0, 1, "seconds",
                     high_open=True)
    launch = c.within(o.get("launch_s", 0.0), f"{path}.launch_s", 0, 0.01, "seconds",
                      high_open=True)
    moe_op = c.within(o.get("moe_host_op_s", 0.0), f"{path}.moe_host_op_s", 0, 0.01,
                      "seconds", high_open=True)
    speed = c.within(o.get("attention_speed", 0.0), f"{path}.attention_speed", 0, 2)
    bw = c.within(o.get("attention_backward_speed", 0.0), f"{path}.attention_backward_speed",
                  0, 2)
    tile = c.int(o.get("attention_tile", 0), f"{path}.attention_tile", minimum=0)
    accum = c.within(o.get("grad_accum_bytes", 0.0), f"{path}.grad_accum_bytes", 0, 64, "bytes")
    in_gemm = c.bool(o.get("grad_accum_in_gemm", False), f"{path}.grad_accum_in_gemm")
    ab = (0.0, 0.0, 0.0, 0.0)
    if "adapter_elementwise_bytes" in o:
        ap = f"{path}.adapter_elementwise_bytes"
        a = o["adapter_elementwise_bytes"]
        if not isinstance(a, dict):
            c.fail(ap, f"expected an object of {', '.join(ADAPTER_BYTES_KEYS)}")
        c.keys(a, ap, (), ADAPTER_BYTES_KEYS)
        ab = tuple(c.within(a.get(k, 0.0), f"{ap}.{k}", 0, 1000, "bytes an element")
                   for k in ADAPTER_BYTES_KEYS)
    chunks = c.bool(o.get("tp_overlap_chunks", False), f"{path}.tp_overlap_chunks")
    gather8 = c.bool(o.get("tp_gather_fp8", False), f"{path}.tp_gather_fp8")
    tables = read_fp8_linear_speedup(c, o.get("fp8_linear_speedup", {}),
                                     f"{path}.fp8_linear_speedup")
    split = c.bool(o.get("separate_projections", False), f"{path}.separate_projections")
    ring = c.choice(o.get("cp_ring_impl", "te"), f"{path}.cp_ring_impl", CP_RING_IMPLS)
    return TimeOverhead(frac, moe_s, launch, speed, attention_backward_speed=bw,
                        attention_tile=tile, grad_accum_bytes=accum,
                        grad_accum_in_gemm=in_gemm, adapter_bytes=ab,
                        tp_overlap_chunks=chunks, tp_gather_fp8=gather8,
                        fp8_linear_speedup=tables, separate_projections=split,
                        moe_host_op_s=moe_op, cp_ring_impl=ring)


# The fp8 recipes ``time_overhead.fp8_linear_speedup`` may hold a table for.
FP8_SPEEDUP_RECIPES = ("tensorwise", "rowwise", "mxfp8")


def read_fp8_linear_speedup(c: "Checker", o, path: str) -> tuple:
    """``{recipe: {"M": [...], "K": [...], "N": [...], "speedup": [M][K][N]}}``
    -> ``((recipe, Ms, Ks, Ns, speedups flattened M-major), ...)``."""
    if not isinstance(o, dict):
        c.fail(path, f"expected an object of recipe -> table, got {kind_of(o)}")
    out = []
    for recipe, t in o.items():
        rp = f"{path}.{recipe}"
        if recipe not in FP8_SPEEDUP_RECIPES:
            c.fail(rp, f"not an fp8 recipe with a table ({', '.join(FP8_SPEEDUP_RECIPES)})")
        if not isinstance(t, dict):
            c.fail(rp, f"expected an object with M, K, N and speedup, got {kind_of(t)}")
        c.keys(t, rp, ("M", "K", "N", "speedup"), ("source",))
        axes = []
        for a in ("M", "K", "N"):
            v = t[a]
            if not isinstance(v, list) or not v:
                c.fail(f"{rp}.{a}", "expected a non-empty list of sizes")
            v = [c.number(x, f"{rp}.{a}") for x in v]
            if any(x < 1 for x in v) or any(b <= a_ for a_, b in zip(v, v[1:])):
                c.fail(f"{rp}.{a}", "sizes must be >= 1 and increasing")
            axes.append(tuple(v))
        sp = t["speedup"]
        flat = []
        shape_ok = isinstance(sp, list) and len(sp) == len(axes[0])
        for plane in sp if shape_ok else ():
            if not isinstance(plane, list) or len(plane) != len(axes[1]):
                shape_ok = False
                break
            for line in plane:
                if not isinstance(line, list) or len(line) != len(axes[2]):
                    shape_ok = False
                    break
                flat.extend(c.number(x, f"{rp}.speedup") for x in line)
        if not shape_ok:
            c.fail(f"{rp}.speedup", f"expected {len(axes[0])} x {len(axes[1])} x "
                   f"{len(axes[2])} nested lists (M, K, N)")
        if any(not 0 < x <= 10 for x in flat):
            c.fail(f"{rp}.speedup", "every speed-up must be in (0, 10]")
        out.append((recipe, *axes, tuple(flat)))
    return tuple(out)


# The keys of ``time_overhead.adapter_elementwise_bytes`` (TimeOverhead.adapter_bytes).
ADAPTER_BYTES_KEYS = ("forward_input", "forward_output", "backward_input", "backward_output")


def read_memory_headroom(c: "Checker", o, capacity_GiB: float | None = None,
                         path: str = "memory_headroom") -> MemoryHeadroom:
    """A ``memory_headroom`` object -> MemoryHeadroom; with ``capacity_GiB``
    (tier 1's), the headroom must be below it."""
    c.keys(o, path, (), ("GiB", "band_GiB"))
    vals = []
    for k in ("GiB", "band_GiB"):
        x = c.number(o.get(k, 0.0), f"{path}.{k}")
        if x < 0:
            c.fail(f"{path}.{k}", f"must be >= 0, got {x}")
        vals.append(x)
    if capacity_GiB is not None and vals[0] >= capacity_GiB:
        c.fail(f"{path}.GiB", f"must be below mem1.GiB ({capacity_GiB}), got {vals[0]}")
    return MemoryHeadroom(*vals)


def memory_overhead_json(o: MemoryOverhead) -> dict:
    """MemoryOverhead -> its JSON record: the four Calculon-era fields always,
    every later field only where it differs from its default (a file that
    predates a field reads the same), in declaration order."""
    out = {"reserved_GiB": _num(o.reserved_GiB), "fraction": o.fraction,
           "logits_fp32_copies": _num(o.logits_fp32_copies),
           "logits_gathered": o.logits_gathered}
    for f in dataclass_fields(MemoryOverhead)[4:]:
        v = getattr(o, f.name)
        if v != f.default:
            out[f.name] = _num(v) if isinstance(v, float) else v
    return out


def time_overhead_json(t: TimeOverhead) -> dict:
    out = {"pipeline_fraction": _num(t.pipeline_fraction)}
    for k in ("moe_block_s", "moe_host_op_s", "launch_s", "attention_speed",
              "attention_backward_speed", "attention_tile", "grad_accum_bytes"):
        if getattr(t, k):
            out[k] = _num(getattr(t, k))
    if any(t.adapter_bytes):
        out["adapter_elementwise_bytes"] = {k: _num(x) for k, x in
                                            zip(ADAPTER_BYTES_KEYS, t.adapter_bytes)}
    if t.grad_accum_in_gemm:
        out["grad_accum_in_gemm"] = True
    if t.tp_overlap_chunks:
        out["tp_overlap_chunks"] = True
    if t.tp_gather_fp8:
        out["tp_gather_fp8"] = True
    if t.separate_projections:
        out["separate_projections"] = True
    if t.cp_ring_impl != "te":
        out["cp_ring_impl"] = t.cp_ring_impl
    if t.fp8_linear_speedup:
        out["fp8_linear_speedup"] = {
            r: {"M": list(ms), "K": list(ks), "N": list(ns),
                "speedup": [[[_num(v[(i * len(ks) + j) * len(ns) + k]) for k in range(len(ns))]
                             for j in range(len(ks))] for i in range(len(ms))]}
            for r, ms, ks, ns, v in t.fp8_linear_speedup}
    return out


def memory_headroom_json(h: MemoryHeadroom) -> dict:
    return {"GiB": _num(h.GiB), "band_GiB": _num(h.band_GiB)}


# --------------------------------------------------------------------------
# Execution

def _check_split(c: "Checker", out: dict, model: ModelSpec | None) -> None:
    """The pipeline split fields (uneven pipelines) that no layout can use:
    the combinations Megatron-Core's TransformerConfig refuses
    (transformer_config.py ``__post_init__``: first/last stage blocks with the
    embedding or loss counted, a layout with first/last stage blocks), a
    split without a pipeline, and more stage blocks than the model has."""
    first, last = out.get("first_stage_blocks", 0), out.get("last_stage_blocks", 0)
    counted = [f for f in ("embedding_in_split", "loss_in_split") if out.get(f)]
    named = [f for f in ("first_stage_blocks", "last_stage_blocks") if out.get(f)]
    if named and counted:
        c.fail(named[0], f"cannot be set with {counted[0]} (Megatron refuses "
                         f"num_layers_in_first/last_pipeline_stage with "
                         f"account_for_embedding/loss_in_pipeline_split)")
    if named and out.get("pipeline_layout", "even") != "even":
        c.fail("pipeline_layout", f"{out['pipeline_layout']!r} cannot be set with {named[0]} "
                                  f"(a layout fixes every stage)")
    layout = out.get("pipeline_layout", "even")
    if layout not in ("even", "balanced"):
        if counted:
            c.fail("pipeline_layout", f"{layout!r} cannot be set with {counted[0]} (Megatron: "
                                      f"pipeline_model_parallel_layout cannot be set with "
                                      f"other pipeline layout arguments)")
        stages = parse_layout(layout)
        if out.get("pipeline_par", 1) > 1 and "pipeline_interleaving" in out:
            # (a decoder layer t is a block, or two of a hybrid pattern's
            # mixer + MLP pairs: decoder_layer_counts)
            t = sum(st.count("t") for st in stages)
            layers = None if model is None or t in decoder_layer_counts(model) \
                else model.num_blocks
            why = layout_problem(stages, out["pipeline_par"], out["pipeline_interleaving"],
                                 layers, model.mtp if model is not None else None)
            if why:
                c.fail("pipeline_layout", f"{layout!r} {why}")
    split = named + counted + (["pipeline_layout"] if out.get("pipeline_layout", "even")
                               != "even" else [])
    if split and out["pipeline_par"] == 1:
        c.fail(split[0], "needs pipeline_par > 1 (a split of the blocks over pipeline stages)")
    if model is not None and first + last > model.num_blocks:
        c.fail(named[0], f"first_stage_blocks + last_stage_blocks = {first + last} exceeds "
                         f"the model's {model.num_blocks} blocks")


def _check_offload_blocks(c: "Checker", out: dict, model: ModelSpec | None) -> None:
    """``activation_offload_blocks`` where Megatron-Core takes
    ``cpu_offloading_num_layers`` (NVIDIA/Megatron-LM@2a75ac1
    megatron/core/transformer/transformer_config.py ``__post_init__``): in
    training, without pipeline parallelism, without activation recompute
    (nor the all-activations ``activations_offload``), below the model's
    blocks (Transformer Engine's ``get_cpu_offload_context`` keeps the last
    layer on the GPU).  Only the fields the file states are checked."""
    n = out.get("activation_offload_blocks", 0)
    if not n:
        return
    why = None
    if out.get("training") is False:
        why = "needs training (offloads the activations saved for backward)"
    elif out.get("pipeline_par", 1) != 1:
        why = (f"needs pipeline_par 1: Megatron-Core has no CPU offloading with pipeline "
               f"parallelism (pipeline_par {out['pipeline_par']})")
    elif out.get("activation_recompute", "none") != "none" or out.get("recompute_moe_act") \
            or out.get("recompute_mla_up_proj"):
        why = "cannot be set with activation recompute (Megatron-Core refuses the two together)"
    elif out.get("activations_offload"):
        why = "cannot be set with activations_offload (that offloads every block already)"
    elif model is not None and n >= model.num_blocks:
        why = (f"{n} must be below the model's {model.num_blocks} blocks (the last block's "
               f"activations stay on the GPU)")
    if why:
        c.fail("activation_offload_blocks", why)


def _check_fine_offload(c: "Checker", out: dict, model: ModelSpec | None) -> None:
    """``activation_offload_modules`` where autopar counts Megatron-Core's
    fine-grained activation offloading (``autopar.io.layouts``): in training,
    not beside ``cpu_offloading`` (``activation_offload_blocks``: Megatron-Core's
    ``TransformerConfig.__post_init__``, NVIDIA/Megatron-LM@2a75ac1, asserts
    the two apart), not beside ``activations_offload``, without full recompute
    (a fully recomputed block saves only its input), and the experts' modules
    only for a model with routed experts.  Only the fields the file states
    are checked."""
    mods = out.get("activation_offload_modules", "none")
    if mods == "none":
        return
    why = None
    if out.get("training") is False:
        why = "needs training (offloads the activations saved for backward)"
    elif out.get("activation_offload_blocks", 0):
        why = ("cannot be set with activation_offload_blocks (Megatron-Core refuses "
               "fine_grained_activation_offloading beside cpu_offloading)")
    elif out.get("activations_offload"):
        why = "cannot be set with activations_offload (that offloads every block already)"
    elif out.get("activation_recompute") == "full":
        why = ("cannot be set with activation_recompute full (a recomputed block saves only "
               "its input; autopar counts the modules' saved tensors of blocks that keep them)")
    elif model is not None and model.moe is None and (
            set(EXPERT_OFFLOAD_MODULES) & set(mods.split("+"))):
        why = f"{mods} names expert modules, and the model has no routed experts"
    if why:
        c.fail("activation_offload_modules", why)


def _check_counts(c: "Checker", out: dict, model: ModelSpec | None) -> None:
    """Counts beyond what the model has: ``recompute_layers`` above the blocks
    of a pipeline stage (Megatron-Core's ``TransformerConfig.__post_init__``,
    megatron/core/transformer/transformer_config.py, takes
    recompute_num_layers up to num_layers // pipeline_model_parallel_size;
    the model's rules say the same of a searched layout)."""
    k = out.get("recompute_layers", 0)
    pp = out.get("pipeline_par", 1)
    if model is None or pp < 1:
        return
    per = model.num_blocks // pp
    if k > per:
        c.fail("recompute_layers", f"{k} exceeds the {per} blocks of a pipeline stage "
                                   f"(num_blocks {model.num_blocks} // pipeline_par {pp})")
    # The recipe's BF16 blocks: each count at most a stage's blocks
    # (transformer_config.py ``__post_init__``, max_bf16_layers_per_pipeline_stage).
    for f in ("bf16_first_blocks", "bf16_last_blocks"):
        n = out.get(f, 0)
        if n > per and out.get("fp8_recipe", "none") != "none":
            c.fail(f, f"{n} exceeds the {per} blocks of a pipeline stage "
                      f"(num_blocks {model.num_blocks} // pipeline_par {pp})")


def execution_value(c: "Checker", f: str, v, path: str | None = None):
    """One value of execution field ``f`` checked as a file's would be: a
    choice, a flag, or an integer (>= 1 for counts, >= 0 for tiers)."""
    path = path or f
    if f == "pipeline_layout" and isinstance(v, str) and v not in CHOICES[f]:
        # Megatron-Core's pipeline_model_parallel_layout string, parsed once
        # here (autopar.io.layouts.layout_code; checked against the model and
        # the pipeline sizes in _check_split)
        try:
            layout_code(v)
        except ValueError as e:
            c.fail(path, f"{v!r}: {e}")
        return v
    if f == "activation_offload_modules":
        # a set of module names (autopar.io.layouts.offload_modules_value)
        v = offload_modules_value(v)
        if isinstance(v, tuple):
            c.fail(path, v[1])
    if f in CHOICES:
        return c.choice(v, path, CHOICES[f])
    if f in BOOL_FIELDS:
        return c.bool(v, path)
    return c.int(v, path, minimum=1 if f in _COUNT_FIELDS else 0)


def load_execution(path_or_dict, system: SystemSpec | None = None,
                   source: str | None = None, model: ModelSpec | None = None,
                   defaults: Mapping | None = None) -> dict:
    """An execution file or dict -> dict of the 23 fields in FIELDS order,
    followed by the extension fields that differ from their defaults.

    Extensions (optional): ``attention_impl`` (unfused | fused_softmax |
    flash_v1 | flash_v2), ``fused_norm`` (bool), ``context_par`` (>= 1),
    ``context_par_net``, ``context_par_comm`` (p2p | a2a | allgather: DSA models only), ``weight_sharding``
    (bool), ``sharding_group`` and ``recompute_layers`` (>= 0), ``fp8_recipe``
    (none | tensorwise | rowwise | mxfp8 | nvfp4 | mxfp4) (see
    ``autopar.io.layouts``), and the pair some Calculon forks write:
    ``attention_type: "flash"`` (multi-head attention with a FlashAttention-2
    kernel) and ``structure_type`` ("gpt" | "llama"), which
    must match the model's ``block`` when ``model`` is given.
    ``defaults`` (a framework's recipe defaults, already checked) fill the
    fields the file does not state.
    With ``system``, also checks that the datatype is one the system runs
    (listed in both matrix and vector) and that the network tiers exist.
    """
    data, src = _open(path_or_dict, source, "an execution")
    if defaults:
        data = {**defaults, **data}
    return _check_execution(data, src, system, model)


# A field of an execution file given as null or "?" is unknown (a partial
# layout, ``load_partial_execution``).
UNKNOWN_MARKS = (None, "?")
# Fields a partial layout must state: they define the case (processors, batch,
# datatype, training or inference), not how it is laid out.
CASE_FIELDS = ("num_procs", "batch_size", "datatype", "training")


def load_partial_execution(path_or_dict, system: SystemSpec | None = None,
                           source: str | None = None, model: ModelSpec | None = None,
                           missing_unknown: bool = False,
                           defaults: Mapping | None = None) -> tuple[dict, tuple[str, ...]]:
    """A partial execution file or dict -> (stated, unknown).

    A field given as ``null`` or ``"?"`` is unknown; with ``missing_unknown``
    so is every one of Calculon's 23 fields the file leaves out (extension
    fields left out keep their defaults, as in a full execution).  ``stated``
    holds the other fields, checked as ``load_execution`` checks them, with
    every extension field not unknown at its value (defaults included);
    ``unknown`` the unknown fields in ``ALL_FIELDS`` order.  The fields of
    ``CASE_FIELDS`` cannot be unknown.  ``defaults`` (a framework's recipe
    defaults) fill the fields the file leaves out that are not unknown.
    """
    data, src = _open(path_or_dict, source, "an execution")
    unknown = {f for f, v in data.items() if v is None or (isinstance(v, str) and v == "?")}
    if missing_unknown:
        unknown |= {f for f in FIELDS if f not in data}
    if defaults:
        data = {**{f: v for f, v in defaults.items() if f not in unknown}, **data}
    c = Checker(src)
    for f in sorted(unknown, key=lambda f: (f not in ALL_FIELDS, f)):
        if f not in ALL_FIELDS:
            c.keys({f: None}, "", (), ALL_FIELDS + ("structure_type",))
            c.fail(f, "cannot be unknown: only execution fields can")
        if f in CASE_FIELDS:
            c.fail(f, "cannot be unknown: it defines the case (processors, batch, datatype, "
                      "training); state it")
    known = {f: v for f, v in data.items() if f not in unknown}
    out = _check_execution(known, src, system, model, required=tuple(
        f for f in FIELDS if f not in unknown))
    stated = {f: out.get(f, EXT_DEFAULTS.get(f)) for f in ALL_FIELDS
              if f not in unknown and (f in out or f in EXT_DEFAULTS)}
    return stated, tuple(f for f in ALL_FIELDS if f in unknown)


def _check_execution(data: dict, src: str, system: SystemSpec | None,
                     model: ModelSpec | None, required: tuple = FIELDS) -> dict:
    """The checks of ``load_execution`` on a parsed execution object: the
    ``required`` fields present, every value typed, the system's datatype and
    network tiers."""
    c = Checker(src)
    c.keys(data, "", required, tuple(f for f in ALL_FIELDS if f not in required)
           + ("structure_type",))
    data = dict(data)
    if data.get("attention_type") == "flash":
        data["attention_type"] = "multihead"
        data.setdefault("attention_impl", "flash_v2")
    if "structure_type" in data:
        st = c.choice(data["structure_type"], "structure_type", BLOCK_TYPES)
        if model is not None and st != model.block:
            c.fail("structure_type", f"{st!r} does not match the model's block "
                                     f"{model.block!r}")
    out = {}
    for f in ALL_FIELDS:
        if f not in data:
            continue
        out[f] = execution_value(c, f, data[f])
        if f in EXT_DEFAULTS and out[f] == EXT_DEFAULTS[f]:
            del out[f]
    _check_split(c, out, model)
    _check_counts(c, out, model)
    _check_offload_blocks(c, out, model)
    _check_fine_offload(c, out, model)
    if out.get("optimizer_outer_sharding"):
        # Megatron-FSDP's outer_dp_sharding_strategy "optim" needs full
        # sharding within an instance and more than one instance.
        g, dp = out.get("sharding_group", 0), out.get("data_par")
        if not out.get("weight_sharding") or g <= 0 or (isinstance(dp, int) and g >= dp):
            c.fail("optimizer_outer_sharding",
                   "true needs weight_sharding true and 0 < sharding_group < data_par "
                   "(the optimizer state sharded across instances of sharded weights; "
                   f"here weight_sharding {bool(out.get('weight_sharding'))}, "
                   f"sharding_group {g}, data_par {dp})")
    if out.get("sequence_fill", 100) > 100:
        c.fail("sequence_fill", f"{out['sequence_fill']} exceeds 100 (the percentage of a "
                                f"sequence's tokens that are real)")
    if out.get("optimizer_moment_bytes", 4) not in MOMENT_BYTES:
        c.fail("optimizer_moment_bytes", f"{out['optimizer_moment_bytes']} is not a moment "
                                         f"width autopar counts: 4 (fp32) or 2 (bf16)")
    if model is not None and out.get("attention_span", 0) > model.seq_size:
        c.fail("attention_span", f"{out['attention_span']} exceeds the model's seq_size "
                                 f"{model.seq_size} (the keys a query of a packed document "
                                 f"attends to)")
    if system is not None:
        if out.get("datatype") in GEMM_ONLY_DATATYPES:
            c.fail("datatype", f"{out['datatype']!r} is a GEMM rate, not a working datatype: "
                               f"use datatype bfloat16 with fp8_recipe {out['datatype']}")
        if "datatype" in out and out["datatype"] not in system.datatypes:
            where = system.source if system.source != "dict" else "the system"
            c.fail("datatype", f"{out['datatype']!r} is not supported by {where} "
                               f"(it runs: {', '.join(system.datatypes)})")
        n = len(system.networks)
        recipe = out.get("fp8_recipe", "none")
        if recipe != "none" and FP8_MATRIX[recipe] not in system.matrix:
            where = system.source if system.source != "dict" else "the system"
            c.fail("fp8_recipe", f"{recipe!r} needs a {FP8_MATRIX[recipe]} matrix rate, which "
                                 f"{where} does not list")
        for f in ("tensor_par_net", "pipeline_par_net", "data_par_net", "context_par_net",
                  "expert_par_net", "expert_tensor_par_net"):
            if out.get(f, 0) >= n:
                c.fail(f, f"network tier {out[f]} does not exist: the system has "
                          f"{n} network{'s' if n != 1 else ''} (tiers 0..{n - 1})")
    return out
