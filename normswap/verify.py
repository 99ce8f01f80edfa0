"""Proof, per module, that a replacement computes what the original computed.

Checks for one module (all must hold):
  eps        the replacement's eps is bit-for-bit the original's (0 stays 0, never a default);
  dtype      every adopted parameter keeps its dtype (and is the same tensor object);
  casting    the declared family (kind, casting mode, offset) is the one the registry read from the
             original, and on every probe the output dtype equals the original's: in mixed
             precision the families differ exactly there (Llama promotes to the weight's dtype,
             Gemma casts back to the input's, T5 to a half-precision weight's);
  numeric    on ~65K random probe elements (rows at scales 1e-2, 1, 1e2 and sqrt(eps), where eps
             weighs as much as the data, with per-row offsets; a non-contiguous 3-D view),
             in the model's dtype (plus a smaller mixed-dtype probe), original and replacement are both compared with the float64 value of the
             same formula (normswap.kernels.reference on float64 tensors):
                 E_orig = max|orig(x) - ref(x)|,  E_new = max|new(x) - ref(x)|
             and pass when  E_new <= E_orig + ulp(max|ref(x)|)  for both probes, and on average
             M_new <= MEAN_RATIO * M_orig (M = mean|y - ref|, plus 0.1% of an ulp). The original
             itself must sit within ORIGINAL_ULPS of the reference: otherwise the spec (from which
             the reference is built) does not describe the module and the proof would be empty.

Why max-abs with one ulp at the largest reference magnitude: the quantities being compared are
themselves maxima over the tensor, and a norm's largest absolute error sits at its largest
outputs (the error of a rounded value is relative to that value), so the unit that matches them is
the spacing of the output dtype at max|ref|: ulp(m) = 2**floor(log2 m) * finfo(dtype).eps. A
per-element rule would be wrong in the other direction: where the original happens to land
exactly on the reference, a replacement that rounds to the neighbouring representable value
(a fused multiply-add, a different reduction order) is already 1 ulp away and would fail while
being as accurate as the original overall.

Why the mean as well: one extra rounding (a Gemma norm cast to the input dtype before the
(1 + w) product, as Llama does) costs at most one ulp at the maximum, so the max rule lets it
pass, but it is there on a large share of the elements: the mean error grows by 1.35-1.8x. A faithful
kernel (another reduction order, a fused multiply-add) stays within ~1% of the original's mean.

Overflow: a probe at OVERFLOW_SCALE (|x| ~ 1e30, in the dtypes that hold it), where the
variance or mean square overflows float32, compares the non-finite patterns of the two outputs.
Implementations disagree there by design, and torch itself by device: torch's CPU nn.LayerNorm
gives NaN rows once sum(x^2) overflows, a hand-written fp32 LayerNorm (Cohere's) and every RMSNorm
give the bias or zero, as normswap's kernels do. normswap keeps its kernels' finite output; a
difference in either direction does not fail the module but is recorded as a note naming the
number of rows, shown in the patch table and its JSON, so it is reported, never silent.

Whole model: the logits of the patched model against the original's on one probe batch (a model
without logits: every floating-point output it returns, each by its name), within a dtype-dependent
fraction of each output's own largest magnitude. Each output is judged on its own scale: a ViT's
pooler output (a tanh, at most 1) measured against its last hidden state's scale (which a large
final-norm weight can make hundreds) would let an error hundreds of times its own tolerance pass.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from normswap.errors import BadInputError, NormswapError, one_line, way_out
from normswap.kernels.reference import layer_norm_ref, rms_norm_ref
from normswap.modules import NormswapNorm, default_eps
from normswap.specs import NormSpec

DEFAULT_SCALES = (1e-2, 1.0, 1e2)
# Far past where float32 sums of squares overflow (~1.8e19 per element), representable in fp32
# and bf16 (not fp16: the probe is skipped there).
OVERFLOW_SCALE = 1e30
# How far the original may sit from the spec's float64 value before the spec is deemed not to
# describe it: each family rounds at most twice (Llama: normalised value, then the product), and
# the fp32 statistics add a little; a wrong family is off by hundreds of ulps.
ORIGINAL_ULPS = 8
# How much larger the replacement's mean error may be than the original's (see the module doc):
# faithful kernels measure <= 1.01, one extra rounding 1.35-1.8, a doubled eps 1.7.
MEAN_RATIO = 1.25
# Whole-model tolerance, per compared output: max|Δout| <= rtol * max|out| (the logits; each
# output of a model without logits on its own scale). One-ulp differences in a norm
# propagate through every later layer; these bound that growth with room, and are far below
# what a wrong family (an offset applied twice, a dropped bias) produces. The conversion's
# reload check uses the same gate: its weights are rounded once to the stored dtype.
LOGITS_RTOL = {torch.float32: 1e-4, torch.float64: 1e-10, torch.float16: 2e-2, torch.bfloat16: 5e-2}


@dataclass(frozen=True)
class ProbeConfig:
    scales: tuple[float, ...] = DEFAULT_SCALES
    # Elements per probe. The check compares two maxima; on a small sample each is a noisy
    # estimate of its implementation's worst error (two equally accurate fp32 LayerNorms differ by
    # > 1 ulp in ~1% of 512-element samples), while on ~65K elements both sit at their sup
    # (spread < 0.75 ulp over 100 seeds). Random rows cost little, also in the Triton interpreter.
    elements: int = 1 << 16
    min_rows: int = 16
    seed: int = 0
    batch: int = 2  # whole-model probe batch: batch x seq_len token ids
    seq_len: int = 8


DEFAULT_PROBE = ProbeConfig()  # what patch() uses when not given one


@dataclass
class ModuleCheck:
    path: str
    module_class: str
    impl: str
    eps: float | None  # None: nn.RMSNorm(eps=None), a machine epsilon (modules.default_eps)
    dtype: str  # the probe dtype (the model's dtype)
    param_dtype: str | None
    max_err_original: float = 0.0  # max over probes of |orig - fp64|
    max_err_replacement: float = 0.0  # max over probes of |new - fp64|
    max_diff: float = 0.0  # max |new - orig|
    worst_margin_ulps: float | None = None  # max over probes of (E_new - E_orig) / ulp; pass: <= 1
    original_ulps: float = 0.0  # max over probes of E_orig / ulp; the spec describes it if <= 8
    mean_err_ratio: float | None = None  # max over probes of M_new / M_orig; pass: <= MEAN_RATIO
    passed: bool = True
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # reported differences that do not fail (overflow)

    def fail(self, why: str) -> None:
        self.passed = False
        self.failures.append(why)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class ModelCheck:
    kind: str  # what was compared: "logits", or the names of the outputs ("last_hidden_state, pooler_output")
    dtype: str
    max_abs_diff: float  # of the output nearest its limit (all of them: `outputs`)
    max_abs_value: float  # that output's largest magnitude: its limit is rtol * max_abs_value
    rtol: float
    argmax_agreement: float | None
    passed: bool  # every output within rtol of its own largest magnitude
    # name -> {"max_abs_diff", "max_abs_value", "passed"}: each output judged on its own scale
    outputs: dict[str, dict] = field(default_factory=dict)

    def rel_diff(self, name: str) -> float:
        """One output's max|Δ| / its max|value|: how far into its limit (rtol) it is; a NaN
        difference is past any limit (inf)."""
        o = self.outputs[name]
        d = o["max_abs_diff"]
        return d / max(o["max_abs_value"], 1e-30) if math.isfinite(d) else math.inf

    @property
    def max_rel_diff(self) -> float:
        """The largest rel_diff over the outputs (the conversion reports it)."""
        return max(map(self.rel_diff, self.outputs), default=0.0)

    def to_dict(self) -> dict:
        return asdict(self)


def ulp(magnitude: float, dtype: torch.dtype) -> float:
    """Spacing of `dtype` at `magnitude` (the smallest normal's spacing below the normal range)."""
    fi = torch.finfo(dtype)
    m = max(abs(magnitude), fi.tiny)
    return 2.0 ** math.floor(math.log2(m)) * fi.eps


def _param_dtype(module: nn.Module) -> torch.dtype | None:
    for p in module.parameters(recurse=False):
        return p.dtype
    return None


def _other_dtype(dtype: torch.dtype) -> torch.dtype:
    """The mixed-precision partner for the extra probe: half params see fp32 input, and fp32
    params see bf16 input (autocast-like use)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


def reference64(spec: NormSpec, x: torch.Tensor, weight, bias, eps: float) -> torch.Tensor:
    """The original family's formula evaluated in float64 (roundings vanish; only math is left).
    A per-head norm reduces over the last dimension, its (..., N) parameters broadcast over x's
    matching leading dims; otherwise every dimension of spec.shape is reduced over."""
    k = 1 if spec.per_head else max(len(spec.shape), 1)
    flat = (lambda t: t) if spec.per_head else (lambda t: t.reshape(-1))
    x64 = x.to(torch.float64).reshape(*x.shape[:-k], -1) if k > 1 else x.to(torch.float64)
    w64 = flat(weight.detach().to(torch.float64)) if weight is not None else None
    b64 = flat(bias.detach().to(torch.float64)) if bias is not None else None
    if spec.kind == "rms":
        y = rms_norm_ref(x64, w64, eps, spec.offset, spec.casting)
    else:
        y = layer_norm_ref(x64, w64, b64, eps, spec.offset)
    return y.reshape(x.shape)


def eps_scale(eps: float, dtype: torch.dtype) -> float | None:
    """The input scale at which eps weighs as much as the data: rows with mean square ~ eps.

    At the fixed scales eps is negligible (at 1e-2 an eps of 1e-6 moves a bf16 output by half an
    ulp), so a kernel that doubles eps, or adds it outside the square root, would pass there.
    None when eps is 0 or when such rows would be subnormal in `dtype` (eps cannot matter for
    any input the dtype can hold at full precision, e.g. eps=1e-12 in fp16)."""
    if not eps > 0:
        return None
    scale = math.sqrt(eps)
    return scale if scale >= 16 * torch.finfo(dtype).tiny else None


def probe_scales(cfg: ProbeConfig, eps: float, dtype: torch.dtype) -> tuple[float, ...]:
    """cfg.scales plus the eps scale (see eps_scale), unless one of them is already near it."""
    extra = eps_scale(eps, dtype)
    if extra is None or any(0.5 <= s / extra <= 2 for s in cfg.scales):
        return tuple(cfg.scales)
    return (*cfg.scales, extra)


def probe_input(spec: NormSpec, dtype: torch.dtype, device, cfg: ProbeConfig, scales=None,
                elements: int | None = None, zero_mean: bool = False) -> torch.Tensor:
    """One batch of probe rows, an equal share at each scale: Gaussian rows, each standardised to
    mean 0 and spread 1 before the scale, with a per-row offset (a LayerNorm must remove it), rounded to `dtype` first so that every implementation sees the
    same representable input. A norm treats rows independently, so all scales share one launch
    (the Triton interpreter pays per launch)."""
    g = torch.Generator().manual_seed(cfg.seed)
    scales = cfg.scales if scales is None else scales
    width = math.prod(spec.shape) if spec.shape else 8
    per_scale = max(cfg.min_rows, -(-(elements or cfg.elements) // (width * len(scales))))
    tail = spec.shape or (8,)
    blocks = []
    for scale in scales:
        x = torch.randn((per_scale, *tail), generator=g, dtype=torch.float64)
        if width > 1:
            # Every row spread at the scale: a row of a few Gaussian samples (a width-2 or -3
            # LayerNorm) can land almost flat, and then removing its offset in the dtype cancels
            # (error ~ ulp(offset) / spread), so the original itself sits thousands of ulps from
            # float64 and the proof would blame the spec for the input's conditioning.
            dims = tuple(range(1, x.dim()))
            x = (x - x.mean(dim=dims, keepdim=True)) / x.std(dim=dims, keepdim=True)
        x = x + 0.5 * torch.randn((per_scale,) + (1,) * len(tail), generator=g, dtype=torch.float64)
        if zero_mean:
            x = x - x.mean(dim=tuple(range(1, x.dim())), keepdim=True)
        blocks.append(scale * x)
    return torch.cat(blocks).to(dtype).to(device)


def strided(x: torch.Tensor) -> torch.Tensor:
    """The probe rows as a non-contiguous (2, rows/2, *norm shape) view, the way a model hands a norm
    its activations: leading dimensions, and (after a transpose) rows not evenly strided. A kernel
    that assumes a contiguous 2-D input ("strided inputs giving silently wrong output") fails the
    numeric check instead of passing on tidy probes."""
    n = x.shape[0] - x.shape[0] % 2
    return x[:n].reshape(n // 2, 2, *x.shape[1:]).transpose(0, 1)


@torch.no_grad()
def verify_module(path: str, original: nn.Module, replacement: NormswapNorm, spec: NormSpec,
                  dtype: torch.dtype | None = None, cfg: ProbeConfig = ProbeConfig(),
                  registry_spec: NormSpec | None = None) -> ModuleCheck:
    """Run every check on one (original, replacement) pair; never raises for a failed check."""
    pdtype = _param_dtype(original)
    dtype = dtype or pdtype or torch.float32
    eps_orig = getattr(original, spec.eps_attr) if spec.eps_attr else spec.eps
    eps_orig = None if eps_orig is None else float(eps_orig)  # None: nn.RMSNorm(eps=None), see below
    check = ModuleCheck(path=path, module_class=type(original).__name__, impl=replacement.impl,
                        eps=eps_orig, dtype=str(dtype).removeprefix("torch."),
                        param_dtype=str(pdtype).removeprefix("torch.") if pdtype else None)

    # eps: exactly equal, as the bits of a float (0.0 stays 0.0; no default slipped in).
    # eps None (torch's nn.RMSNorm(eps=None)) means a machine epsilon chosen by the input's dtype
    # on every call (modules.default_eps): the replacement must keep None too.
    eps_new = replacement.norm_eps
    if eps_orig is None or eps_new is None:
        same = eps_orig is None and eps_new is None
    else:
        same = (eps_new == eps_orig and math.copysign(1, eps_new) == math.copysign(1, eps_orig)
                and eps_orig == spec.eps)
    if not same:
        check.fail(f"eps differs: original {eps_orig!r}, spec {spec.eps!r}, replacement {eps_new!r}")

    # dtype / adoption: same Parameter objects, same dtypes.
    for name, p in original.named_parameters(recurse=False):
        q = replacement._parameters.get(name)
        if q is None:
            check.fail(f"parameter {name} not adopted")
        elif q is not p:
            check.fail(f"parameter {name} is a copy, not the original tensor")
        elif q.dtype != p.dtype:
            check.fail(f"parameter {name} dtype {q.dtype} != {p.dtype}")

    # casting: the declared family is the registry's.
    want = registry_spec or spec
    got = replacement.spec
    if (got.kind, got.casting, got.offset) != (want.kind, want.casting, want.offset):
        check.fail(f"family differs: replacement ({got.kind}, {got.casting}, offset {got.offset}) "
                   f"vs original ({want.kind}, {want.casting}, offset {want.offset})")

    weight, bias, device = _materialized_params(original, spec)
    if device.type == "meta":
        check.fail("parameters are on the meta device; nothing to run the probes on")
        return check
    zero_mean = getattr(replacement, "rms_form", None) is not None

    eps_main = default_eps(dtype) if eps_orig is None else eps_orig
    probes = [("main", strided(probe_input(spec, dtype, device, cfg, scales=probe_scales(cfg, eps_main, dtype),
                                           zero_mean=zero_mean))),
              ("mixed", probe_input(spec, _other_dtype(dtype), device, cfg, scales=(1.0,),
                                    elements=cfg.elements // 4, zero_mean=zero_mean))]
    for scale, x in probes:
        try:
            x, y_orig = _run_original(original, x)
        except Exception as e:  # noqa: BLE001 - e.g. nn.LayerNorm refuses mixed dtypes on CPU
            if scale == "mixed":
                continue  # the original does not support this use; nothing to match
            # patch(dtype=...) wider than the weights (fp64 on fp32, fp32 on bf16): nothing to prove in;
            # the dtype is named only when it differs, else the hint would blame it for any other failure
            other = check.param_dtype is not None and str(x.dtype).removeprefix("torch.") != check.param_dtype
            hint = f"; verify in the dtype the model runs in ({check.param_dtype})" if other else ""
            check.fail(f"the original itself raised on {_probe_name(scale, x)} ({e.__class__.__name__}: "
                       f"{one_line(e)}){hint}")
            return check
        try:
            y_new = replacement(x.clone())
        except Exception as e:  # noqa: BLE001 - a replacement that cannot run where the original can
            check.fail(f"replacement raised on {_probe_name(scale, x)}: {e.__class__.__name__}: {e}")
            continue
        eps = default_eps(x.dtype) if eps_orig is None else eps_orig
        _compare(check, spec, scale, x, y_orig, y_new, reference64(spec, x, weight, bias, eps),
                 [t.dtype for t in (weight, bias) if t is not None])
    if torch.finfo(dtype).max > OVERFLOW_SCALE * 1e3:
        x = probe_input(spec, dtype, device, cfg, scales=(OVERFLOW_SCALE,), elements=1,
                        zero_mean=zero_mean)
        x, y_orig = _run_original(original, x)
        try:
            # The probe overflows on purpose: the Triton interpreter's numpy would warn about it
            # in the middle of the user's progress bar.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                y_new = replacement(x.clone())
        except Exception as e:  # noqa: BLE001
            check.fail(f"replacement raised on the overflow probe: {e.__class__.__name__}: {e}")
        else:
            _compare_overflow(check, y_orig, y_new)
    return check


def _compare_overflow(check: ModuleCheck, y_orig: torch.Tensor, y_new: torch.Tensor) -> None:
    """Non-finite patterns on the overflow probe (see the module doc): a new NaN/Inf fails, a
    NaN/Inf of the original that the replacement does not reproduce is noted."""
    fin_o, fin_n = torch.isfinite(y_orig), torch.isfinite(y_new)
    rows = y_orig.reshape(-1, y_orig.shape[-1]).shape[0] if y_orig.dim() else 1
    def rows_where(mask):
        return int(mask.reshape(rows, -1).any(-1).sum()) if y_orig.dim() else int(mask.any())

    if bool((fin_o & ~fin_n).any()):
        check.notes.append(f"overflow: at |x| ~ {OVERFLOW_SCALE:g} the replacement gives NaN/Inf on "
                           f"{rows_where(fin_o & ~fin_n)} of {rows} probe rows where the original stays finite")
    if bool((~fin_o & fin_n).any()):
        check.notes.append(f"overflow: at |x| ~ {OVERFLOW_SCALE:g} the original gives NaN/Inf on "
                           f"{rows_where(~fin_o & fin_n)} of {rows} probe rows where the replacement stays finite")


def _run_original(original: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, original(x)); a norm whose own forward cannot take the strided view (a .view() in it) is
    never handed one by its model either, so it is probed with the same rows made contiguous."""
    try:
        y = original(x)
    except RuntimeError:
        if x.is_contiguous():
            raise
        x = x.contiguous()
        y = original(x)
    return x, y


def _materialized_params(original: nn.Module, spec: NormSpec):
    """(weight, bias, device) with real values, also when accelerate offloads them (the module's
    own tensors are then on the meta device and the values sit in its hook's weights_map)."""
    hook = vars(original).get("_hf_hook")

    def grab():
        w = getattr(original, spec.weight_attr, None) if spec.has_weight else None
        b = getattr(original, spec.bias_attr, None) if spec.has_bias else None
        return (w.detach().clone() if w is not None else None, b.detach().clone() if b is not None else None)

    if hook is not None and getattr(hook, "offload", False):
        from accelerate.utils import align_module_device

        with align_module_device(original):
            w, b = grab()
        return w, b, torch.device(hook.execution_device)
    w, b = grab()
    device = next((t.device for t in (w, b) if t is not None),
                  next((t.device for t in original.buffers(recurse=False)), torch.device("cpu")))
    return w, b, device


def _probe_name(scale, x) -> str:
    return f"mixed {x.dtype} input" if scale == "mixed" else f"{x.dtype} input"


def _compare(check: ModuleCheck, spec, scale, x, y_orig, y_new, ref, param_dtypes=()) -> None:
    name = _probe_name(scale, x)
    if y_new.dtype != y_orig.dtype:
        check.fail(f"casting: output dtype {y_new.dtype} != original {y_orig.dtype} on {name}")
        return
    if y_new.shape != y_orig.shape:
        check.fail(f"output shape {tuple(y_new.shape)} != original {tuple(y_orig.shape)} on {name}")
        return
    o, n, r = y_orig.double(), y_new.double(), ref.to(y_orig.device)
    finite = torch.isfinite(o)
    if not bool(finite.all()):  # compare where the original is finite (an fp16 overflow, say)
        o, n, r = o[finite], n[finite], r[finite]
    if not bool(torch.isfinite(n).all()):
        check.fail(f"non-finite output where the original is finite on {name}")
        return
    if r.numel() == 0:
        return
    e_orig = (o - r).abs().max().item()
    e_new = (n - r).abs().max().item()
    # The unit is the coarsest dtype the computation passes through: a Llama norm with fp32
    # weights fed bf16 returns fp32 holding a bf16-rounded value, judged in bf16 ulps.
    coarse = max((x.dtype, y_orig.dtype, *param_dtypes), key=lambda d: torch.finfo(d).eps)
    unit = ulp(r.abs().max().item(), coarse)
    margin = (e_new - e_orig) / unit
    if scale != "mixed":  # the reported errors are those in the model's own dtype
        check.max_err_original = max(check.max_err_original, e_orig)
        check.max_err_replacement = max(check.max_err_replacement, e_new)
        check.max_diff = max(check.max_diff, (n - o).abs().max().item())
    check.worst_margin_ulps = margin if check.worst_margin_ulps is None else max(check.worst_margin_ulps, margin)
    check.original_ulps = max(check.original_ulps, e_orig / unit)
    if e_orig > ORIGINAL_ULPS * unit and coarse == torch.float64 and \
            e_orig <= ORIGINAL_ULPS * ulp(r.abs().max().item(), torch.float32):
        # Transformers' RMS norms cast their input to float32 (`.to(torch.float32)`), also a float64
        # one: the original is a float32 computation, not the float64 formula every normswap
        # implementation computes on float64 input. Said as such, not as a spec that does not fit.
        way = way_out("dtype", "fp32", "model.float()")  # None: the caller has no such option
        check.fail(f"float64: on {name} the original computes in float32, which normswap's implementations "
                   "(float64 in float64) do not reproduce; run the model in fp32" + (f" ({way})" if way else ""))
    elif e_orig > ORIGINAL_ULPS * unit:
        # The float64 reference is built from the spec; an original that far from it means the
        # spec does not describe the module (a wrong offset, casting or eps), and comparing the
        # replacement with a wrong reference would prove nothing.
        check.fail(f"reference: the original itself is {e_orig / unit:.1f} ulp from the spec's float64 "
                   f"value on {name} (> {ORIGINAL_ULPS}); the spec does not describe this module")
    if e_new > e_orig + unit:
        check.fail(f"numeric: error {e_new:.3g} exceeds the original's {e_orig:.3g} by {margin:.2f} ulp "
                   f"(> 1) on {name}")
    m_orig, m_new = (o - r).abs().mean().item(), (n - r).abs().mean().item()
    ratio = m_new / m_orig if m_orig > 0 else (1.0 if m_new == 0 else math.inf)
    check.mean_err_ratio = ratio if check.mean_err_ratio is None else max(check.mean_err_ratio, ratio)
    if m_new > MEAN_RATIO * m_orig + 1e-3 * unit:  # the ulp term: an original exact almost everywhere
        check.fail(f"numeric: mean error {m_new:.3g} is {ratio:.2f}x the original's {m_orig:.3g} (> {MEAN_RATIO:g}x) "
                   f"on {name}: an extra rounding or another eps")


# -- whole model ------------------------------------------------------------------------------

def check_weights(model: nn.Module, what: str = "the model") -> None:
    """Refuse weights that no numeric proof can be built on, naming the tensor: a NaN or an Inf
    in the input would make both the original and the replacement produce NaN, and the check
    would blame the replacement. Meta tensors (no values at all) are refused the same way."""
    meta, real = [], []
    for path, module in model.named_modules():
        hook = vars(module).get("_hf_hook")
        offloaded = hook is not None and getattr(hook, "offload", False)  # values live in the hook
        for name, p in module.named_parameters(recurse=False):
            full = f"{path}.{name}" if path else name
            (real if not p.is_meta else meta if not offloaded else []).append((full, p))
    if meta:
        raise BadInputError(f"{what} has no weights to verify with: {meta[0][0]} (and {len(meta) - 1} more) is on "
                            "the meta device; load the weights first, or pass verify=False")
    for name, p in real:
        if p.is_floating_point() and not bool(torch.isfinite(p).all()):
            nan, inf = int(torch.isnan(p).sum()), int(torch.isinf(p).sum())
            raise BadInputError(f"{what} is corrupt: {name} holds {nan} NaN and {inf} infinite value(s) "
                                f"(of {p.numel()}); nothing can be verified against it")


def check_reference_output(kind: str, output: torch.Tensor, what: str = "the original model") -> None:
    """The output every later one is compared with must be finite, or the comparison would blame
    whatever comes after (the kernel, the conversion) for the input's own NaN."""
    bad = ~torch.isfinite(output)
    if bool(bad.any()):
        raise BadInputError(f"{what} already gives non-finite {kind} ({int(bad.sum())} of {output.numel()}) on "
                            "the probe batch, with finite weights; nothing can be verified against it")


def probe_batch(model: nn.Module, cfg: ProbeConfig = ProbeConfig()) -> dict[str, torch.Tensor]:
    """The inputs of one forward pass of `model` (real or on the meta device), random, on the CPU:
    token ids above the special ids, below the vocabulary size, no longer than the context; an
    image of the config's size, a spectrogram or a waveform for a vision or audio model (and
    both, ids and image, for a model that pairs them, as CLIP does): what its forward takes, as
    normswap.inputs derives it. The one probe batch of the whole-model checks (patch, save,
    fusion, conversion): the inputs discovery traced the model on, with values."""
    from normswap import inputs

    config = getattr(model, "config", None)
    names = _probe_inputs(model)
    if "input_ids" in names and inputs.vocab_size(config) < 2:
        raise BadInputError("cannot build a probe batch: the model's config has no vocab_size")
    context = inputs.context_length(config)
    seq_len = min(cfg.seq_len, context) if context is not None else cfg.seq_len
    return inputs.build(model, names, batch=cfg.batch, seq_len=seq_len, decoder_len=max(seq_len // 2, 1),
                        generator=torch.Generator().manual_seed(cfg.seed + 1), device="cpu", masks=False)


def _probe_inputs(model: nn.Module) -> tuple[str, ...]:
    """Which inputs the probe feeds: the one set the forward takes, or, where it may take more
    (token ids and an image), the first set a trace of its meta-device twin runs on."""
    from normswap import discover, inputs

    sets = inputs.candidates(model) or [("input_ids",)]
    if len(sets) == 1:
        return sets[0]
    twin = model
    if not all(p.is_meta for p in model.parameters()):
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            twin = type(model)._from_config(model.config)
    return discover.trace(twin, towers=False).fed or sets[-1]


def _input_device(model: nn.Module) -> torch.device:
    try:
        emb = model.get_input_embeddings()
        return emb.weight.device if emb.weight.device.type != "meta" else torch.device("cpu")
    except Exception:  # noqa: BLE001
        return next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))


