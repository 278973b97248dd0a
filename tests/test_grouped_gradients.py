"""The grouped nested projections' backward pass as grouped kernels (issue 40: the training
step): the dX kernels' epilogues (the GELU's derivative, a gated fc2's gate's gradient, the
contraction read in parts) against float64 numpy through Pallas' interpreter; the training
form's projections (LayerNorm prologue, residual and row sums, MoNE's gate, fc1 keeping its
pre-activations) differentiate through the grouped kernels to the plain path's gradients; a
MoNE model's training-call gradients equal the per-group form's; the on-card check of a
grouped training block. The weight-gradient kernel's own tests: ``test_weight_gradient_kernel``;
the LayerNorm's statistics' cotangents: ``test_norm_cotangents``."""

import keras
import numpy as np
import pytest
from conftest import BACKEND, TINY, assert_f32_close, gradients, images, normal32, randomize_weights

pytestmark = pytest.mark.skipif(BACKEND != "jax", reason="a Pallas kernel: the jax backend")

def _weight_gradient_sides(monkeypatch):
    """The ``side`` of every weight-gradient launch from here on (the grouped backward pass ran,
    not the per-group recompute)."""
    from keras_mone.kernels import grouped_gradients

    calls, original = [], grouped_gradients.grouped_weight_gradient
    monkeypatch.setattr(grouped_gradients, "grouped_weight_gradient",
                        lambda *a, **k: calls.append(a[3]) or original(*a, **k))
    return calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("gated", [True, False])
def test_the_dx_kernel_of_a_gated_fc2_sums_the_gates_gradient_in_its_epilogue(dtype, gated):
    """``pallas_projection``'s ``products`` with a ``scale`` on side "in" (the dX kernel of a gated
    fc2): ``d pre = factor * gelu'(pre) * (dy W^T)``, per column tile ``sum(gelu(pre) * (dy W^T))``
    and in one more row ``dy . b`` over each group's first ``d`` columns (an empty group, a width
    under ``block_k``): all sum to the float64 numpy value of the gate's gradient. In bf16 rows
    ``b`` enters as two bf16 parts: ``dy . b`` to about 16 bits, not bf16's 8. The forms it does not
    serve are refused."""
    import jax
    import jax.numpy as jnp

    from keras_mone.kernels.grouped_kernel import pallas_projection
    from keras_mone.layers.mlp import _kernel_gelu

    gelu, rng = _kernel_gelu(False), np.random.default_rng(22)
    layout = ((5, 16), (0, 32), (3, 8), (7, 48), (2, 64))
    dy, pre = (np.asarray(jnp.asarray(t, dtype).astype(jnp.float32)) for t in (normal32(rng, 2, 17, 64),
                                                                              normal32(rng, 2, 17, 96)))
    w = np.asarray(jnp.asarray(0.2 * normal32(rng, 96, 64), dtype).astype(jnp.float32))
    zeros, b = np.zeros((96,), "float32"), 1.0 + normal32(rng, 64)  # (b's values not bf16's)
    gate, alpha = rng.random((2, 17)).astype("float32"), np.float32(0.7)
    scale = (gate, alpha) if gated else gate
    dx, partials = pallas_projection(jnp.asarray(dy, dtype), jnp.asarray(w, dtype), zeros, None, scale, None, layout,
                                     "in", None, 1, (16, 32, 16, 4, 2), "highest", True, transposed=True,
                                     derivative=(gelu, jnp.asarray(pre, dtype)), products=b)
    assert partials.shape == (4, 2, 17)  # 3 column tiles and x . b
    nested, bias, start = np.zeros((2, 17, 96)), np.zeros((2, 17)), 0  # dy_g[:, :d] @ W[:, :d]^T, float64
    for size, width in layout:
        nested[:, start:start + size] = dy[:, start:start + size, :width].astype("float64") @ w[:, :width].T
        bias[:, start:start + size] = dy[:, start:start + size, :width].astype("float64") @ b[:width]
        start += size
    value, slope = (np.asarray(t, "float64") for t in jax.jvp(gelu, (pre,), (np.ones_like(pre),)))
    partials, factor = np.asarray(partials), (alpha * gate + 1.0 if gated else gate)[..., None]
    if dtype == "float32":
        assert_f32_close(partials.sum(axis=0), (value * nested).sum(-1) + bias, ulps=64)
        assert_f32_close(partials[1], (value[..., 32:64] * nested[..., 32:64]).sum(-1), ulps=64)
        assert_f32_close(partials[3], bias, ulps=64)
        assert_f32_close(np.asarray(dx), factor * slope * nested, ulps=64)
    else:  # products of bf16 values, summed in float32: float32's rounding; the GELU's, d pre's: bf16's
        assert np.abs(partials[3] - bias).max() <= 1e-4 * np.abs(bias).max()
        products = (value * nested).sum(-1) + bias
        assert np.abs(partials.sum(axis=0) - products).max() <= 2.0 ** -8 * np.abs(products).max()
        got = np.asarray(jnp.asarray(dx).astype(jnp.float32))
        assert np.abs(got - factor * slope * nested).max() <= 2.0 ** -7 * np.abs(factor * slope * nested).max()
    for options in (dict(products=b), dict(products=b, derivative=(gelu, pre), norm=(gate, gate, zeros, zeros))):
        arguments = dict(dict(derivative=None, norm=None), **options)
        with pytest.raises(ValueError, match="`products` and a `scale` on side 'in' belong to a dX kernel"):
            pallas_projection(dy, w, zeros, None, gate, arguments.pop("norm"), layout, "in", None, 1,
                              (16, 32, 16, 4, 2), "highest", True, transposed=True, **arguments)
    with pytest.raises(ValueError, match="`products` and a `scale` on side 'in' belong to a dX kernel"):
        pallas_projection(dy, w, zeros, dy, None, None, layout, "in", None, 1, (16, 32, 16, 4, 2), "highest", True,
                          transposed=True, derivative=(gelu, pre), products=b)  # (a residual)


