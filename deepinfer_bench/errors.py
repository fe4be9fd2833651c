"""Errors whose message alone tells the user what to fix: the CLI prints one as one line and exits 2
(cli/options.py `user_errors`). A leaf module, so any library can raise them without importing the CLI."""

from __future__ import annotations


class UserError(RuntimeError):
    """A failure the user fixes from its message (bad or missing input data), not a bug to trace."""


class GoldenError(UserError):
    """Golden data missing, of another format, or made for another model."""
