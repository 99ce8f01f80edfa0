"""Helpers shared by the launch-planning tests (launch table, tuner), which run without a GPU:
stand-ins for the compiled kernels, and CUDA devices of a chosen architecture and name as
launch_config sees them."""

from __future__ import annotations

import torch

from normswap.kernels import _common


def kernel(op: str):
    """A compiled (not interpreted) kernel of `op` as launch_config sees it: it reads only the
    module the kernel belongs to."""
    return type(f"{op}_kernel", (), {"__module__": f"normswap.kernels.{op}"})()


RMS, LN = kernel("rms_norm"), kernel("layer_norm")


def cuda_devices(monkeypatch, arch="sm_90", name="Fake GPU (test)") -> torch.device:
    """cuda:N is a device of architecture `arch` named `name` (each a string for every index, or a
    tuple indexed by N); returns cuda:0. Call again to rename: launch_config's cached tiles are
    dropped, since a real device index keeps its name and architecture for the whole process."""
    def by_index(value):
        return (lambda index: value[index]) if isinstance(value, tuple) else (lambda index: value)

    monkeypatch.setattr(_common, "_cuda_arch", by_index(arch))
    monkeypatch.setattr(_common, "_cuda_name", by_index(name))
    _common._gpu_launch_config.cache_clear()
    return torch.device("cuda", 0)
