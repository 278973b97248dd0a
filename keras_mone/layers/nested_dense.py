"""NestedDense: one full-size Dense kernel used at any nested width (MoNE App. A.1)."""

import keras
from keras import ops

from keras_mone.layers.config import ConfigMixin, register
from keras_mone.layers.platform_forms import accelerator, order_form


@register
class NestedDense(ConfigMixin, keras.layers.Layer):
    """A Dense layer whose kernel serves every nested width (Eq. 7).

    With ``in_width=d`` it is the sliced in-projection ``x[:, :d] @ W[:d, :]``;
    with ``out_width=d`` the sliced out-projection ``x @ W[:, :d]`` whose result
    is zero-padded back to ``units`` features (``pad_output=True``) before the
    residual connection. Only the sliced sub-matrix is multiplied, so the cost
    scales with ``d``; on jax the slice is cut where it is used, in the forward
    and again in the backward pass (``sliced_matmul``), so no slice waits in
    memory between them. Called without widths it is an ordinary Dense layer.

    Args:
        units: full output width.
        use_bias: add a bias (sliced like the kernel's columns).
        kernel_initializer, bias_initializer: Keras initialisers.

    Example:
        >>> layer = NestedDense(64)
        >>> y = layer(x, in_width=8)              # reads x[..., :8]
        >>> y = layer(x, out_width=16)            # 16 features, padded to 64
    """

    def __init__(
        self,
        units,
        use_bias=True,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.units = int(units)
        self.use_bias = use_bias
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)

    def build(self, input_shape):
        self.kernel = self.add_weight(
            name="kernel",
            shape=(input_shape[-1], self.units),
            initializer=self.kernel_initializer,
        )
        self.bias = None
        if self.use_bias:
            self.bias = self.add_weight(
                name="bias", shape=(self.units,), initializer=self.bias_initializer
            )

    def call(self, inputs, in_width=None, out_width=None, pad_output=True, slice_after=None, rows=None):
        """``slice_after`` (jax): a tensor the weight slice is cut after (default ``inputs``,
        see ``after``); pass one that is materialised anyway, e.g. the pre-activation
        when ``inputs`` is an elementwise function of it. ``rows``: ``(start, stop)``,
        project only those tokens of ``inputs`` (``(batch, tokens, features)``: a token
        group's rows of a joined tensor); on jax the backward pass cuts them again from
        ``inputs`` instead of keeping the cut (``sliced_matmul``)."""
        full_in, full_out = self.kernel.shape
        in_width = _check_width(in_width, full_in, "in_width")
        out_width = _check_width(out_width, full_out, "out_width")
        if inputs.shape[-1] not in (in_width, full_in):
            raise ValueError(
                f"NestedDense '{self.name}' expects {in_width} or {full_in} input "
                f"features, got {inputs.shape[-1]}."
            )
        rows = _check_rows(rows, inputs)
        if rows is not None and keras.backend.backend() != "jax":
            inputs, rows = inputs[:, rows[0] : rows[1]], None
        if inputs.shape[-1] != in_width and rows is None:  # (with ``rows``, both cuts are made together)
            inputs = inputs[..., :in_width]
        if in_width != full_in or out_width != full_out or rows is not None:
            outputs = sliced_matmul(inputs, self.kernel, in_width, out_width, self.compute_dtype,
                                    slice_after=slice_after, rows=rows)
        else:
            outputs = ops.matmul(inputs, ops.cast(self.kernel, self.compute_dtype))
        if self.bias is not None:
            bias = self.bias if out_width == full_out else self.bias[:out_width]
            outputs = add_bias(outputs, ops.cast(bias, self.compute_dtype))
        if pad_output and out_width != full_out:
            outputs = pad_features(outputs, full_out)
        return outputs

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self.units,)

    def compute_output_spec(self, inputs, in_width=None, out_width=None, pad_output=True, slice_after=None,
                            rows=None):
        # (compute_output_shape may only take the input's shape: Keras' rule)
        width = self.units if (pad_output or out_width is None) else out_width
        shape = tuple(inputs.shape[:-1])
        if rows is not None:
            shape = (shape[0], rows[1] - rows[0], *shape[2:])
        return keras.KerasTensor(shape + (width,), dtype=self.compute_dtype)


