"""Model-level speed: the unpatched model against each impl, with and without fused residual adds.

One process, one model (built from its config with random weights unless weights are asked for),
patched and reverted in place between variants so every variant runs the same weights on the same
inputs. Per variant and mode:

- train    one training step: forward with labels + backward (no optimizer step); tokens/s and
           peak memory (CUDA only)
- prefill  a no-grad forward over the prompt that fills a KV cache; tokens/s
- decode   one next-token step against a static KV cache holding the prompt (the cache position is
           reset before each step, so every repeat does the same work); latency. On CUDA the step
           is captured in a CUDA graph and replayed where the model allows it (the row says which
           method timed it); elsewhere it runs eagerly.

Timing: warm-up calls, then `repeats` timed calls; the median is reported. CUDA is timed with
events around each call (or graph replay); CPU with perf_counter. CPU numbers say nothing about
GPU speed: the result records the device, and the CLI labels CPU runs as such.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from normswap import jsonsafe
from normswap.choices import AT_MOST, MODES  # defined there: --help states them without importing torch
from normswap.errors import NormswapError, named_twice, option_labels, using_option_names
from normswap.progress import ProgressFn

FORMAT = "normswap-bench/1"


@dataclass(frozen=True)
class BenchConfig:
    model: str
    impls: tuple[str, ...] = ("torch", "triton")
    fuse_residual: bool = False  # also measure each impl with its residual adds fused
    modes: tuple[str, ...] = MODES
    batch: int = 1
    seq: int = 512
    dtype: str = "bf16"
    device: str | None = "auto"  # auto (or None): CUDA when there is one, as patch_checkpoint's device
    compile: bool = False
    compile_backend: str = "inductor"
    warmup: int = 3
    repeats: int = 10
    load_weights: bool = False  # False: random weights from the config (any size, no download)
    seed: int = 0


@dataclass
class BenchRow:
    variant: str  # "eager" (unpatched) or IMPL[+fused]
    impl: str | None
    fused: bool
    mode: str
    median_ms: float | None = None
    tokens_per_s: float | None = None
    peak_memory_bytes: int | None = None
    speedup: float | None = None  # the unpatched model's median / this one (same mode)
    method: str | None = None  # cuda-graph | cuda-events | perf_counter
    # writers whose residual add ran inside a norm kernel in one call of the mode, counted (+fused)
    fused_writers: int | None = None
    error: str | None = None  # why this row has no numbers


@dataclass
class BenchResult:
    config: BenchConfig
    device: dict[str, Any]
    versions: dict[str, Any]
    model_info: dict[str, Any]
    rows: list[BenchRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # what the load dropped that cannot change what the model computes (loading.UnusedTensors)
    unused_tensors: list = field(default_factory=list)
    # fixed when the run starts: the results file and the --json document carry the same stamp
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))

    def to_dict(self) -> dict:
        return {"format": FORMAT, "created": self.created,
                "config": asdict(self.config), "device": self.device, "versions": self.versions,
                "model": self.model_info, "notes": self.notes, "rows": [asdict(r) for r in self.rows],
                "unused_tensors": [u.to_dict() for u in self.unused_tensors]}


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int) -> tuple[float, str]:
    """Median seconds of one fn() call, and the method that timed it."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    if device.type == "cuda":
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times), "cuda-events"
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), "perf_counter"


def _cuda_graph(fn: Callable[[], Any], device: torch.device) -> Callable[[], Any] | None:
    """fn captured in a CUDA graph (a replay function), or None where the model does not allow it
    (host syncs, data-dependent allocation): the caller then times fn eagerly."""
    try:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay
    except Exception:  # noqa: BLE001 - any capture failure means: not capturable, time eagerly
        torch.cuda.synchronize(device)
        return None


# ---------------------------------------------------------------------------------------------
# The three workloads
# ---------------------------------------------------------------------------------------------


def _train_step(model, ids):
    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
    return step


