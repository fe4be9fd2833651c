#!/usr/bin/env python
"""How long would `deepinfer golden --kernels stand-in` take? Replays its kernel-op call mix through the op table.

    python scripts/standin_golden_bench.py [--executor stand-in|reference] [--dtype float32|bfloat16]
                                           [--layers N] [--steps N] [--profile]

The replay follows the engine's structure (engine/model/{model,attention,moe}.py) at the tiny model's sizes
(golden/tiny/config.json) over the golden prompts (golden/golden.json: 12 prompts of 3..321 tokens): one prefill
step of all prompt tokens (956), then one decode step per further output token (47, batch <= 12, sequences drop
out as they finish). Per layer and step: 2 hc_mixes, 2 hc_collapse, 2 hc_expand, the attention and ffn norms;
q/kv projections (wq_a, wq_b, wkv, wo_b as FP8 block weights, the checkpoint's format), q_norm, the per-head
unweighted norm, kv_norm; on compressed layers the compressor projections (dense fp32), its pooling and entry
norm per sequence (prefill) or per closing sequence (decode); on CSA layers the indexer (FP8 wq_b, dense
weights_proj, its own compressor) and one index_score per attention group; one sparse_attn per group (per
sequence in prefill, one for the decode batch); grouped wo_a (dense); the MoE with random top-2 of 8 routed FP4
experts (w1, w3, swiglu, w2 per expert that got tokens) and the FP8 shared expert; then the head (dense). Ops with
no kernel family (rope, gate, route, index_topk, hc_head) are not replayed: they are the same torch code in every
mode. The weights are random (right shapes and formats); the values do not change the stand-in's work.

The real run inside the model is `deepinfer golden --kernels stand-in` (engine/model/ops.py).

Reports the wall time, per-op time and call counts, and the dispatch counters. torch runs on 1 intra-op thread
(the stand-in is single-threaded NumPy; on a shared 2-core box torch's 2-thread index_add_/matmul spin distorts
everything else).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from nki_kernels import dispatch, formats, kernel_ops  # noqa: E402


def load_setup(golden_dir: Path = ROOT / "golden") -> tuple[dict, list[tuple[int, int]]]:
    cfg = json.loads((golden_dir / "tiny" / "config.json").read_text())
    g = json.loads((golden_dir / "golden.json").read_text())
    prompts = [(int(p["prompt_len"]), int(p["max_new_tokens"])) for p in g["prompts"]]
    return cfg, prompts


class TimedOps:
    """The op table with wall time and call count per op name."""

    def __init__(self, table: dict):
        self.time: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        for name, fn in table.items():
            setattr(self, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.time[name] += time.perf_counter() - t0
                self.calls[name] += 1

        return call


def _fp8(gen, n, k, dtype):
    w8, s = formats.quant_fp8_block(torch.randn(n, k, generator=gen) * k ** -0.5)
    return formats.stored_fp8(w8, s)


def _fp4(gen, n, k):
    p, s = formats.quant_fp4(torch.randn(n, k, generator=gen) * k ** -0.5)
    return formats.stored_fp4(p, s)


def _dense(gen, n, k, dtype):
    return (torch.randn(n, k, generator=gen) * k ** -0.5).to(dtype)


def build_layers(cfg: dict, n_layers: int, dtype: torch.dtype, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    dim, hd, h, q_lora = cfg["dim"], cfg["head_dim"], cfg["n_heads"], cfg["q_lora_rank"]
    n, inter, ne = cfg["hc_mult"], cfg["moe_inter_dim"], cfg["n_routed_experts"]
    hi, di, grp, rank = cfg["index_n_heads"], cfg["index_head_dim"], cfg["o_groups"], cfg["o_lora_rank"]
    mix = (2 + n) * n
    layers = []
    for lid in range(n_layers):
        ratio = cfg["compress_ratios"][lid]
        L = {"ratio": ratio, "csa": ratio == 4}
        for site in ("attn", "ffn"):
            L[f"hc_{site}"] = (torch.randn(mix, n * dim, generator=g) * (n * dim) ** -0.5,
                               torch.rand(3, generator=g) + 0.5, torch.randn(mix, generator=g) * 0.5)
            L[f"{site}_norm"] = (torch.rand(dim, generator=g) + 0.5).to(dtype)
        L["wq_a"], L["wq_b"], L["wkv"] = _fp8(g, q_lora, dim, dtype), _fp8(g, h * hd, q_lora, dtype), \
            _fp8(g, hd, dim, dtype)
        L["q_norm"], L["kv_norm"] = (torch.rand(q_lora, generator=g) + 0.5).to(dtype), \
            (torch.rand(hd, generator=g) + 0.5).to(dtype)
        L["wo_a"] = _dense(g, grp * rank, h * hd // grp, dtype)
        L["wo_b"] = _fp8(g, dim, grp * rank, dtype)
        L["sink"] = torch.randn(h, generator=g)
        if ratio:
            coff = 2 if L["csa"] else 1
            L["cmp"] = (_dense(g, coff * hd, dim, dtype), _dense(g, coff * hd, dim, dtype),
                        (torch.rand(hd, generator=g) + 0.5).to(dtype))
            if L["csa"]:
                L["idx_wq_b"] = _fp8(g, hi * di, q_lora, dtype)
                L["idx_wproj"] = _dense(g, hi, dim, dtype)
                L["idx_cmp"] = (_dense(g, 2 * di, dim, dtype), _dense(g, 2 * di, dim, dtype),
                                (torch.rand(di, generator=g) + 0.5).to(dtype))
        L["experts"] = [(_fp4(g, inter, dim), _fp4(g, dim, inter), _fp4(g, inter, dim)) for _ in range(ne)]
        L["shared"] = (_fp8(g, inter, dim, dtype), _fp8(g, dim, inter, dtype), _fp8(g, inter, dim, dtype))
        layers.append(L)
    return layers


def _attention(ops, cfg, L, x, groups, dtype, g):
    """x [T, dim] (normed) -> [T, dim]. groups: list of (rows slice, n queries, keys per query, entries, closes)."""
    t = x.shape[0]
    h, hd, eps = cfg["n_heads"], cfg["head_dim"], cfg["norm_eps"]
    qr = ops.rms_norm(ops.fp8_linear(x, *L["wq_a"]), L["q_norm"], eps)
    q = ops.fp8_linear(qr, *L["wq_b"]).view(t, h, hd)
    q = ops.rms_norm(q, None, eps)
    ops.rms_norm(ops.fp8_linear(x, *L["wkv"]), L["kv_norm"], eps)  # kv (its values are not needed here)
    if L["ratio"]:
        xf = x.float()
        comps = [L["cmp"]] + ([L["idx_cmp"]] if L["csa"] else [])
        projs = [(ops.linear(xf, c[0]), ops.linear(xf, c[1])) for c in comps]
        if L["csa"]:
            iq = ops.fp8_linear(qr, *L["idx_wq_b"]).view(t, cfg["index_n_heads"], cfg["index_head_dim"])
            iw = ops.linear(x, L["idx_wproj"]).float()
    o = torch.empty_like(q)
    for rows, b, tq, nwin, ent, closes in groups:
        if L["ratio"]:
            m = L["ratio"]
            for (ckv, _), c in zip(projs, comps, strict=True):
                cdim = ckv.shape[-1]
                if closes:
                    w = closes if tq > 1 else 1
                    bb = 1 if tq > 1 else closes
                    blk = ckv.new_empty(bb, w, m, cdim).normal_(generator=g)
                    sc = ckv.new_empty(bb, w, m, cdim).normal_(generator=g)
                    prev = (blk[:, 0], sc[:, 0]) if L["csa"] else (None, None)
                    pooled = ops.compress_pool(blk if bb > 1 else blk[0], sc if bb > 1 else sc[0], L["csa"], *(
                        (p if bb > 1 else p[0]) if p is not None else None for p in prev))
                    ops.rms_norm(pooled.reshape(-1, pooled.shape[-1]), c[2], eps)
        nk = nwin + ent
        qg = q[rows].reshape(b, tq, h, hd)
        keys = torch.randn(b, nk, hd, generator=g).to(q.dtype)
        valid = torch.rand(b, tq, nk, generator=g) < 0.6
        if L["csa"] and ent:
            ikeys = torch.randn(b, ent, cfg["index_head_dim"], generator=g).to(q.dtype)
            ops.index_score(iq[rows].reshape(b, tq, *iq.shape[1:]), ikeys, iw[rows].reshape(b, tq, -1))
        o[rows] = ops.sparse_attn(qg, keys, valid, L["sink"], hd ** -0.5).reshape(-1, h, hd)
    u = ops.grouped_out_proj(o.reshape(t, -1), L["wo_a"], cfg["o_groups"])
    return ops.fp8_linear(u, *L["wo_b"])


def _moe(ops, cfg, L, x, g):
    t, ne, k = x.shape[0], cfg["n_routed_experts"], cfg["n_activated_experts"]
    lim = cfg["swiglu_limit"]
    idx = torch.rand(t, ne, generator=g).topk(k, dim=-1).indices
    wts = torch.rand(t, k, generator=g)
    y = torch.zeros(t, x.shape[1])
    for e in range(ne):
        tok, kk = torch.where(idx == e)
        if tok.numel() == 0:
            continue
        w1, w2, w3 = L["experts"][e]
        xe = x[tok]
        hmid = ops.swiglu(ops.fp4_linear(xe, *w1), ops.fp4_linear(xe, *w3), lim) * wts[tok, kk, None]
        y.index_add_(0, tok, ops.fp4_linear(hmid.to(x.dtype), *w2).float())
    w1, w2, w3 = L["shared"]
    hs = ops.swiglu(ops.fp8_linear(x, *w1), ops.fp8_linear(x, *w3), lim)
    return (y + ops.fp8_linear(hs.to(x.dtype), *w2).float()).to(x.dtype)


def _site(ops, cfg, L, x, site, inner):
    c = cfg
    pre, post, comb = ops.hc_mixes(x, *L[f"hc_{site}"], c["hc_mult"], c["hc_sinkhorn_iters"], c["hc_eps"],
                                   c["norm_eps"])
    hnorm = ops.rms_norm(ops.hc_collapse(x, pre), L[f"{site}_norm"], c["norm_eps"])
    return ops.hc_expand(inner(hnorm), x, post, comb)


def _groups(cfg, ratio, seqs, prefill):
    """Attention groups of one step: seqs = [(start position, n new tokens)]."""
    win = cfg["window_size"]
    out, row = [], 0
    if prefill:
        for start, n in seqs:
            ent = (start + n) // ratio if ratio else 0
            closes = (start + n) // ratio - start // ratio if ratio else 0
            out.append((slice(row, row + n), 1, n, min(win, start) + n, ent, closes))
            row += n
        return out
    b = len(seqs)
    pos = [s for s, _ in seqs]
    ent = max((p + 1) // ratio for p in pos) if ratio else 0
    closes = sum((p + 1) % ratio == 0 for p in pos) if ratio else 0
    return [(slice(0, b), b, 1, win, ent, closes)]


def replay(ops, cfg: dict, prompts: list[tuple[int, int]], dtype: torch.dtype, n_layers: int | None = None,
           max_steps: int | None = None, seed: int = 0) -> int:
    """Run the call mix; returns the number of engine steps replayed."""
    n_layers = cfg["n_layers"] if n_layers is None else n_layers
    layers = build_layers(cfg, n_layers, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    head = _dense(g, cfg["vocab_size"], cfg["dim"], dtype)
    head_norm = (torch.rand(cfg["dim"], generator=g) + 0.5).to(dtype)
    steps = max(o for _, o in prompts)
    if max_steps is not None:
        steps = min(steps, max_steps)
    for step in range(steps):
        if step == 0:
            seqs = [(0, p) for p, _ in prompts]
        else:
            seqs = [(p + step - 1, 1) for p, o in prompts if o > step]
        t = sum(n for _, n in seqs)
        x = (torch.randn(t, cfg["hc_mult"], cfg["dim"], generator=g)).to(dtype)
        for L in layers:
            grp = _groups(cfg, L["ratio"], seqs, step == 0)
            x = _site(ops, cfg, L, x, "attn", lambda h, L=L, grp=grp: _attention(ops, cfg, L, h, grp, dtype, g))
            x = _site(ops, cfg, L, x, "ffn", lambda h, L=L: _moe(ops, cfg, L, h, g))
        last = x[-len(prompts):] if step == 0 else x
        hfin = ops.rms_norm(last.float().sum(1).to(dtype), head_norm, cfg["norm_eps"])  # hc_head is reference-only
        ops.linear(hfin.float(), head)
    return steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--executor", default="stand-in", help="op table: stand-in (kernels) or reference")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--layers", type=int, default=None, help="main layers to replay (default: the config's)")
    ap.add_argument("--steps", type=int, default=None, help="engine steps to replay (default: all, 48)")
    ap.add_argument("--profile", action="store_true", help="cProfile the run, print the top functions")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg, prompts = load_setup()
    dtype = getattr(torch, args.dtype)
    ops = TimedOps(kernel_ops.make_ops(args.executor))
    dispatch.reset_counts()
    prof = cProfile.Profile() if args.profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    ok = True
    steps = replay(ops, cfg, prompts, dtype, args.layers, args.steps)
    if prof:
        prof.disable()
    wall = time.perf_counter() - t0
    n_layers = cfg["n_layers"] if args.layers is None else args.layers
    full = wall * (cfg["n_layers"] / n_layers)
    print(f"replay {args.executor} {args.dtype}: {steps} steps x {n_layers} layers in {wall:.1f} s "
          f"(all {cfg['n_layers']} layers: ~{full:.1f} s; ops {sum(ops.time.values()):.1f} s)")
    print(f"{'op':20s} {'calls':>7s} {'total s':>9s} {'ms/call':>8s}")
    for name, sec in ops.time.most_common():
        print(f"{name:20s} {ops.calls[name]:7d} {sec:9.2f} {sec / ops.calls[name] * 1e3:8.2f}")
    for key, n in sorted(dispatch.counts().items()):
        print(f"  dispatch {key[0]:24s} {key[1]:10s} {n}")
    if dispatch.fallbacks():
        print("  fallbacks:", dispatch.fallbacks())
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