def sliced_matmul(inputs, kernel, in_width, out_width, dtype, slice_after=None, rows=None):
    """``inputs @ kernel[:in_width, :out_width]`` (``inputs`` already ``in_width`` wide).

    Both jax and tensorflow copy a column slice out of the kernel, and both
    would cut every block's slices at the start of the call and hold them
    (issue 27); so the slice is cut once ``slice_after`` exists, and cut again
    in the backward pass instead of being kept for it:

    * jax (``_jax_sliced_matmul``): every slice, tied by default to
      ``inputs`` (XLA fuses the copy into its consumer); with ``rows``
      (``(start, stop)``, jax only) the product is ``inputs[:, start:stop] @ ...``
      and the backward pass cuts those rows again too;
    * tensorflow (``_tf_sliced_matmul``): column slices only (a slice of
      leading rows is a view of the kernel), tied to ``slice_after`` if given;
      see ``slice_point`` for which tensor each backend wants.
    """
    backend = keras.backend.backend()
    if backend == "jax":
        kernel = ops.convert_to_tensor(kernel)
        return _jax_sliced_matmul(inputs, kernel, in_width, out_width, dtype, slice_after, rows)
    if rows is not None:
        raise ValueError(f"`rows` is taken on jax only; on {backend} cut the rows before the product.")
    if backend == "tensorflow" and out_width < kernel.shape[1]:
        return _tf_sliced_matmul(inputs, kernel, in_width, out_width, dtype, slice_after)
    return ops.matmul(inputs, ops.cast(kernel[:in_width, :out_width], dtype))


def slice_point(early, late):
    """The tensor to cut a block's nested weight slice after (``slice_after``), per backend.

    ``early`` is the block's input to the projection's sub-layer, ``late`` the
    projection's own input. jax wants ``late``: XLA fuses the copy into the
    matmul's operand, and the later the cut, the shorter the slice lives.
    tensorflow wants ``early``: its executor runs the copy on the second core
    beside the sub-layer's first ops; tied to ``late`` the copy sat on the
    critical path (MoNE-ViT-B/16 forward 328 -> 350 ms), untied it ran at the
    start of the call for every block, all slices held (forward peak RSS
    +318 MB over the build against +194 MB tied early, dense +119; issue 27).
    """
    return early if keras.backend.backend() == "tensorflow" else late


def _tf_sliced_matmul(inputs, kernel, in_width, out_width, dtype, tie):
    """The product with a column slice of the kernel and a hand-written backward pass (tensorflow).

    Autodiff keeps the forward pass's slice (a copy) from the forward to the
    backward pass, for every block at once; here the backward pass keeps the
    kernel (a weight) and cuts the slice again once the incoming gradient
    exists: ``dx = dy W[:a, :b]^T``, ``dW = Pad(x^T dy)`` (autodiff's result).
    """
    import tensorflow as tf

    kernel = tf.convert_to_tensor(kernel)
    full_in, full_out = kernel.shape

    def cut(tied_to):
        with tf.control_dependencies([] if tied_to is None else [tied_to]):
            return tf.cast(kernel[:in_width, :out_width], dtype)

    @tf.custom_gradient
    def product(inputs, kernel):
        def backward(upstream):
            grad_inputs = tf.matmul(upstream, tf.cast(cut(upstream), upstream.dtype), transpose_b=True)
            rows = tf.reshape(inputs, (-1, in_width))
            grad_slice = tf.matmul(rows, tf.reshape(upstream, (-1, out_width)), transpose_a=True)
            padding = [[0, full_in - in_width], [0, full_out - out_width]]
            return tf.cast(grad_inputs, inputs.dtype), tf.pad(tf.cast(grad_slice, kernel.dtype), padding)

        return ops.matmul(inputs, cut(tie)), backward

    return product(tf.convert_to_tensor(inputs), kernel)


