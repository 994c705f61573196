"""What every layer of a block needs to know about its layout, as columns.

``LayoutContext`` gathers, once per chunk of layouts, the quantities the
layer formulas share: bytes per element of the datatype, the tensor-parallel
size and how its communication is done, the divisors that optimizer
sharding applies to footprints, the compute engines and memory tiers, and
the processing mode (Calculon's ``roofline`` takes the slower of compute and
memory; ``no_overlap`` adds them).
"""
from __future__ import annotations

import numpy as np

from autopar.io.layouts import BYTES_PER_ELEMENT, CHOICES
from autopar.io.specs import ModelSpec, SystemSpec
from autopar.model.hardware import ComputeEngine, MemoryTier, NetworkTier


def is_choice(column: np.ndarray, field: str, value: str) -> np.ndarray:
    """Rows whose string-coded ``field`` is ``value``."""
    return column == CHOICES[field].index(value)


class LayoutContext:
    """Per-row quantities shared by all layers of a block."""

    def __init__(self, model: ModelSpec, system: SystemSpec, cols: dict, datatypes):
        self.model = model
        self.n = len(cols["tensor_par"])
        self.training = cols["training"]
        self.elem_bytes = np.array([BYTES_PER_ELEMENT[d] for d in CHOICES["datatype"]],
                                   dtype=float)[cols["datatype"]]
        self.matrix = ComputeEngine(system.matrix, cols["datatype"], datatypes)
        self.vector = ComputeEngine(system.vector, cols["datatype"], datatypes)
        self.mem1 = MemoryTier(system.mem1)
        self.mem2 = MemoryTier(system.mem2)
        self.roofline = system.processing_mode == "roofline"
        self.tp = cols["tensor_par"].astype(float)
        # Optimizer sharding divides the optimizer state (and, unless the
        # gradients are kept whole, the weight gradients) over data_par.
        shards = np.where(cols["optimizer_sharding"], cols["data_par"], 1)
        self.optim_shards = shards.astype(float)
        self.grad_shards = np.where(cols.get("unsharded_grads", False), 1.0,
                                    self.optim_shards)
        self.tp_net = NetworkTier(system.networks, cols["tensor_par_net"])
        comm = cols["tensor_par_comm_type"]
        # Sequence parallelism: reduce-scatter + all-gather instead of all-reduce.
        self.tp_rs_ag = is_choice(comm, "tensor_par_comm_type", "rs_ag")
        # The same split only at the edges of a block (point-to-point variant).
        self.tp_p2p = is_choice(comm, "tensor_par_comm_type", "p2p_rs_ag")
        self.tp_pipe_overlap = is_choice(cols["tensor_par_overlap"], "tensor_par_overlap",
                                         "pipe")
        # Mixture of experts: expert weights are spread over expert_par x
        # expert_tensor_par processors; their gradients are synchronised, and
        # their optimizer state sharded, over the expert-data-parallel group
        # (tensor_par * data_par / (EP * ETP), as Megatron lays EP over TP x DP).
        one = np.ones(self.n, dtype=np.int64)
        self.ep = cols.get("expert_par", one).astype(float)
        self.etp = cols.get("expert_tensor_par", one).astype(float)
        self.edp = np.maximum(cols["data_par"] * cols["tensor_par"] / (self.ep * self.etp), 1.0)
        self.expert_optim_shards = np.where(cols["optimizer_sharding"], self.edp, 1.0)
        self.expert_grad_shards = np.where(cols.get("unsharded_grads", False), 1.0,
                                           self.expert_optim_shards)
        self.ep_net = NetworkTier(system.networks, cols.get("expert_par_net", one * 0))
        self.etp_net = NetworkTier(system.networks, cols.get("expert_tensor_par_net", one * 0))
        self.moe_allgather = is_choice(cols.get("moe_dispatcher", one * 0), "moe_dispatcher",
                                       "allgather")
        self.moe_overlap = cols.get("moe_overlap", np.zeros(self.n, dtype=bool))
        self.zeros = np.zeros(self.n)

    def processing_time(self, flops_time, mem_time):
        """Time of work that computes ``flops_time`` and moves ``mem_time``."""
        if self.roofline:
            return np.maximum(flops_time, mem_time)
        return flops_time + mem_time
