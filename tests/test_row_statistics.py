"""A LayerNorm's row statistics as one Pallas kernel (``kernels.row_statistics``,
``$KERAS_MONE_STATISTICS=kernel``): mean and rstd equal a float64 numpy reference and the
plain path, forward and backward, through Pallas' interpreter; one Triton call for a CUDA GPU
without one; the grouped projection kernels' prologues take them in a whole MoNE model."""

import numpy as np
import pytest
from conftest import BACKEND, TINY, assert_f32_close

pytestmark = pytest.mark.skipif(BACKEND != "jax", reason="a Pallas kernel: the jax backend")


def _rows(shape, mean=0.0, std=1.0, seed=0):
    return np.random.default_rng(seed).normal(mean, std, size=shape).astype("float32")


def _reference(x, epsilon):
    wide = np.asarray(x, np.float64)
    mean = wide.mean(-1)
    return mean, 1 / np.sqrt(((wide - mean[..., None]) ** 2).mean(-1) + epsilon)


# (shape, tiles): rows not a multiple of the tile, features not a power of 2 (ViT's 768), one
# row, one feature, rows far from zero (the two-pass variance keeps them), tiny variances
CASES = [((2, 37, 96), None), ((13, 768), (4, 4)), ((1, 48), (8, 2)), ((5, 1), None), ((3, 7, 100), (2, 1))]


@pytest.mark.parametrize("shape, tiles", CASES)
@pytest.mark.parametrize("mean, std", [(0.0, 1.0), (30.0, 1.0), (0.0, 1e-3)])
def test_the_kernel_equals_a_float64_reference(shape, tiles, mean, std):
    """float32 rows: the mean within a few float32 ulps of the largest magnitude, rstd within
    64 ulps relative (sums over at most 768 features in float32; std 1e-3 puts the variance at
    epsilon's size, so a dropped epsilon would fail)."""
    from keras_mone.kernels.row_statistics import row_statistics

    x = _rows(shape, mean, std)
    got_mean, got_rstd = (np.asarray(t) for t in row_statistics(x, 1e-6, tiles=tiles, interpret=True))
    mean_64, rstd_64 = _reference(x, 1e-6)
    assert got_mean.shape == got_rstd.shape == shape[:-1] and got_mean.dtype == np.float32
    np.testing.assert_allclose(got_mean, mean_64, rtol=0, atol=8 * np.spacing(np.float32(abs(mean) + 5 * std)))
    np.testing.assert_allclose(got_rstd, rstd_64, rtol=64 * np.finfo(np.float32).eps)


def test_16_bit_rows_are_read_as_they_are_and_reduced_in_float32():
    import jax.numpy as jnp

    from keras_mone.kernels.row_statistics import plain_row_statistics, row_statistics

    for dtype in (jnp.bfloat16, jnp.float16):
        x = jnp.asarray(_rows((6, 33, 768), mean=2.0), dtype)
        got = row_statistics(x, 1e-6, interpret=True)
        expected = _reference(np.asarray(x.astype(jnp.float32)), 1e-6)
        for g, e, plain in zip(got, expected, plain_row_statistics(x, 1e-6)):
            assert g.dtype == jnp.float32 and plain.dtype == jnp.float32
            np.testing.assert_allclose(np.asarray(g), e, rtol=1e-5, atol=1e-5)


def test_gradients_are_the_plain_paths():
    import jax

    from keras_mone.kernels.row_statistics import plain_row_statistics, row_statistics

    x = _rows((3, 11, 64), mean=1.0, seed=2)
    weights = _rows((2, 3, 11), seed=3)

    def loss(statistics):
        return lambda t: sum((w * s).sum() for w, s in zip(weights, statistics(t, 1e-5)))

    kernel = jax.grad(loss(lambda t, e: row_statistics(t, e, interpret=True)))(x)
    plain = jax.grad(loss(plain_row_statistics))(x)
    assert_f32_close(np.asarray(kernel), np.asarray(plain), ulps=64)


def test_bad_arguments_are_named():
    from keras_mone.kernels.row_statistics import row_statistics

    x = _rows((2, 8, 16))
    with pytest.raises(ValueError, match="`x` must be"):
        row_statistics(x.astype("int32"), 1e-6, interpret=True)
    with pytest.raises(ValueError, match="`tiles` must be"):
        row_statistics(x, 1e-6, tiles=(3, 4), interpret=True)
    with pytest.raises(ValueError, match="`tiles` must be"):
        row_statistics(x, 1e-6, tiles=(8,), interpret=True)
    with pytest.raises(ValueError, match="`epsilon` must be"):
        row_statistics(x, -1.0, interpret=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_lowers_to_one_triton_call_for_a_cuda_gpu(dtype):
    """ViT-B/16's token rows at batch 8 and ViViT-FE-B/16's at batch 1, through Pallas' Triton
    lowering (power-of-2 blocks, supported ops), without a GPU."""
    import jax
    import jax.numpy as jnp

    from keras_mone.kernels.cuda_lowering import TRITON_CALL, lower_for_cuda
    from keras_mone.kernels.row_statistics import row_statistics

    for shape in [(8, 197, 768), (16, 257, 768)]:
        spec = jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
        assert lower_for_cuda(lambda t: row_statistics(t, 1e-6), spec).count(TRITON_CALL) == 1


def test_the_grouped_kernels_prologues_take_them_in_a_mone_model(monkeypatch):
    """MoNE-ViT through the grouped projection kernels with the statistics from the kernel
    (interpreted): logits within float32 rounding of the one-GEMM-per-group form, and every
    LayerNorm prologue's statistics came from ``kernels.row_statistics``."""
    import keras

    from keras_mone import models
    from keras_mone.kernels import row_statistics as kernel
    from keras_mone.layers import platform_forms

    model = models.MoNEViTBackbone(**TINY, capacity=0.3)
    images = np.random.default_rng(5).uniform(-1, 1, (2, 32, 32, 3)).astype("float32")
    expected = keras.ops.convert_to_numpy(model(images))
    calls = []
    original = kernel.row_statistics
    monkeypatch.setattr(kernel, "row_statistics", lambda *a, **k: calls.append(a[0].shape) or original(*a, **k))
    monkeypatch.setenv(platform_forms.PROJECTIONS_ENV, "grouped_kernel")
    monkeypatch.setenv(platform_forms.STATISTICS_ENV, "kernel")
    got = keras.ops.convert_to_numpy(model(images))  # (the kernels interpreted here)
    assert len(calls) == 2 * TINY["depth"]  # both LayerNorms of every block
    assert_f32_close(got, expected, ulps=256)


def test_no_rows_launch_nothing():
    import jax.numpy as jnp

    from keras_mone.kernels.row_statistics import row_statistics

    mean, rstd = row_statistics(jnp.zeros((2, 0, 64), jnp.bfloat16), 1e-6, interpret=True)
    assert mean.shape == rstd.shape == (2, 0) and mean.dtype == jnp.float32