def _jax_sliced_matmul(inputs, kernel, in_width, out_width, dtype, tie, rows):
    """The product with a hand-written backward pass (jax).

    Autodiff keeps the forward pass's slice for the input gradient, and XLA's
    scheduler cuts the slices of every block early and holds them: 23 MiB per
    ViT-B/16 block, most of MoNE's extra training-step memory (issue 27). Here
    the backward pass keeps only the kernel (a weight, alive anyway) and cuts
    the slice again from it once the incoming gradient exists (``after``):
    ``dx = dy @ W[:d_in, :d_out]^T``, ``dW = Pad(x^T dy)`` (exactly autodiff's
    result). With ``rows`` the same holds for the rows ``x = inputs[:, start:stop]``:
    the backward pass keeps ``inputs`` and cuts ``x`` again (attention's output,
    kept by attention's backward pass anyway; its per-group cuts were one more
    attention output per block in MoNE's training step, issue 40), and ``dinputs``
    is ``dx`` padded with zeros along the tokens. ``tie`` defaults to ``x``.
    """
    import jax

    full_shape = kernel.shape

    def cut(kernel, tied_to):
        if (in_width, out_width) == tuple(full_shape):  # the whole kernel (``rows`` only): nothing to cut
            return kernel
        return after(kernel[:in_width, :out_width], tied_to)

    def cut_rows(inputs):
        if rows is None:
            return inputs
        return inputs[:, rows[0] : rows[1], :in_width]  # (``inputs`` may be wider than ``in_width``)

    @jax.custom_vjp
    def product(inputs, kernel, tie):
        part = cut_rows(inputs)
        return ops.matmul(part, ops.cast(cut(kernel, part if tie is None else tie), dtype))

    def forward(inputs, kernel, tie):
        return product(inputs, kernel, tie), (inputs, kernel)

    def backward(saved, upstream):
        inputs, kernel = saved
        grad_part = ops.matmul(upstream, ops.transpose(ops.cast(cut(kernel, upstream), upstream.dtype)))
        if rows is not None:  # a barrier: XLA would merge this cut with the forward pass's (CSE) and keep that
            inputs, upstream = jax.lax.optimization_barrier((inputs, upstream))
        part = ops.reshape(cut_rows(inputs), (-1, in_width))
        grad_slice = ops.matmul(ops.transpose(part), ops.reshape(upstream, (-1, out_width)))
        padding = [[0, full_shape[0] - in_width], [0, full_shape[1] - out_width]]
        grad_inputs = grad_part.astype(inputs.dtype)
        if rows is not None:  # zeros for the other tokens and the features past ``in_width``
            padding_rows = [[0, 0], [rows[0], inputs.shape[1] - rows[1]], [0, inputs.shape[2] - in_width]]
            grad_inputs = ops.pad(grad_inputs, padding_rows)
        # ``tie`` only orders the forward pass: its cotangent is a symbolic zero (None)
        return grad_inputs, ops.pad(ops.cast(grad_slice, kernel.dtype), padding), None

    product.defvjp(forward, backward)
    return product(inputs, kernel, tie)