def test_the_dx_kernel_reads_its_contraction_in_parts():
    """dX of q/k/v: an out-projection whose input comes in three parts along the contraction
    equals it on the joined input, bit for bit; parts are refused where they do not apply."""
    from keras_mone.kernels.grouped_kernel import pallas_projection

    rng = np.random.default_rng(8)
    layout = ((5, 16), (7, 48), (2, 64))
    parts, w, b = tuple(normal32(rng, 2, 14, 32) for _ in range(3)), normal32(rng, 96, 64), normal32(rng, 64)
    tiles = (16, 16, 16, 4, 2)

    def run(x, side="out"):
        return np.asarray(pallas_projection(x, w, b, None, None, None, layout, side, None, 1, tiles, "default", True))

    np.testing.assert_array_equal(run(parts), run(np.concatenate(parts, axis=-1)))
    with pytest.raises(ValueError, match="`x` in parts needs side 'out'"):
        run(parts, side="in")


@pytest.mark.parametrize("approximate", [False, True])
def test_an_out_projection_of_an_activation_takes_its_derivative_in_the_dx_kernel(approximate):
    """fc2 of the training form (``input_activation``): the output and the gradients of the
    pre-activations, weights and bias equal the plain path's (autodiff through the GELU), and
    the dX kernel carries the derivative in its epilogue (its compiled name)."""
    import jax

    from keras_mone.kernels.cuda_lowering import lower_for_cuda
    from keras_mone.kernels.grouped_projection import grouped_projection, plain_grouped_projection
    from keras_mone.layers.mlp import _kernel_gelu

    gelu = _kernel_gelu(approximate)
    rng = np.random.default_rng(6)
    layout = ((5, 16), (0, 32), (7, 48), (2, 64))
    hidden, w, b = 2.0 * normal32(rng, 2, 14, 96), 0.2 * normal32(rng, 96, 64), normal32(rng, 64)
    weights = normal32(rng, 2, 14, 64)

    def loss(function, **options):
        return lambda h, w, b: (function(h, w, b, layout, "out", input_activation=gelu, **options) * weights).sum()

    kernel_loss = loss(grouped_projection, tiles=(16, 32, 16, 4, 2), interpret=True)
    assert_f32_close(np.asarray(kernel_loss(hidden, w, b)), np.asarray(loss(plain_grouped_projection)(hidden, w, b)),
                     ulps=64)
    got = jax.grad(kernel_loss, argnums=(0, 1, 2))(hidden, w, b)
    expected = jax.grad(loss(plain_grouped_projection), argnums=(0, 1, 2))(hidden, w, b)
    for got_one, expected_one in zip(got, expected):
        assert_f32_close(np.asarray(got_one), np.asarray(expected_one), ulps=64)
    on_the_card = jax.grad(loss(grouped_projection, tiles=(16, 32, 16, 4, 2)), argnums=(0, 1, 2))
    text = lower_for_cuda(on_the_card, hidden, w, b)
    assert "grouped_in_projection_derivative_k64_n96" in text and "weight_gradient_bias" in text
    with pytest.raises(ValueError, match="`input_activation` belongs to side 'out'"):
        grouped_projection(hidden, w, b, layout, "in", input_activation=gelu, interpret=True)


