"""Optimizers as a model of their state and their step: ``optimizer``.

A layer's optimizer state (fp32 elements, before data-parallel sharding) and
the FLOPs of its elementwise update per parameter, per row's ``optimizer``
(``autopar.io.layouts``), and Muon's Newton-Schulz orthogonalisation of the
blocks' matrices with the transfers it needs (``newton_schulz``), charged
to the optimizer step of the batch.

* ``adam`` (Adam/AdamW; Calculon's count, the default): two fp32 moments a
  parameter (``exp_avg``, ``exp_avg_sq``: torch/optim/adam.py ``_init_group``)
  and 11 FLOPs a parameter (Calculon's ``layers.py``).
* ``sgd`` (SGD with momentum): one fp32 momentum buffer a parameter
  (torch/optim/sgd.py, ``momentum_buffer``); its update ``buf = mu * buf +
  g`` and ``p = p - lr * buf`` is 4 FLOPs a parameter.
* ``adafactor`` (Shazeer & Stern 2018, "Adafactor: Adaptive Learning Rates
  with Sublinear Memory Cost", Alg. 4 with beta1 = 0, the paper's and
  transformers' ``Adafactor(beta1=None)`` default): a matrix keeps a row and
  a column second-moment vector (rows + columns elements), a vector its full
  second moment; no first moment.  Its update counts 12 FLOPs a parameter:
  the squared gradient plus epsilon (2), the row and column sums (2), the
  reconstructed second moment ``R_i C_j / sum(R)`` (2), ``g / sqrt(v)``
  (2), the update's RMS for clipping (2), the clipped update of the weight
  (2).
* ``muon`` (K. Jordan, "Muon: An optimizer for hidden layers in neural
  networks", kellerjordan.github.io/posts/muon, 2024; J. Liu et al., "Muon is
  Scalable for LLM Training", arXiv:2502.16982, 2025): the matrices of the
  blocks keep one fp32 momentum buffer; the rest (norm vectors, the
  embedding and the output layer) are trained by AdamW as the Muon recipes
  do (Moonshot's Moonlight, Keller Jordan's modded-nanogpt).  The
  elementwise part counts 9 FLOPs a parameter: momentum ``buf = mu * buf
  + g`` (2), the Nesterov step ``g + mu * buf`` (2), the shape scale of the
  update (1), decoupled weight decay (2), the update (2).  Each matrix's
  update is then orthogonalised by five Newton-Schulz iterations
  (``zeropower_via_newtonschulz5``): for X of m x n (m <= n, transposed
  otherwise) an iteration computes ``A = X X^T`` (2 m^2 n FLOPs), ``B = b A
  + c A A`` (2 m^3) and ``X = a X + B X`` (2 m^2 n): ``2 (2 m^2 n + m^3)``
  FLOPs, at the matrix rate of the working datatype (the iterations run in
  bfloat16).

Where Newton-Schulz runs (our choice, stated): it needs whole matrices, so
each matrix is orthogonalised once, by one owner among the ranks that hold
pieces of it (the tensor-parallel ranks and, with ``optimizer_sharding``,
the data-parallel shards), as Moonshot's Distributed Muon gathers the
partitioned gradient of a matrix, computes its full update and keeps only
the local part (arXiv:2502.16982, Sec. 2.3, Algorithm 3).  Per rank that is
1 / (tensor_par x shards) of the block's Newton-Schulz FLOPs, and every
rank sends its share of each matrix (the fp32 momentum-updated gradient) to
its owner and receives its share of the update back: over ``g`` ranks
``(g - 1) / g`` of its share each way, charged as two all-gathers of the
shares on the tier of that group (the shards on the data-parallel tier, the
tensor-parallel ranks on theirs), not overlapped with anything.  Without
sharding and tensor parallelism every data-parallel replica orthogonalises
every matrix itself and nothing moves.  The Newton-Schulz workspace (a few
matrix-sized bfloat16 buffers, transient) is not counted.
"""
from __future__ import annotations

import numpy as np

from autopar.io.layouts import CHOICES

_OPT = CHOICES["optimizer"]
ADAM, SGD, MUON, ADAFACTOR = (_OPT.index(n) for n in ("adam", "sgd", "muon", "adafactor"))

# Elementwise FLOPs of the update per parameter (see the module's docstring).
STEP_FLOPS = {"adam": 11.0, "sgd": 4.0, "muon": 9.0, "adafactor": 12.0}
# Newton-Schulz iterations of Muon (zeropower_via_newtonschulz5).
NS_STEPS = 5


def newton_schulz_flops(m: float, n: float, steps: int = NS_STEPS) -> float:
    """FLOPs of ``steps`` Newton-Schulz iterations on an m x n matrix."""
    m, n = min(m, n), max(m, n)
    return steps * 2.0 * (2.0 * m * m * n + m ** 3)


def layer_state(ctx, optim, is_matrix: bool, factored):
    """(fp32 optimizer-state elements, update FLOPs per parameter) of a
    layer, per row: ``optim`` is Adam's count (two moments a weight),
    ``is_matrix`` whether its weights are matrices, ``factored`` the rows +
    columns of its matrices (Adafactor).  Only called where some row does
    not use Adam (``ctx.optimizer`` set)."""
    opt = ctx.optimizer
    one = optim / 2.0
    sgd, muon, ada = opt == SGD, opt == MUON, opt == ADAFACTOR
    if is_matrix:
        state = np.where(sgd | muon, one, np.where(ada, np.where(optim > 0, factored, 0.0),
                                                   optim))
        per = np.where(sgd, STEP_FLOPS["sgd"], np.where(
            muon, STEP_FLOPS["muon"], np.where(ada, STEP_FLOPS["adafactor"],
                                               STEP_FLOPS["adam"])))
    else:
        # Vectors: Muon trains them by AdamW.
        state = np.where(sgd | ada, one, optim)
        per = np.where(sgd, STEP_FLOPS["sgd"], np.where(
            ada, STEP_FLOPS["adafactor"], STEP_FLOPS["adam"]))
    return state, per