@torch.no_grad()
def named_outputs(model: nn.Module, batch: dict, *, raw: bool = False) -> dict[str, torch.Tensor]:
    """What every whole-model check compares, from one forward pass: {"logits": tensor} when the
    model has a head, else every floating-point output it returns, by name in the model's order
    ({"last_hidden_state": ..., "pooler_output": ...} for a ViTModel; CLIP, with neither:
    image-text logits, embeddings, each tower's states as "text_model_output.last_hidden_state").
    Every output: the conversion changes weights that any output may read (a ViT's pooler reads
    its final norm), and so may a patched norm. `batch` holds the forward's keyword arguments
    (tensors are moved to the model's input device). A tuple or list (a layer-by-layer
    hidden_states) is one output, its tensors flattened into one; a nested ModelOutput or dict is
    named field by field.

    The tensors come back as float32 on the CPU (comparable across devices and dtypes), or with
    raw=True as the model produced them (their dtype and device: scoring and float64 checks).
    Runs in eval mode (dropout would make two runs differ) and restores every module's own
    training flag afterwards: a model being fine-tuned stays in train mode."""
    device = _input_device(model)
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        dtype = model_dtype(model)  # an image or a waveform in the weights' dtype (float64 checks)
        out = model(**{k: v.to(device, dtype) if isinstance(v, torch.Tensor) and v.is_floating_point()
                       else v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()})
    finally:
        for m, training in flags:
            m.training = training
    logits = getattr(out, "logits", None)
    found = {"logits": logits} if isinstance(logits, torch.Tensor) else _floating_outputs(out)
    if not found:
        raise NormswapError(f"{type(model).__name__} returned neither logits nor any floating-point output")
    return {name: t.detach() if raw else t.detach().float().cpu() for name, t in found.items()}


