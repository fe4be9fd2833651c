"""Session setup shared by every test: the engine's reproducible host math (engine/envs.py `pin_reproducible_math`)
before the session's first matmul, as the `deepinfer` entry point does, so in-process engine tests compute under
the same MKL mode as the CLI."""

from engine.envs import pin_reproducible_math

pin_reproducible_math()
