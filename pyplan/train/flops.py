"""Model FLOPs utilisation in `pyplan run`'s log: the FLOPs of one optimizer step, counted with
torch.utils.flop_counter's formulas (its `flop_registry`: matrix products, attention,
convolutions) by a dispatch mode while every rank runs the run's first step (forward, backward,
optimizer), summed over the ranks (FlopCounterMode itself also tracks modules with backward
hooks, which the split backward's autograd.grad refuses); MFU = those FLOPs / (the step's time x the ranks x one
device's peak). Model FLOPs: a plan that recomputes part of its forward runs more than the model
needs, so none are counted then. The peak is a device's dense bf16/fp16 tensor-core figure from
its vendor's datasheet, for the GPUs listed below; elsewhere (the CPU, fp32, another GPU) no
peak is known and MFU is not shown.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

__all__ = ["PEAK_TFLOPS", "counter", "peak_flops"]

# Dense (no sparsity) bf16/fp16 tensor-core TFLOPS by a substring of torch.cuda's device name,
# the more specific first.
PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0),
               ("L40S", 362.0), ("L4", 121.0), ("A10", 125.0))


class counter(TorchDispatchMode):
    """A context counting the FLOPs of what runs inside it (get_total_flops())."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.total += formula(*args, **kwargs, out_val=out)
        return out

    def get_total_flops(self) -> int:
        return self.total


def peak_flops(device: torch.device, dtype: str) -> float | None:
    """One device's peak FLOP/s for `dtype` (pyplan run's --dtype), None when unknown."""
    if device.type != "cuda" or dtype not in ("bf16", "fp16"):
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops * 1e12 for key, tflops in PEAK_TFLOPS if key in name), None)