def head_state_bytes(ctx):
    """fp32 optimizer-state bytes per parameter (scaled by the caller to
    ``ctx.moment_bytes``) of the embedding and output
    layer (before sharding): Adam's 8 (also under Muon, whose recipes train
    them by AdamW), SGD's momentum 4, Adafactor's factored state (V + h per
    V x h matrix: about none)."""
    if ctx.optimizer is None:
        return 8.0
    V, h = float(ctx.model.vocab_size), float(ctx.model.hidden)
    factored = 4.0 * (V + h) / (V * h) if V > 0 else 0.0
    opt = ctx.optimizer
    return np.where(opt == SGD, 4.0, np.where(opt == ADAFACTOR, factored, 8.0))


def block_matrices(model, kind: str = "dense") -> tuple[list, list]:
    """The whole weight matrices of one block, as (rows, columns) pairs:
    (those split over tensor_par, the routed experts' split over
    expert_tensor_par).  Attention: Q, K, V and the output projection (or
    multi-head latent attention's); the MLP (SwiGLU: gate and up apart; a
    MoE block: the shared experts' MLP); each routed expert's two matrices
    (the first two wide under SwiGLU, as the grouped GEMM has it).  The
    MoE router is left to AdamW with the vectors."""
    h = float(model.hidden)
    H, d = float(model.attn_heads), float(model.attn_size)
    KV = float(model.kv_heads or model.attn_heads)
    llama = model.block == "llama"
    mats = []
    if model.mla is not None:
        a = model.mla
        dqk = float(a.qk_head_dim)
        if a.q_lora_rank:
            mats += [(h, float(a.q_lora_rank)), (float(a.q_lora_rank), H * dqk)]
        else:
            mats.append((h, H * dqk))
        mats += [(h, float(a.kv_lora_rank + a.qk_rope_head_dim)),
                 (float(a.kv_lora_rank), H * (a.qk_nope_head_dim + a.v_head_dim)),
                 (H * a.v_head_dim, h)]
    else:
        mats += [(h, H * d), (h, KV * d), (h, KV * d), (H * d, h)]
    f = float(model.moe.shared_feedforward if kind == "moe" else model.feedforward)
    if f > 0:
        mats += ([(h, f), (h, f)] if llama else [(h, f)]) + [(f, h)]
    experts = []
    if kind == "moe":
        fe = float(model.moe.expert_feedforward)
        w = float(model.moe.latent_size or h)
        experts = [(w, 2 * fe if llama else fe), (fe, w)] * int(model.moe.experts)
        if model.moe.latent_size:
            # LatentMoE's down and up projections (whole on every
            # tensor-parallel rank: autopar.model.moe._latent_projections)
            mats += [(h, w), (w, h)]
    return mats, experts


def newton_schulz(ctx, cols: dict, blocks_per_stage, networks):
    """Muon's Newton-Schulz orthogonalisation per batch and row: seconds of
    its compute and of its exchanges (see the module's docstring), 0 where
    the row does not use Muon, does not train, or freezes its base weights
    (adapters' matrices are orthogonalised too, but are small: not
    counted)."""
    if ctx.optimizer is None:
        return 0.0
    on = (ctx.optimizer == MUON) & ctx.training
    if ctx.frozen is not None:
        on = on & ~ctx.frozen
    if not on.any():
        return 0.0
    from autopar.model.hardware import NetworkTier
    model = ctx.model
    tp, shards = ctx.tp, ctx.optim_shards
    kinds = [("dense", float(model.num_blocks))]
    if model.moe is not None:
        first = float(model.moe.first_dense)
        kinds = [("dense", first), ("moe", float(model.num_blocks) - first)]
    flops_d = flops_x = params_d = params_x = 0.0
    for kind, count in kinds:
        mats, experts = block_matrices(model, kind)
        w = count / float(model.num_blocks)
        flops_d += w * sum(newton_schulz_flops(m, n) for m, n in mats)
        params_d += w * sum(m * n for m, n in mats)
        flops_x += w * sum(newton_schulz_flops(m, n) for m, n in experts)
        params_x += w * sum(m * n for m, n in experts)
    per_block = flops_d / (tp * shards)
    if params_x:
        per_block = per_block + flops_x / (ctx.ep * ctx.etp * ctx.expert_optim_shards)
    compute = ctx.matrix.time(per_block)
    tp_net = NetworkTier(networks, cols["tensor_par_net"])
    dp_net = NetworkTier(networks, cols["data_par_net"])

    def exchange(net, whole, group):
        """Shares of ``whole`` bytes over ``group`` ranks to their owners
        and back."""
        return np.where(group > 1, 2.0 * net.time("all_gather", whole / group,
                                                  np.maximum(group, 2)), 0.0)

    # (the tensor-parallel group shares the whole matrices, the shards of a
    # data-parallel group a rank's tensor-parallel part of them)
    comm = exchange(tp_net, 4.0 * params_d, tp) \
        + exchange(dp_net, 4.0 * params_d / tp, shards)
    if params_x:
        x_shards = ctx.expert_optim_shards
        comm = comm + exchange(tp_net, 4.0 * params_x / ctx.ep, ctx.etp) \
            + exchange(dp_net, 4.0 * params_x / (ctx.ep * ctx.etp), x_shards)
    return np.where(on, blocks_per_stage * (compute + comm), 0.0)
