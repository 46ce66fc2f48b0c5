"""The accelerators the planner knows: memory, peak throughput and link bandwidths.

Numbers are vendor datasheet values for dense (not sparse) bf16/fp16 tensor-core math and
per-GPU, per-direction bandwidths, so a planner table can be checked against a datasheet:

- H100 SXM 80 GB: 989 TFLOP/s, NVLink 4 = 900 GB/s bidirectional = 450 GB/s each way, one
  400 Gb/s InfiniBand NDR port per GPU = 50 GB/s.
- H200 SXM 141 GB: the H100's compute and links with more HBM.
- A100 SXM 80 GB / 40 GB: 312 TFLOP/s, NVLink 3 = 300 GB/s each way, one 200 Gb/s HDR port per
  GPU = 25 GB/s.
- "cpu": a rough stand-in for the tiny CPU runs (gloo over loopback); memory is this machine's RAM.

``memory_gib`` is what the driver reports as usable (nvidia-smi's total, e.g. 81559 MiB on an
H100 80 GB), not the marketing figure. ``overhead_gib`` is memory a training process loses
before its first tensor: CUDA context and kernels (~0.5-1 GiB), NCCL's buffers (~1 GiB at
these scales) and allocator fragmentation; 3 GiB is a deliberately round guess, override it
with ``--overhead-gib``. The CPU has none of these.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float  # usable device memory
    peak_tflops: float  # dense bf16/fp16 tensor-core peak per device
    intra_node_gbps: float  # GB/s per device per direction inside a node (NVLink)
    inter_node_gbps: float  # GB/s per device between nodes (InfiniBand)
    overhead_gib: float = 3.0  # CUDA context, NCCL buffers, fragmentation
    is_cuda: bool = True  # decides kernel-dependent activation sizes (dropout masks, RMSNorm)

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30

    def with_overhead(self, overhead_gib: float | None) -> "GPU":
        return self if overhead_gib is None else replace(self, overhead_gib=overhead_gib)


def _host_memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return 16.0


GPUS = {
    "h100-80gb": GPU("h100-80gb", 81559 / 1024, 989.0, 450.0, 50.0),
    "h200-141gb": GPU("h200-141gb", 143771 / 1024, 989.0, 450.0, 50.0),
    "a100-80gb": GPU("a100-80gb", 81920 / 1024, 312.0, 300.0, 25.0),
    "a100-40gb": GPU("a100-40gb", 40960 / 1024, 312.0, 300.0, 25.0),
    "cpu": GPU("cpu", _host_memory_gib(), 0.5, 5.0, 1.0, overhead_gib=0.0, is_cuda=False),
}
ALIASES = {"h100": "h100-80gb", "h200": "h200-141gb", "a100": "a100-80gb"}


def get_gpu(name: str) -> GPU:
    """The catalogue entry for ``name`` (case-insensitive; "h100", "h200", "a100" are accepted short names)."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in GPUS:
        raise ValueError(f"--gpu = {name!r}: not in the catalogue. Fix: use one of {', '.join(GPUS)} "
                         f"(or a short name: {', '.join(ALIASES)})")
    return GPUS[key]
