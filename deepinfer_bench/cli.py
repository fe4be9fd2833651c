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
    app()


if __name__ == "__main__":
    main()
