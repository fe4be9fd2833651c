"""Console entry point `deepinfer`: imports every command module so each registers itself on the app."""

from __future__ import annotations

import deepinfer_bench.cmd_compile  # noqa: F401
import deepinfer_bench.cmd_golden  # noqa: F401
import deepinfer_bench.cmd_kernels  # noqa: F401
import deepinfer_bench.cmd_matrix  # noqa: F401
import deepinfer_bench.cmd_regions  # noqa: F401
import deepinfer_bench.cmd_serve  # noqa: F401
import deepinfer_bench.cmd_speed  # noqa: F401
from deepinfer_bench import cmd_env  # noqa: F401
from deepinfer_bench.app import app

__all__ = ["app"]


def main() -> None:
    """`deepinfer`: user-facing errors print one clear line and exit 2 (deepinfer_bench/options.py `user_errors`);
    DEEPINFER_TRACEBACK=1 shows the traceback instead."""
    import click

    from deepinfer_bench.options import user_errors
    from engine.envs import pin_reproducible_math

    pin_reproducible_math()  # before this process's first matmul (MKL reads it once): engine/envs.py

    try:
        with user_errors():  # commands without the engine options (kernels, bench serve, env) get the same rule
            app()
    except click.exceptions.Exit as e:
        raise SystemExit(e.exit_code) from None


if __name__ == "__main__":
    main()
