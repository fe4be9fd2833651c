"""MoE FFN (shared/spec/deepseek_v4.md §2.6): sqrt-softplus gate, bias for selection only, hash-routed layers via
`tid2eid`, routed scaling, one shared expert, SwiGLU with clamps. Routed experts may be a subset (expert
parallelism): `local_experts` says which ones this process holds; the exchange is `engine/parallel.py`'s job."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.config import ModelConfig
from engine.model.layers import Linear, _empty
from nki_kernels.reference import gate_scores, linear, route, swiglu


class Gate(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.topk, self.route_scale = cfg.n_activated_experts, cfg.route_scale
        self.hash = cfg.is_hash_layer(layer_id)
        self.weight = _empty(cfg.n_routed_experts, cfg.dim)
        if self.hash:
            self.tid2eid = _empty(cfg.vocab_size, cfg.n_activated_experts, dtype=torch.int64)
        else:
            self.bias = _empty(cfg.n_routed_experts)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = gate_scores(x, self.weight)  # [T, E]
        if self.hash:
            return route(scores, self.topk, self.route_scale, hash_ids=self.tid2eid[input_ids])
        return route(scores, self.topk, self.route_scale, bias=self.bias)


class Expert(nn.Module):
    def __init__(self, dim: int, inter_dim: int, limit: float) -> None:
        super().__init__()
        self.w1 = Linear(dim, inter_dim)
        self.w2 = Linear(inter_dim, dim)
        self.w3 = Linear(dim, inter_dim)
        self.limit = limit

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, dim] -> fp32 [T, dim]; the routing weight [T, 1] multiplies before w2 (official order)."""
        h = swiglu(linear(x, self.w1.weight), linear(x, self.w3.weight), self.limit)  # [T, inter] fp32
        if weights is not None:
            h = h * weights
        return linear(h.to(x.dtype), self.w2.weight).float()


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, local_experts: range | None = None) -> None:
        super().__init__()
        self.n_experts = cfg.n_routed_experts
        self.local = local_experts if local_experts is not None else range(cfg.n_routed_experts)
        self.gate = Gate(cfg, layer_id)
        self.experts = nn.ModuleList(
            [Expert(cfg.dim, cfg.moe_inter_dim, cfg.swiglu_limit) if i in self.local else None
             for i in range(cfg.n_routed_experts)])
        self.shared_experts = Expert(cfg.dim, cfg.moe_inter_dim, cfg.swiglu_limit)
        # Set by the parallel runtime: (x, weights, indices, local_fn) -> routed sum over all experts (fp32 [T, dim]).
        self.exchange: Callable | None = None

    def routed_local(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Sum over this process's experts of w_i * Expert_i(x): x [T, dim], weights/indices [T, K] -> fp32."""
        y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        counts = torch.bincount(indices.flatten(), minlength=self.n_experts).tolist()
        for e in self.local:
            if counts[e] == 0:
                continue
            tok, k = torch.where(indices == e)
            y.index_add_(0, tok, self.experts[e](x[tok], weights[tok, k, None]))
        return y

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, indices = self.gate(x, input_ids)
        if self.exchange is not None:
            y = self.exchange(x, weights, indices, self.routed_local)
        else:
            y = self.routed_local(x, weights, indices)
        y = y + self.shared_experts(x)
        return y.to(x.dtype)
