"""NestedDense's gradients (App. A.1 Eq. 7: those of the sliced product) and its row-cut form
(``rows=(start, stop)``: a token group's rows of a joined tensor)."""

import keras
import numpy as np
import pytest
from conftest import BACKEND, assert_f32_close, gradients, randomize_weights, to_numpy
from nested_layer_cases import ATOL, D, built, rand

from keras_mone import layers


class _NestedDenseOfVariable(keras.layers.Layer):
    """``NestedDense(x)`` at given widths, ``x`` a variable (so its gradient is a variable's)."""

    def __init__(self, x, units, widths, **kwargs):
        super().__init__(**kwargs)
        self.x = self.add_weight(shape=x.shape, initializer=keras.initializers.Constant(x))
        self.dense = layers.NestedDense(units)
        self.dense.build(x.shape)
        self.widths = widths

    def call(self, inputs, training=None):
        widths = dict(self.widths)
        if widths.pop("tied", False):  # the slice cut after another tensor (NestedMLP's pre-activation)
            widths["slice_after"] = keras.ops.exp(self.x)
        return self.dense(self.x, **widths)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize(
    "widths", [dict(in_width=4), dict(out_width=8), dict(in_width=4, out_width=8), dict(out_width=8, tied=True),
               dict(rows=(1, 4)), dict(rows=(1, 4), out_width=8), dict(rows=(0, 2), in_width=4, out_width=8)],
    ids=["in", "out", "both", "tied", "rows", "rows-out", "rows-both"],
)
def test_nested_dense_gradients_are_those_of_the_sliced_product(widths, graph):
    """Input, kernel and bias gradients of a nested projection (jax and, for column slices,
    tensorflow: the hand-written backward pass that cuts the slice again) against numpy:
    dx = Pad(dy W[:a, :b]^T), dW = Pad(x[:, :a]^T dy). ``tied``: the slice is cut after another
    tensor (``slice_after``), which adds no gradient. ``rows``: the product of the rows
    ``x[:, start:stop]`` (jax cuts them again in the backward pass), whose gradient is padded
    with zeros along the tokens. ``graph``: tensorflow inside a ``tf.function``, where the tie
    is a control dependency (other backends: one run)."""
    if graph and BACKEND != "tensorflow":
        pytest.skip("eager and graph differ only on tensorflow")
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 5, 16)).astype("float32")
    start, stop = widths.get("rows", (0, 5))
    upstream = rng.normal(size=(2, stop - start, 32)).astype("float32")
    a, b = widths.get("in_width", 16), widths.get("out_width", 32)
    upstream[..., b:] = 0.0  # the padded outputs' gradient never reaches the product
    layer = _NestedDenseOfVariable(x, 32, widths)
    model = keras.Sequential([keras.Input((1,)), layer])
    randomize_weights(layer.dense, seed=4)
    kernel = to_numpy(layer.dense.kernel).astype("float64")
    grad_x, grad_kernel, grad_bias = gradients(
        model, lambda out: keras.ops.sum(out * keras.ops.convert_to_tensor(upstream)), np.zeros((1, 1), "float32"),
        [layer.x, layer.dense.kernel, layer.dense.bias], graph=graph,
    )
    dy = upstream[..., :b].astype("float64")
    expected_x = np.zeros_like(x, dtype="float64")
    expected_x[:, start:stop, :a] = dy @ kernel[:a, :b].T
    expected_kernel = np.zeros_like(kernel)
    expected_kernel[:a, :b] = x[:, start:stop, :a].reshape(-1, a).astype("float64").T @ dy.reshape(-1, b)
    assert_f32_close(grad_x, expected_x)
    assert_f32_close(grad_kernel, expected_kernel)
    assert_f32_close(grad_bias, upstream.reshape(-1, 32).sum(0))


class TestNestedDenseRows:
    """``NestedDense(x, rows=(start, stop))``: the projection of a token group's rows of a
    joined tensor (MoNE attention's out-projection), equal to cutting the rows first."""

    @pytest.mark.parametrize("widths", [{}, dict(out_width=8), dict(in_width=4, out_width=8)])
    def test_equals_the_cut_rows(self, widths):
        layer = built(layers.NestedDense(48), (None, None, D))
        x = rand(2, 7, D)
        out = to_numpy(layer(x, rows=(2, 5), **widths))
        assert out.shape == (2, 3, 48)
        np.testing.assert_allclose(out, to_numpy(layer(x[:, 2:5], **widths)), rtol=0, atol=ATOL)

    @pytest.mark.parametrize("rows", [(3, 3), (-1, 2), (2, 8), (1,), "ab", (1.5, 3)])
    def test_bad_rows_name_the_argument(self, rows):
        layer = built(layers.NestedDense(48), (None, None, D))
        with pytest.raises(ValueError, match="`rows`"):
            layer(rand(2, 7, D), rows=rows)

    def test_symbolic_shape(self):
        layer = layers.NestedDense(48)
        spec = layer.compute_output_spec(keras.KerasTensor((2, 7, D)), out_width=8, pad_output=False, rows=(2, 5))
        assert spec.shape == (2, 3, 8)

    @pytest.mark.skipif(BACKEND != "jax", reason="the backward pass's residuals are jax's")
    def test_backward_keeps_the_joined_tensor_not_the_cut(self):
        """What ``jax.vjp`` keeps for the backward pass: the joined input and the kernel,
        never a ``(batch, stop - start, ...)`` copy of the rows (MoNE's training step kept
        one such copy of attention's output per block and group, issue 40)."""
        import jax

        layer = built(layers.NestedDense(48), (None, None, D))
        kernel = layer.kernel.value
        x = jax.numpy.asarray(rand(2, 7, D))

        def project(x, kernel):
            return layer.stateless_call([kernel, layer.bias.value], [], x, out_width=8, rows=(2, 5))[0]

        _, pullback = jax.vjp(project, x, kernel)
        kept = [leaf.shape for leaf in jax.tree_util.tree_leaves(pullback) if hasattr(leaf, "shape")]
        assert (2, 7, D) in kept
        assert not [shape for shape in kept if len(shape) == 3 and shape[1] == 3], kept
        # ...and in the compiled step the backward pass's cut sits behind a barrier, which keeps
        # XLA's CSE from merging it with the forward pass's cut (and keeping that one instead)
        def loss(x, kernel):
            return jax.numpy.sum(project(x, kernel) ** 2)

        step = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, kernel).as_text()
        assert "optimization_barrier" in step
        assert "optimization_barrier" not in jax.jit(loss).lower(x, kernel).as_text()

    def test_rows_of_a_wider_input_keep_the_input_itself(self):
        # in_width < the input's features: both cuts are made inside the product, and the
        # backward pass keeps the input, not a (batch, tokens, in_width) copy of it
        if BACKEND != "jax":
            pytest.skip("the backward pass's residuals are jax's")
        import jax

        layer = built(layers.NestedDense(48), (None, None, D))
        x = jax.numpy.asarray(rand(2, 7, D))

        def project(x):
            return layer.stateless_call([layer.kernel.value, layer.bias.value], [], x, in_width=8, rows=(2, 5))[0]

        _, pullback = jax.vjp(project, x)
        kept = [leaf.shape for leaf in jax.tree_util.tree_leaves(pullback) if hasattr(leaf, "shape")]
        assert (2, 7, D) in kept and (2, 7, 8) not in kept and (2, 3, 8) not in kept, kept
        np.testing.assert_allclose(np.asarray(project(x)), to_numpy(layer(rand(2, 7, D)[:, 2:5], in_width=8)),
                                   rtol=0, atol=ATOL)
