"""Kernel weight layouts made at load: every weight a kernel of a kernel table (`--kernels stand-in | nki`) reads is
converted into its kernel layout once, before any graph is traced, and kept on the weight tensor
(nki_kernels/weight_layouts.py). A traced region then reads the converted tensors as graph inputs and converts
nothing; a layout missing there raises one line (nki_kernels/kernel_ops.py `KernelOps._layout`).

What each module's weights become (the ops that read them in brackets):
* `Linear` (dense): the transposed weight in its own dtype [linear; the fused attention tail's wo_b]; stored
  FP8: trn2 e4m3 codes + fp32 scales [fp8_linear]; stored FP4: packed bytes + fp32 scales [fp4_linear];
* an attention's `wo_a`: the grouped [G*K/G, R] layout in the compute dtype [grouped_out_proj]; its `wo_b` dense
  in the compute dtype (dequantised if stored) and that transposed [hc_attn_out]; `attn_sink` as [H, 1] fp32
  [sparse_attn];
* a block's `hc_{attn,ffn}_fn` transposed fp32 (scale, base: fp32 already) [hc_mixes];
* a stacked MoE's `stack_w1/w2/w3`: the stack of its experts' layouts [stack_linear] (the per-expert views are not
  converted again);
* norm weights are fp32 already (nothing to convert) [rms_norm].
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn


def prepare(model: nn.Module, kops: Any, dtype: torch.dtype) -> Counter[str]:
    """Convert every kernel weight of `model` for `kops` (a `KernelOps`) with activations in `dtype`; returns how
    many weights got each layout kind."""
    from engine.model.attention import Attention
    from engine.model.block import Block
    from engine.model.layers import Linear, RMSNorm
    from engine.model.moe import MoE

    done: Counter[str] = Counter()

    def conv(kind: str, weight: torch.Tensor, *deps: torch.Tensor, **kw: Any) -> None:
        kops.prepare(kind, weight, *deps, **kw)
        done[kind] += 1

    stacked = {id(lin) for m in model.modules() if isinstance(m, MoE) and m._stacked
               for ex in m.experts if ex is not None for lin in ex.modules() if isinstance(lin, Linear)}
    for m in model.modules():
        if isinstance(m, MoE) and m._stacked:
            for w in m._WEIGHTS:
                fmt = getattr(m.experts[m.local.start], w).fmt
                stack = getattr(m, f"stack_{w}")
                if fmt is None:
                    conv("stackT", stack, dt=dtype)
                else:
                    conv(f"stack_{fmt}", stack, getattr(m, f"stack_{w}_scale"))
        elif isinstance(m, Linear) and id(m) not in stacked:
            if m.fmt is None:
                conv("T", m.weight, dt=m.weight.dtype)
            else:
                conv("trn2_fp8" if m.fmt == "fp8" else "fp4", m.weight, m.scale)
        elif isinstance(m, Attention):
            conv("woaT", m.wo_a.weight, dt=dtype, groups=int(m.cfg.o_groups))
            conv("T", m.wo_b.dense(dtype), dt=dtype)
            conv("sink", m.attn_sink)
        elif isinstance(m, Block):
            for site in ("attn", "ffn"):
                conv("fnT", getattr(m, f"hc_{site}_fn"))
                conv("fp32", getattr(m, f"hc_{site}_scale"))
                conv("fp32", getattr(m, f"hc_{site}_base"))
        elif isinstance(m, RMSNorm):
            conv("fp32", m.weight)
    return done
