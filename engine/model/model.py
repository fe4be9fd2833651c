"""The DeepSeek-V4 model: embedding and stream expansion, decoder blocks with two mHC sites each, `hc_head`, the
final norm and head, and the MTP block. Module and parameter names are DeepSeek's official ones, so
`load_state_dict` takes the loader's output as it is."""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.model.block import Block, MTPBlock
from engine.model.cache import KVCache, StepPlan
from engine.model.capabilities import Capabilities
from engine.model.dspark_block import DSparkBlock
from engine.model.layers import Embedding, Linear, RMSNorm, _empty, keeps_fp32, stored_fp32
from engine.model.ops import OpsUser
from engine.parallel import Parallel
from engine.profiling import RegionTimer


def use_ops(module: nn.Module, ops: object, caps: Capabilities | None = None) -> None:
    """Run every op of `module` through `ops` (engine/model/ops.py `ops_for(config.kernels)`) and, when given, let
    it do what `caps` allows (the backend's capabilities)."""
    for m in module.modules():
        if isinstance(m, OpsUser):
            m.ops = ops
            if caps is not None:
                m.caps = caps


def use_formats(module: nn.Module, formats: dict[str, str]) -> None:
    """Hold the weights named in `formats` ({weight name relative to `module`: "fp8" | "fp4"}) as stored: their
    Linear modules get uint8 `weight` + `scale` parameters (engine/loader.py `stored_formats` gives the map)."""
    linears = {f"{name}.weight": m for name, m in module.named_modules() if isinstance(m, Linear)}
    unknown = sorted(set(formats) - set(linears))
    if unknown:
        raise KeyError(f"stored formats for weights the model has no Linear for, e.g. {unknown[:3]}")
    for name, fmt in formats.items():
        lin = linears[name]
        parent, _, leaf = name[: -len(".weight")].rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, leaf, type(lin)(lin.in_features,
                                                                                   lin.out_features, fmt))


def formats_of(module: nn.Module) -> dict[str, str]:
    """The stored formats `module` holds (the inverse of `use_formats`)."""
    return {f"{name}.weight": m.fmt for name, m in module.named_modules() if isinstance(m, Linear) and m.fmt}


def draft_block(cfg: ModelConfig, layer_id: int, par: Parallel | None = None) -> Block:
    """The draft layer `mtp.<layer_id - n_layers>`: an MTP block, or a DSpark stage when the config has a DSpark
    head (engine/model/dspark_proposer.py; the 0731 / 0813 releases keep their DSpark stages under `mtp.*`)."""
    if cfg.has_dspark:
        return DSparkBlock(cfg, layer_id, par)
    return MTPBlock(cfg, layer_id, par)


