"""LoRA / QLoRA adapters as layers of a block (``autopar.model.finetune`` says
which rows train adapters and on which matrices; this module builds their
layers with ``autopar.model.layers.layer``)."""
from __future__ import annotations

import numpy as np

from autopar.model.finetune import targeted
from autopar.model.layers import layer


def adapter_layers(ctx, B, shapes, **kw) -> list:
    """The adapters of the matrices ``shapes`` ((name, n, k) on a processor,
    for ``B`` tokens), as (layer, rows that have it) pairs; none where no
    row has adapters."""
    if ctx.frozen is None:
        return []
    r = ctx.adapter_rank
    out = []
    for name, n, k in shapes:
        rows = targeted(ctx, name)
        if not np.any(rows):
            continue
        w = r * (n + k)
        flops = 2.0 * B * w
        L = layer(ctx, fw=flops, agrad=flops, wgrad=flops, inputs=B * n, outputs=B * k,
                  act=B * r, weight=w, weight_grads=w, optim=2.0 * w, matrix=True,
                  adapter=True, factored=n + 2.0 * r + k, **kw)
        # Backward reads the output's gradient (the base layer's) too.
        L["mem_agrad"] = L["mem_agrad"] + B * k * ctx.elem_bytes
        # The framework's element-wise work around the two GEMMs
        # (time_overhead.adapter_elementwise_bytes): casts, dropout, the
        # scaling and the add into the base output, and their backward.
        fw_in, fw_out, bw_in, bw_out = ctx.adapter_bytes
        if fw_in or fw_out or bw_in or bw_out:
            L["mem_fw"] = L["mem_fw"] + B * (n * fw_in + k * fw_out)
            L["mem_agrad"] = L["mem_agrad"] + B * (n * bw_in + k * bw_out)
        # What the framework's adapter keeps for backward beyond ``x A``
        # and the base layer's input (memory_overhead.adapter_saved_bytes:
        # PEFT's dropout mask and the bf16 cast lora_A saves), in training.
        if ctx.adapter_saved_bytes:
            L["keep_b"] = ctx.if_training(B * n * ctx.adapter_saved_bytes + ctx.zeros)
        out.append((L, rows))
    return out