def _prefill(model, ids):
    def step():
        with torch.no_grad():
            model(input_ids=ids, use_cache=True)
    return step


def _decode(model, ids):
    """One next-token step after the prompt `ids`. A StaticCache keeps every step's work and
    addresses the same (graph-capturable); its position is reset in place before each step.
    Models whose layers do not take a StaticCache use a DynamicCache cropped back to the prompt."""
    from transformers import DynamicCache, StaticCache

    prompt = ids.shape[1]
    nxt = ids[:, -1:].contiguous()
    name = _cache_argument(model)
    with torch.no_grad():
        try:
            cache = StaticCache(config=model.config, max_cache_len=prompt + 1)
            model(input_ids=ids, **{name: cache}, use_cache=True)
            counters = [layer.cumulative_length for layer in getattr(cache, "layers", [])
                        if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)]
            if not counters:
                raise TypeError("no cache position to reset")
        except Exception:  # noqa: BLE001 - the model's attention layers refuse a static cache
            cache, counters = DynamicCache(config=model.config), None
            model(input_ids=ids, **{name: cache}, use_cache=True)

    def step():
        with torch.no_grad():
            if counters is None:
                cache.crop(prompt)
            else:
                for c in counters:
                    c.fill_(prompt)
            return model(input_ids=nxt, **{name: cache}, use_cache=True).logits
    return step, counters is not None


def _cache_argument(model) -> str:
    """The name the model's forward takes its KV cache under: `cache` since transformers 5.24,
    which still takes `past_key_values` but warns (a FutureWarning on stderr from every bench's
    decode rows) and drops it in 5.40; `past_key_values` before. A compiled model is asked about
    the module it wraps (its own forward takes *args, **kwargs)."""
    from normswap.inputs import forward_params

    # a forward without a signature to read takes the name every version still takes
    return "cache" if "cache" in forward_params(getattr(model, "_orig_mod", model).forward) else "past_key_values"


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------


def _device(name: str | None) -> torch.device:
    """cpu, cuda or cuda:N (None: CUDA when there is one), as every command reads --device: any other
    torch device was taken as is, so meta timed a model that computes nothing and wrote its
    tokens/s, and mps/xpu failed after the config was read with torch's dispatcher listing."""
    from normswap.loading import device_label, parse_device

    return torch.device(device_label(parse_device("auto" if name is None else name)))


def build_model(cfg: BenchConfig, dtype: torch.dtype, device: torch.device, progress: ProgressFn | None = None):
    """The model of cfg.model: its config with random weights (seeded), or its weights."""
    from normswap.loading import load_config, load_model, model_class, resolve

    source = resolve(cfg.model, progress=progress)
    config = load_config(source, progress)
    _check_context(cfg, config, option_labels(CHECKED_OPTIONS))
    cls = model_class(config)
    _check_head(cfg, cls, option_labels(CHECKED_OPTIONS))
    if cfg.load_weights:
        return load_model(source, dtype=dtype, device=str(device), config=config)
    torch.manual_seed(cfg.seed)
    try:
        with torch.device(device):
            model = cls._from_config(config, dtype=dtype)
    except Exception as e:  # noqa: BLE001
        raise NormswapError(f"{cfg.model}: cannot build {cls.__name__} from its config: {e}") from None
    return model.eval()


def _check_head(cfg: BenchConfig, cls, n: Mapping[str, str]) -> None:
    """Refuse train and decode on a model without a language-model head (a bare encoder such as
    BertModel), before it is built: each variant failed inside the timing with "'...Output' object
    has no attribute 'loss'" (or 'logits'), beside a warning of transformers', and the run ended
    as "nothing was measured". Train asks the forward for a loss from labels, which a masked LM
    (BertForMaskedLM, bert-base-uncased's class) gives though it cannot generate: only decode
    needs a model that generates."""
    import inspect

    takes_labels = "labels" in inspect.signature(cls.forward).parameters
    needs = [m for m in cfg.modes if (m == "train" and not (takes_labels or cls.can_generate()))
             or (m == "decode" and not cls.can_generate())]
    if needs:
        what, instead = (("cannot generate", "time it with {} prefill,train") if takes_labels else
                         ("has no language-model head", "time its forward alone with {} prefill"))
        raise NormswapError(f"{cls.__name__} {what}, which {n['modes']} {' and '.join(needs)} "
                            f"need{'s' * (len(needs) == 1)}; {instead.format(n['modes'])}")


