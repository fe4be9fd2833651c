"""The model's kernel path inside compiled graphs: every kernel call of the kernel op table (nki_kernels/kernel_ops.py)
goes through its torch op `torch.ops.deepinfer.<kernel>`, so a region traced with `fullgraph=True` holds each kernel
call as one graph node, reads weights converted at load (graph inputs, no conversion op on a weight inside the
graph) and, run, dispatches the kernel per execution on the NumPy stand-in. A layout that was not prepared at load
raises one line while tracing."""

from __future__ import annotations

import types

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


@pytest.fixture
def sdk(monkeypatch: pytest.MonkeyPatch):
    """The fake TorchNeuron that enforces the SDK's rules (tests/fake_torchneuron.py) and a fake real NKI whose
    `jit` returns what wrap_nki reads (`.func`, `.sign`); the kernels' cached jit objects and wrappers reset."""
    from nki_kernels import _nki, stand_in
    from tests import fake_torchneuron

    sdk = fake_torchneuron.install(monkeypatch, device=True)
    monkeypatch.setattr(_nki, "real_nki", lambda: (types.SimpleNamespace(jit=fake_torchneuron.nki_kernel),
                                                   stand_in.language, stand_in.isa))
    monkeypatch.setattr(torch_ops, "_WRAPPED", {})
    for op in torch_ops.KERNELS:
        monkeypatch.setattr(torch_ops.kernel_of(op), "_plain", None)
        monkeypatch.setattr(torch_ops.kernel_of(op), "_bound", {})
    return sdk


def test_a_device_launch_is_one_wrap_nki_per_kernel_launched_with_a_grid_tuple(sdk) -> None:
    """On a TorchNeuron device a kernel launch is `wrap_nki(kernel.jitted())[(lnc,)](*operands)`: the wrapper built
    once (wrap_nki traces and registers the kernel on every call), the grid a sequence (the April 2026 tree does
    `tuple(map(int, grid))`), the active dispatcher's LNC, the operands unchanged, counted once per eager launch."""
    x, w = torch.randn(4, 64), torch.rand(64)  # CPU tensors stand for device tensors here
    d = dispatch.Dispatcher("stand-in", lnc=1)
    with d.active():
        for _ in range(3):
            out = torch_ops._device_launch("rmsnorm", "rmsnorm", "neuron", (x, w, 1e-6))
    assert sdk.traces == {"rmsnorm_kernel": 1}  # one wrap_nki for three launches
    assert [g for g, _ in sdk.launches] == [(1,)] * 3
    grid, args = sdk.launches[0]
    assert args[0] is x and args[1] is w and args[2] == 1e-6 and out.shape == x.shape
    assert d.counts == {("rmsnorm", "neuron"): 3}
    with pytest.raises(TypeError):  # what an int subscript meets in the April 2026 tree
        torch_ops.wrapped("rmsnorm")[1]


def test_nki_op_only_on_the_device_path(sdk) -> None:
    """With TorchNeuron and the real NKI loaded, the host / stand-in kernel ops stay torch.library ops (nki_op would
    make the op body - NumPy here - its fake and trace it into the graph), so a stand-in graph still compiles and
    runs; the device ops are nki_op ops whose body is traced under compile into a launch of the kernel."""
    kops = kernel_ops.KernelOps("stand-in")
    torch._dynamo.reset()
    graph = torch.compile(lambda x, w: kops.rms_norm(x, w, 1e-6), backend="aot_eager", fullgraph=True, dynamic=False)
    x, w = torch.randn(4, 64), torch.rand(64) + 0.5
    torch.testing.assert_close(graph(x, w), kernel_ops.reference.rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-5)
    assert sdk.launches == []  # nothing of the device path ran
    op = torch_ops.device_op("rmsnorm")
    assert torch_ops.device_registered() == "torchneuron"
    dev = torch.compile(lambda x, w: op("rmsnorm", "neuron", x, w, 1e-6), backend="aot_eager", fullgraph=True,
                        dynamic=False)
    out = dev(x, w)
    assert out.shape == x.shape and len(sdk.launches) >= 1
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    assert isinstance(sdk.launches[0][1][0], FakeTensor | FunctionalTensor)  # the body traced on fake tensors


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
