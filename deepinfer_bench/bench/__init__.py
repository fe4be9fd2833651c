"""The libraries behind the bench commands: each returns data; the CLI (deepinfer_bench/cli/) prints and saves it."""
