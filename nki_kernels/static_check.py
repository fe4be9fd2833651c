"""Static check of the kernel sources against the NKI meta-language subset and the NKI 0.6 signatures.

The NKI compiler parses each `@nki.jit` function (and the sub-kernels it calls) and accepts only a subset of
Python. The stand-in runs any Python, so this AST check catches the commonest "passes on the
CPU, fails to compile" class before a Neuron machine is involved:

* no `is`/`is not`, no keyword-only `*`/`*args`/`**kwargs`, no lambda / nested def / class / global / nonlocal /
  try / with / while / yield / import / comprehension / del / assert inside a kernel;
* calls only to `nl.*`, `nisa.*` (each checked against `SIGNATURES`, the NKI 0.6 parameter lists), `range`,
  `min`, `max`, `len`, the tensor view methods `reshape`/`view`, and sub-kernels (plain functions of the same
  module or of `nki_kernels._tiles`, checked the same way);
* global names only `nki`, `nl`, `nisa`, sub-kernels and int/float module constants; `nl.X` / `nisa.X`
  attributes only from `NL_ATTRS` / `NISA_ATTRS`;
* dict literals with string keys only; kernel parameters without list defaults; no nested slicing `t[a][b]`
  (the stand-in also rejects slicing a slice at run time, which catches it across sub-kernel calls).

`check_file(path) -> list[Issue]`; `check_all()` runs over every kernel module (used by the CI test).
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass
from pathlib import Path

# NKI 0.6 signatures of every nl.* / nisa.* call the kernels make (SDK nki/api/nki/{isa,language}/__init__.py).
SIGNATURES: dict[str, str] = {
    "nisa.dma_copy": "dst, src, priority=None, oob_mode=oob_mode.error, dge_mode=dge_mode.unknown, "
                     "engine=engine.unknown, name=None",
    "nisa.tensor_copy": "dst, src, engine=engine.unknown, name=None",
    "nisa.memset": "dst, value, engine=engine.unknown, name=None",
    "nisa.iota": "dst, pattern, offset=0, channel_multiplier=0, name=None",
    "nisa.nc_matmul": "dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False, "
                      "is_transpose=False, accumulate=None, tile_position=(), tile_size=(), "
                      "perf_mode=matmul_perf_mode.none, name=None",
    "nisa.nc_transpose": "dst, data, engine=engine.unknown, name=None",
    "nisa.activation": "dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None, "
                       "reduce_cmd=reduce_cmd.idle, name=None",
    "nisa.tensor_tensor": "dst, data1, data2, op, engine=engine.unknown, name=None",
    "nisa.tensor_scalar": "dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False, "
                          "engine=engine.unknown, name=None",
    "nisa.tensor_reduce": "dst, op, data, axis, negate=False, keepdims=False, name=None",
    "nisa.reciprocal": "dst, data, name=None",
    "nisa.max8": "dst, src, name=None",
    "nisa.nc_find_index8": "dst, data, vals, name=None",
    "nisa.nc_match_replace8": "dst, data, vals, imm, dst_idx=None, name=None",
    "nl.ndarray": "shape, dtype, buffer=sbuf, name='', address=None",
    "nl.zeros": "shape, dtype, buffer=sbuf, name=''",
}

NL_ATTRS = frozenset({
    # dtypes
    "bool_", "int8", "int16", "int32", "uint8", "uint16", "uint32", "float16", "float32", "bfloat16",
    "float8_e4m3", "float8_e5m2",
    # memory
    "sbuf", "psum", "hbm", "private_hbm", "shared_hbm", "tile_size",
    # ops passed to nisa instructions
    "add", "subtract", "multiply", "maximum", "minimum", "bitwise_and", "bitwise_or", "left_shift", "right_shift",
    "greater", "greater_equal", "less", "less_equal", "equal", "not_equal", "exp", "log", "sqrt", "rsqrt",
    "reciprocal", "sigmoid", "silu", "relu", "tanh", "square", "copy", "abs", "negative",
})
NISA_ATTRS = frozenset({"reduce_cmd", "engine", "dge_mode", "oob_mode", "matmul_perf_mode"})
# gen4 (trn3) only: never in a trn2 kernel
GEN4_ONLY = frozenset({"nc_matmul_mx", "quantize_mx", "exponential", "activate2", "float8_e4m3fn",
                       "float8_e4m3fn_x4", "float8_e5m2_x4", "float4_e2m1fn_x4"})
BUILTINS = frozenset({"range", "min", "max", "len"})
TENSOR_METHODS = frozenset({"reshape", "view"})
ALLOWED_GLOBALS = frozenset({"nki", "nl", "nisa"}) | BUILTINS
SUBKERNEL_MODULE = "_tiles.py"

_FORBIDDEN = {
    ast.Lambda: "lambda", ast.FunctionDef: "nested def", ast.AsyncFunctionDef: "async def", ast.ClassDef: "class",
    ast.Global: "global", ast.Nonlocal: "nonlocal", ast.Try: "try", ast.With: "with", ast.While: "while",
    ast.Yield: "yield", ast.YieldFrom: "yield", ast.Await: "await", ast.Import: "import", ast.ImportFrom: "import",
    ast.ListComp: "comprehension", ast.SetComp: "comprehension", ast.DictComp: "comprehension",
    ast.GeneratorExp: "generator", ast.Delete: "del", ast.Assert: "assert", ast.Set: "set literal",
    ast.Starred: "star-args", ast.JoinedStr: "f-string",
}


@dataclass(frozen=True)
class Issue:
    file: str
    line: int
    function: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.function}: {self.message}"


def _params(sig: str) -> tuple[list[str], set[str]]:
    """(all parameter names in order, the required ones) of a signature string."""
    fn = ast.parse(f"def f({sig}): pass").body[0]
    args = fn.args
    names = [a.arg for a in args.args]
    required = set(names[: len(names) - len(args.defaults)])
    return names, required


def _is_jit(fn: ast.FunctionDef) -> bool:
    for d in fn.decorator_list:
        if isinstance(d, ast.Attribute) and d.attr == "jit" and isinstance(d.value, ast.Name) and d.value.id == "nki":
            return True
    return False


def _module_constants(tree: ast.Module) -> set[str]:
    out = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and \
                isinstance(node.value.value, (int, float)):
            out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return out


class _Checker:
    def __init__(self, file: str, functions: dict[str, ast.FunctionDef], subkernels: set[str], constants: set[str]):
        self.file, self.functions, self.subkernels, self.constants = file, functions, subkernels, constants
        self.issues: list[Issue] = []

    def err(self, node: ast.AST, fn: str, msg: str) -> None:
        self.issues.append(Issue(self.file, getattr(node, "lineno", 0), fn, msg))

    def check_function(self, fn: ast.FunctionDef, is_kernel: bool) -> None:
        name = fn.name
        a = fn.args
        if a.kwonlyargs or a.vararg or a.kwarg:
            self.err(fn, name, "keyword-only `*`, *args or **kwargs are not allowed in NKI functions")
        for d in [*a.defaults, *(k for k in a.kw_defaults if k is not None)]:
            if isinstance(d, (ast.List, ast.Dict, ast.Set)):
                self.err(d, name, "mutable default argument (kernel list arguments must be tuples)")
        if is_kernel and fn.decorator_list and not _is_jit(fn):
            self.err(fn, name, "kernel decorator must be @nki.jit")
        local = {arg.arg for arg in a.args}
        for node in ast.walk(fn):
            if isinstance(node, (ast.Name,)) and isinstance(node.ctx, ast.Store):
                local.add(node.id)
            elif isinstance(node, ast.For):
                for t in ast.walk(node.target):
                    if isinstance(t, ast.Name):
                        local.add(t.id)
        for node in ast.walk(fn):
            if node is fn:
                continue
            for typ, what in _FORBIDDEN.items():
                if isinstance(node, typ):
                    self.err(node, name, f"{what} is outside the NKI meta-language subset")
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Subscript):
                self.err(node, name, "nested slicing `t[..][..]` is not available in NKI >= 0.2")
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
                self.err(node, name, "`is` / `is not` is not supported; use == / !=")
            if isinstance(node, ast.Dict) and any(not (isinstance(k, ast.Constant) and isinstance(k.value, str))
                                                  for k in node.keys):
                self.err(node, name, "dict keys must be string literals")
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in local:
                if node.id not in ALLOWED_GLOBALS | self.subkernels | self.constants | {"True", "False", "None"}:
                    self.err(node, name, f"global name `{node.id}` (only nki/nl/nisa, builtins range/min/max/len, "
                                         "sub-kernels and numeric constants)")
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                mod, attr = node.value.id, node.attr
                if attr in GEN4_ONLY:
                    self.err(node, name, f"{mod}.{attr} is NeuronCore-v4 (trn3) only")
                elif mod == "nl" and attr not in NL_ATTRS and f"nl.{attr}" not in SIGNATURES:
                    self.err(node, name, f"nl.{attr} is not in the checked subset")
                elif mod == "nisa" and attr not in NISA_ATTRS and f"nisa.{attr}" not in SIGNATURES:
                    self.err(node, name, f"nisa.{attr} is not in the checked subset")
            if isinstance(node, ast.Call):
                self.check_call(node, name, local)

    def check_call(self, call: ast.Call, fn: str, local: set[str]) -> None:
        f = call.func
        if isinstance(f, ast.Name):
            if f.id in BUILTINS or f.id in self.subkernels:
                return
            self.err(call, fn, f"call to `{f.id}` (not nl/nisa, a builtin of the subset or a sub-kernel)")
            return
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in ("nl", "nisa", "nki"):
            key = f"{f.value.id}.{f.attr}"
            if key not in SIGNATURES:
                self.err(call, fn, f"{key}(...) has no NKI 0.6 signature in the table")
                return
            names, required = _params(SIGNATURES[key])
            if len(call.args) > len(names):
                self.err(call, fn, f"{key}: {len(call.args)} positional arguments, signature has {len(names)}")
            given = set(names[: len(call.args)])
            for kw in call.keywords:
                if kw.arg is None:
                    self.err(call, fn, f"{key}: **kwargs not allowed")
                elif kw.arg not in names:
                    self.err(call, fn, f"{key}: unknown keyword `{kw.arg}` (signature: {SIGNATURES[key]})")
                elif kw.arg in given:
                    self.err(call, fn, f"{key}: `{kw.arg}` given twice")
                else:
                    given.add(kw.arg)
            if required - given:
                self.err(call, fn, f"{key}: missing {sorted(required - given)}")
            return
        if isinstance(f, ast.Attribute) and f.attr in TENSOR_METHODS:
            return
        self.err(call, fn, f"call `{ast.unparse(f)}` is outside the checked subset")


def check_file(path: str | Path) -> list[Issue]:
    path = Path(path)
    tree = ast.parse(path.read_text(), filename=str(path))
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    imported = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("_tiles"):
            imported |= {a.asname or a.name for a in node.names}
    kernels = [f for f in functions.values() if _is_jit(f)]
    # sub-kernels: module functions reachable from a kernel (or every function of the sub-kernel module)
    if path.name == SUBKERNEL_MODULE:
        sub = set(functions)
    else:
        sub, todo = set(), [k.name for k in kernels]
        while todo:
            for node in ast.walk(functions[todo.pop()]):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in functions \
                        and node.func.id not in sub and not _is_jit(functions[node.func.id]):
                    sub.add(node.func.id)
                    todo.append(node.func.id)
    checker = _Checker(path.name, functions, sub | imported, _module_constants(tree))
    for k in kernels:
        checker.check_function(k, is_kernel=True)
    for s in sorted(sub):
        checker.check_function(functions[s], is_kernel=False)
    if path.name != SUBKERNEL_MODULE and not kernels:
        checker.issues.append(Issue(path.name, 0, "-", "no @nki.jit kernel found"))
    return checker.issues


def check_all() -> dict[str, list[Issue]]:
    from nki_kernels import registry

    return {Path(f).name: check_file(f) for f in registry.kernel_files()}


def used_calls() -> set[str]:
    """Every nl.* / nisa.* function called by any kernel file (the test asserts each is in `SIGNATURES`)."""
    from nki_kernels import registry

    out = set()
    for f in registry.kernel_files():
        for node in ast.walk(ast.parse(Path(f).read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    isinstance(node.func.value, ast.Name) and node.func.value.id in ("nl", "nisa"):
                out.add(f"{node.func.value.id}.{node.func.attr}")
    return out


def stand_in_matches_table() -> list[str]:
    """Differences between the stand-in's parameter lists and `SIGNATURES` (they must agree)."""
    from nki_kernels import stand_in

    problems = []
    for key, sig in SIGNATURES.items():
        mod, name = key.split(".")
        obj = getattr(stand_in.isa if mod == "nisa" else stand_in.language, name)
        want, _ = _params(sig)
        have = list(inspect.signature(obj).parameters)
        if have != want:
            problems.append(f"{key}: stand-in {have} != table {want}")
    return problems
