"""The declared op table (engine/model/ops.py `OpTable`), the host's block decoder keeping the packs, and the
proposer factory (engine/model/drafting.py `proposer_for`)."""

from __future__ import annotations

import dataclasses

import pytest

import engine
from deepinfer_bench.bench.golden import GOLDEN_DIR
from engine import host_kernels as H
from engine.config import EngineConfig
from engine.llm import greedy_with_logits
from engine.model.drafting import proposer_for
from engine.model.dspark_proposer import DSparkProposer
from engine.model.mtp_proposer import MTPProposer
from engine.model.ops import REFERENCE, OpByOp, OpTable, make_table, ops_for


def test_a_table_lacking_ops_fails_at_construction_naming_them() -> None:
    ops = dict(vars(REFERENCE))
    del ops["rope_tail"], ops["block_decoder"]
    with pytest.raises(ValueError, match="op table 'partial' lacks rope_tail, block_decoder"):
        make_table("partial", ops)


@pytest.mark.parametrize("kernels", ["reference", "stand-in", "host"])
def test_every_table_supplies_every_declared_op(kernels: str) -> None:
    table = ops_for(kernels)
    assert isinstance(table, OpTable)
    for f in dataclasses.fields(OpTable):
        if f.name not in ("kernel_ops", "attn_qkv_native", "keep_rows"):  # declared: None where the table has none
            assert getattr(table, f.name) is not None, f.name
    assert isinstance(table.block_decoder, OpByOp) == (kernels != "host")
    assert (table.keep_rows is not None) == (kernels == "host")  # the runner's held rows: native, else torch


def test_official_numerics_take_no_fused_host_path() -> None:
    table = ops_for("host", "official")
    assert isinstance(table.block_decoder, OpByOp) and table.attn_qkv_native is None
    assert table.moe_ffn(None, None, None, None) is None


def test_the_host_packs_live_in_the_block_decoder_not_in_the_modules() -> None:
    eng = engine.build(EngineConfig.from_model_dir(GOLDEN_DIR / "tiny", kernels="host", max_num_seqs=2))
    greedy_with_logits(eng, [[5, 9, 13], [7, 8]], 3)
    model = eng.runner.model
    assert not [n for n, m in model.named_modules() if any(k.startswith("_native") for k in vars(m))]
    decoder = model.layers[0].ops.block_decoder
    if all(H.max_m(k) >= 2 for k in ("mhc", "sparse_attn", "linear", "fp8", "fp4")):  # the build takes 2 rows
        assert all("layer" in decoder.packs._packs.get(layer, {}) for layer in model.layers)


def test_the_proposer_is_chosen_once_from_the_method() -> None:
    assert proposer_for("none") is None
    assert isinstance(proposer_for("mtp"), MTPProposer) and not proposer_for("mtp").captures
    assert isinstance(proposer_for("dspark"), DSparkProposer) and proposer_for("dspark").captures
    assert proposer_for("mtp") is proposer_for("mtp")
    with pytest.raises(ValueError):
        proposer_for("medusa")