@pytest.mark.parametrize("approximate", [False, True])
def test_fc1_keeping_its_pre_activations_feeds_fc2_with_the_plain_mlps_values_and_gradients(approximate):
    """The training form's MLP: fc1's epilogue stores its pre-activations and their GELU
    (``keep_pre_activation``, one launch, no pass of XLA's between the kernels), fc2 reads the
    GELU's output (``activated``). Both outputs are bit for bit those of fc1 without and with
    its activation epilogue; the MLP's value and gradients (LayerNorm prologue included) equal
    the plain path's; the activated output carries no gradient of its own."""
    import jax

    from keras_mone.kernels.cuda_lowering import lower_for_cuda
    from keras_mone.kernels.grouped_projection import grouped_projection, plain_grouped_projection
    from keras_mone.layers.mlp import _kernel_gelu

    gelu = _kernel_gelu(approximate)
    rng = np.random.default_rng(8)
    layout = ((5, 16), (0, 32), (7, 48), (2, 64))
    x, weights = normal32(rng, 2, 14, 64), normal32(rng, 2, 14, 64)
    w1, b1, w2, b2 = 0.2 * normal32(rng, 64, 96), normal32(rng, 96), 0.2 * normal32(rng, 96, 64), normal32(rng, 64)
    mean, rstd = x.mean(-1), 1.0 / np.sqrt(x.var(-1) + 1e-6)
    gamma, beta = 1.0 + 0.1 * normal32(rng, 64), 0.1 * normal32(rng, 64)
    options = {"tiles": (16, 32, 16, 4, 2), "interpret": True}

    def fc1(function, x, w1, b1, gamma, beta, **more):
        return function(x, w1, b1, layout, "in", norm=(mean, rstd, gamma, beta), **more)

    pre, activated = fc1(grouped_projection, x, w1, b1, gamma, beta, activation=gelu, keep_pre_activation=True,
                         **options)
    np.testing.assert_array_equal(np.asarray(pre), np.asarray(fc1(grouped_projection, x, w1, b1, gamma, beta,
                                                                  **options)))
    np.testing.assert_array_equal(np.asarray(activated), np.asarray(fc1(grouped_projection, x, w1, b1, gamma, beta,
                                                                        activation=gelu, **options)))

    def kept(x, w1, b1, w2, b2, gamma, beta):
        pre, activated = fc1(grouped_projection, x, w1, b1, gamma, beta, activation=gelu, keep_pre_activation=True,
                             **options)
        out = grouped_projection(pre, w2, b2, layout, "out", input_activation=gelu, activated=activated, **options)
        return (out * weights).sum()

    def plain(x, w1, b1, w2, b2, gamma, beta):
        pre = fc1(plain_grouped_projection, x, w1, b1, gamma, beta)
        return (plain_grouped_projection(pre, w2, b2, layout, "out", input_activation=gelu) * weights).sum()

    def plain_kept(x, w1, b1, w2, b2, gamma, beta):  # the plain path in the kept form: the same gradients
        pre, activated = fc1(plain_grouped_projection, x, w1, b1, gamma, beta, activation=gelu,
                             keep_pre_activation=True)
        out = plain_grouped_projection(pre, w2, b2, layout, "out", input_activation=gelu, activated=activated)
        return (out * weights).sum()

    arguments, positions = (x, w1, b1, w2, b2, gamma, beta), tuple(range(7))
    assert_f32_close(np.asarray(kept(*arguments)), np.asarray(plain(*arguments)), ulps=64)
    expected_gradients = jax.grad(plain, positions)(*arguments)
    for function in (kept, plain_kept):
        for got, expected in zip(jax.grad(function, positions)(*arguments), expected_gradients):
            assert np.abs(np.asarray(expected)).max() > 0
            assert_f32_close(np.asarray(got), np.asarray(expected), ulps=256)
    only_activated = jax.grad(lambda x: fc1(grouped_projection, x, w1, b1, gamma, beta, activation=gelu,
                                            keep_pre_activation=True, **options)[1].sum())(x)
    np.testing.assert_array_equal(np.asarray(only_activated), 0.0)
    text = lower_for_cuda(jax.grad(lambda *a: kept(*a), positions[:3]), *arguments)
    assert "grouped_in_projection_norm_pre_k64_n96" in text  # one launch stores both
    for bad, message in (({"keep_pre_activation": True}, "`keep_pre_activation` belongs to side 'in' with an"),
                         ({"keep_pre_activation": True, "activation": gelu, "parts": 3}, "one part"),
                         ({"activated": x}, "`activated` must be `input_activation\\(x\\)`")):
        with pytest.raises(ValueError, match=message):
            grouped_projection(x, w1, b1, layout, "in", **bad, interpret=True)
    with pytest.raises(ValueError, match="`activated` must be"):
        grouped_projection(pre, w2, b2, layout, "out", input_activation=gelu, activated=activated[:, :3],
                           interpret=True)


