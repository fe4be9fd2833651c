"""`deepinfer golden` and `deepinfer generate`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from deepinfer_bench.app import app
from deepinfer_bench.options import EngineArgs, engine_options
from deepinfer_bench.report import DEFAULT_OUT_DIR, err_console, render_df, save_results


@app.command("golden")
@engine_options
def golden_cmd(
    engine: EngineArgs,
    golden_dir: Annotated[Path | None, typer.Option(help="Golden data dir (default: golden/).")] = None,
    report_collectives: Annotated[bool, typer.Option(help="Print collective calls per layer per step.")] = False,
    out: Annotated[Path, typer.Option(help="Results folder (a new run dir each time).")] = DEFAULT_OUT_DIR,
) -> None:
    """Run every golden prompt through the engine's serving path (scheduler, KV pool, greedy sampler; on --cp
    ranks) and compare tokens and logits with the HF reference outputs. Exit 1 on any mismatch."""
    from deepinfer_bench.golden import GOLDEN_DIR, collectives_per_layer, engine_settings, load_golden, run_golden

    cfg = engine.model_config()
    golden_dir = golden_dir or GOLDEN_DIR
    _, prompts = load_golden(golden_dir, cfg)
    config = engine.config(cfg, **engine_settings(prompts, cfg, engine.cp or 1))
    c = config.cache
    err_console.print(f"[dim]golden: model {engine.model_dir}, {config.model.dtype}, cp {config.cp}, backend "
                      f"{config.backend}, graph {config.graph.mode}, kernels {config.kernels}, weights "
                      f"{config.model.weights}; max_num_seqs "
                      f"{c.max_num_seqs}, max_num_batched_tokens {c.max_num_batched_tokens}, num_kv_blocks "
                      f"{c.num_kv_blocks} x {c.block_size}[/dim]")
    run = run_golden(config, golden_dir)
    render_df(run.table, f"golden vs HF reference ({config.model.dtype}, cp={config.cp}, graph {config.graph.mode})")
    if run.collectives and (report_collectives or config.cp > 1):
        render_df(collectives_per_layer(run.collectives, run.steps), f"collectives per layer per step "
                                                                      f"({run.steps} engine steps)")
    if len(run.kernels):
        render_df(run.kernels, f"Kernel dispatches inside the model (--kernels {config.kernels})")
    path = save_results(run.table, out, "golden", run.meta)
    if len(run.kernels):
        run.kernels.to_csv(path.parent / "golden_kernels.csv", index=False)
    n = len(run.table)
    style = "green" if run.ok else "red"
    toks = f"{int(run.table['tokens_matched'].sum())}/{int(run.table['tokens_total'].sum())}"
    err_console.print(f"[{style}]{run.n_match}/{n} prompts match[/{style}] (greedy tokens identical: {toks}, "
                      f"max |dlogit| {run.table['max_abs_dlogit'].max():.2e}, tol {run.table['logit_tol'].iloc[0]}; "
                      f"{run.steps} engine steps, {run.meta['preemptions']} preemptions; host math "
                      f"{_host_math(run.meta['host_math'])})  ->  {path}")
    raise typer.Exit(0 if run.ok else 1)


def _host_math(m: dict) -> str:
    """e.g. 'mkl AUTO,STRICT x2': the BLAS, MKL's reproducibility mode (engine/envs.py) and the thread count."""
    return f"{m['blas']}{' ' + m['mkl_cbwr'] if m.get('mkl_cbwr') else ''} x{m['threads']}"


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
    top_p: Annotated[float, typer.Option()] = 1.0,
    top_k: Annotated[int, typer.Option()] = 0,
    seed: Annotated[int | None, typer.Option()] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print {prompt_ids, output_ids, text} as JSON.")] = False,
    out: Annotated[Path | None, typer.Option("--out", help="Also write generate.csv + meta.json (timing, resident "
                                                           "weight bytes, peak RSS) under this folder.")] = None,
) -> None:
    """One-off generation through the full engine (scheduler, KV pool, sampler)."""
    from deepinfer_bench.generate import chat_prompt_ids, checkpoint_bytes, engine_settings, generate
    from engine.chat_encoding import parse_completion
    from engine.llm import check_token_ids
    from engine.sampler import SamplingParams

    if (prompt is None) == (prompt_ids is None):
        raise typer.BadParameter("give exactly one of --prompt or --prompt-ids")
    if (chat or thinking) and prompt is None:
        raise typer.BadParameter("--chat / --thinking take the user message as --prompt")
    ids = None
    if prompt_ids is not None:
        try:
            ids = [int(x) for x in prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise typer.BadParameter(f"--prompt-ids {prompt_ids!r}: expected comma-separated integers") from None
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, max_tokens=max_tokens)
    cfg = engine.model_config()
    if ids is not None:
        ids = check_token_ids(ids, cfg.vocab_size)  # before any engine is built: one line, exit 2
    mode = "thinking" if thinking else "chat"
    if chat or thinking:
        ids, prompt = chat_prompt_ids(engine.model_dir, prompt, mode), None
    config = engine.config(cfg, **engine_settings(cfg, prompt, ids, max_tokens, engine.cp or 1))
    result = generate(config, prompt if prompt is not None else ids, params)
    if out is not None:
        import pandas as pd

        ckpt = checkpoint_bytes(engine.model_dir)
        row = {"prompt_len": len(result["prompt_ids"]), "output_len": len(result["output_ids"]),
               "seconds": result["seconds"], "weights": str(config.model.weights), "dtype": str(config.model.dtype),
               "checkpoint_bytes": ckpt, "resident_weight_bytes": result["resident_weight_bytes"],
               "kv_cache_bytes": result["kv_cache_bytes"], "peak_rss_bytes": result["peak_rss_bytes"],
               "peak_rss_over_checkpoint": result["peak_rss_bytes"] / ckpt if ckpt else float("nan")}
        path = save_results(pd.DataFrame([row]), out, "generate", {"engine_config": config.to_dict(), **row})
        err_console.print(f"peak RSS {row['peak_rss_bytes'] / 2**30:.2f} GiB = {row['peak_rss_over_checkpoint']:.2f}"
                          f" x the checkpoint ({ckpt / 2**30:.2f} GiB); resident weights "
                          f"{row['resident_weight_bytes'] / 2**30:.2f} GiB  ->  {path}")
    if chat or thinking:
        parsed = parse_completion(result["text"], thinking_mode=mode, tools=False)
        result["message"] = {"role": "assistant", "reasoning_content": parsed.reasoning_content,
                             "content": parsed.content}
        if parsed.reasoning_content and not as_json:
            err_console.print(parsed.reasoning_content, style="dim", markup=False, highlight=False)
        result["text"] = parsed.content
    if as_json:
        typer.echo(json.dumps(result))
    else:
        typer.echo(result["text"] if result["text"] is not None else " ".join(map(str, result["output_ids"])))
