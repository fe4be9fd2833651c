"""`--numerics official` and `--kv-cache-dtype fp8` (engine/model/numerics.py, engine/model/cache.py KVStore,
nki_kernels/quant.py): the stores' byte layouts against the quantisers' formulas, the FP8 cache against the in-place
simulation on the tiny official model at every compression boundary, exact accumulation against its formula and
its batch invariance, the layout arithmetic, the shape checks, and the golden of a model that differs only in its
draft head."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer_bench.bench.golden import GOLDEN_DIR, golden_config, load_golden, main_model_hash
from deepinfer_bench.errors import GoldenError
from engine.config import EngineConfig, ModelConfig, Workload
from engine.model.cache import KVCache, KVStore, kv_bytes
from nki_kernels import quant
from nki_kernels.reference import fp4_dequant_rows, fp8_dequant_rows

TINY, TINY_OFFICIAL, TINY_DSPARK = GOLDEN_DIR / "tiny", GOLDEN_DIR / "tiny-official", GOLDEN_DIR / "tiny-dspark"


# ---- FP4 codes two per byte --------------------------------------------------------------------------------------
def test_pack_nibbles_hand_case_and_every_pair_round_trips() -> None:
    assert quant.pack_nibbles(torch.tensor([1, 2, 15, 0], dtype=torch.uint8)).tolist() == [0x21, 0x0F]
    pairs = torch.cartesian_prod(torch.arange(16), torch.arange(16)).to(torch.uint8).flatten()  # 512 codes
    packed = quant.pack_nibbles(pairs)
    assert packed.dtype == torch.uint8 and sorted(packed.tolist()) == list(range(256))
    assert torch.equal(quant.unpack_nibbles(packed), pairs)


# ---- KVStore: what the fp8 cache stores is what it reads back ------------------------------------------------------
def _store(fmt: str, rows: int, d: int, rd: int = 0, dtype: torch.dtype = torch.bfloat16) -> KVStore:
    if fmt == "fp8":
        nope = d - rd
        return KVStore(torch.zeros(rows, nope, dtype=torch.uint8), torch.zeros(rows, nope // 64, dtype=torch.uint8),
                       torch.zeros(rows, rd, dtype=dtype))
    if fmt == "fp8/128":
        return KVStore(torch.zeros(rows, d, dtype=torch.uint8), torch.zeros(rows, d // 128, dtype=torch.uint8),
                       dtype=dtype)
    return KVStore(torch.zeros(rows, d // 2, dtype=torch.uint8), torch.zeros(rows, d // 32, dtype=torch.uint8),
                   dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_kv_store_holds_the_simulated_values_exactly(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    kv = (torch.randn(9, 256, generator=g) * torch.logspace(-3, 2, 9).unsqueeze(1)).to(dtype)
    kv[0, :64] = 0  # an all-zero block: the amax floor's scale
    st = _store("fp8", 9, 256, rd=64, dtype=dtype)
    assert st.fmt == "fp8" and st.shape == (9, 256) and st.dtype == dtype
    st[torch.arange(9)] = kv
    sim = quant.kv_fp8_qdq(kv, 64)
    assert torch.equal(st[torch.arange(9)], sim)  # stored bytes + scales = the in-place simulation
    assert torch.equal(st.rope, kv[:, 192:])  # RoPE dims kept in the model dtype
    # the bytes are quant.fp8_quant's: one e4m3 byte per non-RoPE dim, one UE8M0 byte per 64
    codes, scale = quant.fp8_quant(kv[:, :192], 64)
    assert torch.equal(st.data, codes) and torch.equal(st.scale, scale)
    st[torch.arange(9)] = sim  # storing a value already on the grid is exact
    assert torch.equal(st[torch.arange(9)], sim)


def test_index_key_stores_fp8_per_128_and_fp4_per_32() -> None:
    g = torch.Generator().manual_seed(4)
    k = torch.randn(6, 128, generator=g).to(torch.bfloat16)
    s8 = _store("fp8/128", 6, 128)
    assert s8.fmt == "fp8/128"
    s8[torch.arange(6)] = k
    assert torch.equal(s8[torch.arange(6)], quant.fp8_qdq(k, 128))
    s4 = _store("fp4", 6, 128)
    assert s4.fmt == "fp4" and s4.shape == (6, 128) and s4.data.shape == (6, 64)
    sim = quant.indexer_fp4_qdq(k)  # the official keys: Hadamard + FP4, values on the e2m1 grid
    s4[torch.arange(6)] = sim
    assert torch.equal(s4[torch.arange(6)], sim)  # e2m1 codes + 32-block scales hold them exactly


@pytest.mark.parametrize("fmt", ["auto", "fp8", "fp8/128", "fp4"])
def test_store_reads_are_tensor_indexing_for_every_key(fmt: str) -> None:
    """A read by one index tensor takes `index_select` (engine/model/cache.py `_rows`); it must equal indexing the
    values for the keys the model uses: slots [B] (ring), block tables [B, nb] (pool), a 0-d slot, int32 ids, a
    (slot, rows) pair and an int."""
    g = torch.Generator().manual_seed(5)
    vals = torch.randn(5, 4, 128, generator=g).to(torch.bfloat16)
    if fmt == "auto":
        st = KVStore(torch.zeros(5, 4, 128, dtype=torch.bfloat16))
    else:
        flat = _store(fmt, 20, 128, rd=64 if fmt == "fp8" else 0)
        st = KVStore(*(t.view(5, 4, *t.shape[1:]) for t in flat.tensors()), dtype=torch.bfloat16)
    st[torch.arange(5)] = vals
    want = st[(torch.arange(5),)]  # a tuple key: plain tensor indexing
    for key in (torch.tensor([3, 0, 3]), torch.tensor([[4, 1], [0, 2]]), torch.tensor(2),
                torch.tensor([1, 3], dtype=torch.int32), (torch.tensor([2]), torch.tensor([1, 3])), 4):
        got = st[key]
        ref = want[key]
        assert got.shape == ref.shape and torch.equal(got, ref), key


# ---- the FP8 cache in the engine = the in-place simulation (every compression boundary) ----------------------------
def _greedy(config: EngineConfig, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    from engine import build
    from engine.llm import greedy_with_logits

    outs, logits = greedy_with_logits(build(config), [ids], n)
    return outs[0], logits[0]


@pytest.fixture(scope="module")
def official_fp32_auto() -> tuple[EngineConfig, list[int], tuple[list[int], torch.Tensor]]:
    # chunks of 7 tokens: chunk ends fall on every offset of the CSA (4) and HCA (16) blocks of a 37-token prompt,
    # and 27 decode steps close more blocks one token at a time (positions 37..63: CSA entries 9..15, HCA 2..3)
    config = golden_config(numerics="official", dtype="float32", max_num_batched_tokens=7, max_num_seqs=1)
    ids = [(i * 37 + 11) % 1000 + 2 for i in range(37)]
    return config, ids, _greedy(config, ids, 27)


def test_fp8_cache_equals_the_in_place_simulation(official_fp32_auto) -> None:
    config, ids, (toks, logits) = official_fp32_auto
    toks8, logits8 = _greedy(config.replace(kv_cache_dtype="fp8"), ids, 27)
    assert toks8 == toks
    assert torch.equal(logits8, logits)  # the same numbers, bit for bit, over every step


def test_fp8_cache_with_hf_numerics_really_quantises() -> None:
    config = golden_config(max_num_batched_tokens=7, max_num_seqs=1, model_dir=TINY_OFFICIAL,
                           golden_dir=GOLDEN_DIR / "official-fp32", numerics="hf")
    ids = [(i * 37 + 11) % 1000 + 2 for i in range(37)]
    _, auto = _greedy(config, ids, 8)
    _, fp8 = _greedy(config.replace(kv_cache_dtype="fp8"), ids, 8)
    d = float((fp8 - auto).abs().max())
    assert 0 < d < 3.0  # FP8 KV moves the logits (std ~3) but does not scramble them


# ---- exact accumulation ---------------------------------------------------------------------------------------
def test_act_linear_exact_is_the_float64_formula_and_batch_invariant() -> None:
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(256, 384, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    ws = torch.randint(118, 124, (2, 3), generator=g, dtype=torch.uint8)
    x = torch.randn(37, 384, generator=g).to(torch.bfloat16)
    y = quant.act_linear_exact(x, w, ws, "fp8")
    want = (quant.fp8_qdq(x, 128).double() @ fp8_dequant_rows(w, ws, 0, 256).double().T).to(torch.bfloat16)
    assert torch.equal(y, want)
    assert torch.equal(quant.act_linear_exact(x[5:6], w, ws, "fp8"), y[5:6])  # one row alone = in a batch
    ref = quant.act_linear(x, w, ws, "fp8")  # the official kernel: fp32 per-K-block sums
    assert float(((ref.float() - y.float()).abs() / y.float().abs().clamp(min=1e-3)).max()) <= 2 ** -7
    packed = torch.randint(0, 256, (64, 64), generator=g, dtype=torch.uint8)
    s4 = torch.randint(120, 126, (64, 4), generator=g, dtype=torch.uint8)
    x4 = x[:, :128]
    want4 = (quant.fp8_qdq(x4, 128).double() @ fp4_dequant_rows(packed, s4, 0, 64).double().T).to(torch.bfloat16)
    assert torch.equal(quant.act_linear_exact(x4, packed, s4, "fp4"), want4)


def test_head_rms_bf16_rounds_once_and_does_not_depend_on_the_batch() -> None:
    g = torch.Generator().manual_seed(6)
    q = (torch.randn(300, 4, 256, generator=g) * 3).to(torch.bfloat16)
    full = quant.head_rms(q, 1e-6)
    for n in (1, 3, 5, 8):  # torch's own bf16 rsqrt rounds the tail of small tensors twice
        assert torch.equal(quant.head_rms(q[:n], 1e-6), full[:n])
    ms = (q.double().square().to(torch.bfloat16).double().mean(-1, keepdim=True)).to(torch.bfloat16)
    r = torch.rsqrt((ms + 1e-6).double()).to(torch.bfloat16)
    assert torch.equal(full, q * r)
    q32 = q.float()
    assert torch.equal(quant.head_rms(q32, 1e-6), q32 * torch.rsqrt(q32.square().mean(-1, keepdim=True) + 1e-6))


def test_sparse_attn_exact_ignores_padded_keys_and_rounds_probabilities() -> None:
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 3, 4, 64, generator=g).to(torch.bfloat16)
    kv = torch.randn(1, 10, 64, generator=g).to(torch.bfloat16)
    sink = torch.randn(4, generator=g)
    valid = torch.ones(1, 3, 10, dtype=torch.bool)
    o = quant.sparse_attn_exact(q, kv, valid, sink, 0.125)
    pad = torch.cat([kv, torch.randn(1, 53, 64, generator=g).to(torch.bfloat16)], 1)
    vpad = torch.cat([valid, torch.zeros(1, 3, 53, dtype=torch.bool)], 2)
    assert torch.equal(quant.sparse_attn_exact(q, pad, vpad, sink, 0.125), o)
    s = torch.einsum("bthd,bnd->bthn", q.double(), kv.double()) * 0.125
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    den = p.sum(-1) + torch.exp(sink.double() - m[..., 0])
    want = (torch.einsum("bthn,bnd->bthd", p.to(torch.bfloat16).double(), kv.double()) / den[..., None])
    assert torch.equal(o, want.to(torch.bfloat16))


def test_official_bf16_engine_is_batch_invariant() -> None:
    """The same prompt alone and among others: the prefill's logits to fp32 noise (exact accumulation of the
    GEMMs, attention and q norm: no bf16 rounding flips; the fp32 head GEMM sums in a batch-dependent order); the
    decode steps (4 rows vs 1) within what torch's fp32 vectorisation of the
    norms leaves (a last-bit flip of an fp32 rsqrt before a bf16 rounding), the same greedy tokens."""
    from engine import build
    from engine.llm import greedy_with_logits

    # the reference table: the claim is about the official ops' exact accumulation; with the native host kernels
    # (what `--kernels auto` picks on the host) the prefill logits moved by 0.38 between alone and batched
    config = golden_config(numerics="official", dtype="bfloat16", kernels="reference")
    ids = [5, 17, 300, 41, 9, 77, 120, 3, 8, 64, 11]
    others = [[(i * 13 + j) % 900 + 2 for i in range(n)] for j, n in enumerate((3, 29, 40))]
    eng = build(config)
    out_alone, alone = greedy_with_logits(eng, [ids], 6)
    out_batch, batch = greedy_with_logits(eng, [others[0], ids, *others[1:]], 6)
    assert float((batch[1][0] - alone[0][0]).abs().max()) < 1e-5
    assert out_batch[1] == out_alone[0]
    assert float((batch[1] - alone[0]).abs().max()) < 0.05


# ---- layout arithmetic and shape checks ------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_dtype,index_keys", [("auto", "fp8"), ("fp8", "fp8"), ("fp8", "fp4")])
def test_kv_bytes_is_what_the_cache_allocates(kv_dtype: str, index_keys: str) -> None:
    cfg = ModelConfig.from_json(TINY_OFFICIAL)
    lids = list(range(cfg.n_layers))
    cache = KVCache(cfg, 3, 5, 16, torch.bfloat16, lids, kv_dtype=kv_dtype, index_keys=index_keys)
    lay = kv_bytes(cfg, lids, torch.bfloat16, 16, kv_dtype=kv_dtype, index_keys=index_keys)
    pool = sum(t.numel() * t.element_size() for r in cache.roots.values() for n, t in r.items() if "_pool" in n)
    assert pool == 5 * lay.per_block and cache.nbytes() == pool + 3 * lay.per_slot
    assert cache.bytes_per_token == lay.per_token


def test_kv_bytes_per_token_hand_computed_for_tiny_official() -> None:
    cfg = ModelConfig.from_json(TINY_OFFICIAL)  # head_dim 256 (rope 64), index_head_dim 128, ratios 0/4/16/4
    lids = list(range(cfg.n_layers))
    auto = kv_bytes(cfg, lids, torch.bfloat16, 16).per_token
    csa, hca = (256 * 2 + 128 * 2) / 4, 256 * 2 / 16  # bf16 entry (+ bf16 indexer key) per compressed token
    assert auto == 2 * csa + hca
    fp8 = kv_bytes(cfg, lids, torch.bfloat16, 16, kv_dtype="fp8").per_token
    entry = 192 + 192 // 64 + 64 * 2  # e4m3 bytes + one scale per 64 + bf16 RoPE dims
    assert fp8 == 2 * (entry + 128 + 1) / 4 + entry / 16
    fp4 = kv_bytes(cfg, lids, torch.bfloat16, 16, kv_dtype="fp8", index_keys="fp4").per_token
    assert fp4 == 2 * (entry + 64 + 4) / 4 + entry / 16
    assert fp8 <= 0.6 * auto


def test_shapes_the_fp8_layout_cannot_hold_are_one_line() -> None:
    cfg = ModelConfig.from_json(TINY)  # head_dim 64 - rope 16 = 48 dims: no 64-blocks
    w = Workload(max_num_seqs=1, max_num_batched_tokens=16, max_model_len=64)
    with pytest.raises(ValueError, match=r"--kv-cache-dtype fp8: .*48 non-RoPE KV dims") as e:
        EngineConfig.from_model_config(cfg, model_dir=str(TINY), workload=w, kv_cache_dtype="fp8")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="--numerics official"):
        EngineConfig.from_model_config(cfg, model_dir=str(TINY), workload=w, numerics="official")
    EngineConfig.from_model_config(ModelConfig.from_json(TINY_OFFICIAL), model_dir=str(TINY_OFFICIAL), workload=w,
                                   kv_cache_dtype="fp8", numerics="official")


# ---- a golden of the main model holds for every draft head ----------------------------------------------------------
def test_golden_of_the_main_model_accepts_another_draft_head() -> None:
    tiny, dspark = ModelConfig.from_json(TINY), ModelConfig.from_json(TINY_DSPARK)
    assert tiny.config_hash() != dspark.config_hash()
    assert main_model_hash(tiny) == main_model_hash(dspark)
    _, prompts = load_golden(GOLDEN_DIR, dspark)
    assert len(prompts) == 12
    other = dataclasses.replace(dspark, index_topk=dspark.index_topk + 1)  # a main-model field differs
    with pytest.raises(GoldenError, match="was made for config"):
        load_golden(GOLDEN_DIR, other)


def test_golden_of_tiny_runs_under_the_dspark_head() -> None:
    from deepinfer_bench.bench.golden import run_golden

    run = run_golden(golden_config(model_dir=TINY_DSPARK, golden_dir=GOLDEN_DIR, speculative="dspark",
                                   num_speculative_tokens=3))
    assert run.ok, run.table.to_string()


def test_kv_fit_table_matches_the_spec_arithmetic() -> None:
    from tests.scripts import load_script

    kv_fit = load_script("scripts/kv_fit.py")
    table = {(r["model"], r["kv"]): r for r in kv_fit.rows(64, 24)}
    # spec §3: bf16 CSA (512 + 128) / 4 x 2 B = 320 B, HCA 512 / 128 x 2 B = 8 B; Flash 21 CSA + 20 HCA layers
    assert table["V4-Flash", "bf16"]["bytes_per_token"] == 21 * 320 + 20 * 8
    entry = 448 + 448 // 64 + 64 * 2  # e4m3 bytes, one scale per 64, bf16 RoPE dims
    assert table["V4-Flash", "fp8"]["bytes_per_token"] == 21 * (entry + 128 + 1) / 4 + 20 * entry / 128
    assert table["V4-Pro", "bf16"]["bytes_per_token"] == 30 * 320 + 31 * 8
    for model in ("V4-Flash", "V4-Pro"):
        assert table[model, "fp8"]["bytes_per_token"] <= 0.6 * table[model, "bf16"]["bytes_per_token"]
    flash = table["V4-Flash", "bf16"]
    assert 0 < flash["weights_gib"] < 24 and flash["ctx_b1"] >= flash["ctx_b8"] >= flash["ctx_b32"] > 0
