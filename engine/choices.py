"""The engine's choice lists: one `str` Enum per option, defined once (a leaf module: the config, the env flags and
the CLI options all take their choices from here)."""

from __future__ import annotations

import enum
from typing import Any

__all__ = ["Backend", "DType", "GraphMode", "HostCompiler", "Kernels", "KVCacheDType", "LoadFormat", "MoeMode",
           "Numerics", "Speculative", "Weights"]


class _Choice(str, enum.Enum):
    """A str Enum whose str() is its value (so it prints, formats and serialises as the plain choice)."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: Any, what: str) -> Any:
        try:
            return cls(str(value.value if isinstance(value, enum.Enum) else value))
        except ValueError:
            raise ValueError(f"{what} {value!r}: expected one of {', '.join(m.value for m in cls)}") from None

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(m.value for m in cls)


class Backend(_Choice):
    AUTO = "auto"  # resolved by `resolve_backend` when the config is built; a built config never holds it
    HOST = "host"  # CPU torch
    XLA = "xla"  # the PyTorch/XLA lane: a torch-xla device (PJRT CPU here; the legacy Neuron PJRT stack elsewhere)
    NEURON = "neuron"  # TorchNeuron: the native `neuron` device, torch.compile(backend="neuron") graphs
    NEURON_STANDIN = "neuron-standin"  # the same backend, its compile step on a CPU stand-in (torch-mlir + XLA CPU)


class GraphMode(_Choice):
    AUTO = "auto"  # resolved by `resolve_graph_mode` when the config is built: eager on the host, layer on a device
    EAGER = "eager"  # no graphs
    REGIONS = "regions"  # two graphs per layer (attention half, MoE half)
    LAYER = "layer"  # one graph per layer


class HostCompiler(_Choice):
    INDUCTOR = "inductor"
    AOT_EAGER = "aot_eager"
    EAGER = "eager"  # dynamo capture only
    NONE = "none"  # no torch.compile: the same static-shape code as plain Python


class MoeMode(_Choice):
    AUTO = "auto"  # decode regions: gather while T*K < local experts, else grouped on the host, dense on a device
    GROUPED = "grouped"  # each chosen expert once on its tokens (routing-dependent shapes: between graphs, host)
    GATHER = "gather"  # per (token, k) pair, the chosen expert's weights gathered by index: cost K per token
    DENSE = "dense"  # every local expert on every token with a zero weight where not chosen (fine for small E_local)


class Kernels(_Choice):
    AUTO = "auto"  # resolved by config.resolve_kernels: host where the native kernels build and run, else reference
    REFERENCE = "reference"  # the torch formulation of every op (nki_kernels/reference.py)
    STAND_IN = "stand-in"  # the NKI kernels executed on the NumPy stand-in, inside the model (host only)
    NKI = "nki"  # the NKI kernels on a Neuron device
    HOST = "host"  # native CPU GEMV kernels (engine/host_kernels: bf16/FP8/FP4 weights decoded in registers)


class LoadFormat(_Choice):
    SAFETENSORS = "safetensors"
    DUMMY = "dummy"  # random weights for the directory's config.json (engine/model/dummy.py)


class Weights(_Choice):
    STORED = "stored"  # FP8 / FP4 weights kept as the checkpoint's bytes; the GEMMs consume them
    DEQUANT = "dequant"  # every weight dequantised to the compute dtype at load (A/B runs, the HF reference)


class DType(_Choice):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"


class Speculative(_Choice):
    NONE = "none"  # one token per sequence and step
    MTP = "mtp"  # the checkpoint's MTP block drafts k tokens (applied recursively for k > 1)
    DSPARK = "dspark"  # the checkpoint's DSpark head drafts a block of tokens in parallel (0731 / 0813 releases)


class Numerics(_Choice):
    HF = "hf"  # HF transformers' numerics: exact KV, indexer and GEMM inputs (what golden/golden.json holds)
    OFFICIAL = "official"  # DeepSeek's inference/model.py: its FP8 / FP4 simulation steps and bf16 rounding points


class KVCacheDType(_Choice):
    AUTO = "auto"  # the compute dtype
    FP8 = "fp8"  # non-RoPE KV dims as e4m3 bytes + one UE8M0 scale per 64, RoPE dims in the compute dtype; indexer
    # keys as e4m3 + one scale per 128 (hf numerics) or e2m1 codes + one scale per 32 (official numerics)
