"""`deepinfer generate` (library: deepinfer_bench/bench/generate.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from deepinfer_bench.bench.report import err_console
from deepinfer_bench.cli.app import app
from deepinfer_bench.cli.options import EngineArgs, engine_options


@app.command("generate")
@engine_options
def generate_cmd(
    engine: EngineArgs,
    prompt: Annotated[str | None, typer.Option(help="Text prompt (needs a tokenizer in the model dir).")] = None,
    prompt_ids: Annotated[str | None, typer.Option(help="Comma-separated token ids, e.g. 1,2,3.")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="--prompt is a user message: render it with DeepSeek-V4's "
                                                      "chat encoding (as /v1/chat/completions does), parse the reply.")
                    ] = False,
    thinking: Annotated[bool, typer.Option("--thinking", help="With --chat: thinking mode (the reply starts with "
                                                              "its reasoning).")] = False,
    max_tokens: Annotated[int, typer.Option(min=1)] = 32,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(min=0.0, max=1.0)] = 1.0,
    top_k: Annotated[int, typer.Option(min=0, help="0 = off.")] = 0,
    seed: Annotated[int | None, typer.Option()] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print {prompt_ids, output_ids, text} as JSON.")] = False,
    out: Annotated[Path | None, typer.Option("--out", help="Also write generate.csv + meta.json (timing, resident "
                                                           "weight bytes, peak RSS) under this folder.")] = None,
) -> None:
    """One-off generation through the full engine (scheduler, KV pool, sampler)."""
    from deepinfer_bench.bench.generate import Prompt, run_generate
    from engine.sampler import SamplingParams

    request = Prompt.parse(prompt, prompt_ids, chat, thinking)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, max_tokens=max_tokens)
    result = run_generate(engine, request, params, out=out)
    if out is not None:
        err_console.print(f"peak RSS {result['peak_rss_bytes'] / 2**30:.2f} GiB = "
                          f"{result['peak_rss_over_checkpoint']:.2f} x the checkpoint "
                          f"({result['checkpoint_bytes'] / 2**30:.2f} GiB); resident weights "
                          f"{result['resident_weight_bytes'] / 2**30:.2f} GiB  ->  {result['results']}")
    message = result.get("message")
    if message and message["reasoning_content"] and not as_json:
        err_console.print(message["reasoning_content"], style="dim", markup=False, highlight=False)
    if as_json:
        typer.echo(json.dumps(result))
    else:
        typer.echo(result["text"] if result["text"] is not None else " ".join(map(str, result["output_ids"])))
