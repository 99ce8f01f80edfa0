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

from normswap.archs import ArchData, expand, load_arch, pattern_regex
from normswap.discover import OUTPUT, STREAM, Trace, discover, fold_orientation, layer_norm_paths
from normswap.errors import NormswapError, option_labels, option_setting, way_out

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
    category: str | None = None  # why not, as one of normswap.discover.REFUSALS
    zero_mean_input: bool = False
    folded_gain: bool = False
    folded_bias: bool = False
    kept_gain: bool = False
    kept_gain_why: str | None = None
    kept_bias: bool = False
    kept_bias_why: str | None = None
    baked: bool = False  # embedding norm baked into its token table (BLOOM)
    bake_scale: float | None = None  # the gain s of a baked norm (its weight is s·1)


@dataclass
class Job:
    """One group of tensors transformed together (the unit the streaming path holds in memory)."""

    kind: str  # center_embedding | center_param | center_writer | fold_reader | reset_norm | bake | copy
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


def _is_norm(mod: torch.nn.Module) -> bool:
    return "norm" in type(mod).__name__.lower() and not isinstance(mod, torch.nn.ModuleList)


def _config_matches(config, wanted: dict[str, Any]) -> bool:
    return all(getattr(config, k, None) == v for k, v in wanted.items())


def _tied(model, head: str, table: str, modules: dict) -> bool:
    h, t = modules.get(head), modules.get(table)
    return h is not None and t is not None and getattr(h, "weight", None) is getattr(t, "weight", 1)


@dataclass
class Layout:
    """Where the stream's writers, the norms and their readers are: what a plan is built from.
    Found by tracing the model (normswap.discover) or read from normswap/archs/*.toml."""

    source: str | None  # the arch file, or None when discovered
    tables: list[str] = field(default_factory=list)  # embeddings whose rows are centered
    writers: list[tuple[str, str]] = field(default_factory=list)  # (module, orientation)
    params: list[str] = field(default_factory=list)  # parameters added into the stream as is
    bakes: list[tuple[str, str]] = field(default_factory=list)  # (embedding norm, its table)
    readers: dict[str, list[tuple[str, str | None]]] = field(default_factory=dict)  # norm -> readers
    refused: dict[str, tuple[str, str]] = field(default_factory=dict)  # norm -> (category, reason)
    untie: tuple[str, str] | None = None  # (head module, table module)
    eps: dict[str, float | None] = field(default_factory=dict)
    norms: list[str] = field(default_factory=list)  # every LayerNorm found, in module order
    also_untied: dict[str, str] = field(default_factory=dict)  # other tied tensors, saved on their own


def plan_conversion(model: torch.nn.Module, config, keep_gain: bool = False, arch_data: bool = True,
                    tr: Trace | None = None) -> Plan:
    """Decide, per LayerNorm, what folds where; `model` may live on the meta device.

    The layout comes from one traced forward (normswap.discover; `tr`: one already made of this
    model, as discover and norm_readers take it); a file in normswap/archs/ for the model_type
    overrides it (arch_data=False ignores the files)."""
    model_type = getattr(config, "model_type", "?")
    modules = dict(model.named_modules())
    arch = load_arch(model_type) if arch_data else None
    if arch is not None:
        lns = {p: modules[p] for p in layer_norm_paths(model)}
        if not lns:
            _nothing_to_convert(model_type, modules)
        layout = _layout_from_arch(arch, model, config, modules, lns)
    else:
        layout = _layout_from_discovery(model, tr)
        lns = {p: modules[p] for p in layout.norms}
        if not lns:
            _nothing_to_convert(model_type, modules)
    if layout.untie is not None:
        layout.also_untied = {t: s for t, s in _tied_pairs(model).items() if t != layout.untie[0]}
    return _build_plan(model_type, layout, modules, lns, keep_gain)


def _tied_pairs(model) -> dict[str, str]:
    """target -> source of the parameters transformers ties in this model (and that are tied now)."""
    pairs = getattr(model, "all_tied_weights_keys", None) or {}
    out = {}
    for target, source in pairs.items():
        try:
            if model.get_parameter(target) is model.get_parameter(source):
                out[target] = source
        except AttributeError:
            continue
    return out


def _nothing_to_convert(model_type: str, modules: dict) -> None:
    n_norms = sum(1 for m in modules.values() if _is_norm(m))
    raise NormswapError(
        f"nothing to convert: this {model_type} model has no LayerNorm"
        + (f" (its {n_norms} norms are RMS norms already)" if n_norms else "")
    )


def _layout_from_discovery(model, tr: Trace | None = None) -> Layout:
    d = discover(model, tr=tr)
    layout = Layout(None, tables=list(d.tables), writers=list(d.writers), params=list(d.params),
                    norms=list(d.norms))
    if d.untie is not None:
        layout.untie = (f"{d.untie[0]}.weight", f"{d.untie[1]}.weight")
    for p, f in d.norms.items():
        layout.eps[p] = f.eps
        if f.category is not None:
            layout.refused[p] = (f.category, f.reason)
        elif f.baked_table is not None:
            layout.bakes.append((p, f.baked_table))
        else:
            layout.readers[p] = list(f.readers)
    return layout


