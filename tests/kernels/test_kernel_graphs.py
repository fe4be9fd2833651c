"""The model's kernel path inside compiled graphs: every kernel call of the kernel op table (nki_kernels/kernel_ops.py)
goes through its torch op `torch.ops.deepinfer.<kernel>`, so a region traced with `fullgraph=True` holds each kernel
call as one graph node, reads weights converted at load (graph inputs, no conversion op on a weight inside the
graph) and, run, dispatches the kernel per execution on the NumPy stand-in. A layout that was not prepared at load
raises one line while tracing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nki_kernels import dispatch, kernel_ops, torch_ops
from nki_kernels import weight_layouts as wl


class _Tiny(nn.Module):
    """Three kernel families and a stacked-expert GEMM, with their weights as parameters."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.norm = nn.Parameter(torch.rand(64, generator=g) + 0.5, requires_grad=False)
        self.w = nn.Parameter(torch.randn(32, 64, generator=g) * 0.1, requires_grad=False)
        self.wo_a = nn.Parameter(torch.randn(64, 16, generator=g) * 0.1, requires_grad=False)
        self.stack = nn.Parameter(torch.randn(3, 32, 64, generator=g) * 0.1, requires_grad=False)
        self.ops = None

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        h = ops.rms_norm(x, self.norm, 1e-6)
        y = ops.linear(h, self.w) + ops.stack_linear(h, self.stack, None, e, None)
        return ops.grouped_out_proj(y, self.wo_a, 2)  # [T, 32] -> [T, 2 * 32] groups of 16 rows each


def _prepare(m: _Tiny, kops: kernel_ops.KernelOps) -> None:
    kops.prepare("T", m.w, dt=torch.float32)
    kops.prepare("stackT", m.stack, dt=torch.float32)
    kops.prepare("woaT", m.wo_a, dt=torch.float32, groups=2)


