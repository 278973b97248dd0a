"""MoNEAttention: multi-head self-attention with nested in/out projections (App. A.1 Eq. 5)."""

import keras
from keras import ops

from keras_mone.layers.config import ConfigMixin, register
from keras_mone.layers.nested_dense import NestedDense, slice_point
from keras_mone.layers.platform_forms import attention_form, fused_attention


@register
class MoNEAttention(ConfigMixin, keras.layers.Layer):
    """Self-attention in which each token group uses its own nested width.

    A token of width ``d`` computes its query, key and value from its first
    ``d`` features only (``x[:, :d] @ W_qkv[:d]``); attention runs over all
    tokens at the full dimension ``D`` (Sec. 3.1: "irrespective of the sub-model
    used in the in-projections, it is always projected to the model dimension
    D"); the output projection produces the first ``d`` features, zero-padded
    to ``D`` (Eq. 5 and 7). Q, K and V share one fused ``(D, 3D)`` kernel.

    Call with a tensor ``(batch, tokens, D)`` for ordinary (full-width)
    attention, or with a list of token groups ``(batch, k_j, D)`` and their
    ``widths``; the result has the same structure as the input.

    Args:
        hidden_dim: model dimension ``D``.
        num_heads: attention heads; ``D`` must be divisible by it.
        use_bias: biases on the projections.
        dropout_rate: dropout on the attention output.
        kernel_initializer: initialiser of both projections.
    """

    def __init__(
        self,
        hidden_dim,
        num_heads,
        use_bias=True,
        dropout_rate=0.0,
        kernel_initializer="glorot_uniform",
        **kwargs,
    ):
        super().__init__(**kwargs)
        if hidden_dim % num_heads:
            raise ValueError(
                f"`hidden_dim` ({hidden_dim}) must be divisible by `num_heads` ({num_heads})."
            )
        self.hidden_dim = hidden_dim
        self.num_heads = num_heads
        self.use_bias = use_bias
        self.dropout_rate = dropout_rate
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.qkv = NestedDense(
            3 * hidden_dim, use_bias=use_bias, kernel_initializer=kernel_initializer,
            dtype=self.dtype_policy, name="qkv",
        )
        self.out = NestedDense(
            hidden_dim, use_bias=use_bias, kernel_initializer=kernel_initializer,
            dtype=self.dtype_policy, name="out",
        )
        self.dropout = keras.layers.Dropout(dropout_rate, dtype=self.dtype_policy)

    def build(self, input_shape):
        self.qkv.build((None, None, self.hidden_dim))
        self.out.build((None, None, self.hidden_dim))

    def call(self, inputs, widths=None, training=None, return_received_attention=False):
        """With ``return_received_attention``, also returns the attention each
        token receives, ``(batch, tokens)`` float32: the post-softmax weights
        averaged over heads and query rows (A-MoD's routing score)."""
        groups, widths, single = as_groups(inputs, widths, self.hidden_dim)
        sizes = [g.shape[1] for g in groups]
        head_dim = self.hidden_dim // self.num_heads
        qkv = [
            ops.reshape(self.qkv(g, in_width=w), (-1, g.shape[1], 3, self.num_heads, head_dim))
            for g, w in zip(groups, widths)
        ]
        attended = multi_head_attention(qkv[0] if len(qkv) == 1 else qkv, return_received_attention)
        if return_received_attention:
            attended, received = attended
        attended = ops.reshape(attended, (-1, attended.shape[1], self.hidden_dim))
        outputs = []
        start = 0
        for group, size, width in zip(groups, sizes, widths):
            # the group's rows of ``attended``: on jax cut again in the backward pass, not kept for it
            rows = None if len(sizes) == 1 else (start, start + size)
            start += size
            projected = self.out(attended, out_width=width, rows=rows, slice_after=slice_point(early=group, late=None))
            outputs.append(self.dropout(projected, training=training))
        outputs = outputs[0] if single else outputs
        return (outputs, received) if return_received_attention else outputs

    def compute_output_shape(self, input_shape):
        return input_shape

    def compute_output_spec(self, inputs, widths=None, training=None, return_received_attention=False):
        outputs = same_structure(inputs, self.compute_dtype)
        if not return_received_attention:
            return outputs
        first = inputs[0] if isinstance(inputs, (list, tuple)) else inputs
        return outputs, keras.KerasTensor(tuple(first.shape[:2]), dtype="float32")