def _layout_from_arch(arch: ArchData, model, config, modules: dict, lns: dict) -> Layout:
    layout = Layout(arch.source)

    def refuse_all(reason: str, category: str = "arch-data") -> Layout:
        return Layout(arch.source, refused={p: (category, reason) for p in lns})

    for r in arch.refuse_if:
        if (r.config is not None and _config_matches(config, r.config)) or (
            r.module is not None and _local(arch, r.module, modules) in modules
        ):
            return refuse_all(r.reason, r.category)

    # Known non-convertible norms, with the data's reason.
    for r in arch.refuse:
        rx = pattern_regex(_local(arch, r.path, modules))
        for p in lns:
            if rx.match(p):
                layout.refused[p] = (r.category, r.reason)

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
                    f"({_local(arch, entry.path, modules)}): centering the stream would change its output",
                    "stray-reader",
                )

    # Writers and tables: every one must exist, or the data does not describe this model.
    for pat in arch.writers:
        rx = pattern_regex(_local(arch, pat, modules))
        found = [p for p in modules if rx.match(p)]
        if not found:
            return refuse_all(f"{arch.source} names writer {pat!r} but this model has none: layout not described")
        layout.writers += [(p, arch.orientation_of(pat)) for p in found]
    layout.tables = [_local(arch, t, modules) for t in arch.embeddings]
    tables_needed = []
    if arch.embedding_norm:
        npath = _local(arch, arch.embedding_norm["path"], modules)
        table = _local(arch, arch.embedding_norm["table"], modules)
        tables_needed = [table]
        if npath not in lns:
            return refuse_all(f"{arch.source} names embedding norm {npath!r} but this model has none")
        layout.bakes.append((npath, table))
        readers_of.pop(npath, None)
    for t in layout.tables + tables_needed:
        if t not in modules or getattr(modules[t], "weight", None) is None:
            return refuse_all(f"{arch.source} names embedding {t!r} but this model has none")
    for p, o in layout.writers:
        actual = fold_orientation(modules[p])
        if actual != o:
            raise NormswapError(f"{arch.source}: {p} is a {type(modules[p]).__name__}, not a {o} layer")

    for p, readers in readers_of.items():
        if p in layout.refused:
            continue
        missing = [r for r, _ in readers if r not in modules]
        if missing:
            layout.refused[p] = ("arch-data", f"reader {missing[0]} named in {arch.source} is not in this model")
            continue
        bad = [(r, o) for r, o in readers if fold_orientation(modules[r]) != o]
        if bad:
            r, o = bad[0]
            raise NormswapError(f"{arch.source}: {r} is a {type(modules[r]).__name__}, not a {o} layer")
        layout.readers[p] = readers
    for p in lns:
        if p not in layout.readers and p not in layout.refused and not any(b[0] == p for b in layout.bakes):
            layout.refused[p] = ("arch-data", (
                f"not described in normswap/archs/{arch.source}: normswap does not know what reads this norm "
                "or whether its input is the residual stream"))

    # Untie a head whose table changes (or which is itself folded into).
    for head, table in arch.tied.items():
        head_l, table_l = _local(arch, head, modules), _local(arch, table, modules)
        if _tied(model, head_l, table_l, modules):
            layout.untie = (f"{head_l}.weight", f"{table_l}.weight")
    return layout