class Transformer(OpsUser, nn.Module):
    def __init__(self, cfg: ModelConfig, par: Parallel | None = None, with_mtp: bool = True) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList([Block(cfg, i, par) for i in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.dim)
        self.head = Linear(cfg.dim, cfg.vocab_size)
        self.hc_head_fn = _empty(cfg.hc_mult, cfg.hc_dim)
        self.hc_head_base = _empty(cfg.hc_mult)
        self.hc_head_scale = _empty(1)
        self.mtp = nn.ModuleList(
            [draft_block(cfg, cfg.n_layers + i, par) for i in range(cfg.n_mtp_layers if with_mtp else 0)])

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (activations and residual streams)."""
        return getattr(self, "_compute_dtype", torch.float32)

    def load_weights(self, state: dict[str, torch.Tensor], dtype: torch.dtype, keep_narrow: bool = False) -> None:
        """Take official-named tensors (dequantised, or as stored for the formats set by `use_formats`); cast float
        ones to the compute dtype except fp32-kept ones; bytes (uint8) and ints stay as they are. `keep_narrow`
        (weights=stored): a bf16 / fp16 matrix (embedding, head, compressor and indexer projections, router) stays
        as the checkpoint stores it - the ops widen it exactly when they use it - instead of a 2x wider copy."""
        self._compute_dtype = dtype
        own = self.state_dict(keep_vars=True)
        missing = sorted(set(own) - set(state))
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")
        cast = {}
        for name, p in own.items():
            t = state[name]
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"tensor {name}: shape {tuple(t.shape)}, model expects {tuple(p.shape)}")
            want = torch.float32 if keeps_fp32(name) else dtype
            narrow = t.dtype in (torch.bfloat16, torch.float16) and t.dim() >= 2 and t.element_size() <= \
                torch.empty((), dtype=want).element_size()
            if not t.is_floating_point() or (keep_narrow and narrow and not stored_fp32(name)):
                cast[name] = t
            else:
                cast[name] = t.to(want)
        self.load_state_dict(cast, strict=True, assign=True)

    def streams(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> the embedding copied into every residual stream [T, n, dim]."""
        e = self.embed.weight[input_ids].to(self.dtype)  # [T, dim]
        return e.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()

    def hidden(self, input_ids: torch.Tensor, plan: StepPlan, cache: KVCache,
               timer: RegionTimer | None = None) -> torch.Tensor:
        """input_ids [T] -> last-layer residual streams [T, n, dim]. With an enabled `timer` each half of each layer
        is timed as region `attn` / `moe` (eager: no stages inside)."""
        if timer is None or not timer.enabled:
            x = self.streams(input_ids)
            for layer in self.layers:
                x = layer(x, plan, cache, input_ids)
            return x
        with timer.region("embed"):
            x = self.streams(input_ids)
        for layer in self.layers:
            with timer.region("attn", layer.layer_id):
                x = layer.attn_half(x, plan, cache)
            with timer.region("moe", layer.layer_id):
                x = layer.ffn_half(x, plan, input_ids)
        return x

    def logits(self, x: torch.Tensor, hc: nn.Module | None = None, norm: RMSNorm | None = None) -> torch.Tensor:
        """Streams [T, n, dim] -> fp32 logits [T, vocab] via hc_head, the final norm and the head."""
        hc = hc or self
        fused = self.ops.block_decoder.logits(self, x, hc, norm or self.norm)
        if fused is not None:
            return fused
        h = self.ops.hc_head(x, hc.hc_head_fn, hc.hc_head_scale, hc.hc_head_base, self.cfg.hc_eps, self.cfg.norm_eps)
        h = self.ops.rms_norm(h, (norm or self.norm).weight, self.cfg.norm_eps)
        return self.head(h.float())

    def mtp_streams(self, x: torch.Tensor, next_ids: torch.Tensor, plan: StepPlan, cache: KVCache,
                    k: int = 0) -> torch.Tensor:
        """MTP block k: streams x [T, n, dim] at positions t (the main model's last-layer streams, or the block's
        own output when it drafts recursively) and the ids of tokens t+1 -> the block's output streams [T, n, dim]
        (before its hc_head). Writes the block's window KV at positions t (engine/model/mtp_proposer.py)."""
        return self.mtp[k](self.mtp_input(x, next_ids, k), plan, cache, next_ids)

    def mtp_pass(self, x: torch.Tensor, next_ids: torch.Tensor, plan: StepPlan, cache: KVCache, rows: list[int],
                 k: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One drafting pass of MTP block k: `mtp_streams` (its output streams [T, n, dim]), then the head over their
        rows `rows` -> (streams, fp32 logits [len(rows), vocab] of the tokens two past those rows, their argmax where
        the op table runs the pass as one call, else None)."""
        blk: MTPBlock = self.mtp[k]
        fused = self.ops.block_decoder.mtp_pass(self, blk, x, next_ids, plan, cache.layers[blk.layer_id], rows)
        if fused is not None:
            return fused
        out = self.mtp_streams(x, next_ids, plan, cache, k)
        return out, self.logits(out[torch.tensor(rows, device=out.device)], blk, blk.norm), None

    def mtp_draft(self, x: torch.Tensor, next_ids: torch.Tensor, seqs: list, cache: KVCache,
                  k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """k greedy drafts of MTP block 0 in one call of the op table (`BlockDecoder.mtp_draft`): the catch-up over
        the final positions of `seqs` (DraftInputs; x, next_ids: one row each), then k - 1 recursion passes ->
        (logits [k, R, vocab], tokens [k, R]); None where the table has no such call (propose_mtp then plans each
        pass and runs it as `mtp_pass`)."""
        blk: MTPBlock = self.mtp[0]
        return self.ops.block_decoder.mtp_draft(self, blk, x, next_ids, seqs, cache.layers[blk.layer_id], k)

    def mtp_input(self, x: torch.Tensor, next_ids: torch.Tensor, k: int = 0) -> torch.Tensor:
        """MTP block k's input streams [T, n, dim]: e_proj(enorm(embedding of tokens t+1)) + h_proj(hnorm(x))."""
        blk: MTPBlock = self.mtp[k]
        fused = self.ops.block_decoder.mtp_input(self, blk, x, next_ids)
        if fused is not None:
            return fused
        eps = self.cfg.norm_eps
        e = self.ops.rms_norm(self.embed.weight[next_ids].to(self.dtype), blk.enorm.weight, eps)
        h = self.ops.rms_norm(x, blk.hnorm.weight, eps)
        return blk.e_proj(e).unsqueeze(1) + blk.h_proj(h)

    def mtp_logits(self, x: torch.Tensor, next_ids: torch.Tensor, plan: StepPlan, cache: KVCache,
                   k: int = 0) -> torch.Tensor:
        """MTP block k: streams x [T, n, dim] at positions t and the ids of tokens t+1 -> logits for tokens t+2."""
        blk: MTPBlock = self.mtp[k]
        return self.logits(self.mtp_streams(x, next_ids, plan, cache, k), blk, blk.norm)
