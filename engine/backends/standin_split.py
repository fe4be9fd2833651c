"""NKI custom ops inside a stand-in graph: the CPU stand-in's equivalent of "an NKI kernel as a custom call inside the
NEFF".

On TorchNeuron a kernel op (`torch.ops.deepinfer.<kernel>`, nki_kernels/torch_ops.py) stays one node of the graph
down to the NEFF, where `wrap_nki(kernel)[lnc]` is a custom call between the compiled ops. Upstream torch-mlir has no
lowering for a foreign custom op, and XLA's CPU compiler could not call a NumPy kernel from inside an executable, so
the stand-in cuts the AOTAutograd graph at its custom-op nodes, in graph order:

    piece 0 (pure ATen: lowered to StableHLO, XLA CPU executable) -> custom op (its CPU implementation: the kernel on
    the NumPy stand-in / simulator, counted by the dispatcher) -> piece 1 -> ... -> last piece (with the graph's
    KV-cache writes: AOTAutograd puts the input mutations at the end)

and runs the pieces and ops in that order as one graph call. Each piece goes through the pipeline's full compile
step (portability checks, aliasing pass, constants lifted, torch-mlir, module checks, XLA), so every piece is held to
the same rules as a whole graph. Counted: graphs split, pieces compiled, custom-op calls per op (in the pipeline's
stats, meta.json). What this proves: the graph with its kernel calls traces as one Dynamo graph (`fullgraph=True`),
each kernel call is one node in it, the ops between them lower; not how neuronx-cc schedules a custom call.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

NAMESPACE = "deepinfer"  # nki_kernels.torch_ops.NAMESPACE (the engine's backends do not import the kernels)


def is_custom_op(node: Node) -> bool:
    """A call of one of the kernels' torch ops (`torch.ops.deepinfer.*`)."""
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and \
        node.target.namespace == NAMESPACE


def custom_op_nodes(gm: GraphModule) -> list[Node]:
    return [n for n in gm.graph.nodes if is_custom_op(n)]


@dataclass
class _Piece:
    nodes: list[Node]
    inputs: list[Node] = field(default_factory=list)
    outputs: list[Node] = field(default_factory=list)
    run: Callable[[list[Any]], list[Any]] | None = None


@dataclass
class _OpCall:
    node: Node
    items: list[Node]  # getitem nodes of a tuple result, evaluated with the op


def _steps(gm: GraphModule) -> list[_Piece | _OpCall]:
    """The graph cut at its custom ops, in graph order (a getitem of an op's result goes with the op)."""
    steps: list[_Piece | _OpCall] = []
    current: list[Node] = []
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_custom_op(node):
            if current:
                steps.append(_Piece(current))
                current = []
            steps.append(_OpCall(node, [u for u in node.users if u.op == "call_function"
                                        and u.target is operator.getitem]))
        elif node.op == "call_function" and node.target is operator.getitem and is_custom_op(node.args[0]):
            continue
        else:
            current.append(node)
    if current:
        steps.append(_Piece(current))
    return steps


def _piece_module(root: GraphModule, piece: _Piece) -> GraphModule:
    """A piece as a graph of its own: its inputs (values defined before it) as placeholders, in order of first
    use; its outputs (values used after it) returned; nodes copied with their metadata."""
    inside = set(piece.nodes)
    for node in piece.nodes:
        for a in node.all_input_nodes:
            if a not in inside and a not in piece.inputs:
                piece.inputs.append(a)
    piece.outputs = [n for n in piece.nodes if any(u not in inside for u in n.users)]
    graph = Graph()
    env: dict[Node, Node] = {}
    for i, a in enumerate(piece.inputs):
        ph = graph.placeholder(f"in_{i}")
        ph.meta = dict(a.meta)
        env[a] = ph
    for node in piece.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[n] for n in piece.outputs))
    return GraphModule(root, graph)


class SplitGraph:
    """The graph's pieces and ops run in graph order (boxed calling convention, as AOTAutograd calls it)."""

    _boxed_call = True

    def __init__(self, gm: GraphModule, steps: list[_Piece | _OpCall], stats: Any) -> None:
        self._placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self._outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        self._steps, self._stats = steps, stats

    def __call__(self, args: list[Any]) -> Any:
        env: dict[Node, Any] = dict(zip(self._placeholders, args, strict=True))
        args.clear()
        for step in self._steps:
            if isinstance(step, _Piece):
                outs = step.run([env[n] for n in step.inputs])
                env.update(zip(step.outputs, outs, strict=True))
                continue
            node = step.node
            res = node.target(*torch.fx.node.map_arg(node.args, env.__getitem__),
                              **torch.fx.node.map_arg(node.kwargs, env.__getitem__))
            env[node] = res
            for item in step.items:
                env[item] = res[item.args[1]]
            self._stats.custom_op_calls[node.target.overloadpacket.__name__] += 1
        self._stats.executions += 1
        outs = self._outputs
        return [env[o] if isinstance(o, Node) else o for o in (outs if isinstance(outs, (tuple, list)) else [outs])]


def _writeback(piece: _Piece) -> Callable[[list[Any]], list[Any]]:
    """A piece made only of `copy_(graph input, value)` nodes (the input mutations AOTAutograd puts at the end, when
    the last values come from a kernel op): the copies themselves, in order."""

    def run(args: list[Any]) -> list[Any]:
        env: dict[Node, Any] = dict(zip(piece.inputs, args, strict=True))
        for node in piece.nodes:
            env[node] = env[node.args[0]].copy_(env[node.args[1]])
        return [env[n] for n in piece.outputs]

    return run


def compile_split(pipeline: Any, fw: GraphModule, record: Any) -> SplitGraph:
    """`fw` (an AOTAutograd graph with custom-op nodes) as pure pieces, each through the pipeline's compile step
    (`<graph>.p<k>`), and its custom ops between them. `pipeline` is the calling StandinPipeline and `record` its
    GraphRecord (not imported here: the pipeline imports this module); a piece's record is a new one of that type."""
    steps = _steps(fw)
    pieces = [s for s in steps if isinstance(s, _Piece)]
    for k, piece in enumerate(pieces):
        gm = _piece_module(fw, piece)
        copies = [n.op == "call_function" and n.target is torch.ops.aten.copy_.default for n in piece.nodes]
        if not piece.outputs and not any(copies):
            piece.run = lambda args: []  # nothing used after it, nothing written: dead code
            continue
        if all(copies):  # only the graph's cache writes of values computed before it: no program to compile
            piece.run = _writeback(piece)
            continue
        sub = type(record)(name=f"{record.name}.p{k}", inputs=[])
        piece.run = pipeline._compile(gm, [], sub, piece=True)
        record.xla_s += sub.xla_s
        record.mlir_s += sub.mlir_s
        record.ops += sub.ops
        record.mutated_inputs += sub.mutated_inputs
    record.pieces = len(pieces)
    record.custom_ops = len(steps) - len(pieces)
    pipeline.stats.graphs_split += 1
    return SplitGraph(fw, steps, pipeline.stats)
