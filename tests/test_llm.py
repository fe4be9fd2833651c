"""LLMEngine / LLM over the fake runner: scheduling never changes what a request generates."""

from __future__ import annotations

import ast
import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.llm import LLMEngine, RequestRejected, SamplingParams
from engine.offline import LLM
from tests.fake_runner import FakeRunner, fake_config

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def make_engine(max_num_seqs=4, budget=32, num_kv_blocks=16, block_size=8, max_model_len=256, **kw) -> LLMEngine:
    cfg = fake_config(max_num_seqs, budget, num_kv_blocks, block_size, max_model_len, **kw)
    return LLMEngine(cfg, FakeRunner(max_num_seqs, num_kv_blocks, block_size, max_model_len))


def run_all(eng: LLMEngine) -> dict[str, list]:
    outs: dict[str, list] = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


@settings(max_examples=25, deadline=None)
@given(max_num_seqs=st.integers(1, 5), extra=st.integers(0, 40), num_kv_blocks=st.integers(8, 24),
       block_size=st.sampled_from([4, 8, 16]), seed=st.integers(0, 10_000))
def test_greedy_output_is_independent_of_scheduling(max_num_seqs, extra, num_kv_blocks, block_size, seed):
    rng = random.Random(seed)
    llm = LLM(make_engine(max_num_seqs, max_num_seqs + extra, num_kv_blocks, block_size, 96).config,
              runner=FakeRunner(max_num_seqs, num_kv_blocks, block_size, 96))
    eng, runner = llm.engine, llm.engine.runner
    limit = min(num_kv_blocks * block_size, 96)
    prompts = [[rng.randrange(97) for _ in range(rng.randrange(1, limit - 8))] for _ in range(rng.randrange(1, 8))]
    params = SamplingParams(temperature=0, max_tokens=rng.randrange(1, 8), ignore_eos=True)
    results = llm.generate(prompts, params)
    for p, r in zip(prompts, results, strict=True):
        assert r.finished and r.finish_reason == "length" and r.prompt_len == len(p)
        assert r.output_token_ids == runner.reference_greedy(p, params.max_tokens)
    st_ = eng.stats()
    assert st_.num_used_blocks == 0 and st_.kv_usage == 0 and st_.num_running == st_.num_waiting == 0
    assert st_.num_generated_tokens == len(prompts) * params.max_tokens
    assert st_.num_free_blocks == num_kv_blocks
    # Every slot that was ever released was reset before reuse (the fake runner asserts the positions).
    assert set(runner.freed) <= set(range(max_num_seqs))


def test_preemption_happens_and_is_invisible_in_outputs():
    eng = make_engine(max_num_seqs=4, budget=64, num_kv_blocks=6, block_size=8)
    prompts = [[i + 1] * 20 for i in range(4)]
    rids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)) for p in prompts]
    outs = run_all(eng)
    assert eng.stats().num_preemptions > 0
    for rid, p in zip(rids, prompts, strict=True):
        assert outs[rid][-1].output_token_ids == eng.runner.reference_greedy(p, 20)
        assert [t for o in outs[rid] for t in o.new_token_ids] == outs[rid][-1].output_token_ids


def test_kv_usage_observable_and_returned():
    eng = make_engine(num_kv_blocks=16, block_size=8)
    eng.add_request([1] * 30, GREEDY)
    eng.step()
    s = eng.stats()
    assert s.num_used_blocks == 4 and s.kv_usage == pytest.approx(4 / 16) and s.num_running == 1
    run_all(eng)
    # 30 prompt + 11 fed outputs = 41 positions
    assert eng.stats().num_used_blocks == 0 and eng.stats().peak_used_blocks == 6
    eng.reset_peak_usage()
    assert eng.stats().peak_used_blocks == 0


