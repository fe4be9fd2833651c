"""`deepinfer slice` (library: deepinfer_bench/bench/slice.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from deepinfer_bench.bench.report import err_console
from deepinfer_bench.cli.app import app


@app.command("slice")
def slice_cmd(
    model_dir: Annotated[Path, typer.Option(help="The full checkpoint (official format, sharded or not).")],
    layers: Annotated[str, typer.Option(help="Contiguous main layers to keep, A-B (renumbered from 0).")],
    out: Annotated[Path, typer.Option(help="Where the slice is written.")],
    experts: Annotated[int | None, typer.Option(min=1, help="Keep the first N routed experts (router rows, bias "
                                                            "and hash table kept consistent).")] = None,
) -> None:
    """Cut a small self-consistent checkpoint (a few layers and experts) from a real V4 one.

    Streamed shard by shard (peak memory ~ one
    shard of the slice): the layers, the MTP block when present, the first N experts, embeddings and head."""
    from deepinfer_bench.bench.slice import SliceError, slice_checkpoint

    try:
        s = slice_checkpoint(model_dir, out, layers, experts)
    except SliceError as e:
        raise typer.BadParameter(str(e)) from None
    err_console.print(f"[green]slice[/green] layers {s['layers'][0]}-{s['layers'][1]} of {model_dir}: "
                      f"{s['n_layers']} layers, {s['n_routed_experts']} experts, {s['tensors']} tensors, "
                      f"{s['bytes'] / 2**20:.1f} MiB (largest shard {s['largest_shard_bytes'] / 2**20:.1f} MiB)"
                      f"  ->  {out}")
