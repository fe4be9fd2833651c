"""Tests of the NKI kernels, their stand-in, static check, dispatch and the `deepinfer kernels` command."""

from __future__ import annotations