def test_projections_without_an_epilogue_differentiate_through_the_grouped_kernels(monkeypatch):
    """The training form's projections (the LayerNorm prologue, q/k/v parts, both sides, no
    epilogue): gradients of every input equal the plain path's, and the backward pass runs
    the weight-gradient kernel (not the per-group recompute)."""
    import jax

    from keras_mone.kernels.grouped_projection import grouped_projection, plain_grouped_projection

    calls = _weight_gradient_sides(monkeypatch)
    rng = np.random.default_rng(3)
    layout = ((5, 16), (0, 32), (7, 48), (2, 64))
    x = 2.0 + normal32(rng, 2, 14, 64)
    w1, b1 = 0.2 * normal32(rng, 64, 96), normal32(rng, 96)
    w2, b2 = 0.2 * normal32(rng, 32, 64), normal32(rng, 64)
    mean, rstd = x.mean(-1), 1.0 / np.sqrt(x.var(-1) + 1e-6)
    gamma, beta = 1.0 + 0.1 * normal32(rng, 64), 0.1 * normal32(rng, 64)
    weights = normal32(rng, 2, 14, 64)

    def loss(function, **options):
        def value(x, w1, b1, w2, b2, mean, rstd, gamma, beta):
            q, k, v = function(x, w1, b1, layout, "in", parts=3, norm=(mean, rstd, gamma, beta), **options)
            out = function(q * k + v, w2, b2, layout, "out", **options)
            return (out * weights).sum()
        return value

    arguments = (x, w1, b1, w2, b2, mean, rstd, gamma, beta)
    wrt = range(len(arguments))
    kernel = jax.grad(loss(grouped_projection, tiles=(16, 32, 16, 4, 2), interpret=True), argnums=wrt)(*arguments)
    plain = jax.grad(loss(plain_grouped_projection), argnums=wrt)(*arguments)
    assert sorted(calls) == ["in", "out"]
    for got, expected in zip(kernel, plain):
        assert_f32_close(np.asarray(got), np.asarray(expected), ulps=64)


def _statistics(sums, function):
    """``sums.statistics()``; for the plain path without ``rows``, so that its gradient is autodiff
    of its sums (of the output), independent of the kernel's (through ``RowSums.rows``)."""
    from keras_mone.kernels.grouped_projection import plain_grouped_projection

    return (sums.with_rows(None) if function is plain_grouped_projection else sums).statistics()


