"""The conversion plan: per LayerNorm, what folds where, and the jobs that do it.

Built from the model's module tree (the meta device is enough) and the architecture data in
normswap/archs/. The plan is a list of *jobs* (run by normswap.jobs), each reading a few tensors
of the original checkpoint and writing a few tensors of the converted one; every output tensor
is written by exactly one job and every job reads original values only, so jobs can run in any
order: all at once in memory (normswap.convert) or one group at a time (normswap.streaming).
build_manifest turns a plan into the "convert" section of normswap.json.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from normswap import fold
from normswap.archs import ArchData, expand, load_arch, pattern_regex
from normswap.errors import NormswapError

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
