"""`deepinfer serve` (OpenAI-compatible server over the engine) and `deepinfer bench serve` (the online sweep)."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import typer

from deepinfer_bench.app import app, bench_app
from deepinfer_bench.options import EngineArgs, engine_options
from deepinfer_bench.report import DEFAULT_OUT_DIR, err_console, measured_on, render_df, save_results

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def tokenizer_root(model_dir: str | Path) -> Path:
    """The directory `/v1/models` reports as `root`: where a client (vLLM's `get_tokenizer` -> HF `AutoTokenizer`)
    loads the tokenizer from.

    That is the model directory itself when its config.json is HF-format. An official-format config.json (no
    `model_type`, `"dtype": "fp8"`) makes `AutoTokenizer.from_pretrained` fail while parsing the config, so then
    the tokenizer files are copied once into a tokenizer-only directory (keyed by their content) and that is `root`.
    """
    model_dir = Path(model_dir).resolve()
    cfg_path = model_dir / "config.json"
    if not (model_dir / "tokenizer.json").exists():
        return model_dir
    if cfg_path.exists() and "model_type" in json.loads(cfg_path.read_text()):
        return model_dir
    files = [model_dir / f for f in TOKENIZER_FILES if (model_dir / f).exists()]
    keyed = files + ([cfg_path] if cfg_path.exists() else [])  # the HF config.json written below derives from it
    digest = hashlib.sha256(b"".join(f.name.encode() + f.read_bytes() for f in keyed)).hexdigest()[:16]
    out = Path(tempfile.gettempdir()) / "deepinfer-tokenizers" / f"{model_dir.name}-{digest}"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        for f in files:
            shutil.copyfile(f, tmp / f.name)
        _write_hf_config(cfg_path, tmp / "config.json")
        try:
            tmp.rename(out)
        except OSError:  # another server made it first
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_hf_config(official: Path, out: Path) -> None:
    """Clients (vLLM's `get_config`) look for an HF config.json beside the tokenizer: write the HF spelling of the
    model's config there (skipped if the config cannot be read; the server itself reports that error)."""
    from engine.config import ConfigError, ModelConfig

    try:
        hf = {"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"],
              **ModelConfig.from_json(official).to_hf_json()}
    except (ConfigError, OSError):
        return
    out.write_text(json.dumps(hf, indent=1) + "\n")


def build_serving_engine(config: Any) -> Any:
    """The engine for serving (in the engine process): the process set up by the config's backend (threads,
    Neuron runtime variables), the fixed KV pool, and the weights loaded before the first request so its TTFT
    does not include loading. The engine never runs MTP while serving."""
    import engine

    return engine.build(config)


def engine_settings(cfg: Any, block_size: int | None) -> dict[str, Any]:
    """Serving defaults: 32 slots, 2048 tokens per step, a pool of 8192 token positions (or one max_model_len)."""
    from engine.config import default_block_size

    bs = block_size or default_block_size(cfg)
    max_len = min(4096, cfg.max_position_embeddings)
    return {"max_num_seqs": 32, "max_num_batched_tokens": 2048, "max_model_len": max_len,
            "num_kv_blocks": -(-max(8192, max_len) // bs)}


def build_app(config: Any, *, served_model_name: str | None, api_key: str | None, engine_process: bool = True) -> Any:
    """The server app. `engine_process`: the engine runs in a child process (no GIL shared with the HTTP side),
    else on a thread of this process."""
    from deepinfer_bench.server import ServerConfig, create_app
    from engine.sampler import SamplingParams
    from engine.tokenizer import load_tokenizer

    model_dir = Path(config.model.model_dir).resolve()
    engine, loop = None, None
    if engine_process:
        from deepinfer_bench.engine_process import ProcessEngineLoop

        if config.cp > 1:  # rank 0 of cp ranks schedules and serves; the others execute its steps (engine/launch.py)
            import functools
            import math

            from engine.launch import run_job

            loop = ProcessEngineLoop(None, (config,), job_runner=functools.partial(run_job, timeout_s=math.inf))
        else:
            loop = ProcessEngineLoop(build_serving_engine, (config,))
        ready = loop.launch()
        tokenizer = load_tokenizer(model_dir)
        vocab_size, max_model_len = ready.vocab_size, ready.max_model_len
    else:
        engine = build_serving_engine(config)
        tokenizer, vocab_size = engine.tokenizer, engine.vocab_size
        max_model_len = config.cache.max_model_len
    scfg = ServerConfig(served_model_name=served_model_name or model_dir.name,
                        model_root=str(tokenizer_root(model_dir)), model_aliases=(str(model_dir),),
                        max_model_len=min(max_model_len, config.cache.max_model_len),
                        vocab_size=vocab_size, api_key=api_key)
    return create_app(engine, tokenizer, scfg, make_sampling_params=SamplingParams, engine_loop=loop)


@app.command("serve")
@engine_options
def serve_cmd(
    engine: EngineArgs,
    host: str = typer.Option("127.0.0.1", help="Bind address (loopback by default)."),
    port: int = typer.Option(8000, help="TCP port."),
    served_model_name: str | None = typer.Option(None, help="Model id in /v1/models and requests (default: the "
                                                 "model directory name; the directory path is accepted too)."),
    api_key: str | None = typer.Option(None, help="Require `Authorization: Bearer KEY` on /v1/*, /tokenize."),
    engine_process: bool = typer.Option(True, "--engine-process/--engine-thread", help="Run the engine in a child "
                                        "process (default; no GIL shared with HTTP) or on a thread of the server."),
    log_level: str = typer.Option("info", help="uvicorn log level."),
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (`vllm bench serve --backend openai` works against it)."""
    import uvicorn

    if (engine.cp or 1) > 1 and not engine_process:
        raise typer.BadParameter("--cp > 1 runs the engine on rank processes: use the default --engine-process",
                                 param_hint="--cp")
    cfg = engine.model_config()
    config = engine.config(cfg, **engine_settings(cfg, engine.block_size))
    err_console.print(f"loading {engine.model_dir} ({config.backend}, {config.model.dtype}, cp {config.cp}, graph "
                      f"{config.graph.mode}) ...")
    try:
        server_app = build_app(config, served_model_name=served_model_name, api_key=api_key,
                               engine_process=engine_process)
    except RuntimeError as e:  # the engine process could not build the engine (bad checkpoint, ...)
        err_console.print(f"[red]error:[/red] cannot start the engine: {e}")
        raise typer.Exit(2) from None
    err_console.print(f"serving [bold]{server_app.state.config.served_model_name}[/bold] on http://{host}:{port} "
                      f"({measured_on(config.backend)})")
    uvicorn.run(server_app, host=host, port=port, log_level=log_level, timeout_keep_alive=30,
                timeout_graceful_shutdown=10)


@bench_app.command("serve")
def bench_serve_cmd(
    base_url: str = typer.Option("http://127.0.0.1:8000", help="Server root (with or without /v1)."),
    matrix: str = typer.Option("serve_quick", help="Matrix name in matrices/ or a TOML path."),
    out: Path = typer.Option(DEFAULT_OUT_DIR, help="Results folder (a new run folder each time)."),
    api_key: str | None = typer.Option(None, help="Bearer token for the server."),
    compare: Path | None = typer.Option(None, help="Offline matrix CSV: add online/offline TTFT and TPOT ratios."),
) -> None:
    """Sweep concurrency x input length x output length against an OpenAI-compatible server (vLLM's metrics)."""
    import pandas as pd

    from deepinfer_bench.serve_bench import compare_offline, load_serve_matrix, run_serve_matrix

    try:
        m = load_serve_matrix(matrix)
    except (ValueError, FileNotFoundError) as e:
        raise typer.BadParameter(str(e)) from None

    def progress(k: int, n: int, row: dict[str, Any]) -> None:
        err_console.print(f"[{k}/{n}] concurrency={row['concurrency']} input={row['input_len']} "
                          f"output={row['output_len']}: {row['status']} "
                          f"ttft_p50={row.get('ttft_ms_p50', float('nan')):.1f} ms "
                          f"tpot_p50={row.get('tpot_ms_p50', float('nan')):.2f} ms")

    import httpx

    try:
        df, info = run_serve_matrix(base_url, m, api_key=api_key, progress=progress)
    except httpx.HTTPError as e:  # the server is not there, or /v1/models failed
        err_console.print(f"[red]cannot benchmark {base_url}: {type(e).__name__}: {e}[/red]")
        raise typer.Exit(2) from None
    render_df(df, f"Serving sweep: {m.name} against {info.model}",
              columns=["concurrency", "input_len", "output_len", "completed", "failed", "ttft_ms_p50",
                       "ttft_ms_p90", "tpot_ms_p50", "tpot_ms_p90", "itl_ms_p50", "e2el_ms_p50", "output_tok_s",
                       "status"])
    for metric in ("ttft_ms_p50", "tpot_ms_p50"):
        for o, part in df[df.status != "skipped"].groupby("output_len"):
            pivot = part.pivot(index="concurrency", columns="input_len", values=metric)
            pivot.columns = [f"in={c}" for c in pivot.columns]
            pivot.index = pivot.index.astype(str)  # keep ints ints through render_df's row-wise formatting
            render_df(pivot.reset_index(), f"{metric} (output_len={o}; rows concurrency, columns input_len)")
    if compare is not None:
        ratios = compare_offline(df, pd.read_csv(compare))
        render_df(ratios, "online / offline (p50)")
    path = save_results(df, out, f"serve-{m.name}", meta={
        "kind": "serve", "base_url": base_url, "model": info.model, "root": info.root, "matrix": m.name,
        "matrix_def": {k: getattr(m, k) for k in m.__dataclass_fields__}})
    err_console.print(f"wrote {path}")
    if (df.status == "failed").any():
        raise typer.Exit(1)