def test_an_out_projection_with_a_residual_and_row_sums_differentiates_through_the_grouped_kernels(monkeypatch):
    """The attention's out-projection of a training call (its residual add and, one-pass, the
    second LayerNorm's row sums in the kernel): gradients of x, W, b and the residual equal the
    plain path's (its statistics' by autodiff of its sums), the statistics' gradient reaching the
    output through the rows, and the backward pass runs the weight-gradient kernel, not the
    per-group recompute."""
    import jax

    from keras_mone.kernels.grouped_projection import grouped_projection, plain_grouped_projection

    calls = _weight_gradient_sides(monkeypatch)
    rng = np.random.default_rng(9)
    layout = ((5, 16), (0, 32), (7, 48), (2, 64))
    x, residual = normal32(rng, 2, 14, 64), 1.0 + normal32(rng, 2, 14, 64)
    w, b = 0.2 * normal32(rng, 64, 64), normal32(rng, 64)
    weights, mean_weights, rstd_weights = normal32(rng, 2, 14, 64), normal32(rng, 2, 14), normal32(rng, 2, 14)

    def loss(function, **options):
        def value(x, w, b, residual):
            out, sums = function(x, w, b, layout, "out", residual=residual, statistics_epsilon=1e-6, **options)
            mean, rstd = _statistics(sums, function)
            return (out * weights).sum() + (mean * mean_weights).sum() + (rstd * rstd_weights).sum()
        return value

    arguments = (x, w, b, residual)
    wrt = range(len(arguments))
    kernel = jax.grad(loss(grouped_projection, tiles=(16, 32, 16, 4, 2), interpret=True), argnums=wrt)(*arguments)
    plain = jax.grad(loss(plain_grouped_projection, statistics_tiles=2), argnums=wrt)(*arguments)
    assert calls == ["out"]
    for got, expected in zip(kernel, plain):
        assert_f32_close(np.asarray(got), np.asarray(expected), ulps=64)
    # the statistics' share is no zero: without it x's gradient differs
    bare = jax.grad(lambda x: (grouped_projection(x, w, b, layout, "out", residual=residual, tiles=(16, 32, 16, 4, 2),
                                                  interpret=True) * weights).sum())(x)
    assert np.abs(np.asarray(bare) - np.asarray(kernel[0])).max() > 1e-3 * np.abs(np.asarray(bare)).max()


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("activation", [True, False])
def test_a_gated_out_projection_differentiates_through_the_grouped_kernels(monkeypatch, gated, activation):
    """fc2 of a training call: ``residual + (alpha g + 1) * projection`` (or a plain factor per
    row) with row sums, in the kernel. Gradients of x (through the GELU's derivative), the weights,
    the residual, the gate and alpha (or the factor) equal the plain path's, and the weight-gradient
    kernel runs. Of the GELU's output (fc2), the gate's gradient comes from the dX kernel's
    epilogue and the forward pass keeps no projection; without an activation, from the projection
    the forward pass kept."""
    import jax

    from keras_mone.kernels.grouped_projection import grouped_projection, plain_grouped_projection
    from keras_mone.layers.mlp import _kernel_gelu

    calls = _weight_gradient_sides(monkeypatch)
    rng = np.random.default_rng(12)
    layout, gelu = ((5, 16), (0, 32), (7, 48), (2, 64)), _kernel_gelu(False) if activation else None
    x, residual = normal32(rng, 2, 14, 96), 1.0 + normal32(rng, 2, 14, 64)
    w, b = 0.2 * normal32(rng, 96, 64), normal32(rng, 64)
    gate, alpha = rng.random((2, 14)).astype("float32"), np.float32(0.7)
    weights, mean_weights = normal32(rng, 2, 14, 64), normal32(rng, 2, 14)

    def loss(function, **options):
        def value(x, w, b, residual, gate, alpha):
            scale = (gate, alpha) if gated else gate
            out, sums = function(x, w, b, layout, "out", residual=residual, scale=scale, input_activation=gelu,
                                 statistics_epsilon=1e-6, **options)
            return (out * weights).sum() + (_statistics(sums, function)[0] * mean_weights).sum()
        return value

    arguments = (x, w, b, residual, gate, alpha)
    wrt = range(len(arguments))
    kernel = jax.grad(loss(grouped_projection, tiles=(16, 32, 16, 4, 2), interpret=True), argnums=wrt)(*arguments)
    plain = jax.grad(loss(plain_grouped_projection, statistics_tiles=2), argnums=wrt)(*arguments)
    assert calls == ["out"]
    for index, (got, expected) in enumerate(zip(kernel, plain)):
        if gated or index < 5:  # (alpha takes no part in a plain factor)
            assert_f32_close(np.asarray(got), np.asarray(expected), ulps=64)
    assert np.abs(np.asarray(kernel[4])).max() > 0.1  # the gate's gradient is no zero
    from keras_mone.kernels.cuda_lowering import lower_for_cuda

    # lowered for CUDA: of the GELU's output, the dX kernel scales its rows and sums the gate's gradient, the
    # weight-gradient kernel scales dy, and the forward pass stores no projection; else it stores one
    text = lower_for_cuda(jax.grad(loss(grouped_projection, tiles=(16, 32, 16, 4, 2)), argnums=wrt), *arguments)
    assert ("grouped_out_projection_residual_scale_pre_sums2_k96_n64" in text) is not activation
    assert ("grouped_out_projection_residual_scale_sums2_k96_n64" in text) is activation
    assert ("grouped_in_projection_scale_derivative_products4_k64_n96" in text) is activation
    assert ("grouped_out_weight_gradient_bias_scale_k96_n64" in text) is activation


