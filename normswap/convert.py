"""Exact LayerNorm → RMSNorm conversion: plan per norm, apply, report, manifest.

The plan is built from the model's module tree (the meta device is enough) and the architecture
data in normswap/archs/. It is a list of *jobs*, each reading a few tensors of the original
checkpoint and writing a few tensors of the converted one; every output tensor is written by
exactly one job and every job reads original values only, so jobs can run in any order, all at
once in memory (convert_model, the in-memory checkpoint path) or one group at a time
(normswap.streaming). Both run the same run_job, so their outputs are identical to the byte.

The converted model is a checkpoint of the *original* class: the LayerNorms stay LayerNorms
(weight ones / bias zeros where γ / β were folded), and give the same outputs because their
input is now zero-mean. The "convert" section of the manifest (normswap.json, see
normswap.manifest) records which norms may instead run as RMSNorm kernels, and which of their
γ/β were folded (the RMS form skips those): normswap.manifest.rms_forms(...).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from normswap import fold
from normswap.archs import ArchData, expand, load_arch, pattern_regex
from normswap.errors import NormswapError
from normswap.manifest import MANIFEST_NAME, new_manifest, rms_forms, write_manifest
from normswap.progress import ProgressFn

# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------


@dataclass
class NormDecision:
    """What happens to one LayerNorm, and why. Serialised into the manifest as is."""

    path: str
    eps: float | None
    readers: list[str] = field(default_factory=list)
    rms: bool = False  # converted: its input is zero-mean, so it may run as an RMSNorm
    why_not: str | None = None
    zero_mean_input: bool = False
    folded_gain: bool = False
    folded_bias: bool = False
    kept_gain: bool = False
    kept_gain_why: str | None = None
    kept_bias: bool = False
    kept_bias_why: str | None = None
    baked: bool = False  # embedding norm baked into its token table (BLOOM)
    bake_scale: float | None = None  # the gain s of a baked norm (its weight is s·1)

    @property
    def rms_weight(self) -> str:
        """How an RMSNorm replacing this norm uses its weight: 'none' (γ folded, weight is ones)
        or 'weight' (the module's own weight, kept γ or a baked s·1)."""
        return "weight" if (self.kept_gain or self.baked) else "none"


@dataclass
class Job:
    """One group of tensors transformed together (the unit the streaming path holds in memory)."""

    kind: str  # center_embedding | center_writer | fold_reader | reset_norm | bake | copy
    module: str
    outputs: list[str]
    inputs: list[str]
    orientation: str | None = None
    norm: str | None = None
    gain: bool = False
    shift: bool = False
    ones: bool = False  # reset_norm: weight -> ones
    zeros: bool = False  # reset_norm: bias -> zeros
    eps: float | None = None
    source: str | None = None  # copy / untie: the tensor whose original value is copied


@dataclass
class Plan:
    model_type: str
    arch_file: str | None
    norms: list[NormDecision]
    jobs: list[Job]
    embeddings: list[str]
    writers: list[str]
    untie: tuple[str, str] | None  # (head weight, table weight)
    aliases: dict[str, str]  # tensor -> tensor holding its original value (a tied head)
    keep_gain: bool = False

    @property
    def refused(self) -> list[NormDecision]:
        return [n for n in self.norms if not n.rms]

    @property
    def converted(self) -> list[NormDecision]:
        return [n for n in self.norms if n.rms]


def _is_layer_norm(mod: torch.nn.Module) -> bool:
    if isinstance(mod, torch.nn.LayerNorm):
        return True
    name = type(mod).__name__.lower()
    return "layernorm" in name and "rms" not in name and not name.startswith("t5")


def _is_norm(mod: torch.nn.Module) -> bool:
    return "norm" in type(mod).__name__.lower() and not isinstance(mod, torch.nn.ModuleList)


def _orientation_of_module(mod: torch.nn.Module) -> str | None:
    if isinstance(mod, torch.nn.Linear):
        return fold.LINEAR
    if type(mod).__name__ == "Conv1D" and hasattr(mod, "nf"):
        return fold.CONV1D
    return None


def _config_matches(config, wanted: dict[str, Any]) -> bool:
    return all(getattr(config, k, None) == v for k, v in wanted.items())


def _tied(model, head: str, table: str, modules: dict) -> bool:
    h, t = modules.get(head), modules.get(table)
    return h is not None and t is not None and getattr(h, "weight", None) is getattr(t, "weight", 1)


def plan_conversion(model: torch.nn.Module, config, keep_gain: bool = False) -> Plan:
    """Decide, per LayerNorm, what folds where; `model` may live on the meta device."""
    model_type = getattr(config, "model_type", "?")
    modules = dict(model.named_modules())
    lns = {p: m for p, m in modules.items() if _is_layer_norm(m)}
    if not lns:
        n_norms = sum(1 for m in modules.values() if _is_norm(m))
        raise NormswapError(
            f"nothing to convert: this {model_type} model has no LayerNorm"
            + (f" (its {n_norms} norms are RMS norms already)" if n_norms else "")
        )
    norms = {p: NormDecision(p, _eps(m)) for p, m in lns.items()}
    arch = load_arch(model_type)

    def refuse_all(reason: str) -> Plan:
        for d in norms.values():
            d.why_not = reason
        return Plan(model_type, arch.source if arch else None, list(norms.values()), [], [], [], None, {})

    if arch is None:
        return refuse_all(
            f"no architecture data for model_type {model_type!r} (normswap/archs/{model_type}.toml): which "
            "layers write the residual stream is unknown, so no norm's input can be made zero-mean"
        )
    for r in arch.refuse_if:
        if (r.config is not None and _config_matches(config, r.config)) or (
            r.module is not None and _local(arch, r.module, modules) in modules
        ):
            return refuse_all(r.reason)

    # Known non-convertible norms, with the data's reason.
    for r in arch.refuse:
        rx = pattern_regex(_local(arch, r.path, modules))
        for p in lns:
            if rx.match(p):
                norms[p].why_not = r.reason

    # The residual-stream norms and their readers.
    readers_of: dict[str, list[tuple[str, str]]] = {}
    for entry in arch.norms:
        if not _config_matches(config, entry.when):
            continue
        rx = pattern_regex(_local(arch, entry.path, modules))
        for p in lns:
            m = rx.match(p)
            if not m:
                continue
            i = m.groupdict().get("i")
            readers_of[p] = [
                (_local(arch, expand(r, i), modules), arch.orientation_of(r)) for r in entry.readers
            ]

    # A reader the data puts behind a norm, present in the model while no norm in front of it is
    # (OPT with _remove_final_layer_norm: lm_head reads the stream itself), would see the centered
    # stream directly and change its output: the layout is not the one the data describes.
    assigned = {r for readers in readers_of.values() for r, _ in readers}
    for entry in arch.norms:
        for r in entry.readers:
            rx = pattern_regex(_local(arch, r, modules))
            stray = next((p for p in modules if rx.match(p) and p not in assigned), None)
            if stray is not None:
                return refuse_all(
                    f"{stray} reads the residual stream without the norm {arch.source} puts in front of it "
                    f"({_local(arch, entry.path, modules)}): centering the stream would change its output"
                )

    # Writers and tables: every one must exist, or the data does not describe this model.
    writers: list[tuple[str, str]] = []
    for pat in arch.writers:
        rx = pattern_regex(_local(arch, pat, modules))
        found = [p for p in modules if rx.match(p)]
        if not found:
            return refuse_all(f"{arch.source} names writer {pat!r} but this model has none: layout not described")
        writers += [(p, arch.orientation_of(pat)) for p in found]
    tables = [_local(arch, t, modules) for t in arch.embeddings]
    emb_norm = None
    if arch.embedding_norm:
        emb_norm = (_local(arch, arch.embedding_norm["path"], modules),
                    _local(arch, arch.embedding_norm["table"], modules))
        tables_needed = [emb_norm[1]]
        if emb_norm[0] not in lns:
            return refuse_all(f"{arch.source} names embedding norm {emb_norm[0]!r} but this model has none")
        eps = norms[emb_norm[0]].eps
        if not eps or eps <= 0:
            return refuse_all(
                f"embedding norm {emb_norm[0]} has eps = {eps}: its output *is* the residual stream and, without "
                "eps > 0, no token table makes the stock LayerNorm output a centered row (every row's RMS would "
                "equal the gain)"
            )
    else:
        tables_needed = []
    for t in tables + tables_needed:
        if t not in modules or getattr(modules[t], "weight", None) is None:
            return refuse_all(f"{arch.source} names embedding {t!r} but this model has none")
    for p, o in writers:
        actual = _orientation_of_module(modules[p])
        if actual != o:
            raise NormswapError(f"{arch.source}: {p} is a {type(modules[p]).__name__}, not a {o} layer")

    # Untie a head whose table changes (or which is itself folded into).
    untie = None
    aliases: dict[str, str] = {}
    for head, table in arch.tied.items():
        head_l, table_l = _local(arch, head, modules), _local(arch, table, modules)
        if _tied(model, head_l, table_l, modules):
            untie = (f"{head_l}.weight", f"{table_l}.weight")
            aliases[untie[0]] = untie[1]

    jobs: list[Job] = []
    for t in tables:
        jobs.append(Job("center_embedding", t, [f"{t}.weight"], [f"{t}.weight"]))
    for p, o in writers:
        outs = [f"{p}.weight"] + ([f"{p}.bias"] if _has_bias(modules[p]) else [])
        jobs.append(Job("center_writer", p, outs, list(outs), orientation=o))

    if emb_norm is not None:
        npath, table = emb_norm
        d = norms[npath]
        mod = lns[npath]
        outs = [f"{table}.weight"] + [f"{npath}.{a}" for a in ("weight", "bias") if getattr(mod, a, None) is not None]
        jobs.append(Job("bake", npath, outs, list(outs), eps=d.eps, source=f"{table}.weight"))
        d.rms, d.zero_mean_input, d.baked = True, True, True
        d.readers = ["<residual stream>"]
        d.kept_gain = getattr(mod, "weight", None) is not None
        d.kept_gain_why = "baked: the norm's output is the residual stream; weight is s·1 (s reported as bake_scale)"
        readers_of.pop(npath, None)

    for p, readers in readers_of.items():
        d = norms[p]
        if d.why_not is not None:
            continue
        mod = lns[p]
        d.readers = [r for r, _ in readers]
        missing = [r for r, _ in readers if r not in modules]
        if missing:
            d.why_not = f"reader {missing[0]} named in {arch.source} is not in this model"
            continue
        bad = [(r, o) for r, o in readers if _orientation_of_module(modules[r]) != o]
        if bad:
            r, o = bad[0]
            raise NormswapError(f"{arch.source}: {r} is a {type(modules[r]).__name__}, not a {o} layer")
        has_w = getattr(mod, "weight", None) is not None
        has_b = getattr(mod, "bias", None) is not None
        bias_free = [r for r, _ in readers if not _has_bias(modules[r])]
        fold_bias = has_b and not bias_free
        fold_gain = has_w and not keep_gain and (fold_bias or not has_b)
        d.rms, d.zero_mean_input = True, True
        d.folded_bias, d.folded_gain = fold_bias, fold_gain
        if has_b and not fold_bias:
            d.kept_bias = True
            d.kept_bias_why = (
                f"{', '.join(bias_free)} {'has' if len(bias_free) == 1 else 'have'} no bias to absorb Wβ"
            )
        if has_w and not fold_gain:
            d.kept_gain = True
            d.kept_gain_why = (
                "--keep-gain" if keep_gain else
                "β stays in the norm, and folding γ alone would leave β/γ there (normswap never divides by γ)"
            )
        for r, o in readers:
            outs = [f"{r}.weight"] + ([f"{r}.bias"] if (_has_bias(modules[r]) and fold_bias) else [])
            if not (fold_gain or fold_bias):
                continue
            ins = list(outs) + [f"{p}.weight"] * fold_gain + [f"{p}.bias"] * fold_bias
            jobs.append(Job("fold_reader", r, outs, ins, orientation=o, norm=p, gain=fold_gain, shift=fold_bias))
        if fold_gain or fold_bias:
            outs = [f"{p}.weight"] * fold_gain + [f"{p}.bias"] * fold_bias
            jobs.append(Job("reset_norm", p, outs, list(outs), ones=fold_gain, zeros=fold_bias))

    for d in norms.values():
        if not d.rms and d.why_not is None:
            d.why_not = (
                f"not described in normswap/archs/{arch.source}: normswap does not know what reads this norm "
                "or whether its input is the residual stream"
            )

    if untie is not None:
        head_w, table_w = untie
        if not any(head_w in j.outputs for j in jobs):
            jobs.append(Job("copy", head_w.rsplit(".", 1)[0], [head_w], [table_w], source=table_w))

    outs_seen: dict[str, str] = {}
    for j in jobs:
        for o in j.outputs:
            if o in outs_seen:
                raise NormswapError(
                    f"{arch.source}: {o} would be changed by two steps ({outs_seen[o]} and {j.kind} {j.module}); "
                    "a layer that both writes the stream and reads a norm is not supported"
                )
            outs_seen[o] = f"{j.kind} {j.module}"
    any_converted = any(d.rms for d in norms.values())
    if not any_converted:
        jobs, untie, aliases = [], None, {}
    return Plan(
        model_type, arch.source, list(norms.values()), jobs,
        embeddings=tables + tables_needed if any_converted else [],
        writers=[p for p, _ in writers] if any_converted else [],
        untie=untie, aliases=aliases, keep_gain=keep_gain,
    )


def _eps(mod) -> float | None:
    for attr in ("eps", "variance_epsilon", "epsilon"):
        v = getattr(mod, attr, None)
        if isinstance(v, (int, float)):
            return float(v)
    return None


def _has_bias(mod) -> bool:
    return getattr(mod, "bias", None) is not None


def _local(arch: ArchData, path: str, modules: dict) -> str:
    """Data paths are written for the *ForCausalLM class; a bare base model lacks the prefix."""
    pre = arch.prefix + "." if arch.prefix else ""
    if pre and path.startswith(pre) and not any(p.startswith(pre) for p in modules):
        return path[len(pre):]
    return path


# ---------------------------------------------------------------------------------------------
# Applying one job (float64 arithmetic, one cast back)
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# In-memory conversion of a model object
# ---------------------------------------------------------------------------------------------


def check_refusals(plan: Plan, partial: bool) -> None:
    """Raise when some norm cannot be converted (unless partial) or none can."""
    refused = plan.refused
    if not plan.converted:
        first = refused[0].why_not if refused else "no LayerNorm"
        raise NormswapError(f"nothing converts in this {plan.model_type} model: {first}")
    if refused and not partial:
        raise NormswapError(
            f"{len(refused)} of {len(plan.norms)} norms cannot be converted ({refused[0].path}: "
            f"{refused[0].why_not}); pass --partial to convert the other {len(plan.converted)}"
        )


def convert_model(
    model: torch.nn.Module, keep_gain: bool = False, partial: bool = False, return_plan: bool = False,
    check: bool = True,
):
    """Convert `model` in place (same class, same outputs); return the manifest (or the plan).

    check=True runs one short probe batch and measures, at every RMS-eligible norm, how far its
    input is from zero-mean (the manifest's zero_mean_check); a failure raises NormswapError. The
    model then still computes what it computed before (LayerNorm ignores the mean), but the
    architecture data missed a writer, so no norm may run as an RMSNorm."""
    plan = plan_conversion(model, model.config, keep_gain=keep_gain)
    check_refusals(plan, partial)
    state = model.state_dict()

    def read(name: str) -> torch.Tensor:
        return state[plan.aliases.get(name, name) if name not in state else name].detach()

    results, infos = run_jobs(plan, read, keep_dtype(None))
    record_infos(plan, infos)
    with torch.no_grad():
        if plan.untie is not None:
            head_w = plan.untie[0]
            head_mod = model.get_submodule(head_w.rsplit(".", 1)[0])
            trainable = head_mod.weight.requires_grad
            head_mod.weight = torch.nn.Parameter(results[head_w].clone(), requires_grad=trainable)
            untie_config(model)
        for name, t in results.items():
            model.get_parameter(name).data.copy_(t)
    if return_plan:
        return plan
    manifest = build_manifest(plan, model.config, partial=partial)
    if check and not any(p.is_meta for p in model.parameters()):
        manifest["zero_mean_check"] = check_zero_mean(model, manifest, probe_batch(model.config, 1, 16))
    return manifest


def zero_mean_tolerance(dtype: torch.dtype) -> float:
    """Largest accepted |mean(x)| / rms(x) at a norm's input, per dtype of the stored weights
    (each writer's centering is exact up to one rounding of its weights to that dtype)."""
    return {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 1e-2}.get(dtype, 5e-2)


def check_zero_mean(model, manifest, ids: torch.Tensor, raise_on_failure: bool = True,
                    stored_dtype: torch.dtype | None = None) -> dict:
    """Measure, on a probe batch, |mean(x)| / rms(x) of the input of every RMS-eligible norm (the
    property the conversion promises). Returns the worst ratio, where, the tolerance and a
    verdict; raises NormswapError (unless told not to) when it is over the tolerance."""
    worst: dict[str, float] = {}
    handles = []
    for path in rms_forms(manifest):
        mod = model.get_submodule(path)

        def hook(mod, args, path=path):
            x = args[0].detach().to(torch.float64)
            ratio = x.mean(-1).abs() / x.pow(2).mean(-1).sqrt().clamp_min(1e-30)
            worst[path] = max(worst.get(path, 0.0), float(ratio.max()))

        handles.append(mod.register_forward_pre_hook(hook))
    try:
        _logits(model, ids.to(next(model.parameters()).device))
    finally:
        for h in handles:
            h.remove()
    dtype = next(model.parameters()).dtype
    tol = zero_mean_tolerance(dtype)
    if stored_dtype is not None:
        tol = max(tol, zero_mean_tolerance(stored_dtype))
    where = max(worst, key=worst.get) if worst else None
    result = {"max_mean_over_rms": worst.get(where, 0.0) if where else 0.0, "where": where,
              "tolerance": tol, "passed": all(v <= tol for v in worst.values())}
    if raise_on_failure and not result["passed"]:
        raise NormswapError(
            f"the input of {where} is not zero-mean after conversion (|mean|/rms = {result['max_mean_over_rms']:.3g}, "
            f"tolerance {tol:g}): the architecture data misses a writer into the residual stream"
        )
    return result


def untie_config(model) -> None:
    """Write tie_word_embeddings: false where transformers reads it, so loading does not re-tie."""
    for cfg in {id(c): c for c in _configs(model.config)}.values():
        if getattr(cfg, "tie_word_embeddings", False):
            cfg.tie_word_embeddings = False
    if hasattr(model, "all_tied_weights_keys"):
        model.all_tied_weights_keys = {}


def _configs(config) -> Iterable:
    yield config
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        yield get_text()


# ---------------------------------------------------------------------------------------------
# Manifest and report
# ---------------------------------------------------------------------------------------------


def build_manifest(plan: Plan, config, partial: bool = False, extra: dict | None = None) -> dict:
    """The "convert" section of normswap.json (normswap.manifest.new_manifest(convert=...) makes
    the file): per norm what was folded or kept, and whether it may run as an RMS norm."""
    norms = []
    for d in plan.norms:
        rec = asdict(d)
        rec["rms_weight"] = d.rms_weight if d.rms else None
        rec["rms_bias"] = d.kept_bias if d.rms else None
        norms.append(rec)
    manifest = {
        "to": "rms",
        "arch": plan.model_type,
        "arch_file": plan.arch_file,
        "architectures": list(getattr(config, "architectures", None) or []),
        "keep_gain": plan.keep_gain,
        "partial": partial,
        "untied": {"head": plan.untie[0], "table": plan.untie[1]} if plan.untie else None,
        "centered_embeddings": plan.embeddings,
        "centered_writers": plan.writers,
        "summary": {
            "norms": len(plan.norms),
            "converted": len(plan.converted),
            "refused": len(plan.refused),
            "folded_gain": sum(d.folded_gain for d in plan.norms),
            "folded_bias": sum(d.folded_bias for d in plan.norms),
            "kept_bias": sum(d.kept_bias for d in plan.norms),
        },
        "norms": norms,
    }
    if extra:
        manifest.update(extra)
    return manifest


# ---------------------------------------------------------------------------------------------
# Checkpoint directories: convert (streaming), verify
# ---------------------------------------------------------------------------------------------

_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")


def convert_directory(
    source,
    out_dir: str | os.PathLike,
    keep_gain: bool = False,
    partial: bool = False,
    dtype: torch.dtype | None = None,
    streaming: bool = True,
    progress: bool | ProgressFn = False,
    config=None,
    manifest: bool = True,
) -> dict:
    """Convert the checkpoint `source` (a normswap.loading.ModelSource) into the existing empty
    directory `out_dir`: weights, config (untied, dtype), tokenizer and other files, and (unless
    manifest=False: the caller writes it once, verified) the manifest. Returns the convert section.
    Safetensors checkpoints are converted shard by shard; anything else is loaded whole.
    config: loading.load_config(source) when the caller already read it."""
    import shutil

    from normswap import loading
    from normswap import streaming as st

    out = Path(out_dir)
    config = loading.load_config(source) if config is None else config
    meta = loading.build_meta_model(source, config)
    plan = plan_conversion(meta, config, keep_gain=keep_gain)
    check_refusals(plan, partial)
    policy = keep_dtype(dtype)
    has_safetensors = source.gguf_file is None and (
        (source.path / st.SINGLE_NAME).is_file() or (source.path / st.INDEX_NAME).is_file()
    )
    if has_safetensors:
        names = list(meta.state_dict().keys())
        arch = load_arch(plan.model_type)
        infos = st.convert_files(
            source.path, out, plan, names, prefix=arch.prefix if arch else "",
            out_dtype=policy, streaming=streaming, progress=progress,
        )
        record_infos(plan, infos)
        cfg = json.loads((source.path / "config.json").read_text())
        if plan.untie is not None:
            _untie_config_dict(cfg)
        if dtype is not None:
            for key in ("dtype", "torch_dtype"):
                if key in cfg or key == "dtype":
                    cfg[key] = str(dtype).replace("torch.", "")
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        for f in sorted(source.path.iterdir()):
            if f.is_file() and f.name not in ("config.json", MANIFEST_NAME, st.INDEX_NAME) and not f.name.endswith(
                _WEIGHT_FILES
            ):
                shutil.copy2(f, out / f.name)
    else:  # GGUF or pickled weights: load whole, convert in memory, save with transformers
        # With --dtype, load in float64 and cast after the conversion: loading straight into the
        # target dtype would round the weights once before the float64 arithmetic and once after.
        model = loading.load_model(source, dtype=torch.float64 if dtype is not None else None)
        plan = convert_model(model, keep_gain=keep_gain, partial=partial, return_plan=True)
        if dtype is not None:
            model.to(dtype)
        model.save_pretrained(out)
        try:
            loading.load_tokenizer(source).save_pretrained(out)
        except NormswapError:
            pass
    section = build_manifest(plan, config, partial=partial, extra={"source": str(source.ref)})
    # Only a convert section: a patch section of the source (if any) was verified against the
    # unconverted weights and is not carried (see normswap.manifest).
    if manifest:
        write_manifest(out, new_manifest(convert=section))
    return section


def _untie_config_dict(cfg: dict) -> None:
    cfg["tie_word_embeddings"] = False
    for sub in ("text_config",):
        if isinstance(cfg.get(sub), dict) and "tie_word_embeddings" in cfg[sub]:
            cfg[sub]["tie_word_embeddings"] = False


def probe_batch(config, batch: int = 2, length: int = 32, seed: int = 0) -> torch.Tensor:
    """Random token ids inside the vocabulary (never all one token, never zeros)."""
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab < 2:
        raise NormswapError("cannot build a probe batch: the config has no vocab_size")
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit:
        length = min(length, int(limit))
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (batch, length), generator=g)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=ids)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def _run_as_rms(model, manifest) -> None:
    """The speedup path on a converted model: every zero-mean LayerNorm as an RMS norm (reference
    backend: float64 stays float64), every other norm left alone. In place, unverified: the
    caller compares logits."""
    from normswap.swap import PatchConfig, patch

    forms = rms_forms(manifest)
    if forms:
        patch(model, PatchConfig("reference", paths=tuple(forms), rms_forms=forms), verify=False)


