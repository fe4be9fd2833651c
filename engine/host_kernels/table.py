"""The ops `--kernels host` puts in place of the reference's (engine/model/ops.py `ops_for("host")` assembles the
table from them; a decode site absent here is one the host table's block decoder does not run)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.host_kernels import attn_ops, gemm, layer_ops, moe_ops, native, packs, small_ops, step_ops

NATIVE_OPS: dict[str, Callable[..., Any]] = {
    "linear": gemm.linear, "fp8_linear": gemm.fp8_linear, "fp4_linear": gemm.fp4_linear,
    "hc_mixes": small_ops.hc_mixes, "rms_norm": small_ops.rms_norm, "hc_collapse": small_ops.hc_collapse,
    "hc_expand": small_ops.hc_expand, "hc_pre": small_ops.hc_pre, "sparse_attn": small_ops.sparse_attn,
    "moe_ffn": moe_ops.moe_ffn, "compress_pool": small_ops.compress_pool, "index_score": small_ops.index_score,
    "rope_tail": attn_ops.rope_tail, "grouped_out_proj": attn_ops.grouped_out_proj, "gate": step_ops.gate,
    "hc_head": step_ops.hc_head, "attn_qkv_native": attn_ops.attn_qkv_native, "ffn_site": step_ops.ffn_site,
    "ffn_site_pack": step_ops.site_pack, "attn_front": attn_ops.attn_front, "attn_front_pack": attn_ops.front_pack,
    "attn_decode": attn_ops.attn_decode, "attn_decode_pack": attn_ops.decode_pack,
    "attn_decode_takes": attn_ops.attn_decode_takes, "native_pack": packs.packed,
    "decode_layer": layer_ops.decode_layer, "decode_layer_pack": layer_ops.layer_pack,
    "mtp_input": step_ops.mtp_input, "lm_head": step_ops.lm_head, "mtp_draft": layer_ops.mtp_draft,
    "keep_rows": small_ops.keep_rows,
    "decode_limits": lambda: (native.max_m("close"), native.max_m("index"))}