def _build_plan(model_type: str, layout: Layout, modules: dict, lns: dict, keep_gain: bool) -> Plan:
    """The jobs and per-norm decisions of a layout (either source)."""
    source = layout.source
    norms = {p: NormDecision(p, layout.eps.get(p, _eps(m)) if layout.eps.get(p) is not None else _eps(m))
             for p, m in lns.items()}
    for p, (category, reason) in layout.refused.items():
        norms[p].category, norms[p].why_not = category, reason
    if layout.refused.keys() >= norms.keys():
        return Plan(model_type, source, list(norms.values()), [], [], [], None, {})
    for p, _table in layout.bakes:
        eps = norms[p].eps
        if not eps or eps <= 0:
            reason = (
                f"embedding norm {p} has eps = {eps}: its output *is* the residual stream and, without eps > 0, "
                "no token table makes the stock LayerNorm output a centered row (every row's RMS would equal the gain)"
            )
            for d in norms.values():
                d.category, d.why_not, d.rms = "norm-form", reason, False
            return Plan(model_type, source, list(norms.values()), [], [], [], None, {})
    untie = layout.untie
    aliases = {untie[0]: untie[1], **layout.also_untied} if untie else {}
    tables, writers = list(layout.tables), list(layout.writers)

    jobs: list[Job] = []
    for t in tables:
        jobs.append(Job("center_embedding", t, [f"{t}.weight"], [f"{t}.weight"]))
    for name in layout.params:
        jobs.append(Job("center_param", name.rsplit(".", 1)[0], [name], [name]))
    for p, o in writers:
        outs = [f"{p}.weight"] + ([f"{p}.bias"] if _has_bias(modules[p]) else [])
        jobs.append(Job("center_writer", p, outs, list(outs), orientation=o))

    for npath, table in layout.bakes:
        d = norms[npath]
        mod = lns[npath]
        outs = [f"{table}.weight"] + [f"{npath}.{a}" for a in ("weight", "bias") if getattr(mod, a, None) is not None]
        jobs.append(Job("bake", npath, outs, list(outs), eps=d.eps, source=f"{table}.weight"))
        d.rms, d.zero_mean_input, d.baked = True, True, True
        d.readers = [STREAM]
        d.kept_gain = getattr(mod, "weight", None) is not None
        d.kept_gain_why = "baked: the norm's output is the residual stream; weight is s·1 (s reported as bake_scale)"

    for p, readers in layout.readers.items():
        d = norms[p]
        mod = lns[p]
        d.readers = [r for r, _ in readers]
        has_w = getattr(mod, "weight", None) is not None
        has_b = getattr(mod, "bias", None) is not None
        bias_free = [r for r, _ in readers if r == OUTPUT or not _has_bias(modules[r])]
        fold_bias = has_b and not bias_free
        foldable = any(r != OUTPUT for r, _ in readers) and OUTPUT not in d.readers
        fold_gain = has_w and not keep_gain and foldable and (fold_bias or not has_b)
        d.rms, d.zero_mean_input = True, True
        d.folded_bias, d.folded_gain = fold_bias, fold_gain
        if has_b and not fold_bias:
            d.kept_bias = True
            d.kept_bias_why = (
                f"{', '.join(bias_free)} {'has' if len(bias_free) == 1 else 'have'} no bias to absorb Wβ"
                if OUTPUT not in bias_free else "its output leaves the model as is: β has nowhere to go"
            )
        if has_w and not fold_gain:
            d.kept_gain = True
            d.kept_gain_why = (
                # as the caller asked: keep_gain=True, or the command line's --keep-gain
                option_setting(option_labels(("keep_gain",))["keep_gain"], True) if keep_gain else
                "its output leaves the model as is: γ has nowhere to go" if not foldable else
                "β stays in the norm, and folding γ alone would leave β/γ there (normswap never divides by γ)"
            )
        for r, o in readers:
            if r == OUTPUT or not (fold_gain or fold_bias):
                continue
            outs = [f"{r}.weight"] + ([f"{r}.bias"] if (_has_bias(modules[r]) and fold_bias) else [])
            ins = list(outs) + [f"{p}.weight"] * fold_gain + [f"{p}.bias"] * fold_bias
            jobs.append(Job("fold_reader", r, outs, ins, orientation=o, norm=p, gain=fold_gain, shift=fold_bias))
        if fold_gain or fold_bias:
            outs = [f"{p}.weight"] * fold_gain + [f"{p}.bias"] * fold_bias
            jobs.append(Job("reset_norm", p, outs, list(outs), ones=fold_gain, zeros=fold_bias))

    if untie is not None:
        head_w, table_w = untie
        if not any(head_w in j.outputs for j in jobs):
            jobs.append(Job("copy", head_w.rsplit(".", 1)[0], [head_w], [table_w], source=table_w))
        for target, src in layout.also_untied.items():
            jobs.append(Job("copy", target.rsplit(".", 1)[0], [target], [src], source=src))

    outs_seen: dict[str, str] = {}
    for j in jobs:
        for o in j.outputs:
            if o in outs_seen:
                raise NormswapError(
                    f"{source or 'discovery'}: {o} would be changed by two steps ({outs_seen[o]} and {j.kind} "
                    f"{j.module}); a layer that both writes the stream and reads a norm is not supported"
                )
            outs_seen[o] = f"{j.kind} {j.module}"
    any_converted = any(d.rms for d in norms.values())
    if not any_converted:
        jobs, untie, aliases = [], None, {}
    return Plan(
        model_type, source, list(norms.values()), jobs,
        embeddings=tables + [t for _, t in layout.bakes] if any_converted else [],
        writers=[p for p, _ in writers] + list(layout.params) if any_converted else [],
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
        # convert_model's partial=True, convert's --partial; an experiment's exact arm has no such option
        way = way_out("partial", True, "partial=True")
        raise NormswapError(
            f"{len(refused)} of {len(plan.norms)} norms cannot be converted ({refused[0].path}: "
            f"{refused[0].why_not})" + (f"; pass {way} to convert the other {len(plan.converted)}" if way else "")
        )


# ---------------------------------------------------------------------------------------------
# Manifest and report
# ---------------------------------------------------------------------------------------------


def build_manifest(plan: Plan, config, partial: bool = False, extra: dict | None = None) -> dict:
    """The "convert" section of normswap.json (normswap.manifest.new_manifest(convert=...) makes
    the file): per norm what was folded or kept, and whether it may run as an RMS norm (the form
    it may run in is derived from these facts by normswap.manifest.rms_forms, not stored)."""
    norms = [asdict(d) for d in plan.norms]
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
