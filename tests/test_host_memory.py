"""Host weights on huge pages (engine/host_memory.py): the arena keeps every value, shape, stride, dtype and view
relation; "off" leaves tensors alone; the THP mode and smaps are read right; an engine gives the same logits with
its weights in the arena as without."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import host_memory as hm
from engine.model.dummy import random_weights
from tests.engine.test_engine_consistency import TINY
from tests.engines import build, greedy


@pytest.fixture
def thp_madvise(tmp_path, monkeypatch):
    """A kernel in THP madvise mode, whatever this machine's is (madvise itself is still the real call)."""
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    monkeypatch.setattr(hm, "THP_ENABLED", f)


def _module() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    m = nn.Module()
    m.a = nn.Parameter(torch.randn(300, 700, generator=g), requires_grad=False)
    stack = torch.randint(0, 256, (4, 100, 512), dtype=torch.uint8, generator=g)
    m.register_buffer("stack", stack)
    m.expert = nn.Parameter(stack[2], requires_grad=False)  # a view, as the MoE experts are of their stacks
    big = torch.randn(100, 64, generator=g)
    m.register_buffer("window", big[50:60, 3:7])  # a strided view of a larger storage: only its span is copied
    m.register_buffer("h", torch.randn(1500, 1000, generator=g).to(torch.bfloat16))
    return m, {k: v.clone() for k, v in m.state_dict().items()} | {"expert": stack[2].clone()}


def test_place_keeps_values_layout_and_views(thp_madvise):
    m, ref = _module()
    layout = {k: (v.shape, v.stride(), v.dtype) for k, v in m.state_dict().items()}
    placed = hm.place_weights(m)
    assert placed.huge_pages == "requested" and placed.tensors == 5
    whole = sum(t.numel() * t.element_size() for t in (m.a, m.stack, m.h))
    assert whole < placed.bytes < whole + 4096  # the window's span (~2.4 KB), not its 25.6 KB storage
    for k, v in m.state_dict().items():
        assert (v.shape, v.stride(), v.dtype) == layout[k], k
        assert torch.equal(v, ref[k]), k
    storages = {t.untyped_storage().data_ptr() for t in (*m.parameters(), *m.buffers())}
    assert len(storages) == 1  # one arena
    assert min(t.data_ptr() for t in (*m.parameters(), *m.buffers())) % hm.HUGE == 0
    assert all(t.data_ptr() % hm.ALIGN == 0 for t in (m.a, m.stack, m.h))
    m.stack[2, 0, 0] = 7  # still a view: the expert sees its stack's bytes
    assert m.expert[0, 0] == 7 and m.expert.data_ptr() == m.stack[2].data_ptr()


def test_off_or_no_thp_leaves_tensors(tmp_path, monkeypatch):
    m, _ = _module()
    before = [t.data_ptr() for t in (*m.parameters(), *m.buffers())]
    assert hm.place_weights(m, "off").huge_pages == "off (DEEPINFER_HOST_HUGE_PAGES)"
    f = tmp_path / "enabled"
    f.write_text("always madvise [never]\n")
    monkeypatch.setattr(hm, "THP_ENABLED", f)
    assert hm.place_weights(m).huge_pages == "transparent huge pages: never"
    assert [t.data_ptr() for t in (*m.parameters(), *m.buffers())] == before
    buf, huge = hm.host_buffer(4096)
    assert not huge and buf.numel() == 4096


@pytest.mark.parametrize("text, mode", [("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"),
                                        ("always madvise [never]", "never"), ("", "unavailable")])
def test_thp_mode(tmp_path, text, mode):
    f = tmp_path / "enabled"
    f.write_text(text)
    assert hm.thp_mode(f) == mode
    assert hm.thp_mode(tmp_path / "missing") == "unavailable"


def test_huge_resident_bytes_reads_the_mapping_that_holds_the_tensor(tmp_path):
    t = torch.empty(16)
    a = t.data_ptr()
    smaps = tmp_path / "smaps"
    smaps.write_text(
        f"{a - 8192:x}-{a - 4096:x} rw-p 00000000 00:00 0\nAnonHugePages:      4 kB\n"
        f"{a - 4096:x}-{a + 4096:x} rw-p 00000000 00:00 0\nRss:    8 kB\nAnonHugePages:   2048 kB\n"
        f"{a + 4096:x}-{a + 8192:x} rw-p 00000000 00:00 0\nAnonHugePages:      8 kB\n")
    assert hm.huge_resident_bytes(t, smaps) == 2048 * 1024
    smaps.write_text(f"{a + 4096:x}-{a + 8192:x} rw-p 00000000 00:00 0\nAnonHugePages:      8 kB\n")
    assert hm.huge_resident_bytes(t, smaps) is None
    assert hm.huge_resident_bytes(t, tmp_path / "missing") is None


def test_engine_logits_equal_with_weights_in_the_arena(thp_madvise, monkeypatch):
    weights = random_weights(TINY, seed=3)
    prompts = [[5, 9, 13, 200, 7], [300, 2, 2, 41]]
    placed_eng = build(TINY, weights, kernels="host")
    assert placed_eng.runner.weights_memory.huge_pages == "requested"
    monkeypatch.setattr(hm, "why_not", lambda mode="auto": "off (test)")
    plain_eng = build(TINY, weights, kernels="host")
    assert plain_eng.runner.weights_memory.huge_pages == "off (test)"
    arena = {t.untyped_storage().data_ptr() for t in placed_eng.runner.model.parameters()}
    assert len(arena) == 1 and not arena & {t.untyped_storage().data_ptr() for t in plain_eng.runner.model.parameters()}
    out_p, logits_p = greedy(placed_eng, prompts, 6)
    out_q, logits_q = greedy(plain_eng, prompts, 6)
    assert out_p == out_q
    for a, b in zip(logits_p, logits_q, strict=True):
        assert torch.equal(a, b)  # the same bytes read by the same kernels