@pytest.mark.parametrize("statistics", ["keras", "one_pass"])
def test_a_mone_vits_training_gradients_through_the_kernels_equal_the_per_group_forms(monkeypatch, statistics):
    """``$KERAS_MONE_PROJECTIONS=grouped_kernel`` in a training call (``training=True``): the
    loss's gradients with respect to every weight, the router's included (through MoNE's gate),
    within float32 rounding of the per-group form's. Three blocks, two kernel blocks in a row
    (the second reads the first's joined outputs); one-pass, the LayerNorms' statistics come from
    the out-projections' row sums (but the router's block's first)."""
    from keras_mone import models
    from keras_mone.kernels import grouped_projection as kernels
    from keras_mone.layers import platform_forms

    monkeypatch.setenv(platform_forms.STATISTICS_ENV, statistics)
    summed = []
    original = kernels.grouped_projection
    monkeypatch.setattr(kernels, "grouped_projection",
                        lambda *a, **k: summed.append(k.get("statistics_epsilon")) or original(*a, **k))
    model = models.MoNEViTBackbone(**{**TINY, "depth": 3}, capacity=0.3)
    model.build((None, 32, 32, 3))
    randomize_weights(model, seed=4)
    x = images()
    results = {}
    for form in platform_forms.PROJECTIONS_FORMS:
        monkeypatch.setenv(platform_forms.PROJECTIONS_ENV, form)
        results[form] = gradients(model, lambda out: keras.ops.mean(out * out), x, model.trainable_variables,
                                  training=True)
    assert any("router" in v.path for v in model.trainable_variables)
    # one-pass: each kernel block's out-projections sum their rows for the next LayerNorm
    assert summed and sum(e is not None for e in summed) == (len(summed) // 2 if statistics == "one_pass" else 0)
    for got, expected in zip(results["grouped_kernel"], results["per_group"]):
        assert (got is None) == (expected is None)
        if got is not None:
            # float32 rounding of the variable's largest gradient
            np.testing.assert_allclose(got, expected, atol=1e-5 * float(np.abs(expected).max()))


def test_stochastic_depth_trains_through_the_kernels_with_the_generic_paths_draws(monkeypatch):
    """A MoNE ViT with stochastic depth (the ViViT recipes' 0.3) trains through the kernels:
    its gradients equal the per-group form's, the same examples' branches dropped."""
    from keras_mone import models
    from keras_mone.kernels import grouped_projection as kernels
    from keras_mone.layers import platform_forms

    calls = []
    original = kernels.grouped_projection
    monkeypatch.setattr(kernels, "grouped_projection", lambda *a, **k: calls.append(1) or original(*a, **k))
    model = models.MoNEViTBackbone(**{**TINY, "drop_path_rate": 0.6}, capacity=0.3)
    model.build((None, 32, 32, 3))
    randomize_weights(model, seed=5)
    x = images(batch=8)
    results = {}
    for form in ("grouped_kernel", "per_group"):
        monkeypatch.setenv(platform_forms.PROJECTIONS_ENV, form)
        results[form] = gradients(model, lambda out: keras.ops.mean(out * out), x, model.trainable_variables,
                                  training=True)
    assert calls  # the kernels ran in the training call
    for got, expected in zip(results["grouped_kernel"], results["per_group"]):
        if got is not None:
            # float32 rounding of the variable's largest gradient
            np.testing.assert_allclose(got, expected, atol=1e-5 * float(np.abs(expected).max()))


def test_the_roofline_counts_a_derivative_epilogues_reads():
    from keras_mone.kernels.grouped_labels import kernel_label, labelled_cost

    groups = ((84, 96), (61, 192), (37, 384), (14, 768))
    plain = kernel_label("in", 768, 3072, 128, groups)
    derivative = kernel_label("in", 768, 3072, 128, groups, derivative=True)
    assert derivative == plain.replace("projection_", "projection_derivative_")
    assert labelled_cost(derivative, 2)[0] == labelled_cost(plain, 2)[0]
    assert labelled_cost(derivative, 2)[1] == labelled_cost(plain, 2)[1] + 2 * 128 * 196 * 3072
    kept = kernel_label("in", 768, 3072, 128, groups, norm=True, pre=True)  # fc1 storing its pre-activations too
    assert kept == plain.replace("projection_", "projection_norm_pre_")
    assert labelled_cost(kept, 2)[1] == labelled_cost(plain.replace("projection_", "projection_norm_"), 2)[1] + (
        2 * 128 * 196 * 3072)
    # fc2 of a training call keeping its projection (the gate's gradient): one more (rows, N) store
    gated = kernel_label("out", 3072, 768, 128, groups, residual=True, scale=True, sums=6)
    gated_kept = kernel_label("out", 3072, 768, 128, groups, residual=True, scale=True, pre=True, sums=6)
    assert gated_kept == gated.replace("_scale_sums6", "_scale_pre_sums6")
    assert labelled_cost(gated_kept, 2)[1] == labelled_cost(gated, 2)[1] + 2 * 128 * 196 * 768
    # the dX kernel of a gated fc2: a factor per row read, a float32 partial of the gate's gradient per row and tile
    # (and x . b)
    dx = kernel_label("in", 768, 3072, 128, groups, derivative=True)
    summed = kernel_label("in", 768, 3072, 128, groups, scale=True, derivative=True, products=25)
    assert summed == dx.replace("_derivative_", "_scale_derivative_products25_")
    assert labelled_cost(summed, 2)[1] == labelled_cost(dx, 2)[1] + 2 * 128 * 196 + 4 * 25 * 128 * 196


def test_the_gpu_check_script_checks_a_grouped_training_block(monkeypatch):
    """``bench/kernel_check.py``'s grouped block (q/k/v from the LayerNorm, the attention's
    out-projection with its residual and row sums, fc1 keeping its pre-activations, the gated fc2)
    at a tiny size, interpreted: outputs and every input's gradients within its bounds (and an
    inference block's, its out-projections in place), and a wrong gradient of the gate's (the bias
    term dropped from the dX kernel's products) outside."""
    import pathlib

    import jax

    from keras_mone.kernels import grouped_tile

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
    import kernel_check

    for dtype in ("float32", "bfloat16"):
        errors = kernel_check.grouped_check(dtype, 1, 32, interpret=True)
        assert set(errors) == {"grouped block", "grouped block, gradients", "grouped block, inference in place"}
        assert max(errors.values()) <= kernel_check.GROUPED_BOUNDS[dtype], errors

    def without_bias(x_ref, bias_ref, products_ref, column_tile, rows, valid, *rest):  # zeros for d out . b
        from jax.experimental.pallas import triton as pl_triton
        pl_triton.store(products_ref.at[column_tile, rows], jax.numpy.zeros(rows.shape, "float32"), mask=valid)

    monkeypatch.setattr(grouped_tile, "_bias_products", without_bias)
    jax.clear_caches()  # (the kernels traced above would be reused)
    try:
        errors = kernel_check.grouped_check("float32", 1, 32, interpret=True)
    finally:  # nothing traced with the mutation outlives the test
        monkeypatch.undo()
        jax.clear_caches()
    assert 100 * kernel_check.GROUPED_BOUNDS["float32"] < errors["grouped block, gradients"] < float("inf")
    # a NaN fails every bound (it compares false with each)
    assert kernel_check.relative_error([1.0, np.nan], [1.0, 2.0]) == float("inf")
