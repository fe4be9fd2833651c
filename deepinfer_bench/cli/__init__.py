"""Console entry point `deepinfer`: imports every command module so each registers itself on the app."""

from __future__ import annotations

import deepinfer_bench.cli.cmd_bringup  # noqa: F401
import deepinfer_bench.cli.cmd_compile  # noqa: F401
import deepinfer_bench.cli.cmd_engine_vs_hf  # noqa: F401
import deepinfer_bench.cli.cmd_generate  # noqa: F401
import deepinfer_bench.cli.cmd_golden  # noqa: F401
import deepinfer_bench.cli.cmd_kernels  # noqa: F401
import deepinfer_bench.cli.cmd_matrix  # noqa: F401
import deepinfer_bench.cli.cmd_plan  # noqa: F401
import deepinfer_bench.cli.cmd_reference  # noqa: F401
import deepinfer_bench.cli.cmd_regions  # noqa: F401
import deepinfer_bench.cli.cmd_serve  # noqa: F401
import deepinfer_bench.cli.cmd_slice  # noqa: F401
from deepinfer_bench.cli import cmd_env  # noqa: F401
from deepinfer_bench.cli.app import app

__all__ = ["app"]


def main() -> None:
    """`deepinfer`: every user error is one clear line and exit 2 - a bad option value or usage (Typer/click's own
    range and usage checks included), a malformed config, a bad checkpoint... (deepinfer_bench/cli/options.py
    `user_errors`); DEEPINFER_TRACEBACK=1 shows the traceback instead."""
    import typer

    from deepinfer_bench.cli.options import user_errors
    from engine.envs import pin_reproducible_math

    pin_reproducible_math()  # before this process's first matmul (MKL reads it once): engine/envs.py

    try:
        with user_errors():  # commands without the engine options (kernels, bench serve, env) get the same rule
            code = app(standalone_mode=False)
    except typer.Exit as e:
        raise SystemExit(e.exit_code) from None
    except typer.Abort:
        raise SystemExit(130) from None
    except typer.TyperException as e:  # Typer's own usage errors (bad value, unknown option, missing argument)
        raise SystemExit(_usage_error(e)) from None
    raise SystemExit(code if isinstance(code, int) else 0)


def _usage_error(e: Exception) -> int:
    """One line for a Typer usage error (bad option value, missing argument, unknown option), exit 2; a command
    group called without a command shows its help."""
    from rich.markup import escape

    from deepinfer_bench.bench.report import err_console

    if type(e).__name__ == "NoArgsIsHelpError":
        e.show()
        return int(getattr(e, "exit_code", 2))
    ctx = getattr(e, "ctx", None)
    where = f" (see: {ctx.command_path} --help)" if ctx is not None else ""
    message = " ".join(e.format_message().split())  # one line, whatever click wrapped
    err_console.print(f"[red]error:[/red] {escape(message)}{escape(where)}", highlight=False, soft_wrap=True)
    return 2


if __name__ == "__main__":
    main()
