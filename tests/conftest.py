"""Session setup shared by every test: the engine's reproducible host math (engine/envs.py `pin_reproducible_math`)
before the session's first matmul, as the `deepinfer` entry point does, so in-process engine tests compute under
the same MKL mode as the CLI; and the XLA runtime's settings the xla backend applies (engine/backends/xla.py
`apply_runtime_env`), before any test may start the PJRT runtime itself: the runtime reads them once, so a test that
touched `xla:0` first (a kernel test) left later engine tests with torch-xla's 2048-graph cache, whose evictions
showed up as recompiles after warm-up."""

from engine.backends.xla import apply_runtime_env
from engine.envs import pin_reproducible_math

pin_reproducible_math()
apply_runtime_env()
