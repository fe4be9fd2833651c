"""Portability checks of ATen graphs: the patterns that upstream torch-mlir does not lower, or lowers to StableHLO
with other semantics than torch's (found running the engine's decode graphs through the TorchNeuron stand-in,
engine/backends/standin_pipeline.py). torch only: the default test lane runs them on the engine's graphs without
torch-mlir installed.

Static (`graph_problems`, on an AOTAutograd graph after core-ATen decompositions):
* `sort(stable=True)`: no lowering (order by unique keys instead: `nki_kernels.reference.order_key`);
* `>>` / `<<` on int tensors: no lowering (test bits with `&`, divide by a power of two);
* compares on uint8: emitted as signed compares (XLA's verifier rejects them; a device compiler may not);
* slice assignment with an open end (`x[..., a:] = y`, slice_scatter to the end): torch-mlir aborts (bad_alloc);
* assignment of or into a zero-size slice (`x[..., 1:] = y[..., :-1]` with one block, at T = 1): fails to lower
  (a zero-size slice that is only read lowers);
Static, on the Dynamo graph (`source_problems`: int-size splits and `chunk` become the same ATen op as a list split,
so the list is only visible before AOTAutograd):
* `split([sizes], dim != 0)`: returned wrong data for every chunk on Neuron's lowering in the community V4 port
  (longdct/vllm-neuron docs/model-dev); int sizes, `chunk` and dim 0 were fine (slice instead).
Dynamic (`RemainderProbe`, running the graph): `%` / remainder with a negative dividend - StableHLO `remainder`
takes the dividend's sign, torch's `%` the divisor's, so the value silently differs (use a floor division:
`engine.model.attention.floor_mod`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

aten = torch.ops.aten
OPEN_END = 2 ** 62  # slice ends at or past this are "to the end" (torch records sys.maxsize)
_SHIFTS = {aten.__rshift__, aten.__lshift__, aten.bitwise_right_shift, aten.bitwise_left_shift,
           aten.__irshift__, aten.__ilshift__}
_COMPARES = {aten.eq, aten.ne, aten.lt, aten.le, aten.gt, aten.ge}
_REMAINDERS = {aten.remainder, aten.fmod}
_WRITES = {aten.slice_scatter, aten.select_scatter, aten.index_put, aten.copy, aten.copy_}
_SPLIT_FNS = {torch.split, torch.functional.split, torch.Tensor.split, torch.split_with_sizes,
              torch.Tensor.split_with_sizes}


def _packet(target: Any) -> Any:
    return getattr(target, "overloadpacket", target)


def _val(a: Any) -> Any:
    return a.meta.get("val") if isinstance(a, torch.fx.Node) else a


def source_problems(gm: torch.fx.GraphModule) -> list[str]:
    """One line per `split([sizes], dim != 0)` of a Dynamo graph (see the module doc)."""
    out = []
    for n in gm.graph.nodes:
        is_split = (n.op == "call_method" and n.target in ("split", "split_with_sizes")) or (
            n.op == "call_function" and n.target in _SPLIT_FNS)
        if not is_split or len(n.args) < 2 or not isinstance(n.args[1], (list, tuple)):
            continue
        dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)
        x = n.args[0].meta.get("example_value") if isinstance(n.args[0], torch.fx.Node) else None
        if isinstance(x, torch.Tensor) and x.dim() and isinstance(dim, int):
            dim %= x.dim()
        if dim != 0:
            out.append(f"{n.name} ({n.target}): split([sizes], dim={dim}) returned wrong data on Neuron's lowering; "
                       "slice the pieces, or split on dim 0")
    return out


def graph_problems(gm: torch.fx.GraphModule) -> list[str]:
    """One line per node of `gm` that uses a pattern upstream torch-mlir does not lower to StableHLO as meant
    (see the module doc). Empty: nothing known-bad (a remainder's sign is checked at run time: RemainderProbe)."""
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        p, name = _packet(n.target), f"{n.name} ({n.target})"
        if p is aten.sort and (n.kwargs.get("stable") or (len(n.args) > 1 and n.args[1] is True)):
            out.append(f"{name}: sort(stable=True) does not lower; order by unique keys (reference.order_key)")
        elif p in _SHIFTS:
            out.append(f"{name}: bit shift on an int tensor does not lower; test bits with & / divide by 2**i")
        elif p in _COMPARES and any(isinstance(v, torch.Tensor) and v.dtype == torch.uint8
                                    for v in map(_val, n.args)):
            out.append(f"{name}: compare on uint8 is lowered as a signed compare; widen to int32 first")
        elif p is aten.slice_scatter and len(n.args) > 4 and isinstance(n.args[4], int) and n.args[4] >= OPEN_END:
            out.append(f"{name}: slice assignment with an open end does not lower; build the tensor with cat/where")
        if p in _WRITES and any(isinstance(v, torch.Tensor) and v.numel() == 0 for v in map(_val, n.args[:2])):
            out.append(f"{name}: assignment of or into a zero-size slice does not lower; skip it (static shapes)")
    return out


class RemainderProbe(torch.fx.Interpreter):
    """Runs an ATen graph and records every remainder / fmod whose dividend has a negative element: the op where
    StableHLO's `remainder` (sign of the dividend) and torch's `%` (sign of the divisor) disagree."""

    def __init__(self, gm: torch.fx.GraphModule, found: list[str]) -> None:
        super().__init__(gm)
        self.found = found

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        if n.op == "call_function" and _packet(n.target) in _REMAINDERS:
            a = self.env[n.args[0]] if isinstance(n.args[0], torch.fx.Node) else n.args[0]
            if isinstance(a, torch.Tensor) and not a.is_floating_point() and bool((a < 0).any()):
                self.found.append(f"{n.name} ({n.target}): remainder of a negative int "
                                  f"(min {int(a.min())}): StableHLO takes the dividend's sign; use a floor division")
        return out


class LintBackend:
    """A Dynamo backend for checks without torch-mlir: `source_problems` on the Dynamo graph, AOTAutograd with
    core-ATen decompositions (inference input mutations kept, as TorchNeuron does), `graph_problems` on each graph,
    and each graph run through a RemainderProbe. `problems` collects everything found, `graphs` counts the graphs."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        from functorch.compile import make_boxed_func

        self.problems.extend(source_problems(gm))
        from torch._decomp import core_aten_decompositions
        from torch._functorch.aot_autograd import aot_module_simplified

        def fw(g: torch.fx.GraphModule, _inputs: list[Any]) -> Callable:
            self.graphs += 1
            self.problems.extend(graph_problems(g))
            return make_boxed_func(lambda *args: RemainderProbe(g, self.problems).run(*args))

        return aot_module_simplified(gm, example_inputs, fw_compiler=fw, decompositions=core_aten_decompositions(),
                                     keep_inference_input_mutations=True)