def _check_context(cfg: BenchConfig, config, n: Mapping[str, str]) -> None:
    """Refuse a sequence the model has no positions for (learned position tables end there: every
    variant would fail with an IndexError), before the model is built. Decode writes one token
    after the prompt."""
    from normswap.inputs import context_length

    context = context_length(config)
    need = cfg.seq + (1 if "decode" in cfg.modes else 0)
    if context is not None and need > context:
        extra = " plus the decoded token" if need > cfg.seq else ""
        raise NormswapError(f"{n['seq']} {cfg.seq}{extra} does not fit: the model's context is {context} "
                            f"positions; use {n['seq']} {context - (need - cfg.seq)} or less")


def _versions() -> dict[str, Any]:
    import transformers

    import normswap
    from normswap._version import git_commit

    out: dict[str, Any] = {"normswap": normswap.__version__, "torch": torch.__version__,
                           "transformers": transformers.__version__, "python": platform.python_version()}
    with contextlib.suppress(Exception):
        import triton

        out["triton"] = triton.__version__
    for pkg in ("liger_kernel", "quack"):
        with contextlib.suppress(Exception):
            from importlib.metadata import version

            out[pkg] = version(pkg.replace("_", "-") if pkg == "liger_kernel" else "quack-kernels")
    commit = git_commit()
    if commit:
        out["git_commit"] = commit
    return out


