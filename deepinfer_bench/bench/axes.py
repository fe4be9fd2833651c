"""Matrix definitions (`matrices/*.toml`) for the offline TTFT/TPOT matrix and the online serving sweep: one way to
find, parse and check them. A matrix is a product of three axes - batch size (offline) or concurrency (online) x
input length x output length - plus its own run settings, declared as a frozen dataclass."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, TypeVar

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

MATRICES_DIR = Path(__file__).resolve().parents[2] / "matrices"
T = TypeVar("T")


def resolve(name_or_path: str | Path, *, kind: str = "matrix", prefix: str = "") -> Path:
    """A TOML path, or the name of a file in `matrices/` (`quick` -> matrices/quick.toml)."""
    p = Path(name_or_path)
    if p.suffix == ".toml" or p.exists():
        if not p.exists():
            raise FileNotFoundError(f"no {kind} file {p}")
        return p
    cand = MATRICES_DIR / f"{name_or_path}.toml"
    if not cand.exists():
        names = sorted(f.stem for f in MATRICES_DIR.glob(f"{prefix}*.toml"))
        raise FileNotFoundError(f"no {kind} named {str(name_or_path)!r} in {MATRICES_DIR} (have: {', '.join(names)})")
    return cand


def load(cls: type[T], path: Path, *, section: str | None = None, required: tuple[str, ...] = ()) -> T:
    """`cls(name=<file stem>, **table)` from a TOML file: unknown keys and missing axes are errors; lists become
    tuples; `description` is accepted (and kept when `cls` has the field)."""
    raw = tomllib.loads(path.read_text())
    if section is not None:
        raw = raw.get(section, raw)
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(raw) - known - {"description"})
    if unknown:
        raise ValueError(f"{path}: unknown keys {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    missing = [k for k in required if k not in raw]
    if missing:
        raise ValueError(f"{path}: missing {', '.join(missing)}")
    kw: dict[str, Any] = {k: (tuple(v) if isinstance(v, list) else v) for k, v in raw.items() if k in known}
    kw.setdefault("name", path.stem)
    return cls(**kw)


def check_axes(obj: Any, axes: tuple[str, ...]) -> None:
    """Normalise each axis of a frozen dataclass to a tuple of positive ints (an int becomes a 1-tuple)."""
    for axis in axes:
        vals = getattr(obj, axis)
        vals = (vals,) if isinstance(vals, int) else tuple(vals)
        object.__setattr__(obj, axis, vals)  # normalisation inside the constructor only
        if not vals or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in vals):
            raise ValueError(f"matrix {obj.name!r}: {axis} must be a non-empty list of positive ints, got {vals}")


def cells(first: tuple[int, ...], input_len: tuple[int, ...], output_len: tuple[int, ...]) -> list[tuple[int, ...]]:
    """(first, input_len, output_len) for every cell: output slowest, then input, then the first axis."""
    return [(b, i, o) for o in output_len for i in input_len for b in first]