def test_abort_returns_blocks_and_slot():
    eng = make_engine()
    a = eng.add_request([1, 2, 3] * 5, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    b = eng.add_request([4, 5] * 5, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    eng.step()
    slot = eng.get_sequence(a).slot
    assert eng.abort(a) and not eng.abort(a) and not eng.abort("nope")
    assert slot in eng.runner.freed
    assert eng.stats().num_used_blocks == 2  # only b's blocks remain
    outs = run_all(eng)
    assert outs[a][-1].finished and outs[a][-1].finish_reason == "abort"
    assert outs[b][-1].finish_reason == "length" and len(outs[b][-1].output_token_ids) == 5
    assert eng.stats().num_free_blocks == 16


def test_waiting_request_can_be_aborted():
    eng = make_engine(max_num_seqs=1, budget=8)
    eng.add_request([1] * 4, GREEDY, request_id="x")
    eng.add_request([2] * 4, GREEDY, request_id="y")
    eng.step()
    assert eng.stats().num_waiting == 1 and eng.abort("y")
    outs = run_all(eng)
    assert outs["y"][-1].finish_reason == "abort" and outs["x"][-1].finish_reason == "length"


def test_stop_token_ids_eos_ignore_eos_min_tokens():
    probe = make_engine()
    ref = probe.runner.reference_greedy([9, 9, 9], 12)
    stop_tok = ref[3]
    first = ref.index(stop_tok)
    eng = make_engine(eos_token_id=stop_tok)
    r1 = eng.add_request([9, 9, 9], SamplingParams(temperature=0, max_tokens=12))  # EOS
    r2 = eng.add_request([9, 9, 9], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    r3 = eng.add_request([9, 9, 9], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                   stop_token_ids=[stop_tok]))
    r4 = eng.add_request([9, 9, 9], SamplingParams(temperature=0, max_tokens=12, min_tokens=first + 2))
    outs = run_all(eng)
    assert outs[r1][-1].output_token_ids == ref[: first + 1] and outs[r1][-1].finish_reason == "stop"
    assert outs[r2][-1].output_token_ids == ref and outs[r2][-1].finish_reason == "length"
    assert outs[r3][-1].output_token_ids == ref[: first + 1] and outs[r3][-1].finish_reason == "stop"
    assert len(outs[r4][-1].output_token_ids) > first + 1


def test_seeded_sampling_reproducible_across_schedules():
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=11, max_tokens=10, ignore_eos=True)
    a = LLM(fake_config(1, 4, 16, 8), runner=FakeRunner(1, 16, 8)).generate([[5, 6, 7, 8, 9]], params)
    others = [[1, 2], [3] * 30, [4] * 7]
    b = LLM(fake_config(4, 64, 16, 8), runner=FakeRunner(4, 16, 8)).generate(
        others[:2] + [[5, 6, 7, 8, 9]] + others[2:],
        [params.__class__(temperature=1.0, max_tokens=10)] * 2 + [params]
        + [params.__class__(temperature=1.0, max_tokens=10)])
    assert a[0].output_token_ids == b[2].output_token_ids


def _word_tokenizer(tmp_path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<eos>", "hello", "world", "stop", "here", "the", "end"] + [f"w{i}" for i in range(90)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="the"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    from tokenizers import decoders

    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return tmp_path


def test_text_prompts_and_stop_strings_with_tokenizer(tmp_path):
    model_dir = _word_tokenizer(tmp_path)
    cfg = fake_config(2, 32, 16, 8, model_dir=str(model_dir), eos_token_id=0)
    llm = LLM(cfg, runner=FakeRunner(2, 16, 8))
    eng = llm.engine
    assert eng.tokenizer is not None and eng.eos_token_id == 0
    (full,) = llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    # the text continues the prompt's (incremental detokenisation with the prompt as context, as vLLM's)
    prompt_ids = eng.tokenizer.encode("hello world")
    whole, head = eng.tokenizer.decode(prompt_ids + full.output_token_ids), eng.tokenizer.decode(prompt_ids)
    assert full.prompt_len == 2 and full.text == whole[len(head):]
    words = full.text.split()
    target = words[2]
    (cut,) = llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                          stop=[target]))
    assert cut.finish_reason == "stop" and target not in cut.text
    assert cut.text == full.text[: full.text.index(target)]


def test_text_prompt_without_tokenizer_is_a_clear_error():
    eng = make_engine()
    with pytest.raises(ValueError, match="tokenizer.json"):
        eng.add_request("hello", GREEDY)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        eng.add_request([1, 2], SamplingParams(stop=["x"]))


def test_rejection_is_clear_and_queues_nothing():
    llm = LLM(fake_config(2, 16, 4, 8, 64), runner=FakeRunner(2, 4, 8, 64))
    with pytest.raises(RequestRejected, match=r"prompt 1 rejected: .*exceeds the maximum context length"):
        llm.generate([[1] * 4, [1] * 60], SamplingParams(max_tokens=8))
    with pytest.raises(RequestRejected, match="num_kv_blocks=4"):
        llm.engine.add_request([1] * 30, SamplingParams(max_tokens=8))
    assert not llm.engine.has_unfinished()
    with pytest.raises(ValueError, match="list of strings or a list of token-id lists"):
        llm.generate([1, 2, 3])


def test_engine_config_validation():
    with pytest.raises(ValueError, match="dtype 'fp16'"):
        fake_config(dtype="fp16")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        fake_config(max_num_seqs=8, budget=4)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        LLMEngine(fake_config(num_kv_blocks=64, block_size=8), FakeRunner(8, 32, 8))
    with pytest.raises(TypeError, match="unknown engine setting"):
        fake_config(max_num_seq=8)
    cfg = fake_config(model_dir=Path("/x"))
    assert cfg.model.model_dir == "/x" and isinstance(cfg, EngineConfig)


def test_token_ids_outside_the_vocabulary_are_a_clear_error():
    eng = make_engine()
    for bad in ([1, 2, 97], [-1]):
        with pytest.raises(ValueError, match=r"token id -?\d+ is out of range \[0, 97\)"):
            eng.add_request(bad, GREEDY)
    assert not eng.has_unfinished()


def test_engine_imports_no_presentation_libraries():
    banned = {"deepinfer_bench", "rich", "typer", "pandas"}
    root = Path(__file__).resolve().parents[1] / "engine"
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for n in names:
                assert n.split(".")[0] not in banned, f"{path} imports {n}"
