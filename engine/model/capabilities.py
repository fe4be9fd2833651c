"""What the model may do on the engine's device: the backend answers (engine/backends), the model asks.

The model never tests a tensor's device type to pick a path; it reads `self.caps` (set on every module by
`engine.model.model.use_ops`, like the op table)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Capabilities:
    # Eager ops whose output shapes depend on tensor values (nonzero, boolean masks, per-tile key cuts, routing-
    # dependent expert groups) are cheap: true on the host; on a graph device each new shape is a new compile and
    # every value read a host sync, so the model keeps static shapes there.
    data_dependent_shapes: bool = True
    # `Tensor.view(dtype)` (a bitcast) inside graphs: host and StableHLO (bitcast_convert) have it; torch-xla 2.9
    # runs it on the CPU (a fallback and host copies), so orders are spelled with stable sorts there.
    bitcast: bool = True


HOST = Capabilities(data_dependent_shapes=True)
DEVICE = Capabilities(data_dependent_shapes=False)
