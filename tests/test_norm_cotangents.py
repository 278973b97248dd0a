"""The LayerNorm prologue's backward pass in the grouped training form (issue 40): the dX kernel
of an in-projection with a LayerNorm prologue sums, per column tile, the two row sums its
statistics' cotangents need (``pallas_projection``'s ``norm_sums``), and
``grouped_gradients.normalized_cotangents`` finishes the vjp from them. Checked against float64
numpy and ``jax.vjp(normalized)`` through Pallas' interpreter; lowered for CUDA without a card,
the training gradient runs the summing kernel and no other."""

import numpy as np
import pytest
from conftest import BACKEND, assert_f32_close, normal32

pytestmark = pytest.mark.skipif(BACKEND != "jax", reason="a Pallas kernel: the jax backend")

LAYOUT = ((5, 16), (0, 32), (3, 8), (7, 48), (2, 64))  # an empty group, a width under block_k
TILES = (16, 16, 16, 4, 2)  # (block_rows, block_cols, block_k, warps, stages): 4 column tiles of D = 64


def _rounded(values, dtype):
    """``values`` rounded to ``dtype`` and back to float32 (the inputs both sides see)."""
    import jax.numpy as jnp

    return np.asarray(jnp.asarray(values, dtype).astype(jnp.float32))


def _nested_dn(dy, w, layout):
    """``dn[:, g, :d] = dy_g @ W[:d]^T`` (an in-projection's dX), float64; zeros past each width."""
    dn, start = np.zeros(dy.shape[:2] + (w.shape[0],)), 0
    for size, width in layout:
        dn[:, start:start + size, :width] = dy[:, start:start + size].astype("float64") @ w[:width].T
        start += size
    return dn


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_dx_kernel_sums_the_layernorms_statistics_cotangents(dtype):
    """Per column tile, ``sum(dn * gamma)`` and ``sum(dn * gamma * (x - mean))`` of the ``dn`` it
    stores: summed over the tiles, float64 numpy's value from that ``dn`` (float32: to float32
    rounding; bf16: the products of bf16 ``dn``, summed in float32); the tiles past a group's
    width sum to zero; ``dn`` itself is the kernel's without the sums, bit for bit."""
    import jax.numpy as jnp

    from keras_mone.kernels.grouped_kernel import pallas_projection

    rng = np.random.default_rng(31)
    dy = _rounded(normal32(rng, 2, 17, 96), dtype)
    w = _rounded(0.2 * normal32(rng, 64, 96), dtype)
    x = _rounded(2.0 + normal32(rng, 2, 17, 64), dtype)
    mean, gamma = x.mean(-1) + 0.01, 1.0 + 0.1 * normal32(rng, 64)
    zeros = np.zeros((64,), "float32")

    def dx(**more):
        return pallas_projection(jnp.asarray(dy, dtype), jnp.asarray(w, dtype), zeros, None, None, None, LAYOUT,
                                 "out", None, 1, TILES, "highest", True, transposed=True, **more)

    dn, sums, centred = dx(norm_sums=(jnp.asarray(x, dtype), mean, gamma))
    assert sums.shape == centred.shape == (4, 2, 17)  # 4 column tiles of 16
    np.testing.assert_array_equal(np.asarray(dn.astype(jnp.float32)), np.asarray(dx().astype(jnp.float32)))
    stored = np.asarray(dn.astype(jnp.float32)).astype("float64")
    expected_sums = (stored * gamma).sum(-1)
    expected_centred = (stored * gamma * (x - mean[..., None])).sum(-1)
    assert_f32_close(np.asarray(sums).sum(0), expected_sums, ulps=64)
    assert_f32_close(np.asarray(centred).sum(0), expected_centred, ulps=256)
    assert_f32_close(np.asarray(centred)[2], (stored * gamma * (x - mean[..., None]))[..., 32:48].sum(-1), ulps=64)
    # the first group's tokens (width 16) have nothing in the tiles past their first
    np.testing.assert_array_equal(np.asarray(sums)[1:, :, :5], 0.0)
    np.testing.assert_array_equal(np.asarray(centred)[1:, :, :5], 0.0)
    if dtype == "float32":  # and dn is the nested product's
        assert_f32_close(stored, _nested_dn(dy, w, LAYOUT), ulps=64)


