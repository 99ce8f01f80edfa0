"""The float64 arithmetic of the exact LayerNorm → RMSNorm conversion (normswap.fold)."""

import pytest
import torch

from normswap import fold


def layer_norm64(x: torch.Tensor, gain, shift, eps: float) -> torch.Tensor:
    """float64 LayerNorm over the last dimension, written out (the identities' left-hand side)."""
    mu = x.mean(dim=-1, keepdim=True)
    y = (x - mu) / torch.sqrt((x - mu).pow(2).mean(dim=-1, keepdim=True) + eps)
    return y * (gain if gain is not None else 1.0) + (shift if shift is not None else 0.0)


def rms_norm64(x: torch.Tensor, gain, shift, eps: float) -> torch.Tensor:
    """float64 RMSNorm with an optional bias (the form a kept β takes)."""
    y = x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return y * (gain if gain is not None else 1.0) + (shift if shift is not None else 0.0)


def bake(table, gain, shift, eps):
    """The whole table at once, as normswap.jobs does it a slice at a time: (new rows, s)."""
    s = fold.bake_scale(float(fold.centered_output_ms(table, gain, shift, eps).max()))
    return fold.bake_rows(table, gain, shift, eps, s), s

D = 24


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_center_writer_makes_every_output_zero_mean_in_both_orientations():
    w, b, x = rand(D, 40, seed=1), rand(D, seed=2), rand(7, 40, seed=3)
    wc, bc = fold.center_writer(w, b, fold.LINEAR)
    y = x @ wc.T + bc
    assert y.mean(-1).abs().max() < 1e-13
    assert (x @ w.T + b).mean(-1).abs().max() > 1e-2  # it was not zero-mean before
    # Conv1D stores the transpose and must give the same centered outputs.
    wc1, bc1 = fold.center_writer(w.T.contiguous(), b, fold.CONV1D)
    torch.testing.assert_close(x @ wc1 + bc1, y, rtol=0, atol=1e-13)
    # The centered output differs from the original by a per-row constant only.
    diff = (x @ w.T + b) - y
    assert (diff - diff[:, :1]).abs().max() < 1e-13


def test_center_writer_without_bias():
    w = rand(D, 8)
    wc, bc = fold.center_writer(w, None, fold.LINEAR)
    assert bc is None and wc.mean(0).abs().max() < 1e-15


def test_center_embedding_rows():
    e = rand(50, D)
    ec = fold.center_embedding(e)
    assert ec.mean(-1).abs().max() < 1e-15
    assert (e - ec - (e - ec)[:, :1]).abs().max() < 1e-15


@pytest.mark.parametrize("orientation", [fold.LINEAR, fold.CONV1D])
def test_fold_into_reader_is_exact_with_zero_gains(orientation):
    w, b = rand(16, D, seed=4), rand(16, seed=5)
    gain, shift, u = rand(D, seed=6), rand(D, seed=7), rand(9, D, seed=8)
    gain[3] = 0.0  # never divided by, so a zero gain is fine
    gain[11] = 0.0
    ww = w if orientation == fold.LINEAR else w.T.contiguous()

    def apply(weight, bias, x):
        return (x @ weight.T if orientation == fold.LINEAR else x @ weight) + bias

    ref = apply(ww, b, gain * u + shift)
    wf, bf = fold.fold_into_reader(ww, b, orientation, gain=gain, shift=shift)
    torch.testing.assert_close(apply(wf, bf, u), ref, rtol=0, atol=1e-12)
    # gain only / shift only
    wg, bg = fold.fold_into_reader(ww, b, orientation, gain=gain)
    torch.testing.assert_close(apply(wg, bg, u) , apply(ww, b, gain * u), rtol=0, atol=1e-12)
    ws, bs = fold.fold_into_reader(ww, b, orientation, shift=shift)
    torch.testing.assert_close(apply(ws, bs, u), apply(ww, b, u + shift), rtol=0, atol=1e-12)


def test_fold_shift_into_bias_free_reader_is_refused():
    with pytest.raises(ValueError, match="without a bias"):
        fold.fold_into_reader(rand(8, D), None, fold.LINEAR, gain=rand(D), shift=rand(D))


def test_float32_is_refused():
    with pytest.raises(TypeError, match="float64"):
        fold.center_embedding(torch.randn(3, 4))


def test_layer_norm_of_zero_mean_input_is_rms_norm():
    x = fold.center_embedding(rand(30, D) * 3)
    gain, shift = rand(D, seed=1), rand(D, seed=2)
    torch.testing.assert_close(
        layer_norm64(x, gain, shift, 1e-5), rms_norm64(x, gain, shift, 1e-5), rtol=0, atol=1e-13
    )
    y = rand(30, D) + 1.0  # not zero-mean: the two differ
    assert (layer_norm64(y, gain, shift, 1e-5) - rms_norm64(y, gain, shift, 1e-5)).abs().max() > 0.1


@pytest.mark.parametrize("eps", [1e-5, 1e-12, 0.1])
@pytest.mark.parametrize("scale", [0.05, 5.0])
def test_baked_embedding_norm_reproduces_the_centered_output(eps, scale):
    table = rand(64, D, seed=3) * 2 + 0.5
    table[5] = 0.0  # a zero row too
    gain, shift = rand(D, seed=4) * scale, rand(D, seed=5)
    original = layer_norm64(table, gain, shift, eps)
    want = original - original.mean(-1, keepdim=True)
    new_table, s = bake(table, gain, shift, eps)
    assert s >= 1.0
    assert new_table.mean(-1).abs().max() < 1e-14  # the norm's own input is zero-mean
    # The *stock* LayerNorm with weight s·1, bias 0 now outputs the centered original output.
    got = layer_norm64(new_table, torch.full((D,), s, dtype=torch.float64), torch.zeros(D, dtype=torch.float64), eps)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12 * max(1.0, float(want.abs().max())))
    # ... and so does an RMSNorm (its input is zero-mean).
    got_rms = rms_norm64(new_table, torch.full((D,), s, dtype=torch.float64), None, eps)
    torch.testing.assert_close(got_rms, want, rtol=0, atol=1e-12 * max(1.0, float(want.abs().max())))


def test_bake_needs_positive_eps():
    with pytest.raises(ValueError, match="eps > 0"):
        bake(rand(4, D), rand(D), rand(D), 0.0)


def test_unknown_orientation():
    with pytest.raises(ValueError, match="orientation"):
        fold.center_writer(rand(4, 4), None, "conv2d")