def _floating_outputs(out, prefix: str = "") -> dict[str, torch.Tensor]:
    """The floating-point tensors of a forward's output by name (see named_outputs): the fields of
    a ModelOutput or dict (nested ones as "outer.inner"), the items of a tuple the forward returns
    as "0", "1", ...; any other nest (a tuple inside a field, a cache's tensors) flattened into one."""
    from normswap.discover import tensors_in

    if isinstance(out, dict) or hasattr(out, "to_tuple"):
        items = out.items() if isinstance(out, dict) else enumerate(out.to_tuple())
    elif isinstance(out, (list, tuple)) and not prefix:
        items = enumerate(out)
    else:
        floats = [t.reshape(-1) if not isinstance(out, torch.Tensor) else t
                  for t in tensors_in(out) if t.is_floating_point()]
        if not floats:
            return {}
        return {prefix or "output": floats[0] if isinstance(out, torch.Tensor)
                else torch.cat([f.to(floats[0].dtype) for f in floats])}
    found: dict[str, torch.Tensor] = {}
    for name, value in items:
        for key, t in _floating_outputs(value, f"{prefix}.{name}" if prefix else str(name)).items():
            # a field whose name holds a dot ("a.b" beside a nested "a" with a "b") must not
            # replace the other one: an output dropped here would never be compared
            while key in found:
                key += "'"
            found[key] = t
    return found