def test_the_norm_sums_refuse_the_forms_they_do_not_serve_and_shape_an_empty_launch():
    import jax.numpy as jnp

    from keras_mone.kernels.grouped_kernel import pallas_projection

    rng = np.random.default_rng(2)
    dy, w, x = normal32(rng, 2, 17, 96), normal32(rng, 64, 96), normal32(rng, 2, 17, 64)
    mean, gamma, zeros = x.mean(-1), np.ones((64,), "float32"), np.zeros((64,), "float32")

    def launch(side="out", norm_sums=(x, mean, gamma), **more):
        return pallas_projection(dy, w, zeros, None, None, None, LAYOUT, side, None, 1, TILES, "highest", True,
                                 transposed=True, norm_sums=norm_sums, **more)

    for bad in (dict(side="in"), dict(row_sums=True), dict(keep_pre=True), dict(derivative=(np.tanh, dy[..., :64]))):
        with pytest.raises(ValueError, match="`norm_sums` belongs to the dX kernel of an in-projection"):
            launch(**bad)
    for norm_sums in ((x[..., :32], mean, gamma), (x, mean[:, :3], gamma), (x, mean, gamma[:8]), (x, mean)):
        with pytest.raises(ValueError, match=r"`norm_sums` must be \(x, mean, gamma\) of shapes \(2, 17, 64\)"):
            launch(norm_sums=norm_sums)
    assert len(launch(norm_sums=(jnp.asarray(x), mean, gamma))) == 3
    # no tokens at all: no launch, the results shaped as a launch's
    empty = pallas_projection(dy[:, :0], w, zeros, None, None, None, ((0, 16),), "out", None, 1, TILES, "highest",
                              True, transposed=True, norm_sums=(x[:, :0], mean[:, :0], gamma))
    assert [t.shape for t in empty] == [(2, 0, 64), (4, 2, 0), (4, 2, 0)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_cotangents_from_the_row_sums_equal_the_vjp_of_normalized(dtype):
    """``normalized_cotangents`` from exact row sums gives ``jax.vjp(normalized)``'s cotangents of
    ``x``, the statistics and the weights, each in its input's dtype (bf16 ``x``: its cotangent
    rounded alike; the statistics' within float32's rounding of two sums in another order)."""
    import jax
    import jax.numpy as jnp

    from keras_mone.kernels.grouped_gradients import normalized_cotangents
    from keras_mone.kernels.grouped_kernel import normalized

    rng = np.random.default_rng(5)
    x = jnp.asarray(2.0 + normal32(rng, 3, 11, 48), dtype)
    wide = np.asarray(x.astype(jnp.float32))
    mean, rstd = wide.mean(-1), 1.0 / np.sqrt(wide.var(-1) + 1e-6)
    gamma, beta = 1.0 + 0.1 * normal32(rng, 48), 0.1 * normal32(rng, 48)
    dn = jnp.asarray(normal32(rng, 3, 11, 48), dtype)
    _, pullback = jax.vjp(normalized, x, mean, rstd, gamma, beta)
    expected = pullback(dn)
    dn64, gamma64 = np.asarray(dn.astype(jnp.float32)).astype("float64"), gamma.astype("float64")
    sums = (dn64 * gamma64).sum(-1).astype("float32")
    centred = (dn64 * gamma64 * (wide - mean[..., None])).sum(-1).astype("float32")
    got = normalized_cotangents(dn, x, mean, rstd, gamma, beta, sums, centred)
    for value, reference in zip(got, expected):
        assert value.dtype == reference.dtype and value.shape == reference.shape
        value, reference = (np.asarray(jnp.asarray(t).astype(jnp.float32)) for t in (value, reference))
        if reference.ndim == 3 and dtype == "bfloat16":  # x's cotangent: the same float32 value, rounded to bf16
            assert np.abs(value - reference).max() <= 2.0 ** -8 * np.abs(reference).max()
        else:
            assert_f32_close(value, reference, ulps=64)


def test_the_training_gradient_runs_the_summing_dx_kernels():
    """Lowered for CUDA, the gradient of q/k/v with the LayerNorm prologue launches the dX kernel
    that sums the statistics' cotangents (at ViT-B's D = 768, six column tiles of 128,
    ``_normsums6``; here one of 64: a dX kernel takes ``dx_tiles``, not the forward's)."""
    import jax

    from keras_mone.kernels.cuda_lowering import lower_for_cuda
    from keras_mone.kernels.grouped_projection import grouped_projection

    rng = np.random.default_rng(3)
    x, w, b = 2.0 + normal32(rng, 2, 17, 64), 0.2 * normal32(rng, 64, 96), normal32(rng, 96)
    mean, rstd = x.mean(-1), 1.0 / np.sqrt(x.var(-1) + 1e-6)
    gamma, beta = 1.0 + 0.1 * normal32(rng, 64), 0.1 * normal32(rng, 64)

    def loss(x, mean, rstd, gamma, beta):
        q, k, v = grouped_projection(x, w, b, LAYOUT, "in", parts=3, norm=(mean, rstd, gamma, beta), tiles=TILES)
        return (q * k + v).sum()

    text = lower_for_cuda(jax.grad(loss, argnums=range(5)), x, mean, rstd, gamma, beta)
    assert "grouped_out_projection_normsums1_k96_n64" in text


def test_the_roofline_counts_the_norm_sums_reads_and_writes():
    from keras_mone.kernels.grouped_labels import kernel_label, labelled_cost

    groups = ((84, 96), (61, 192), (37, 384), (14, 768))
    dx = kernel_label("out", 2304, 768, 128, groups)
    summed = kernel_label("out", 2304, 768, 128, groups, norm_sums=6)
    assert summed == dx.replace("projection_", "projection_normsums6_")
    rows, nested = 128 * 196, 128 * sum(size * width for size, width in groups)
    # x where dn is written (each group's first d features), the means and gamma, two float32 per row and tile
    assert labelled_cost(summed, 2)[1] == labelled_cost(dx, 2)[1] + 2 * nested + 4 * (rows + 768) + 4 * 2 * 6 * rows
    assert labelled_cost(summed, 2)[0] == labelled_cost(dx, 2)[0]