def multi_head_attention(qkv, return_received_attention=False):
    """softmax(q k^T / sqrt(head_dim)) v for ``qkv`` of shape (B, N, 3, H, head_dim).

    ``qkv`` may also be a list of such tensors, consecutive along the token
    axis (MoNE's token groups): on jax and tensorflow each part is put heads
    first and the parts are concatenated in that layout, one copy, where
    concatenating them first and then transposing made two (MoNE-ViT-B/16 at
    e_c 0.3: forward 1.5-3.5% faster on jax, 4.8% on tensorflow, jax gradient
    step 5.5%; bit-identical outputs; ``bench/mlp_forms.py --change
    attention``, issue 27). torch concatenates first for its fused kernel.

    Returns (B, N, H, head_dim); with ``return_received_attention`` also the
    (B, N) float32 attention each token receives, averaged over heads and
    query rows (the torch path then forms the weights explicitly instead of
    its fused kernel). Per backend, the fastest exact form on CPU
    (``bench/block_profile.py``, BENCHMARKS.md):

    * torch, and every backend on a GPU or TPU: ``ops.dot_product_attention``
      (a fused kernel; ``layers.platform_forms.attention_form``, which
      ``$KERAS_MONE_ATTENTION`` overrides);
    * tensorflow: heads-first batched matmuls around TF's fused softmax;
    * jax: heads-first batched matmuls with the softmax normalisation
      deferred: ``(exp(s - max) v) / sum(exp(s - max))`` divides the
      (N, head_dim) result instead of the (N, N) weights, one pass over the
      scores fewer, which XLA runs faster on CPU than the softmax form or
      ``jax.nn.dot_product_attention`` (``attention_core`` in
      ``bench/block_profile.py``).

    The exponentials and their sum are float32 whatever the compute dtype.
    """
    parts = list(qkv) if isinstance(qkv, (list, tuple)) else [qkv]
    if not return_received_attention and attention_form() != "explicit":
        whole = parts[0] if len(parts) == 1 else ops.concatenate(parts, axis=1)
        return fused_attention(whole[:, :, 0], whole[:, :, 1], whole[:, :, 2])
    if keras.backend.backend() == "torch":
        parts = [parts[0] if len(parts) == 1 else ops.concatenate(parts, axis=1)]
    # Split, then heads first: the backward pass concatenates dq, dk, dv
    # (indexing a heads-first (3, B, H, N, d) tensor instead gave three padded
    # full-size gradients that every consumer summed: MoNE's step 5% slower).
    split = [[ops.transpose(ops.squeeze(x, 2), (0, 2, 1, 3)) for x in ops.split(part, 3, axis=2)] for part in parts]
    # The queries are scaled part by part, before they are joined (the same
    # products): scaling the joined tensor made XLA's CPU keep a broadcast of
    # the scale, as large as the queries, through every block (MoNE-ViT-B/16
    # forward: 4.6 MiB of 38.6 at batch 8).
    scale = ops.cast(parts[0].shape[-1] ** -0.5, parts[0].dtype)
    split = [[query * scale, key, value] for query, key, value in split]
    query, key, value = (
        pieces[0] if len(pieces) == 1 else ops.concatenate(pieces, axis=2) for pieces in zip(*split)
    )
    scores = ops.cast(ops.matmul(query, ops.swapaxes(key, -1, -2)), "float32")
    received = None
    if keras.backend.backend() == "jax":
        # The shift by the row maximum only keeps exp in range: the result does
        # not depend on it, so its gradient is exactly zero and stopping it
        # spares the backward pass max's argmax masks (3x faster on CPU).
        weights = ops.exp(scores - ops.stop_gradient(ops.max(scores, axis=-1, keepdims=True)))
        total = ops.sum(weights, axis=-1, keepdims=True)
        attended = ops.matmul(ops.cast(weights, value.dtype), value)
        attended = ops.cast(ops.cast(attended, "float32") / total, value.dtype)
        if return_received_attention:
            received = ops.mean(weights / total, axis=(1, 2))
    else:
        probabilities = ops.softmax(scores, axis=-1)
        attended = ops.matmul(ops.cast(probabilities, value.dtype), value)
        if return_received_attention:
            received = ops.mean(probabilities, axis=(1, 2))
    attended = ops.transpose(attended, (0, 2, 1, 3))
    return (attended, received) if return_received_attention else attended


def same_structure(inputs, dtype):
    """KerasTensors shaped like ``inputs`` (a tensor or a list of token groups)."""
    return keras.tree.map_structure(lambda x: keras.KerasTensor(x.shape, dtype=dtype), inputs)


def as_groups(inputs, widths, hidden_dim):
    """Normalises a tensor or a list of token groups and their widths.

    Returns ``(groups, widths, single)``; a bare tensor is one group at full
    width ``hidden_dim``.
    """
    single = not isinstance(inputs, (list, tuple))
    groups = [inputs] if single else list(inputs)
    if widths is None:
        widths = [hidden_dim] * len(groups)
    elif isinstance(widths, int):
        widths = [widths] * len(groups)
    widths = [int(w) for w in widths]
    if len(widths) != len(groups):
        raise ValueError(
            f"Got {len(groups)} token groups but {len(widths)} `widths`; pass one width per group."
        )
    for w in widths:
        if not 0 < w <= hidden_dim:
            raise ValueError(f"`widths` must lie in [1, {hidden_dim}], got {widths}.")
    return groups, widths, single