def model_output(model: nn.Module, batch: dict, *, raw: bool = False) -> tuple[str, torch.Tensor]:
    """named_outputs as one (kind, tensor): the kind names the outputs ("logits", or
    "last_hidden_state, pooler_output"), the tensor is the one output as the model shaped it, or
    several flattened into one (for checks bit for bit, and for scoring, which needs the logits)."""
    found = named_outputs(model, batch, raw=raw)
    if len(found) == 1:
        [(kind, t)] = found.items()
        return kind, t
    parts = [t.reshape(-1) for t in found.values()]
    return ", ".join(found), torch.cat([p.to(parts[0].dtype) for p in parts])


def logits_rtol(dtype: torch.dtype) -> float:
    """The whole-model tolerance of `dtype` (LOGITS_RTOL; float32's for any other dtype)."""
    return LOGITS_RTOL.get(dtype, LOGITS_RTOL[torch.float32])


def compare_outputs(dtype: torch.dtype, before: dict[str, torch.Tensor], after: dict[str, torch.Tensor],
                    rtol: float | None = None) -> ModelCheck:
    """Compare named_outputs of two runs, each output on its own scale: it passes when
    max|after - before| <= rtol * max|before| (rtol: logits_rtol(dtype) unless given). The
    ModelCheck's top-level numbers are those of the output nearest its limit."""
    rtol = logits_rtol(dtype) if rtol is None else rtol
    if list(after) != list(before):
        raise NormswapError(f"the outputs differ: {', '.join(before)} before, {', '.join(after)} after")
    outputs = {}
    for name, b in before.items():
        a = after[name]
        if a.shape != b.shape:
            raise NormswapError(f"{name}: shape {tuple(a.shape)} after, {tuple(b.shape)} before")
        diff = (a.double() - b.double()).abs().max().item() if b.numel() else 0.0
        scale = b.abs().max().item() if b.numel() else 0.0
        outputs[name] = {"max_abs_diff": diff, "max_abs_value": scale,
                         "passed": bool(math.isfinite(diff) and diff <= rtol * max(scale, 1e-30))}
    agree = None
    if "logits" in before and before["logits"].numel():
        agree = (after["logits"].argmax(-1) == before["logits"].argmax(-1)).float().mean().item()
    check = ModelCheck(", ".join(before), str(dtype).removeprefix("torch."), 0.0, 0.0, rtol, agree,
                       all(o["passed"] for o in outputs.values()), outputs)
    if outputs:
        worst = outputs[max(outputs, key=check.rel_diff)]
        check.max_abs_diff, check.max_abs_value = worst["max_abs_diff"], worst["max_abs_value"]
    return check


def describe_model_check(mc: dict, failed: bool = False) -> str:
    """Each compared output's largest difference and its limit (rtol x its own largest magnitude),
    from a ModelCheck's dict: what the patch table prints; failed=True: the outputs over their
    limit alone, what a failure says."""
    return ", ".join(f"max |Δ{name}| {o['max_abs_diff']:.3g} (limit {mc['rtol']:g} x {o['max_abs_value']:.3g})"
                     for name, o in mc["outputs"].items() if not (failed and o["passed"]))


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype most of the model's floating-point weights have."""
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.get) if counts else torch.float32

