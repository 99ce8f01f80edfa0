"""Programs per SM, and the persistent and split-row grids sized from them, by compute capability:
the resident-block cap is the device's (16 on sm_86, 24 on sm_89, 32 on sm_90), not one literal.
No GPU: the device properties and the compiled kernel are stand-ins."""

from __future__ import annotations

import types

import pytest
import torch

from normswap.kernels import _common as C
from normswap.kernels import static_check as S


def _props(major, minor, sms, threads, smem_kib):
    """What torch.cuda.get_device_properties reports for a GPU of that capability."""
    return types.SimpleNamespace(major=major, minor=minor, multi_processor_count=sms, regs_per_multiprocessor=65536,
                                 max_threads_per_multi_processor=threads,
                                 shared_memory_per_multiprocessor=smem_kib * 1024)


# RTX 3090 (sm_86), RTX 4090 (sm_89), H100 (sm_90), B200 (sm_100), RTX 5090 (sm_120).
GPUS = {"sm_86": (_props(8, 6, 82, 1536, 100), 16), "sm_89": (_props(8, 9, 128, 1536, 100), 24),
        "sm_90": (_props(9, 0, 132, 2048, 228), 32), "sm_100": (_props(10, 0, 148, 2048, 228), 32),
        "sm_120": (_props(12, 0, 170, 1536, 100), 24)}


@pytest.fixture
def gpu(monkeypatch):
    """cuda:0 becomes the named GPU (its properties as torch reports them); grids are sized anew."""
    def become(arch):
        props, _ = GPUS[arch]
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (props.major, props.minor))
        C._cuda_props.cache_clear()
        monkeypatch.setattr(C, "_RESIDENT", {})
        return C._cuda_props(0)
    yield become
    C._cuda_props.cache_clear()


@pytest.mark.parametrize("arch", sorted(GPUS))
def test_small_programs_are_capped_by_the_devices_resident_blocks(gpu, arch):
    """One warp, few registers, no shared memory: registers, threads and shared memory would all
    allow more programs than the SM holds blocks, so the cap decides: the capability's own."""
    limits = gpu(arch)
    want = GPUS[arch][1]
    assert limits["blocks"] == want
    assert C.programs_per_sm(16, 1, 0, limits) == want
    assert S.device_target(0).limits == limits  # the static check plans with the same limits
    # Bigger programs are held back by registers / threads first, on every capability alike.
    assert C.programs_per_sm(255, 8, 0, limits) == 1


def test_targets_take_the_cap_from_their_capability():
    assert S.h100().limits == C.H100_LIMITS and C.H100_LIMITS["blocks"] == 32
    ada = S.Target(89, sms=128, regs=65536, threads=1536, smem=100 * 1024)
    assert ada.blocks == 24 and ada == S.Target(89, 128, 65536, 1536, 100 * 1024, blocks=24)
    assert S.programs_per_sm(16, 1, 0, ada) == 24 and S.programs_per_sm(16, 1, 0) == 32
    assert S.Target(86, 84, 65536, 1536, 100 * 1024).blocks == 16
    assert S.Target(80, 108, 65536, 2048, 164 * 1024).blocks == 32
    # A capability the table does not know: the smallest cap, never more than the device might hold.
    assert S.Target(130, 100, 65536, 2048, 228 * 1024).blocks == min(C.MAX_BLOCKS_PER_SM.values()) == 16


class _Compiled:
    n_regs = 32
    metadata = types.SimpleNamespace(shared=0)

    def _init_handles(self):
        pass


class _Kernel:
    """A compiled (not interpreted) kernel as resident_programs sees it: warmup compiles it."""

    def warmup(self, *args, grid, **kwargs):
        return _Compiled()


@pytest.mark.parametrize("arch", sorted(GPUS))
def test_split_row_grids_ask_only_for_programs_that_fit_at_once(gpu, arch):
    """A split-row launch is cooperative: every program must be resident at once, or the driver
    refuses it. Small programs (one warp, 32 registers) are capped by resident blocks, so on an
    sm_89 the grid holds 24 programs per SM, never the 32 an sm_90 holds."""
    limits = gpu(arch)
    cap = GPUS[arch][1] * limits["sms"]
    tile = C.Tile(1, 4096, 16, 1, 1)
    programs, kw = C._grid(_Kernel(), 1 << 20, tile, (), {"num_warps": 1}, torch.device("cuda", 0),
                           persistent=True)
    assert kw["launch_cooperative_grid"] is True
    assert programs == cap // 16 * 16 and programs % tile.chunks == 0
    # Rows held whole, persistent (the backward): one program per resident slot, no more.
    whole = C.Tile(4, 4096, 1, 1, 1)
    assert C._grid(_Kernel(), 1 << 20, whole, (), {"num_warps": 1}, torch.device("cuda", 0), persistent=True)[0] == cap
