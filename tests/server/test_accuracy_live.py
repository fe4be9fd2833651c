"""Accuracy runs against `deepinfer serve` on the tiny model (golden/tiny), in its own process on loopback.

- The real `lm_eval` (`--model local-completions`) on the two local tasks of tests/data/lm_eval (a multiple-choice
  loglikelihood task and a generate_until task, local JSONL, no download): it completes and reports scores, and the
  loglikelihood it computed for every choice equals the engine's own log-softmax over the same tokens.
- The `openai` client: prompt logprobs (`echo=True, logprobs=3, max_tokens=0`) equal the engine's log-softmax of one
  whole-prompt forward (the server prefills in chunks of 16 tokens), and HF's; chat streams and ends with usage;
  bad values of the new fields are a 400 and the server stays healthy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from tests.server.conftest import REPO, start_server, stop_server

TINY = REPO / "golden" / "tiny"
TASKS = REPO / "tests" / "data" / "lm_eval"
SERVE_ARGS = ["--dtype", "float32", "--graph-mode", "eager", "--backend", "host", "--max-num-seqs", "16",
              "--num-kv-blocks", "128", "--block-size", "16", "--max-model-len", "512",
              "--max-num-batched-tokens", "16"]  # prompts longer than 16 tokens are prefilled in chunks
PROMPT = [0, *[(37 * k + 11) % 1000 + 15 for k in range(39)]]  # 40 tokens: 3 chunks
# fp32 against fp32: only summation order differs (chunked vs whole prefill; engine vs HF). The golden check
# allows 1e-3 in logits, which bounds a log-softmax difference by 2e-3.
LOGPROB_TOL = 2e-3


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    # one intra-op thread: the tiny model's many small ops only wait for each other's threads on a busy 2-core box
    proc, base = start_server(["-m", "deepinfer_bench.cli", "serve", "--model-dir", str(TINY), *SERVE_ARGS,
                               "--log-level", "warning"], timeout_s=120, env={"DEEPINFER_NUM_THREADS": "1"})
    try:
        yield base
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def engine():
    """The same engine in this process (same config), for the engine's own log-softmax."""
    import engine as eng_mod
    from engine.config import EngineConfig

    cfg = EngineConfig.from_model_dir(TINY, dtype="float32", graph_mode="eager", backend="host", max_num_seqs=1,
                                      num_kv_blocks=32, block_size=16, max_model_len=512,
                                      max_num_batched_tokens=512)
    return eng_mod.build(cfg)


