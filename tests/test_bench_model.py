"""golden/make_bench_model.py: streamed random V4 checkpoints in the official format are deterministic, load through
`engine.loader` (sharded index, official naming, every dtype/shape), have realistic values, and run in the engine."""

from __future__ import annotations

import filecmp
import json
import math
from pathlib import Path

import pytest
import torch

import engine
from engine import loader
from engine.config import EngineConfig, ModelConfig
from engine.loader import INDEX_FILE, SINGLE_FILE, expected_tensors, expert_of, load_checkpoint, official_format
from engine.model.moe import MoE
from engine.sampler import SamplingParams
from tests.scripts import load_script
from tests.test_config import FLASH_OFFICIAL

ROOT = Path(__file__).resolve().parent.parent
mbm = load_script("golden/make_bench_model.py")

ST_TORCH = {"F8_E4M3": torch.float8_e4m3fn, "I8": torch.int8, "F8_E8M0": torch.float8_e8m0fnu,
            "BF16": torch.bfloat16, "F32": torch.float32, "I64": torch.int64}


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[Path, ModelConfig]:
    cfg = mbm.PRESETS["test"].config()
    out = tmp_path_factory.mktemp("bench") / "test"
    mbm.write_model(out, cfg, seed=7)
    return out, cfg


def _stored_headers(d: Path) -> dict[str, tuple[str, tuple[int, ...], str]]:
    from safetensors import safe_open

    out = {}
    for f in sorted(d.glob("model-*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                sl = h.get_slice(k)
                out[k] = (sl.get_dtype(), tuple(sl.get_shape()), f.name)
    return out


def _want_stored(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """What the released checkpoint format stores for `cfg`, derived from the loader's tables (not the generator)."""
    want = {}
    for name, shape in expected_tensors(cfg).items():
        fmt = official_format(name, cfg)
        if fmt == "fp8":
            want[name] = ("F8_E4M3", shape)
            want[name[:-7] + ".scale"] = ("F8_E8M0", (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128)))
        elif fmt == "fp4":
            want[name] = ("I8", (shape[0], shape[1] // 2))
            want[name[:-7] + ".scale"] = ("F8_E8M0", (shape[0], shape[1] // 32))
        else:
            want[name] = ({"bf16": "BF16", "fp32": "F32", "i64": "I64"}[fmt], shape)
    return want


def _check_layout(d: Path, cfg: ModelConfig) -> None:
    assert (d / INDEX_FILE).exists() and not (d / SINGLE_FILE).exists()
    assert ModelConfig.from_json(d) == cfg
    stored = _stored_headers(d)
    assert {k: v[:2] for k, v in stored.items()} == _want_stored(cfg)
    index = json.loads((d / INDEX_FILE).read_text())
    assert index["weight_map"] == {k: v[2] for k, v in stored.items()}
    sizes = {k: math.prod(s) * ST_TORCH[dt].itemsize for k, (dt, s, _) in stored.items()}
    assert index["metadata"]["total_size"] == sum(sizes.values())
    # one shard for the globals, one per layer (a layer's tensors and their scales together)
    shard_of = {}
    for k, (_, _, f) in stored.items():
        block, idx, _ = loader.split_name(k)
        shard_of.setdefault((block, idx), set()).add(f)
    assert all(len(fs) == 1 for fs in shard_of.values())
    assert len({next(iter(fs)) for fs in shard_of.values()}) == 1 + cfg.n_layers + cfg.n_mtp_layers
    assert loader._detect_scheme(loader._Checkpoint(d), cfg) == "official"


# ---- the small preset ------------------------------------------------------------------------------------------
def test_layout_and_full_load(small):
    d, cfg = small
    _check_layout(d, cfg)
    sd = load_checkpoint(d)  # strict: every tensor present, nothing extra, every dtype/shape/scale checked
    assert list(sd) == list(expected_tensors(cfg))
    for name, shape in expected_tensors(cfg).items():
        assert tuple(sd[name].shape) == shape, name
    assert (d / "tokenizer.json").read_bytes() == (ROOT / "golden" / "tiny" / "tokenizer.json").read_bytes()


def test_deterministic(small, tmp_path):
    d, cfg = small
    again = tmp_path / "again"
    mbm.write_model(again, cfg, seed=7)
    files = sorted(p.name for p in d.iterdir())
    assert files == sorted(p.name for p in again.iterdir())
    assert all(filecmp.cmp(d / f, again / f, shallow=False) for f in files)
    other = tmp_path / "other"
    mbm.write_model(other, cfg, seed=8)
    shards = [f for f in files if f.startswith("model-")]
    assert not any(filecmp.cmp(d / f, other / f, shallow=False) for f in shards)
    # a tensor depends on (seed, name) only: the first two layers of a 2-layer model are those of the 3-layer one
    two = tmp_path / "two"
    mbm.write_model(two, mbm.PRESETS["test"].config(layers=2), seed=7)
    for i in (1, 2):
        assert (d / f"model-{i:05d}-of-00005.safetensors").read_bytes() == \
            (two / f"model-{i:05d}-of-00004.safetensors").read_bytes()


def test_values_are_realistic(small):
    d, cfg = small
    sd = load_checkpoint(d)
    for name, w in sd.items():
        fmt = official_format(name, cfg)
        if fmt in ("fp8", "fp4"):
            ratio = w.std().item() * math.sqrt(w.shape[1])
            blocks = w.numel() / (128 * 128 if fmt == "fp8" else 32)  # scale blocks: two exponents, mixed
            assert (0.95 < ratio < 1.05) if blocks >= 1000 else (0.6 < ratio < 1.6), (name, ratio)
            assert w.abs().max() > 0 and torch.isfinite(w).all()
        elif name.endswith("tid2eid"):
            assert w.min() >= 0 and w.max() < cfg.n_routed_experts
            assert (w.sort(dim=1).values.diff(dim=1) > 0).all(), "experts of a token must be distinct"
            assert len(torch.unique(w[:, 0])) == cfg.n_routed_experts
        elif name.endswith("norm.weight"):
            assert abs(w.mean().item() - 1) < 0.05 and 0.05 < w.std().item() < 0.2, name
        else:  # sinks, ape, gate bias, mHC base/scale/fn, embed, head, router, compressor: random, none zero
            assert (w != 0).all() and (w.numel() == 1 or w.std() > 0) and torch.isfinite(w).all(), name
    fn = sd["layers.1.hc_attn_fn"]  # mHC mixing weights small: std 1/sqrt(hc_mult * dim)
    assert abs(fn.std().item() * math.sqrt(fn.shape[1]) - 1) < 0.05
    # FP8 / FP4 scales really vary between blocks
    from safetensors import safe_open

    shard = json.loads((d / INDEX_FILE).read_text())["weight_map"]["layers.1.attn.wq_b.scale"]
    with safe_open(str(d / shard), framework="pt") as h:
        for key in ("layers.1.attn.wo_b.scale", "layers.1.ffn.experts.3.w2.scale"):
            assert len(torch.unique(h.get_tensor(key).view(torch.uint8))) == 2, key


def _run(d: Path, prompts: list, max_model_len: int, kernels: str = "auto",
         ) -> tuple[list, torch.Tensor, dict[int, torch.Tensor]]:
    """Greedy outputs, logits and (under the reference kernels, where every layer runs the MoE gate module: a fused
    native call routes inside C, at as many rows as the CPU's build takes) each layer's routed experts."""
    config = EngineConfig.from_model_dir(d, max_num_seqs=1, num_kv_blocks=max_model_len // 16 + 8,
                                         max_model_len=max_model_len, kernels=kernels)
    eng = engine.build(config)
    rows: list[torch.Tensor] = []
    eng.on_logits = lambda ids, logits: rows.append(logits.clone())
    picks: dict[int, list[torch.Tensor]] = {}
    for m in eng.runner.model.modules():
        if isinstance(m, MoE):  # the experts each token is routed to, per layer
            m.gate.register_forward_hook(lambda mod, args, out, i=m.layer_id: picks.setdefault(i, []).append(out[1]))
    for p in prompts:
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    outs = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.finished]
    return outs, torch.cat(rows), {k: torch.cat([t.flatten() for t in v]) for k, v in picks.items()}


def _check_forward(cfg: ModelConfig, outs, logits, picks) -> None:
    assert all(len(o.output_token_ids) == 4 for o in outs)
    assert torch.isfinite(logits).all()
    assert (logits.std(dim=-1) > 1.0).all()  # not flat: init gives logits of std ~3
    for layer in range(cfg.n_layers):  # routing is not degenerate: many experts used, none takes most tokens
        counts = torch.bincount(picks[layer], minlength=cfg.n_routed_experts)
        assert (counts > 0).sum() >= cfg.n_routed_experts // 2, (layer, counts.tolist())
        assert counts.max() < 0.5 * counts.sum(), (layer, counts.tolist())


def test_engine_runs_it(small):
    d, cfg = small
    ids = [0] + torch.randint(2, 1000, (119,), generator=torch.Generator().manual_seed(0)).tolist()
    assert len(ids) // 4 > cfg.index_topk and len(ids) > cfg.window_size  # CSA selects, the window slides
    prompts = [ids, "The quick brown fox jumps over the lazy dog."]
    outs, logits, _ = _run(d, prompts, 512)
    _check_forward(cfg, outs, logits, _run(d, prompts, 512, kernels="reference")[2])


# ---- presets ---------------------------------------------------------------------------------------------------
def test_flash_preset_has_the_released_layer_shapes():
    real = ModelConfig.from_dict(FLASH_OFFICIAL)
    ours = mbm.PRESETS["flash"].config(layers=4, hash_layers=1)
    mine, theirs = expected_tensors(ours), expected_tensors(real)
    for name, shape in mine.items():
        block, idx, suffix = loader.split_name(name)
        if block == "global":
            assert theirs[name] == shape, name
        else:  # our layer i (CSA/HCA alternating) is the released layer i + 2 (layers 2..41 alternate the same way)
            twin = f"layers.{idx + 2}.{suffix}"
            if suffix == "ffn.gate.tid2eid":  # our layer 0 and their layer 2 are hash-routed
                twin = "layers.2.ffn.gate.tid2eid"
            assert theirs[twin] == shape, name
            assert official_format(name, ours) == official_format(twin, real)
    for f in ("dim", "n_heads", "head_dim", "rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "window_size",
              "n_routed_experts", "n_activated_experts", "moe_inter_dim", "index_n_heads", "index_head_dim",
              "index_topk", "vocab_size", "hc_mult", "swiglu_limit", "rope_factor", "original_seq_len",
              "max_position_embeddings", "dtype", "expert_dtype"):
        assert getattr(ours, f) == getattr(real, f), f
    assert ours.compress_ratios == (4, 128, 4, 128) and mbm.PRESETS["flash"].config().compress_ratios == (4, 128)
    with pytest.raises(ValueError):
        mbm.PRESETS["flash"].config(layers=5)
    with pytest.raises(ValueError):
        mbm.PRESETS["flash"].config(layers=2, hash_layers=3)


def test_preset_parameter_counts():  # the figures golden/README.md quotes
    mid = mbm.param_counts(mbm.PRESETS["mid"].config())
    assert (mid["total"], mid["embed_head"], mid["main_body"], mid["mtp"]) == (661712660, 264765440, 339399716,
                                                                             57530091)
    flash = mbm.param_counts(mbm.PRESETS["flash"].config())
    assert flash["total"] == 14235367025
    cfg = mbm.PRESETS["mid"].config()
    assert cfg.index_topk < 2048 // 4 and cfg.max_position_embeddings >= 8192


def test_vocab_option():  # issue 24's host-speed model: mid at vocab 8192 (the head no longer dominates a step)
    small = mbm.PRESETS["mid"].config(vocab=8192)
    counts = mbm.param_counts(small)
    assert small.vocab_size == 8192 and counts["embed_head"] == 2 * 8192 * 1024
    assert counts["main_body"] == mbm.param_counts(mbm.PRESETS["mid"].config())["main_body"]
    assert mbm.default_out("mid", small).name == "mid-v8192"
    assert mbm.default_out("mid", mbm.PRESETS["mid"].config(layers=2, vocab=8192)).name == "mid-2l-v8192"
    with pytest.raises(ValueError, match="vocab=512"):
        mbm.PRESETS["mid"].config(vocab=512)


def test_dspark_option(tmp_path):  # a realistic-width DSpark head (random: never accepted) for speculation benchmarks
    cfg = mbm.PRESETS["test"].config(dspark=True)
    assert cfg.has_dspark and cfg.n_mtp_layers == 2 and cfg.dspark_target_layer_ids == (0, 1, 2)
    assert mbm.default_out("mid", mbm.PRESETS["mid"].config(dspark=True)).name == "mid-dspark"
    with pytest.raises(ValueError, match="three main layers"):
        mbm.PRESETS["mid"].config(layers=2, dspark=True)
    d = tmp_path / "dspark"
    mbm.write_model(d, cfg, seed=3)
    _check_layout(d, cfg)
    assert list(load_checkpoint(d)) == list(expected_tensors(cfg))
    config = EngineConfig.from_model_dir(d, max_num_seqs=1, max_model_len=64, speculative="dspark")
    eng = engine.build(config)
    eng.add_request([0, 5, 9, 13, 200, 7], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    assert eng.spec_stats.num_drafts > 0

def test_flash_layout_loads(tmp_path):
    """The exact flash shard layout, headers and sparse zero data only (no time, no disk): the loader reads it."""
    cfg = mbm.PRESETS["flash"].config(layers=1)
    d = tmp_path / "flash-1l"
    mbm.write_model(d, cfg, layout_only=True)
    _check_layout(d, cfg)
    assert sum(f.stat().st_blocks * 512 for f in d.iterdir()) < 64 * 2**20  # sparse
    sd = load_checkpoint(d, layers=[0], experts=range(2), dtype=torch.bfloat16)
    want = [n for n in expected_tensors(cfg) if not n.startswith("mtp.") and (expert_of(n) or (0,))[0] < 2]
    assert list(sd) == want
    assert sd["layers.0.ffn.experts.1.w2.weight"].shape == (4096, 2048)


# ---- the real sizes (slow) -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_mid_generates_loads_and_runs(tmp_path):
    cfg = mbm.PRESETS["mid"].config()
    d = tmp_path / "mid"
    mbm.write_model(d, cfg)
    _check_layout(d, cfg)
    ids = [0] + torch.randint(2, 1000, (1279,), generator=torch.Generator().manual_seed(0)).tolist()
    assert len(ids) // 4 > cfg.index_topk  # the indexer really selects
    outs, logits, _ = _run(d, [ids], 2048)
    _check_forward(cfg, outs, logits, _run(d, [ids], 2048, kernels="reference")[2])


@pytest.mark.slow
def test_flash_one_layer_generates_and_loads(tmp_path):
    cfg = mbm.PRESETS["flash"].config(layers=1)
    d = tmp_path / "flash-1l"
    mbm.write_model(d, cfg)
    _check_layout(d, cfg)
    sd = load_checkpoint(d, layers=[0], experts=range(2), dtype=torch.bfloat16)
    for name in ("layers.0.attn.wo_a.weight", "layers.0.ffn.experts.1.w1.weight", "layers.0.ffn.experts.0.w2.weight"):
        w = sd[name].float()
        assert 0.95 < w.std().item() * math.sqrt(w.shape[1]) < 1.05, name
