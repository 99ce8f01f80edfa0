"""The per-tensor jobs of a conversion plan: float64 arithmetic, one cast back.

Shared by the in-memory paths (normswap.convert, and streaming=False in normswap.streaming) and
the shard-by-shard path (normswap.streaming): both run the same run_job, so their outputs are
identical to the byte.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from normswap import fold
from normswap.errors import NormswapError
from normswap.plan import Job, Plan

# Float64 working copies of big tensors are made a slice at a time (along an axis whose slices are
# computed independently), so a job holds its inputs, its outputs and one slice of float64 work.
CHUNK_ELEMENTS = 1 << 22


def _slices(n: int, per_slice: int):
    step = max(1, CHUNK_ELEMENTS // max(1, per_slice))
    for start in range(0, n, step):
        yield start, min(step, n - start)


def run_job(
    job: Job,
    read: Callable[[str], torch.Tensor],
    out_dtype: Callable[[str, torch.Tensor], torch.dtype],
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Compute a job's output tensors from original tensors. `read(name)` returns the original
    tensor (any dtype); `out_dtype(name, original)` says what to store. All arithmetic is float64
    and each result is cast to its stored dtype once. Outputs never share storage with inputs.
    Returns (tensors, info)."""
    f64 = torch.float64
    small: dict[str, torch.Tensor] = {}

    def get(name: str) -> torch.Tensor:  # whole-tensor float64 copy: for small tensors
        if name not in small:
            small[name] = read(name).to(f64)
        return small[name]

    def dtype_for(name: str, original: torch.Tensor) -> torch.dtype:
        return out_dtype(name, original)

    def cast(name: str, t: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
        # copy=True: an output must never share storage with an original (float64 models would
        # otherwise hand back the very parameter that another job's output overwrites).
        return t.to(dtype=dtype_for(name, original), memory_format=torch.contiguous_format, copy=True)

    out: dict[str, torch.Tensor] = {}
    info: dict[str, Any] = {}
    m = job.module
    if job.kind == "center_embedding":
        name = f"{m}.weight"
        table = read(name)
        res = torch.empty(table.shape, dtype=dtype_for(name, table), device=table.device)
        for s0, n in _slices(table.shape[0], table.shape[-1]):
            res[s0:s0 + n] = fold.center_embedding(table[s0:s0 + n].to(f64))
        out[name] = res
    elif job.kind == "center_param":  # a parameter added into the stream as is (a bias vector)
        name = job.outputs[0]
        t = read(name)
        rows = fold.center_embedding(t.reshape(-1, t.shape[-1]).to(f64))
        out[name] = cast(name, rows.reshape(t.shape), t)
    elif job.kind == "center_writer":
        w_name, b_name = f"{m}.weight", f"{m}.bias"
        w0 = read(w_name)
        b0 = read(b_name) if b_name in job.outputs else None
        w, b = fold.center_writer(w0.to(f64), None if b0 is None else b0.to(f64), job.orientation)
        out[w_name] = cast(w_name, w, w0)
        if b is not None:
            out[b_name] = cast(b_name, b, b0)
    elif job.kind == "fold_reader":
        gain = get(f"{job.norm}.weight") if job.gain else None
        shift = get(f"{job.norm}.bias") if job.shift else None
        w_name, b_name = f"{m}.weight", f"{m}.bias"
        w0 = read(w_name)
        b0 = read(b_name) if job.shift else None
        axis = 0 if job.orientation == fold.LINEAR else 1  # the output axis: its slices are independent
        w_res = torch.empty(w0.shape, dtype=dtype_for(w_name, w0), device=w0.device)
        b_res = None if b0 is None else torch.empty(b0.shape, dtype=dtype_for(b_name, b0), device=b0.device)
        for s0, n in _slices(w0.shape[axis], w0.shape[1 - axis]):
            wc = w0.narrow(axis, s0, n).to(f64)
            bc = None if b0 is None else b0[s0:s0 + n].to(f64)
            wf, bf = fold.fold_into_reader(wc, bc, job.orientation, gain=gain, shift=shift)
            w_res.narrow(axis, s0, n).copy_(wf)
            if b_res is not None:
                b_res[s0:s0 + n] = bf
        out[w_name] = w_res
        if b_res is not None:
            out[b_name] = b_res
    elif job.kind == "reset_norm":
        for name, flag, fill in ((f"{m}.weight", job.ones, 1.0), (f"{m}.bias", job.zeros, 0.0)):
            if flag:
                t = read(name)
                out[name] = torch.full(t.shape, fill, dtype=dtype_for(name, t), device=t.device)
    elif job.kind == "bake":
        table_name = job.source
        table = read(table_name)
        has_w, has_b = f"{m}.weight" in job.outputs, f"{m}.bias" in job.outputs
        gain = get(f"{m}.weight") if has_w else torch.ones(table.shape[-1], dtype=f64, device=table.device)
        shift = get(f"{m}.bias") if has_b else None
        # Two passes over the rows: the gain s depends on every row, then each row is rewritten.
        max_ms = 0.0
        slices = list(_slices(table.shape[0], table.shape[-1]))
        for s0, n in slices:
            ms = fold.centered_output_ms(table[s0:s0 + n].to(f64), gain, shift, job.eps)
            max_ms = max(max_ms, float(ms.max()) if ms.numel() else 0.0)
        s = fold.bake_scale(max_ms)
        if not has_w and s != 1.0:  # a weightless embedding norm cannot carry s
            raise NormswapError(f"{m} has no weight to carry the bake scale {s}")
        res = torch.empty(table.shape, dtype=dtype_for(table_name, table), device=table.device)
        for s0, n in slices:
            res[s0:s0 + n] = fold.bake_rows(table[s0:s0 + n].to(f64), gain, shift, job.eps, s)
        out[table_name] = res
        if has_w:
            w = read(f"{m}.weight")
            out[f"{m}.weight"] = torch.full(w.shape, s, dtype=f64, device=w.device).to(dtype_for(f"{m}.weight", w))
        if has_b:
            b = read(f"{m}.bias")
            out[f"{m}.bias"] = torch.zeros(b.shape, dtype=dtype_for(f"{m}.bias", b), device=b.device)
        info["bake_scale"] = s
    elif job.kind == "copy":
        src = read(job.source)
        out[job.outputs[0]] = cast(job.outputs[0], src, src)
    else:  # pragma: no cover - plans only hold the kinds above
        raise ValueError(f"unknown job kind {job.kind!r}")
    return out, info


def keep_dtype(dtype: torch.dtype | None = None) -> Callable[[str, torch.Tensor], torch.dtype]:
    """out_dtype policy: the original tensor's dtype, or `dtype` for every floating tensor."""
    def policy(name: str, original: torch.Tensor) -> torch.dtype:
        if dtype is not None and original.is_floating_point():
            return dtype
        return original.dtype
    return policy


def run_jobs(plan: Plan, read: Callable[[str], torch.Tensor], out_dtype) -> tuple[dict, dict]:
    """All jobs at once (the in-memory path). Reads originals only; returns new tensors and info."""
    results: dict[str, torch.Tensor] = {}
    infos: dict[str, dict] = {}
    for job in plan.jobs:
        tensors, info = run_job(job, read, out_dtype)
        results.update(tensors)
        if info:
            infos[job.module] = info
    return results, infos


def record_infos(plan: Plan, infos: dict[str, dict]) -> None:
    for d in plan.norms:
        if d.baked and d.path in infos:
            d.bake_scale = infos[d.path]["bake_scale"]