def engine_logprobs(engine, ids: list[int]) -> torch.Tensor:
    """log-softmax [len(ids), V] of the model's logits at every position of `ids`, one whole-prompt forward straight
    through the runner (no scheduler, no chunking, none of the logprobs code of engine/llm.py)."""
    from engine.model.cache import SeqStep

    runner = engine.runner
    runner.free_slot(0)
    step = SeqStep(slot=0, start=0, n=len(ids), token_start=0,
                   block_table=torch.arange(-(-len(ids) // runner.block_size)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        logits = runner.forward([step], torch.tensor(ids), logit_index=torch.arange(len(ids)))  # [T, V] fp32
    finally:
        torch.set_num_threads(threads)
    return torch.log_softmax(logits.float(), dim=-1)


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=120, max_retries=0)


def test_openai_echo_prompt_logprobs_equal_the_engines(server: str, engine) -> None:
    r = client(server).completions.create(model="tiny", prompt=PROMPT, logprobs=3, echo=True, max_tokens=0)
    lp = r.choices[0].logprobs
    assert r.usage.prompt_tokens == 40 and r.usage.completion_tokens == 0
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == 40
    ref = engine_logprobs(engine, PROMPT)  # [40, V]: row t predicts token t + 1
    want = ref[torch.arange(39), torch.tensor(PROMPT[1:])]
    diff = (torch.tensor(lp.token_logprobs[1:]) - want).abs().max().item()
    print(f"\nserver (chunked prefill) vs engine (one forward) prompt logprobs: max |diff| {diff:.2e}")
    assert diff < LOGPROB_TOL
    tok = engine.tokenizer
    for t in range(1, 40):
        top3 = ref[t - 1].topk(3).indices.tolist()
        names = {tok.decode([i], skip_special_tokens=False) for i in [PROMPT[t], *top3]}
        assert set(lp.top_logprobs[t]) == names  # the token and the top 3 (equal names collapse)
    # generated tokens: greedy, so the top-1 of each position is the token itself
    g = client(server).completions.create(model="tiny", prompt=PROMPT, logprobs=3, max_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
    out = g.choices[0].model_extra["token_ids"]
    ref = engine_logprobs(engine, PROMPT + out)
    for j, t in enumerate(out):
        assert int(ref[39 + j].argmax()) == t
        assert abs(g.choices[0].logprobs.token_logprobs[j] - float(ref[39 + j, t])) < LOGPROB_TOL


@pytest.mark.reference
def test_prompt_logprobs_equal_hf(server: str) -> None:
    pytest.importorskip("transformers", minversion="5.24", reason="the HF reference needs the `reference` extra")
    from deepinfer_bench.bench.hf_reference import build_hf_model
    from engine.config import ModelConfig
    from engine.loader import load_checkpoint

    cfg = ModelConfig.from_json(TINY)
    hf = build_hf_model(cfg, load_checkpoint(TINY, cfg, dtype=torch.float32), dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(hf(input_ids=torch.tensor([PROMPT])).logits[0].float(), -1)  # [40, V]
    want = ref[torch.arange(39), torch.tensor(PROMPT[1:])]
    got = client(server).completions.create(model="tiny", prompt=PROMPT, logprobs=1, echo=True, max_tokens=0)
    diff = (torch.tensor(got.choices[0].logprobs.token_logprobs[1:]) - want).abs().max().item()
    print(f"\nserver vs HF DeepseekV4ForCausalLM prompt logprobs: max |diff| {diff:.2e}")
    assert diff < LOGPROB_TOL


def test_chat_streams_and_finishes_with_usage(server: str) -> None:
    c = client(server)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, who are you?"}]
    chunks = list(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    tokens = [ch for ch in chunks if ch.choices]
    assert tokens and tokens[0].choices[0].delta.role == "assistant"
    assert tokens[-1].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices == [] and 1 <= chunks[-1].usage.completion_tokens <= 6
    whole = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0)
    assert whole.usage == chunks[-1].usage
    assert whole.choices[0].message.content == "".join(ch.choices[0].delta.content or "" for ch in tokens)
    thinking = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0,
                                         extra_body={"chat_template_kwargs": {"thinking": True}})
    assert thinking.usage.prompt_tokens == whole.usage.prompt_tokens  # <think> instead of </think>: one token


@pytest.mark.parametrize(("method", "kwargs", "param"), [
    ("completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("completions", {"prompt": "hi", "n": 0}, "n"),
    ("completions", {"prompt": "hi", "best_of": 2, "stream": True}, "best_of"),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("chat", {"messages": [["user", "hi"]]}, "messages.0"),
])
def test_bad_new_fields_are_openai_400s(server: str, method: str, kwargs: dict, param: str) -> None:
    c = client(server)
    create = c.completions.create if method == "completions" else c.chat.completions.create
    with pytest.raises(openai.BadRequestError) as e:
        create(model="tiny", max_tokens=2, **kwargs)
    assert e.value.status_code == 400 and e.value.body["param"] == param and e.value.body["message"]
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200


MODEL_ARGS = "base_url={server}/v1/completions,model=tiny,tokenizer={root},tokenizer_backend=huggingface,\
num_concurrent=1,max_retries=1,max_length=512"
TASK_NAMES = ["deepinfer_tiny_mc", "deepinfer_tiny_gen"]
# lm-eval's own evaluator through its Python API, with the local tasks only: the CLI also indexes every built-in task
# first (~15 s here), which is all that differs from `lm_eval --model local-completions ...` (the slow test runs that).
API_RUN = """
import json, sys
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
model_args, tasks, limit, out, names = sys.argv[1:6]
r = simple_evaluate(model="local-completions", model_args=model_args, tasks=names.split(","), batch_size=16,
                    limit=int(limit),
                    log_samples=True, task_manager=TaskManager(include_path=tasks, include_defaults=False))
mc = [{"doc": s["doc"], "acc": s["acc"], "arguments": [list(a) for a in s["arguments"]],
       "resps": [[float(x[0][0]), bool(x[0][1])] for x in s["resps"]]} for s in r["samples"]["deepinfer_tiny_mc"]]
json.dump({"results": r["results"], "n-samples": r["n-samples"], "mc_samples": mc}, open(out, "w"))
"""


def run_lm_eval(server: str, out: Path, limit: int | None, *, cli: bool) -> tuple[dict, list[dict], float]:
    """lm-eval's results and its multiple-choice samples ({doc, acc, arguments: [[context, continuation]], resps:
    [[loglikelihood, is_greedy]]} per document), and the seconds it ran."""
    root = httpx.get(f"{server}/v1/models", timeout=10).json()["data"][0]["root"]
    model_args = MODEL_ARGS.format(server=server, root=root)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(out / "hf"),
           "TOKENIZERS_PARALLELISM": "false"}
    if cli:
        cmd = ["-m", "lm_eval", "--model", "local-completions", "--model_args", model_args, "--batch_size", "16",
               "--tasks", ",".join(TASK_NAMES), "--include_path", str(TASKS), "--output_path", str(out / "results"),
               "--log_samples", *(["--limit", str(limit)] if limit is not None else [])]
    else:
        cmd = ["-c", API_RUN, model_args, str(TASKS), str(limit), str(out / "results.json"), ",".join(TASK_NAMES)]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, *cmd], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-4000:]
    if not cli:
        got = json.loads((out / "results.json").read_text())
        return got, got["mc_samples"], seconds
    (path,) = (out / "results").rglob("results_*.json")
    (samples,) = (out / "results").rglob("samples_deepinfer_tiny_mc_*.jsonl")
    docs = [json.loads(line) for line in samples.read_text().splitlines()]
    mc = [{"doc": d["doc"], "acc": d["acc"], "arguments": [[a["arg_0"], a["arg_1"]] for a in d["arguments"].values()],
           "resps": [[float(x[0][0]), x[0][1] == "True"] for x in d["resps"]]} for d in docs]
    return json.loads(path.read_text()), mc, seconds


def check_lm_eval(server: str, engine, out: Path, limit: int | None, *, cli: bool) -> None:
    pytest.importorskip("lm_eval", reason="lm-eval is in the dev extra")
    results, docs, seconds = run_lm_eval(server, out, limit, cli=cli)
    mc, gen = results["results"]["deepinfer_tiny_mc"], results["results"]["deepinfer_tiny_gen"]
    print(f"\nlm_eval {'CLI' if cli else 'API'} ({seconds:.1f} s, limit {limit}): deepinfer_tiny_mc acc "
          f"{mc['acc,none']:.4f} acc_norm {mc['acc_norm,none']:.4f}; deepinfer_tiny_gen exact_match "
          f"{gen['exact_match,none']:.4f}")
    assert 0 <= mc["acc,none"] <= 1 and 0 <= mc["acc_norm,none"] <= 1 and 0 <= gen["exact_match,none"] <= 1
    n_mc, n_gen = (6, 4) if limit is None else (min(6, limit), min(4, limit))
    assert results["n-samples"]["deepinfer_tiny_mc"]["effective"] == n_mc
    assert results["n-samples"]["deepinfer_tiny_gen"]["effective"] == n_gen
    # every choice's loglikelihood as lm-eval computed it (the sum of the continuation's logprobs it read from
    # `echo`) against the engine's own log-softmax over the same tokens (lm-eval's encoding: the context, then
    # the rest of the whole text's tokens; no BOS), and lm-eval's is_greedy against the engine's argmax
    assert len(docs) == n_mc
    tok, worst = engine.tokenizer, 0.0
    for doc in docs:
        lls = []
        for (ctx, cont), (got, greedy) in zip(doc["arguments"], doc["resps"], strict=True):
            ctx_ids = tok.encode(ctx, add_special_tokens=False)
            ids = ctx_ids + tok.encode(ctx + cont, add_special_tokens=False)[len(ctx_ids):]
            lp = engine_logprobs(engine, ids)
            span = range(len(ctx_ids), len(ids))
            worst = max(worst, abs(got - sum(float(lp[t - 1, ids[t]]) for t in span)))
            assert greedy == all(int(lp[t - 1].argmax()) == ids[t] for t in span)
            lls.append(got)
        assert doc["acc"] == float(max(range(len(lls)), key=lambda i: lls[i]) == doc["doc"]["label"])
    print(f"lm_eval loglikelihoods vs the engine's log-softmax: max |diff| {worst:.2e}")
    assert worst < LOGPROB_TOL * 4  # a sum of a few token logprobs


def test_lm_eval_local_completions_minimal(server: str, engine, tmp_path: Path) -> None:
    """Both task kinds, 2 documents each, through lm-eval's evaluator (the full tasks and the CLI: the slow test)."""
    check_lm_eval(server, engine, tmp_path, limit=2, cli=False)


@pytest.mark.slow
def test_lm_eval_cli_full(server: str, engine, tmp_path: Path) -> None:
    check_lm_eval(server, engine, tmp_path, limit=None, cli=True)