def _device_info(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        return {"type": "cuda", "name": torch.cuda.get_device_name(device), "cpu_numbers": False}
    return {"type": device.type, "name": platform.processor() or platform.machine(), "cpu_numbers": True,
            "threads": torch.get_num_threads(),
            "triton": "interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "native"}


def _workload(mode: str, run, ids) -> tuple[Callable[[], Any], bool]:
    """The step that one timed call of `mode` runs, and whether it may be captured in a CUDA graph."""
    if mode == "train":
        return _train_step(run, ids), False
    if mode == "prefill":
        return _prefill(run, ids), False
    return _decode(run, ids)


def _measure(cfg, model, ids, mode, device, pairs: dict[str, str] | None) -> tuple[float, str, int | None, int | None]:
    """(median seconds, timing method, peak memory, fused writers). `pairs` (writer -> norm, from
    patch) are only what *can* fuse: an active dropout between an add and its norm (GPT-2's
    resid_pdrop in training) leaves that add unfused. So the writers whose add really ran inside
    its norm's kernel are counted, on one extra eager call (a compiled graph runs no Python)."""
    from normswap import fuse

    run = model
    if cfg.compile:
        torch._dynamo.reset()  # the patched modules are new code: no graph of another variant applies
        run = torch.compile(model, backend=cfg.compile_backend)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model.train(mode == "train")
    try:
        step, static = _workload(mode, run, ids)
        fused = None
        if pairs is not None:
            # uncompiled, the timed step itself is counted (one more warm-up call, not a second
            # set-up: a decode workload's prefill runs once)
            eager = step if run is model else _workload(mode, model, ids)[0]
            with fuse.counting() as used:
                eager()
            fused = sum(id(model.get_submodule(norm)) in used.norms for norm in pairs.values())
        fn = _cuda_graph(step, device) if device.type == "cuda" and static else None
        seconds, method = time_calls(fn or step, device, cfg.warmup, cfg.repeats)
        method = "cuda-graph" if fn is not None else method
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return seconds, method, peak, fused


# The BenchConfig fields check_config names in its messages, and those a run's messages name too
# (fusion's: a model with no residual writers it knows), as run_bench's option_names renames them.
CHECKED_OPTIONS = ("impls", "modes", "batch", "seq", "warmup", "repeats", "compile_backend")
BENCH_OPTIONS = (*CHECKED_OPTIONS, "fuse_residual")
# Each count's smallest value (seq: the train step's loss needs a next token to predict).
_AT_LEAST = (("batch", 1), ("seq", 2), ("repeats", 1), ("warmup", 0))
# The largest, AT_MOST, with why each is enough: normswap.choices.


def check_config(cfg: BenchConfig) -> None:
    """The checks that need no model: bench_checkpoint runs them before anything is read. The
    messages name impls, modes, batch, seq, warmup, repeats and compile_backend as the entry point
    running them was told to (run_bench's, bench_checkpoint's option_names)."""
    from normswap.backends import BACKENDS
    from normswap.dtypes import RUN_DTYPES
    from normswap.errors import BadInputError, require_bool

    n = option_labels(CHECKED_OPTIONS)
    for name, _least in _AT_LEAST:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int):  # 1.5 reached range() after the model was built
            raise TypeError(f"{n[name]}: expected a whole number (int), got {value!r}")
    for name in ("fuse_residual", "compile", "load_weights"):  # load_weights="no" loaded the weights
        require_bool(option_labels((name,))[name], getattr(cfg, name))
    if not isinstance(cfg.dtype, str):
        # The result records the config as JSON: torch.float32 was timed in full, and then every
        # number was lost to "Object of type dtype is not JSON serializable".
        raise TypeError(f"dtype: expected a name such as {', '.join(map(repr, RUN_DTYPES))}, got {cfg.dtype!r}")
    if not cfg.impls:  # only the unpatched model would be timed: nothing to compare it with
        raise BadInputError(f"{n['impls']} names no implementation; expected one or more of {', '.join(BACKENDS)}")
    if not cfg.modes:
        raise BadInputError(f"{n['modes']} names no workload; expected {', '.join(MODES)}")
    for name in ("impls", "modes"):
        if twice := named_twice(getattr(cfg, name)):  # timed twice, two rows under one name
            raise BadInputError(f"{n[name]}: {', '.join(twice)} named twice")
    bad = [m for m in cfg.modes if m not in MODES]
    if bad:
        raise BadInputError(f"{n['modes']}: unknown mode {bad[0]!r}; expected {', '.join(MODES)}")
    for name, least in _AT_LEAST:
        value = getattr(cfg, name)
        if value < least:
            raise BadInputError(f"{n[name]} {value}: must be at least {least}")
    for name, most in AT_MOST.items():
        value = getattr(cfg, name)
        if value > most:
            raise BadInputError(f"{n[name]} {value}: at most {most:,}; more only lengthens every row")
    _device(cfg.device)
    if cfg.compile:  # an unknown backend left every row 'not measured' and wrote that result, exit 0
        import torch._dynamo

        try:
            torch._dynamo.lookup_backend(cfg.compile_backend)
        except Exception:  # InvalidBackend, or a name of the wrong kind
            known = ", ".join(torch._dynamo.list_backends(exclude_tags=()))
            raise BadInputError(f"{n['compile_backend']} {cfg.compile_backend!r}: not a torch.compile backend here; "
                                f"known: {known}") from None


def run_bench(cfg: BenchConfig, progress: ProgressFn | None = None,
              option_names: Mapping[str, str] | None = None) -> BenchResult:
    """Measure every (variant, mode) of `cfg` (see the module doc). A variant that cannot be
    patched (an impl unavailable here, a failed verification) gets rows with its error.
    option_names: what messages call cfg's fields (check_config's, and fuse_residual), here and in
    everything the run calls (a patch's messages).

    progress("<variant> <mode>", done, total) before each measurement (`done` of the `total`
    measurements finished) and again after it (done + 1), and ("<variant> <mode>", total, total)
    after the last one."""
    with using_option_names(option_labels(BENCH_OPTIONS, option_names)):
        return _run_bench(cfg, progress)


def _run_bench(cfg: BenchConfig, progress: ProgressFn | None) -> BenchResult:
    from normswap.backends import get_backend
    from normswap.loading import parse_dtype, unused_tensors_of
    from normswap.swap import patch, revert

    check_config(cfg)
    n = option_labels(CHECKED_OPTIONS)
    for impl in cfg.impls:
        get_backend(impl)  # an impl that cannot run here fails before the model is built
    dtype = parse_dtype(cfg.dtype)
    device = _device(cfg.device)
    model = build_model(cfg, dtype, device, progress)
    config = model.config
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab < 4:
        raise NormswapError(f"{cfg.model}: bench needs a token model (config.vocab_size)")
    g = torch.Generator().manual_seed(cfg.seed)
    try:
        ids = torch.randint(3, vocab, (cfg.batch, cfg.seq), generator=g).to(device)
    except (RuntimeError, MemoryError, TypeError) as e:  # a size the user chose, not a bug: torch's
        # OutOfMemoryError is a RuntimeError, and a size past int64 fails its argument parsing (TypeError)
        from normswap.errors import one_line

        raise NormswapError(f"{n['batch']} {cfg.batch} x {n['seq']} {cfg.seq}: cannot allocate the token ids "
                            f"({one_line(e)}); use a smaller {n['batch']} or {n['seq']}") from None
    result = BenchResult(cfg, _device_info(device), _versions(), {
        "model_type": getattr(config, "model_type", None), "class": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "weights": "loaded" if cfg.load_weights else "random (from the config)",
    }, unused_tensors=unused_tensors_of(model))
    if device.type != "cuda":
        result.notes.append("CPU numbers: they say nothing about GPU speed"
                            + (" (Triton runs through its interpreter)" if os.environ.get("TRITON_INTERPRET") == "1" else ""))

    variants: list[tuple[str | None, bool]] = [(None, False)]
    for impl in cfg.impls:
        variants.append((impl, False))
        if cfg.fuse_residual:
            variants.append((impl, True))
    baseline: dict[str, float] = {}
    total, done = len(variants) * len(cfg.modes), 0
    for impl, fused in variants:
        name = "eager" if impl is None else impl + ("+fused" if fused else "")
        rows = [BenchRow(name, impl, fused, mode) for mode in cfg.modes]
        pairs = None
        try:
            if impl is not None:
                report = patch(model, impl, fuse_residual=fused)
                pairs = report.fusion.pairs if report.fusion is not None else None
            for row in rows:
                if progress:
                    progress(f"{name} {row.mode}", done, total)
                done += 1
                seconds, row.method, row.peak_memory_bytes, row.fused_writers = _measure(
                    cfg, model, ids, row.mode, device, pairs)
                if progress:  # this measurement done: its stage's bar ends at its own count, not the one before
                    progress(f"{name} {row.mode}", done, total)
                row.median_ms = seconds * 1e3
                tokens = cfg.batch * (1 if row.mode == "decode" else cfg.seq)
                row.tokens_per_s = tokens / seconds
                if pairs is not None and row.fused_writers < len(pairs):
                    result.notes.append(f"{name} {row.mode}: {row.fused_writers} of the {len(pairs)} fused writers had "
                                        "their residual add run inside a norm kernel (the others met an op between "
                                        "the add and its norm, e.g. an active dropout)")
                if impl is None:
                    baseline[row.mode] = seconds
                elif row.mode in baseline:
                    row.speedup = baseline[row.mode] / seconds
        except Exception as e:  # noqa: BLE001 - one variant failing (compile, capture) is a row, not the end
            from normswap.errors import one_line

            why = str(e) if isinstance(e, NormswapError) else f"{e.__class__.__name__}: {one_line(e)}"
            for row in rows:
                if row.median_ms is None:
                    row.error = why
        finally:
            revert(model)
            done = len(result.rows) + len(rows)  # a failed variant's unmeasured rows count as done
        result.rows.extend(rows)
    if progress:
        progress(f"{name} {cfg.modes[-1]}", total, total)
    if all(row.error for row in result.rows):
        # The unpatched model's rows too: nothing was measured (a batch too large to allocate, a model
        # whose forward fails). A table of dashes, its results file written (in place of an earlier
        # result at the same path) and exit 0 read as a finished benchmark.
        first = result.rows[0]
        hint = (f"; use a smaller {n['batch']} or {n['seq']}" if "allocate memory" in first.error
                or "out of memory" in first.error.lower() else "")
        raise NormswapError(f"nothing was measured: {first.variant} {first.mode}: {first.error}{hint}")
    return result


def default_output(result: BenchResult, root: str | os.PathLike = "benchmarks/results") -> Path:
    """benchmarks/results/bench-<model>-<device>-<date>.json, <model> the folder's own name (`bench .`
    inside it, where the name as typed has none, was 'bench-x-...'; letters of any script kept, where
    'my model ü' was 'my-model'), a hub id's last part, a .gguf file's name without the suffix; with
    -2, -3, ... before .json where that name is taken."""
    def slug(s: str) -> str:
        return re.sub(r"[\W_]+", "-", s.lower()).strip("-") or "x"

    # abspath, not resolve: '.' and '..' get their folder's name, but a link keeps the name it was
    # given (a hub cache's model.gguf leads to blobs/<sha256>, which named the file after the hash)
    name = Path(os.path.abspath(Path(result.config.model).expanduser())).name
    model = slug(name[:-len(".gguf")] if name.lower().endswith(".gguf") else name)  # the loader's test
    device = slug(result.device["name"] if result.device["type"] == "cuda" else "cpu")
    stem = Path(root) / f"bench-{model}-{device}-{time.strftime('%Y-%m-%d', time.gmtime())}"
    # A second run the same day (other options, or a/model after b/model) takes the next free name:
    # the default never replaces an earlier result; only an --out the user names does.
    path, n = stem.with_name(stem.name + ".json"), 1
    while os.path.lexists(path):
        n += 1
        path = stem.with_name(f"{stem.name}-{n}.json")
    return path


def check_result_target(path: str | os.PathLike) -> None:
    """Refuse a destination that holds something other than an earlier bench result: --out
    MODEL/config.json (a tab completion away from --out MODEL-bench.json) would replace a model's
    config or weights with the numbers. Asked before anything is measured."""
    path = Path(path)
    if not path.is_file():
        return  # new (a folder, or a missing parent, is fileio.unwritable's to report)
    try:  # a results file is kilobytes; a model's weights are not read to find that out
        fmt = jsonsafe.loads(path.read_bytes()).get("format") if path.stat().st_size < (16 << 20) else None
    except (OSError, ValueError, AttributeError):
        fmt = None
    if not (isinstance(fmt, str) and fmt.startswith(FORMAT.split("/")[0] + "/")):
        raise NormswapError(f"{path} exists and is not a normswap bench result; refusing to replace it "
                            "(write elsewhere)")


def write_result(result: BenchResult, path: str | os.PathLike) -> Path:
    """Write the result as strict JSON, atomically (a temporary file renamed into place)."""
    from normswap.fileio import write_text_atomic
    doc = jsonsafe.finite_or_null(result.to_dict())
    return write_text_atomic(path, json.dumps(doc, indent=2, allow_nan=False) + "\n")


def parse_list(value: str | Sequence[str], name: str = "impls") -> tuple[str, ...]:
    if isinstance(value, str):
        value = value.split(",")
    if not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"{name}: expected names, as \"a,b\" or a list of str, got {value!r}")
    return tuple(v.strip() for v in value if v.strip())
