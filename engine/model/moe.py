"""MoE FFN: sqrt-softplus gate, bias for selection only, hash-routed layers via
`tid2eid`, routed scaling, one shared expert, SwiGLU with clamps. Routed experts may be a subset (expert
parallelism): `local_experts` says which ones this process holds; the exchange is `engine/parallel.py`'s job."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from engine.config import ModelConfig
from engine.model.layers import Linear, _empty
from engine.model.ops import OpsUser
from engine.parallel import Parallel
from engine.profiling import no_split

# Grouped routed experts in host decode graphs pay a graph break (~0.3-1 ms: leaving and re-entering compiled code);
# worth it when the dense path would do at least this many extra multiply-adds: (E_local - K) x T x 3 x dim x inter
# (~0.3 ms at this 2-core box's ~60 GFLOP/s). The mid model at batch 16: 705 M (grouped); the tiny model: 2.4 M.
GROUPED_MIN_EXTRA_MACS = 1 << 24


class Gate(OpsUser, nn.Module):
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
        """(weights [T, K] fp32, expert ids [T, K]) of x [T, dim]: `reference.gate` (gate_scores + route) through the
        op table."""
        if self.hash:  # positional (bias, hash_ids): a custom op in host graphs takes no keywords
            return self.ops.gate(x, self.weight, self.topk, self.route_scale, None, self.tid2eid[input_ids])
        return self.ops.gate(x, self.weight, self.topk, self.route_scale, self.bias, None)


class Expert(OpsUser, nn.Module):
    def __init__(self, dim: int, inter_dim: int, limit: float) -> None:
        super().__init__()
        self.w1 = Linear(dim, inter_dim)
        self.w2 = Linear(inter_dim, dim)
        self.w3 = Linear(dim, inter_dim)
        self.limit = limit

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, dim] -> fp32 [T, dim]; the routing weight [T, 1] multiplies before w2 (official order)."""
        return expert_ffn(self.ops, lambda w, v: getattr(self, w)(v), x, weights, self.limit)


def expert_ffn(ops, linear: Callable[[str, torch.Tensor], torch.Tensor], x: torch.Tensor,
               weights: torch.Tensor | None, limit: float) -> torch.Tensor:
    """One expert: w2(swiglu(w1 x, w3 x) * weights), fp32 result; `linear(name, v)` applies weight `name`."""
    h = ops.swiglu(linear("w1", x), linear("w3", x), limit)  # [T, inter] fp32
    if weights is not None:
        h = h * weights
    return linear("w2", h.to(x.dtype)).float()


