"""Console entry point `deepinfer`: imports every command module so each registers itself on the app."""

from __future__ import annotations

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
    """`deepinfer`: user-facing errors (a malformed config, a bad checkpoint, an invalid layout, a failed rank...)
    print one clear line and exit 2; DEEPINFER_TRACEBACK=1 shows the traceback instead."""
    from deepinfer_bench.golden import GoldenError
    from deepinfer_bench.report import err_console
    from engine.envs import get_envs
    from engine.parallel import RankFailed

    try:
        app()
    except (ValueError, FileNotFoundError, GoldenError, RankFailed) as e:
        if get_envs().DEEPINFER_TRACEBACK:
            raise
        from rich.markup import escape

        err_console.print(f"[red]error:[/red] {type(e).__name__}: {escape(str(e))}", highlight=False, soft_wrap=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
