"""The tensor arithmetic of the exact LayerNorm → RMSNorm conversion, and nothing else.

Pure functions on float64 tensors (callers upcast once and cast back once): no modules, no
checkpoints, no transformers. See docs/ARCHITECTURE.md, "Exact LayerNorm → RMSNorm".

Why it is exact: LN(x + c·1) = LN(x) for any scalar c. If every writer into the residual stream
has its output centered (mean over the hidden dimension removed), the stream is zero-mean, so a
LayerNorm reading it subtracts a mean of zero: LN(x) = x / sqrt(mean(x²) + eps) · γ + β, which is
an RMSNorm with the same eps followed by the affine part. That affine part folds into whatever
linear layer reads the norm: W(γ⊙u + β) + b = (W·diag γ)u + (Wβ + b).

Weight orientation: nn.Linear stores [out, in] and computes x @ Wᵀ; GPT-2's Conv1D stores
[in, out] and computes x @ W. "Output rows" below means the hidden-dimension axis of the output.
"""

from __future__ import annotations

import math

import torch

LINEAR = "linear"  # nn.Linear: weight [out_features, in_features]
CONV1D = "conv1d"  # transformers Conv1D (GPT-2): weight [in_features, out_features]
ORIENTATIONS = (LINEAR, CONV1D)


def _out_axis(orientation: str) -> int:
    if orientation == LINEAR:
        return 0
    if orientation == CONV1D:
        return 1
    raise ValueError(f"unknown weight orientation {orientation!r}; expected one of {ORIENTATIONS}")


def _check_f64(*tensors: torch.Tensor | None) -> None:
    for t in tensors:
        if t is not None and t.dtype != torch.float64:
            raise TypeError(f"fold arithmetic runs in float64; got {t.dtype} (upcast once before calling)")


def center_writer(
    weight: torch.Tensor, bias: torch.Tensor | None, orientation: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Make a linear writer's output zero-mean over the hidden dimension, for every input.

    y = W x + b has mean (mean_rows W) x + mean(b); subtracting the mean output row from every
    row of W and the mean of b from b removes it for all x at once.
    """
    _check_f64(weight, bias)
    axis = _out_axis(orientation)
    w = weight - weight.mean(dim=axis, keepdim=True)
    b = None if bias is None else bias - bias.mean()
    return w, b


def center_embedding(table: torch.Tensor) -> torch.Tensor:
    """Center each row of an embedding table [num_embeddings, hidden] (token, position, type):
    a lookup then writes a zero-mean vector into the stream."""
    _check_f64(table)
    return table - table.mean(dim=-1, keepdim=True)


def fold_into_reader(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    orientation: str,
    gain: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fold a norm's gain γ and/or shift β into a linear layer that reads the norm's output.

    W(γ⊙u + β) + b = (W·diag γ) u + (W β + b). The bias term uses the *original* W (β is added
    before the gain is folded away). γ multiplies, it is never divided by, so γᵢ = 0 is fine.
    A shift needs somewhere to go: folding one into a bias-free reader is an error, the caller
    must keep β in the norm instead.
    """
    _check_f64(weight, bias, gain, shift)
    in_axis = 1 - _out_axis(orientation)
    new_bias = bias
    if shift is not None:
        if bias is None:
            raise ValueError("cannot fold a norm bias into a reader without a bias")
        # Linear: W [out, in] @ β [in]; Conv1D: β [in] @ W [in, out]
        wb = weight @ shift if orientation == LINEAR else shift @ weight
        new_bias = bias + wb
    new_weight = weight
    if gain is not None:
        shape = [1, 1]
        shape[in_axis] = -1
        new_weight = weight * gain.reshape(shape)
    return new_weight, new_bias


# Baking an embedding LayerNorm into its token table (BLOOM's word embeddings + embedding
# LayerNorm), so that the norm's output is zero-mean while the *stock* LayerNorm still computes it.
#
# The norm's output for token t is a fixed vector o_t = γ⊙n_t + β. Its mean (⟨γ, n_t⟩/d plus
# mean β) varies per token unless γ is constant, so γ and β alone cannot be changed to make it
# zero-mean. But because o_t depends on the token alone, the table can be rewritten instead:
# with z_t = o_t - mean(o_t) (removing a per-token constant is invisible to every later
# LayerNorm), choose a gain s·1, bias 0 and new rows E'_t = a_t z_t. A LayerNorm then outputs
# s · a_t z_t / sqrt(a_t² m_t² + eps), with m_t² = mean(z_t²); this equals z_t exactly when
# a_t = sqrt(eps / (s² - m_t²)), which exists for s > m_t. So pick s ≥ 2·max_t m_t (and s = 1
# when that is enough, leaving a plain weightless norm). This needs eps > 0: with eps = 0 the
# norm's output always has RMS s, and tokens whose centered outputs differ in RMS cannot all be
# matched. The new rows are zero-mean, so the embedding norm's own input is zero-mean too.
#
# normswap.jobs runs it a slice of rows at a time: centered_output_ms over every row, bake_scale
# once, then bake_rows; the norm's weight becomes s·1 and its bias 0.


def centered_output_ms(table: torch.Tensor, gain, shift, eps: float) -> torch.Tensor:
    """m_t² = mean(z_t²) per row, z_t the centered output of LayerNorm(γ, β, eps) for row t."""
    return _centered_output(table, gain, shift, eps).pow(2).mean(dim=-1)


def bake_scale(max_ms: float) -> float:
    """The gain s of a baked norm: s ≥ 2·max_t m_t (margin from the pole at s = m_t), s = 1 when
    that is enough (the norm stays a plain weightless one)."""
    return max(1.0, 2.0 * math.sqrt(max_ms))


def bake_rows(table: torch.Tensor, gain, shift, eps: float, s: float) -> torch.Tensor:
    """New rows a_t·z_t for a baked norm with gain s (rows are independent: callers may chunk)."""
    _check_f64(table, gain, shift)
    z = _centered_output(table, gain, shift, eps)
    m2 = z.pow(2).mean(dim=-1, keepdim=True)
    if m2.numel() and float(m2.max()) >= s * s:
        raise ValueError(f"bake scale {s} too small for these rows")
    return torch.sqrt(eps / (s * s - m2)) * z


def _centered_output(table, gain, shift, eps: float) -> torch.Tensor:
    if not eps > 0:
        raise ValueError("baking needs eps > 0 (with eps = 0 every output row has RMS equal to the gain)")
    x = table - table.mean(dim=-1, keepdim=True)
    n = x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    out = n * gain + (shift if shift is not None else 0.0)
    return out - out.mean(dim=-1, keepdim=True)
