"""Count the operations that make the host wait for the device, on any device.

On a GPU, reading a value a kernel produced (``.item()``, ``bool(t)``, ``nonzero``, a boolean
index, ``.cpu()``) drains the queue: the host idles until the device catches up, and at batch 1 the
launches of the next step no longer overlap the current one. The engine's rule is that none happen
inside the step loop (samplers/sampler.py). On a CPU-only machine nothing is copied, so a test
cannot watch copies; it can watch the operators that would force one, which is what this
dispatch mode records (one row per operator call, with the bytes it would bring back).
``Tensor.tolist()`` reads memory without dispatching an operator and is not seen: the engine
calls it only on results already on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# operators whose result the host must read: a scalar, or a data-dependent output size
_READS = {aten._local_scalar_dense.default: "scalar", aten.nonzero.default: "nonzero",
          aten.is_nonzero.default: "scalar", aten.equal.default: "scalar",
          aten.masked_select.default: "masked_select", aten.unique_dim.default: "unique",
          aten._unique2.default: "unique"}
_INDEX = (aten.index.Tensor, aten.index_put_.default, aten.index_put.default)


@dataclass
class HostReads(TorchDispatchMode):
    """``with HostReads() as h: ...``; ``h.count``, ``h.bytes``, ``h.by_op``.

    Copies from an accelerator to the CPU are counted too (``_to_copy`` / ``copy_`` whose source is
    not on the CPU and destination is)."""

    count: int = 0
    bytes: int = 0
    by_op: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__()

    def _add(self, name: str, nbytes: int) -> None:
        self.count += 1
        self.bytes += nbytes
        self.by_op[name] = self.by_op.get(name, 0) + 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        kind = _READS.get(func)
        if kind == "scalar":
            self._add(kind, 8)
        elif kind is not None:
            res = out[0] if isinstance(out, tuple) else out
            self._add(kind, 8 + res.numel() * res.element_size())   # the size, then the data
        elif func in _INDEX and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ()):
            self._add("bool_index", 8)                                  # x[mask]: a nonzero inside
        elif func in (aten._to_copy.default, aten.copy_.default):
            src = args[1] if func is aten.copy_.default else args[0]
            dst = args[0] if func is aten.copy_.default else out
            if isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst.device.type == "cpu":
                self._add("device_to_host", src.numel() * src.element_size())
        return out