def tolerance_for(dtype: torch.dtype) -> float:
    """Max |Δlogit| / max |logit| accepted by verification, per stored dtype: the converted
    weights are rounded once to it, so the gate scales with its precision."""
    return {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}.get(dtype, 5e-2)


def verify_conversion(source, converted_dir: str | os.PathLike, manifest: dict, batch=None,
                      config=None) -> dict:
    """Reload the converted directory with stock transformers; compare its logits (and those of
    its RMS-patched form) with the original model's on a probe batch. Raises when over tolerance.
    config: loading.load_config(source) when the caller already read it."""
    from normswap import loading

    config = loading.load_config(source) if config is None else config
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    conv_cfg = loading.load_config(loading.resolve(converted_dir))
    conv_dtype = getattr(conv_cfg, "dtype", None) or stored
    if isinstance(conv_dtype, str):
        conv_dtype = getattr(torch, conv_dtype, torch.float32)
    if isinstance(stored, str):
        stored = getattr(torch, stored, torch.float32)
    run_dtype = torch.float64 if conv_dtype == torch.float64 and stored == torch.float64 else torch.float32
    ids = probe_batch(config) if batch is None else batch
    original = loading.load_model(source, dtype=run_dtype, config=config)
    ref = _logits(original, ids)
    del original
    converted = loading.load_model(loading.resolve(converted_dir), dtype=run_dtype)
    got = _logits(converted, ids)
    zero_mean = check_zero_mean(converted, manifest, ids, raise_on_failure=False,
                                stored_dtype=conv_dtype if isinstance(conv_dtype, torch.dtype) else None)
    _run_as_rms(converted, manifest)
    got_rms = _logits(converted, ids)
    scale = float(ref.abs().max()) or 1.0
    err = float((got - ref).abs().max()) / scale
    err_rms = float((got_rms - ref).abs().max()) / scale
    tol = tolerance_for(conv_dtype if isinstance(conv_dtype, torch.dtype) else torch.float32)
    if run_dtype == torch.float32:
        tol = max(tol, 1e-4)
    # The RMS path runs normswap's modules with the reference backend: float64 stays float64, so
    # it is held to the same gate as the stock reload.
    tol_rms = tol
    result = {"probe": list(ids.shape), "compute_dtype": str(run_dtype).replace("torch.", ""),
              "max_rel_logit_error": err, "max_rel_logit_error_rms": err_rms, "tolerance": tol,
              "tolerance_rms": tol_rms, "zero_mean": zero_mean,
              "passed": err <= tol and err_rms <= tol_rms and zero_mean["passed"]}
    if not zero_mean["passed"]:
        raise NormswapError(
            f"verification failed: the input of {zero_mean['where']} is not zero-mean after conversion "
            f"(|mean|/rms = {zero_mean['max_mean_over_rms']:.3g}, tolerance {zero_mean['tolerance']:g}); "
            "nothing was written"
        )
    if not result["passed"]:
        raise NormswapError(
            f"verification failed: converted logits differ by {err:.3g} of the logit scale as LayerNorms "
            f"(tolerance {tol:g}) and by {err_rms:.3g} as RMSNorms (tolerance {tol_rms:g}); nothing was written"
        )
    return result