def after(value, tensor):
    """``value``, computed only once ``tensor`` exists (jax; unchanged elsewhere).

    XLA copies a weight slice out of its kernel; as it depends on nothing but
    the kernel, XLA's CPU scheduler computes the slices of every block at the
    start of the program and holds them all (315 MiB of temporaries for
    MoNE-ViT-B/16 against 46 MiB dense, issue 27). Adding an exact zero taken
    from ``tensor`` (the block's input) ties the copy to the block, so one
    block's slices are alive at a time; the add fuses into the copy. Also
    used to run a block's token groups one after the other (``ViTBlock``).
    XLA's GPU pipeline folds the zero away (``0 * convert(pred)``), so there the
    tie orders nothing; where an order must hold on a GPU, an optimization
    barrier does it (``materialized``, ``_jax_sliced_matmul``'s ``rows``).
    """
    if keras.backend.backend() != "jax" or order_form() == "free":
        return value
    probe = ops.sum(ops.stop_gradient(ops.reshape(tensor, (-1,))[:1]))  # 0 if ``tensor`` is empty
    zero = ops.cast(ops.isnan(probe), value.dtype) * 0.0  # 0 * (0 or 1): finite whatever ``tensor`` holds
    return value + zero


def materialized(tensors):
    """``tensors``, each written to device memory once (jax on a GPU; unchanged elsewhere).

    A token group gathered from the routed tokens is an input XLA's GPU fusions re-read
    through the gather in each of their consumers (the group's LayerNorm, its residual
    add), so the whole ungrouped tensor lives until the last of them: MoNE-ViT-B/16's
    first block kept the patch embeddings (73.5 MiB at batch 256, bf16) through its
    attention, the program's peak (issue 40). An optimization barrier writes each group
    once, and the ungrouped tensor dies. The same holds for a block's outputs: XLA kept a
    group's residual as its input plus the block's pending updates, small buffers that
    lived for blocks and scattered XLA's heap (``layers.block``: MoNE-ViT-B/16's forward
    heap 670.8 -> 567.3 MiB at batch 256). Not done under ``$KERAS_MONE_ORDER=free``, nor
    on the CPU (its measured program).
    """
    if keras.backend.backend() != "jax" or order_form() == "free" or accelerator() != "gpu" or not tensors:
        return tensors
    import jax

    return type(tensors)(jax.lax.optimization_barrier(list(tensors)))


def _check_rows(rows, inputs):
    """``rows`` as a ``(start, stop)`` pair of ints within ``inputs``' tokens, or ``None``."""
    if rows is None:
        return None
    tokens = inputs.shape[1] if len(inputs.shape) == 3 else None
    pair = tuple(rows) if isinstance(rows, (tuple, list)) else ()
    exact = len(pair) == 2 and all(isinstance(r, int) and not isinstance(r, bool) for r in pair)
    start, stop = pair if exact else (None, None)
    if tokens is None or not exact or not 0 <= start < stop <= tokens:
        raise ValueError(f"`rows` must be (start, stop) with 0 <= start < stop <= tokens of a (batch, tokens, "
                         f"features) input; got rows={rows!r} for an input of shape {tuple(inputs.shape)}.")
    return start, stop


def add_bias(outputs, bias):
    """``outputs + bias`` over the last axis.

    On tensorflow it is ``tf.nn.bias_add``: after a 2-D matmul, TensorFlow's
    oneDNN graph rewrite fuses MatMul + BiasAdd (+ a following GELU) into one
    kernel, which it does not for an ``AddV2`` (``NestedMLP`` feeds 2-D token
    rows for this; the ViT-B/16 MLP's fc1 + GELU 1.2x faster, issue 27).
    """
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.nn.bias_add(outputs, bias)
    return outputs + bias


def pad_features(x, width):
    """Zero-pads the last axis of ``x`` to ``width`` (the paper's *Pad*)."""
    missing = width - x.shape[-1]
    if missing == 0:
        return x
    if keras.backend.backend() == "torch":
        # the same kernel; ``ops.pad`` first builds a Keras ``Operation`` (~0.1 ms of host time per call)
        import torch

        return torch.nn.functional.pad(x, (0, missing))
    return ops.pad(x, [[0, 0]] * (len(x.shape) - 1) + [[0, missing]])


def _check_width(width, full, name):
    if width is None:
        return full
    if not 0 < width <= full:
        raise ValueError(f"`{name}` must be in [1, {full}], got {width}.")
    return int(width)
