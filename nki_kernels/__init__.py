"""NKI kernels of DeepSeek-V4 for trn2, their torch references, and a NumPy stand-in of `nki`.

Importing this package imports nothing else (no `nki`, no stand-in, no NumPy): the engine imports
`nki_kernels.reference` and `nki_kernels.formats` on every host, and kernel modules only when it wants them.

Layout
    reference.py        the torch definition of every op (the engine's host path calls these; owned by the engine)
    formats.py          FP8 / FP4 / UE8M0 checkpoint formats (shared with the loader)
    <op>.py             module docstring (IO layouts, dtypes, constraints, tunables), the `@nki.jit` kernel, the
                        wrapper that checks shapes and dispatches, and the case matrix `CASES` + `run_case`:
                        rmsnorm, swiglu, hc_mixes, hc_collapse, hc_expand, hc_attn_out, compress_pool,
                        index_score, sparse_attn, blockquant (FP8 block GEMM, FP4 expert GEMM, grouped wo_a)
    _nki.py             the one place that resolves `nki` (real NKI >= 0.3, else the stand-in) and binds kernels
    _tiles.py           shared sub-kernels (inlined by the NKI compiler)
    dispatch.py         executor choice (device -> simulator -> stand-in; reference only when asked), counters and
                        the counted explicit fallbacks ("<family>.fallback")
    kernel_ops.py       the engine's op table: `make_ops(executor)` -> {op: callable with the reference's signature}
                        running each family's kernel (weight layouts converted once per weight, cached)
    stand_in/           the strict NumPy stand-in of the `nki.language` / `nki.isa` subset used
    static_check.py     AST check of the kernel files against the NKI meta-language and NKI 0.6 signatures
    cases.py registry.py  case records / comparison rule, and the name -> module table
    trn2_check.py       the prepared trn2 run (scripts/trn2_check.sh): stand-in vs simulator vs device
"""

from __future__ import annotations
