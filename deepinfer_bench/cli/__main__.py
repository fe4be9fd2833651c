"""`python -m deepinfer_bench.cli`: the same entry point as the `deepinfer` console script."""

from deepinfer_bench.cli import main

main()