class MoE(OpsUser, nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, par: Parallel | None = None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.n_experts, self.topk = cfg.n_routed_experts, cfg.n_activated_experts
        self.par = par if par is not None and par.enabled else None
        self.local = self.par.local_experts(cfg.n_routed_experts) if self.par else range(cfg.n_routed_experts)
        self.gate = Gate(cfg, layer_id)
        self.experts = nn.ModuleList(
            [Expert(cfg.dim, cfg.moe_inter_dim, cfg.swiglu_limit) if i in self.local else None
             for i in range(cfg.n_routed_experts)])
        self.shared_experts = Expert(cfg.dim, cfg.moe_inter_dim, cfg.swiglu_limit)
        self.capacity = 0.0  # capacity factor of the grouped path (0 = off); set by the runner
        self.overflows = 0  # multi-token calls that overflowed and re-ran on the dense path
        self.static_moe = "auto"  # decode regions: gather (cost K per token) | dense (every local expert) | auto
        self._stacked = False

    # -- stacked experts: what the static gather path indexes ------------------------------------------------------
    _WEIGHTS = ("w1", "w2", "w3")

    @property
    def stacked(self) -> bool:
        """Whether `stack_experts` ran: the experts' tensors are views of the stacks."""
        return self._stacked

    def stack_experts(self) -> None:
        """Stack the local experts' tensors into non-persistent buffers `stack_<w>` [E_local, ...] (and
        `stack_<w>_scale` for stored FP8/FP4 weights) and make each expert's parameters views of them: no extra
        memory, the same names in the state dict, and a decode region can gather the chosen experts' weights by
        index (reading K experts, not E)."""
        if self._stacked:
            return
        experts = [self.experts[e] for e in self.local]
        for w in self._WEIGHTS:
            for attr in ("weight", "scale"):
                parts = [getattr(getattr(ex, w), attr, None) for ex in experts]
                if parts[0] is None:
                    continue
                stack = torch.stack([p.data for p in parts])  # [E_local, ...]
                name = f"stack_{w}" if attr == "weight" else f"stack_{w}_scale"
                self.register_buffer(name, stack, persistent=False)
                for i, ex in enumerate(experts):
                    setattr(getattr(ex, w), attr, nn.Parameter(stack[i], requires_grad=False))
        self._stacked = True

    def _stack_linear(self, w: str, i: int | torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x @ the weight `w` of local expert i (0-based among the local ones) from the stacks: an int i is a view
        (static), a 1-element index tensor gathers that expert's weight (a device index: no host sync)."""
        fmt = getattr(self.experts[self.local.start], w).fmt
        stack, scales = getattr(self, f"stack_{w}"), getattr(self, f"stack_{w}_scale", None)
        if not isinstance(i, int) or self.ops.kernel_ops is not None:  # kernel tables: int i too
            return self.ops.stack_linear(x, stack, scales, i, fmt)
        if fmt is None:
            return self.ops.linear(x, stack[i])
        return (self.ops.fp8_linear if fmt == "fp8" else self.ops.fp4_linear)(x, stack[i], scales[i])

    def expert(self, e: int, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """Routed expert e (a local one) on x [T, dim] -> fp32 [T, dim]. Once stacked, through the stacks, so a
        region graph's inputs are the three stacks, not every expert's tensors (fewer guards per launch)."""
        if not self._stacked:
            return self.experts[e](x, weights)
        i = e - self.local.start
        return expert_ffn(self.ops, lambda w, v: self._stack_linear(w, i, v), x, weights,
                          self.experts[self.local.start].limit)

    def routed_gather(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """`routed_local` with static shapes whose cost is K experts per token: each (token, k) pair gathers its
        expert's weights from the stacks (index_select by a device index: no host sync) and runs the SwiGLU on that
        token. Pairs routed to another rank's expert carry weight 0 (and read this rank's first expert).
        x [T, dim], weights/indices [T, K] -> fp32 [T, dim]."""
        t, k = indices.shape
        lo, n_local = self.local.start, len(self.local)
        mine = (indices >= lo) & (indices < lo + n_local)
        sel = torch.where(mine, indices - lo, 0).flatten()  # [T*K] local expert ids
        wts = torch.where(mine, weights, 0.0).flatten()  # [T*K]
        limit = self.experts[lo].limit
        out = []
        for p in range(t * k):  # static: T (a batch bucket) x K pairs
            xp, e = x[p // k: p // k + 1], sel[p: p + 1]
            out.append(expert_ffn(self.ops, lambda w, v, e=e: self._stack_linear(w, e, v), xp, wts[p], limit))
        return torch.cat(out, 0).view(t, k, -1).sum(1)

    def static_mode(self, t: int) -> str:
        """The routed-expert path `routed_static` takes for a decode batch of t tokens (see there)."""
        if self.static_moe != "auto":
            return self.static_moe
        n_local, k = len(self.local), self.topk
        if t * k < n_local:
            return "gather"
        ex = self.experts[self.local.start]
        extra = (n_local - k) * t * 3 * ex.w1.in_features * ex.w1.out_features  # dense's extra multiply-adds
        return "grouped" if self.caps.data_dependent_shapes and extra >= GROUPED_MIN_EXTRA_MACS else "dense"

    def routed_static(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """The routed-expert path of decode regions: gather (K experts' weights per token) while the batch reads
        fewer expert weights than the dense path would (T*K < E_local); else, on the host (CPU tensors), grouped -
        `routed_local`, each chosen expert once on its tokens, run between two graphs (a graph break: its shapes
        depend on the routing; on the host that costs a few Python frames, which is why small batches gather) when
        the dense path's extra expert work is worth more than that (GROUPED_MIN_EXTRA_MACS), and dense otherwise
        (each local expert once: all a device graph can do). `static_moe` forces one (the `--moe` option)."""
        mode = self.static_mode(indices.shape[0])
        if mode == "grouped":
            return self._routed_between_graphs(x, weights, indices)
        if mode == "gather" and self._stacked:
            return self.routed_gather(x, weights, indices)
        return self.routed_dense(x, weights, indices)

    @torch.compiler.disable
    def _routed_between_graphs(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """`routed_local`, run eagerly when called inside a graph being compiled (a graph break)."""
        return self.routed_local(x, weights, indices)

    def routed_local(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Sum over this process's experts of w_i * Expert_i(x): x [T, dim], weights/indices [T, K] -> fp32."""
        y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        if x.shape[0] == 1:  # one token (batch-1 decode): its experts directly, in expert order - the same sums
            for e, k in sorted((e, k) for k, e in enumerate(indices[0].tolist()) if e in self.local):
                y += self.expert(e, x, weights[:, k, None])
            return y
        counts = torch.bincount(indices.flatten(), minlength=self.n_experts).tolist()
        for e in self.local:
            if counts[e] == 0:
                continue
            tok, k = torch.where(indices == e)
            y.index_add_(0, tok, self.expert(e, x[tok], weights[tok, k, None]))
        return y

    def routed_dense(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """`routed_local` with static shapes (decode regions): every local expert runs on every token with its routing
        weight, 0 where not chosen (a 0 weight makes the row exactly 0). x [T, dim], weights/indices [T, K] -> fp32."""
        y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        for e in self.local:
            w = (weights * (indices == e)).sum(-1, keepdim=True)  # [T, 1]
            y = y + self.expert(e, x, w)
        return y

    def routed_grouped(self, x: torch.Tensor, weights: torch.Tensor,
                       indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Capacity-grouped `routed_local` (prefill chunks): the (token, k) pairs of each expert, in token order, fill
        a fixed [C, dim] group, C = ceil(capacity * T * K / E); unused rows carry weight 0. Returns (fp32 [T, dim],
        overflow: bool tensor, true when some expert got more than C pairs; then the result is incomplete and the
        caller re-runs the dense path). Static shapes throughout: one graph per (T, C)."""
        t, k = indices.shape
        cap = max(1, math.ceil(self.capacity * t * k / self.n_experts))
        flat = indices.flatten()  # [T*K] pair p = (p // K, p % K)
        onehot = torch.nn.functional.one_hot(flat, self.n_experts)  # [T*K, E]
        rank = (onehot.cumsum(0) - 1).gather(1, flat[:, None])[:, 0]  # [T*K] position within its expert's group
        overflow = onehot.sum(0).max() > cap
        fits = rank < cap
        dest = torch.where(fits, flat * cap + rank, self.n_experts * cap)  # [T*K]; overflowing pairs -> dropped row
        tok = torch.zeros(self.n_experts * cap + 1, dtype=torch.long, device=x.device)
        wgt = torch.zeros(self.n_experts * cap + 1, dtype=torch.float32, device=x.device)
        tok[dest] = torch.arange(t * k, device=x.device) // k
        wgt[dest] = weights.flatten()
        tok, wgt = tok[:-1].view(self.n_experts, cap), wgt[:-1].view(self.n_experts, cap)  # [E, C]
        y = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
        for e in self.local:
            y.index_add_(0, tok[e], self.expert(e, x[tok[e]], wgt[e, :, None]))
        return y, overflow

    def routed(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
               grouped: bool = False) -> torch.Tensor:
        """Routed experts of this process: with `grouped` (a step with prefill chunks) and a capacity factor set, the
        capacity-grouped path, falling back to the dense path on overflow; else `routed_local`."""
        if grouped and self.capacity > 0 and x.shape[0] > 1:
            y, overflow = self.routed_grouped(x, weights, indices)
            if not bool(overflow):
                return y
            self.overflows += 1
        return self.routed_local(x, weights, indices)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, grouped: bool = False) -> torch.Tensor:
        """x [T, dim] (ffn_norm applied) -> [T, dim]. `grouped`: the step has prefill chunks (capacity path)."""
        if self.par is not None:
            return self._forward_ep(x, input_ids, grouped=grouped)
        weights, indices = self.gate(x, input_ids)
        if self._stacked and not (grouped and self.capacity > 0) and not torch.compiler.is_compiling():
            y = self.ops.moe_ffn(self, x, weights, indices)  # the table's one-call MoE FFN, where it takes it
            if y is not None:
                return y.to(x.dtype)
        y = self.routed(x, weights, indices, grouped) + self.shared_experts(x)
        return y.to(x.dtype)

    def forward_static(self, x: torch.Tensor, input_ids: torch.Tensor,
                       split: Callable[[str], None] = no_split) -> torch.Tensor:
        """`forward` with static shapes for decode regions (dense routed experts; under expert parallelism the same
        static exchange). x [T, dim] -> [T, dim]."""
        if self.par is not None:
            return self._forward_ep(x, input_ids, static=True, split=split)
        weights, indices = self.gate(x, input_ids)
        split("moe.gate")
        y = self.ops.moe_ffn(self, x, weights, indices) if self._stacked else None  # a custom op in graphs
        if y is not None:
            split("moe.experts")
            return y.to(x.dtype)
        y = self.routed_static(x, weights, indices)
        split("moe.experts")
        y = y + self.shared_experts(x)
        split("moe.shared")
        return y.to(x.dtype)

    def _forward_ep(self, x: torch.Tensor, input_ids: torch.Tensor, static: bool = False, grouped: bool = False,
                    split: Callable[[str], None] = no_split) -> torch.Tensor:
        """Static MoE exchange (engine/parallel.py): route my 1/cp share of the tokens, ONE packed fp32 all-gather of
        (x, weights, expert ids), my experts over every token, ONE all-reduce. The shared expert is added once, by the
        token's owner."""
        par, t, k = self.par, x.shape[0], self.topk
        per = -(-t // par.cp)
        lo, hi = min(t, par.rank * per), min(t, (par.rank + 1) * per)
        weights, indices = self.gate(x[lo:hi], input_ids[lo:hi])
        packed = torch.cat([x[lo:hi].float(), weights, indices.float()], -1)  # [t_own, dim + 2K]
        if hi - lo < per:  # equal shapes for the all-gather; pad rows carry expert id -1
            pad = packed.new_zeros(per - (hi - lo), packed.shape[1])
            pad[:, -k:] = -1
            packed = torch.cat([packed, pad], 0)
        split("moe.gate")
        rows = torch.cat(par.all_gather(packed, f"L{self.layer_id}.moe.exchange"), 0)[:t]  # [T, dim + 2K]
        split("moe.exchange")
        xs = rows[:, : -2 * k].to(x.dtype)
        w, idx = rows[:, -2 * k: -k], rows[:, -k:].long()
        y = self.routed_static(xs, w, idx) if static else self.routed(xs, w, idx, grouped)
        split("moe.experts")
        y[lo:hi] += self.shared_experts(x[lo:hi])
        split("moe.shared")
        y = par.all_reduce(y, f"L{self.layer_id}.moe.combine").to(x.dtype)
        split("moe.combine")
        return y
