"""Programs per SM, and the persistent and split-row grids sized from them, by compute capability:
the resident-block cap is the device's (16 on sm_86, 24 on sm_89, 32 on sm_90), not one literal,
and the table of caps agrees with NVIDIA's own occupancy calculator (cuda_occupancy.h, compiled
here). No GPU: the device properties and the compiled kernel are stand-ins."""

from __future__ import annotations

import shutil
import subprocess
import types
from pathlib import Path

import pytest
import torch

from normswap.kernels import _common as C
from normswap.kernels import static_check as S


def _props(major, minor, sms, threads, smem_kib):
    """What torch.cuda.get_device_properties reports for a GPU of that capability."""
    return types.SimpleNamespace(major=major, minor=minor, multi_processor_count=sms, regs_per_multiprocessor=65536,
                                 max_threads_per_multi_processor=threads,
                                 shared_memory_per_multiprocessor=smem_kib * 1024)


# RTX 3090 (sm_86), RTX 4090 (sm_89), H100 (sm_90), B200 (sm_100), RTX 5090 (sm_120); and, with
# stand-in SM counts and limits (only the capability decides the cap): Jetson Thor as CUDA 12.8/12.9
# report it (sm_101) and as CUDA 13 does (sm_110), a B300-class sm_103, a GB10-class sm_121.
GPUS = {"sm_86": (_props(8, 6, 82, 1536, 100), 16), "sm_89": (_props(8, 9, 128, 1536, 100), 24),
        "sm_90": (_props(9, 0, 132, 2048, 228), 32), "sm_100": (_props(10, 0, 148, 2048, 228), 32),
        "sm_120": (_props(12, 0, 170, 1536, 100), 24), "sm_101": (_props(10, 1, 20, 1536, 228), 24),
        "sm_110": (_props(11, 0, 20, 1536, 228), 24), "sm_103": (_props(10, 3, 148, 2048, 228), 32),
        "sm_121": (_props(12, 1, 48, 1536, 100), 24)}


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


_ASK_THE_CALCULATOR = r"""
#include <cstdio>
#include "cuda_occupancy.h"
int main() {
    for (int major = 3; major <= 15; ++major)
        for (int minor = 0; minor <= 9; ++minor) {
            cudaOccDeviceProp p;
            p.computeMajor = major;
            p.computeMinor = minor;
            int limit = 0;
            if (cudaOccMaxBlocksPerMultiprocessor(&limit, &p) == CUDA_OCC_SUCCESS)
                std::printf("%d %d\n", 10 * major + minor, limit);
        }
}
"""


def test_resident_block_caps_agree_with_nvidias_occupancy_calculator(tmp_path):
    """MAX_BLOCKS_PER_SM against cudaOccMaxBlocksPerMultiprocessor of the cuda_occupancy.h that
    triton's NVIDIA backend ships (CUDA 12.8 with triton 3.6, 13.1 with triton 3.9), compiled here
    and asked for every capability 3.0 to 15.9. Every capability the table lists has the header's
    cap; one may go unchecked only where the header knows nothing of its major (CUDA 12.8's knows no
    11.x). The fallback for an unlisted capability is never above any cap the header gives.
    Skipped where there is no such header or no C++ compiler."""
    import triton

    include = Path(triton.__file__).parent / "backends" / "nvidia" / "include"
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not (include / "cuda_occupancy.h").exists():
        pytest.skip(f"this triton ships no cuda_occupancy.h ({include})")
    if cxx is None:
        pytest.skip("no C++ compiler to build NVIDIA's occupancy calculator with")
    (tmp_path / "ask.cpp").write_text(_ASK_THE_CALCULATOR)
    subprocess.run([cxx, "-std=c++11", "-w", f"-I{include}", "ask.cpp", "-o", "ask"], cwd=tmp_path, check=True,
                   capture_output=True, timeout=120)
    out = subprocess.run([tmp_path / "ask"], capture_output=True, text=True, check=True, timeout=60).stdout
    header = {int(cap): int(blocks) for cap, blocks in (line.split() for line in out.splitlines())}
    assert header[90] == 32 and header[89] == 24 and header[86] == 16, header  # the calculator answered
    checked = {cap: blocks for cap, blocks in C.MAX_BLOCKS_PER_SM.items() if cap in header}
    assert checked == {cap: header[cap] for cap in checked}
    unchecked = set(C.MAX_BLOCKS_PER_SM) - set(checked)
    assert not {cap // 10 for cap in unchecked} & {cap // 10 for cap in header}, unchecked
    assert min(C.MAX_BLOCKS_PER_SM.values()) <= min(header.values())


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