def _graphs(m: _Tiny, template: _Tiny) -> tuple[object, list[torch.fx.GraphModule]]:
    seen: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        seen.append(gm)
        return gm.forward

    def run(params: dict, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(template, params, (x, e))

    torch._dynamo.reset()
    return torch.compile(run, backend=backend, fullgraph=True, dynamic=False), seen


def test_kernel_calls_are_graph_nodes_on_weights_made_at_load() -> None:
    kops = kernel_ops.KernelOps("stand-in")
    m, template = _Tiny(), _Tiny()
    m.ops = template.ops = kops
    _prepare(m, kops)
    made = sum(kops.cache.conversions.values())
    x, e = torch.randn(4, 64), torch.tensor([1])
    d = dispatch.Dispatcher("stand-in")
    with d.active():
        want = m(x, e)  # eager: the same ops, the same layouts
        eager_calls = sum(d.counts.values())
        graph, seen = _graphs(m, template)
        params = dict(m.named_parameters())
        got = graph(params, x, e)
        got2 = graph(params, x, e)
    assert torch.equal(got, want) and torch.equal(got2, want)
    (gm,) = seen  # one graph, fullgraph
    kernel_nodes = [n for n in gm.graph.nodes if n.op == "call_function"
                    and getattr(n.target, "__module__", "").startswith("torch._ops.deepinfer")
                    or str(n.target).startswith("deepinfer.")]
    assert len(kernel_nodes) == 4, [str(n.target) for n in gm.graph.nodes]  # rmsnorm, 2 GEMMs, grouped_out_proj
    # the converted layouts are graph inputs; no transpose / cast of a weight happens inside the graph
    inputs = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    assert sum(wl.LAYOUTS in name for name in inputs) == 3, inputs
    assert not [n for n in inputs if n.endswith(("_w_", "_wo_a_", "_stack_"))], inputs  # the raw weights: unread
    weights = [n for n in gm.graph.nodes if n.op == "placeholder" and "params" in n.name]
    assert not [u for w in weights for u in w.users if u.op == "call_method"
                and u.target in ("t", "transpose", "permute", "to", "float", "view")]  # (contiguous: a no-op here)
    assert sum(kops.cache.conversions.values()) == made  # nothing converted after load
    # run twice: every kernel dispatched again per execution (the op's CPU implementation counts)
    assert sum(d.counts.values()) == 3 * eager_calls
    assert {k for k, _ in d.counts} == {"rmsnorm", "blockquant.dense", "blockquant.wo_a"}
    assert all(ex == "stand-in" for _, ex in d.counts)


def test_an_unprepared_layout_refuses_to_trace() -> None:
    kops = kernel_ops.KernelOps("stand-in")
    m, template = _Tiny(), _Tiny()
    m.ops = template.ops = kops
    graph, _ = _graphs(m, template)
    with pytest.raises(Exception, match="was not prepared at load"):
        graph(dict(m.named_parameters()), torch.randn(4, 64), torch.tensor([0]))


def test_every_kernel_family_of_the_table_goes_through_its_torch_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eager calls too: the table's kernel launches are the torch ops' (one path for eager and graphs)."""
    launched: list[str] = []
    kops = kernel_ops.KernelOps("stand-in")
    for kname, op in list(kops._ops.items()):
        monkeypatch.setitem(kops._ops, kname, lambda *a, _op=op, _k=kname: launched.append(_k) or _op(*a))
    x = torch.randn(2, 64)
    kops.rms_norm(x, None, 1e-6)
    kops.swiglu(x, x, 1.0)
    assert launched == ["rmsnorm_kernel", "swiglu_kernel"]
    assert set(kops._ops) == {k for _, k in torch_ops.KERNELS.values()}


def test_a_device_launch_is_wrap_nki_of_the_kernel_at_the_dispatchers_lnc(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a TorchNeuron device the op launches `wrap_nki(kernel.jitted())[lnc](*operands)` - the real `nki.jit`
    object of the kernel, the active dispatcher's LNC, the operands unchanged - counted once per eager launch.
    Fakes: TorchNeuron's wrap_nki, the real nki's jit; meta tensors stand for device tensors."""
    import sys
    import types

    from nki_kernels import _nki, stand_in

    launched: list = []

    class WrapNki:
        def __init__(self, kernel: object) -> None:
            self.kernel = kernel

        def __getitem__(self, lnc: int):
            return lambda *a: launched.append((self.kernel, lnc, a)) or a[0].new_empty(a[0].shape)

    monkeypatch.setitem(sys.modules, "torch_neuronx", types.SimpleNamespace(nki_op=None, wrap_nki=WrapNki))
    fake = types.SimpleNamespace(jit=lambda fn: ("nki.jit", fn.__name__, fn.__globals__["nki"]))
    monkeypatch.setattr(_nki, "real_nki", lambda: (fake, stand_in.language, stand_in.isa))
    kernel = torch_ops.kernel_of("rmsnorm")
    monkeypatch.setattr(kernel, "_plain", None)
    monkeypatch.setattr(kernel, "_bound", {})
    x, w = torch.empty(4, 64, device="meta"), torch.empty(64, device="meta")
    d = dispatch.Dispatcher("stand-in", lnc=2)
    with d.active():
        out = torch_ops._launch("rmsnorm", "rmsnorm", "neuron", (x, w, 1e-6))
    ((jitted, lnc, args),) = launched
    assert jitted == ("nki.jit", "rmsnorm_kernel", fake) and lnc == 2  # the kernel bound to the real nki
    assert args[0] is x and args[1] is w and args[2] == 1e-6 and out.shape == x.shape
    assert kernel.jitted() is kernel.jitted()  # one nki.jit object per kernel (NKI caches compiles per object)
    assert d.counts == {("rmsnorm", "neuron"): 1}


def test_a_fallback_traced_into_a_graph_is_counted_per_execution() -> None:
    """A case the kernel does not cover (swiglu with broadcasting shapes) runs the reference inside the graph; the
    active dispatcher cannot be read in a trace, so it is counted in `dispatch.IN_GRAPH_FALLBACKS` per run."""
    kops = kernel_ops.KernelOps("stand-in")
    torch._dynamo.reset()
    graph = torch.compile(lambda g, u: kops.swiglu(g, u, 1.0), backend="eager", fullgraph=True, dynamic=False)
    before = dispatch.IN_GRAPH_FALLBACKS[("swiglu", "broadcast")]
    g, u = torch.randn(3, 8), torch.randn(1, 8)
    for _ in range(3):
        torch.testing.assert_close(graph(g, u), kernel_ops.reference.swiglu(g, u, 1.0))
    assert dispatch.IN_GRAPH_FALLBACKS[("swiglu", "broadcast")] == before + 3
