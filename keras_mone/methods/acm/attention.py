"""ACMAttention: self-attention whose Q, K, V and output projections are ACMs.

Wojcik et al., "Adaptive Computation Modules" (``../shared/papers/acm.txt``,
Sec. 4: "we replace every MLP module and every linear projection in each MHA
with an ACM module (the self-attention mechanism itself is not affected)").
"""

import keras
from keras import ops

from keras_mone.methods.acm.linear import ACMLinear
from keras_mone.arguments import integer, number
from keras_mone.layers.attention import multi_head_attention
from keras_mone.layers.config import ConfigMixin, register

PROJECTIONS = ("query", "key", "value", "out")


@register
class ACMAttention(ConfigMixin, keras.layers.Layer):
    """Multi-head self-attention with four ``ACMLinear`` projections.

    Each projection (``query``, ``key``, ``value`` on the block's normalised
    tokens, ``out`` on the attended values) is ``N`` low-rank learners
    ``Linear(D -> r) -> Linear(r -> D)`` with counts ``k`` in ``1..N`` per
    token (no ``k = 0``: a projection is not under its own residual). The
    rank ``r`` defaults to ``acm_linear.default_rank``,
    ``round((D^2 + D) / (N (2 D + 1)))``: the official code's
    ``attention_linear_block_dim`` with ``block_flops_factor = 1 / N``, so
    ``N`` learners cost about one dense ``D x D`` projection (``r = 96`` for
    ViT-B, ``N = 4``: exactly ``D^2`` MACs per token at ``k = N``). The
    scaled dot-product attention between them is dense and unchanged
    (``layers.attention.multi_head_attention``).

    The gates are not part of this layer (``ACMViTBackbone`` holds them, so
    a gates-only phase can freeze the block and train them); ``call`` takes
    the four projections' choices, ``project`` and ``attend`` run the steps
    one at a time (the output gate reads the attended values).
    ``load_dense`` sets the learners by truncated SVD of a dense attention's
    fused ``(D, 3D)`` QKV and ``(D, D)`` output kernels (``ACMLinear.load_dense``:
    ``k = N`` is the best rank-``N r`` approximation of each projection); this
    is a deterministic initialisation, not the paper's distillation.

    Args:
        hidden_dim: model dimension ``D``.
        num_heads: attention heads (``D`` divisible by it).
        num_learners: ``N`` per projection.
        rank: ``r`` per learner (default: the paper's, above).
        mode: ``"exact"`` or ``"grouped"`` (as ``ACMMLP``; ``mode=`` in calls overrides).
        beta: budget of grouped quotas, above ``1 / N`` (learner 1 runs on every token).
        capacity_factor: slack (>= 1) on the grouped quotas.
        dropout_rate: dropout on the attention output.
        kernel_initializer: initialiser of the learners.
    """

    def __init__(
        self, hidden_dim, num_heads, num_learners=4, rank=None, mode="exact", beta=None, capacity_factor=1.0,
        dropout_rate=0.0, kernel_initializer="glorot_uniform", **kwargs,
    ):
        super().__init__(**kwargs)
        self.hidden_dim = integer("hidden_dim", hidden_dim)
        self.num_heads = integer("num_heads", num_heads)
        if self.hidden_dim % self.num_heads:
            raise ValueError(f"`hidden_dim` ({hidden_dim}) must be divisible by `num_heads` ({num_heads}).")
        self.dropout_rate = number("dropout_rate", dropout_rate, 0.0, 1.0, high_open=True)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        for name in PROJECTIONS:  # attributes query, key, value, out (weight paths attention/<name>/...)
            setattr(self, name, ACMLinear(
                self.hidden_dim, num_learners=num_learners, rank=rank, mode=mode, beta=beta,
                capacity_factor=capacity_factor, kernel_initializer=kernel_initializer,
                dtype=self.dtype_policy, name=name,
            ))
        first = self.query
        self.num_learners, self.rank, self.mode = first.num_learners, first.rank, first.mode
        self.beta, self.capacity_factor = first.beta, first.capacity_factor
        self.dropout = keras.layers.Dropout(self.dropout_rate, dtype=self.dtype_policy)

    @property
    def projections(self):
        """``{name: ACMLinear}`` in the order query, key, value, out."""
        return {name: getattr(self, name) for name in PROJECTIONS}

    def build(self, input_shape):
        for projection in self.projections.values():
            projection.build((None, None, self.hidden_dim))

    def project(self, name, inputs, choices, confidence=None, mode=None, training=None):
        """``h(z, k)`` of projection ``name`` per token (``ACMLinear.call``)."""
        return self.projections[name](inputs, choices, confidence=confidence, mode=mode, training=training)

    def attend(self, query, key, value):
        """Dense multi-head ``softmax(q k^T / sqrt(d_h)) v`` of ``(batch, tokens, D)`` projections."""
        head_dim = self.hidden_dim // self.num_heads
        qkv = ops.stack([query, key, value], axis=2)
        qkv = ops.reshape(qkv, (-1, qkv.shape[1], 3, self.num_heads, head_dim))
        attended = multi_head_attention(qkv)
        return ops.reshape(attended, (-1, attended.shape[1], self.hidden_dim))

    def finish(self, outputs, training=None):
        """Dropout on the output projection's result."""
        return self.dropout(outputs, training=training)

    def call(self, inputs, choices, confidences=None, mode=None, training=None):
        """Attention of ``inputs`` ``(batch, tokens, D)``.

        Args:
            choices: four entries (query, key, value, out), each a one-hot
                ``(batch, tokens, N)`` over ``k = 1..N`` or int counts ``(batch, tokens)``.
            confidences: ``None`` or four ``(batch, tokens)`` gate confidences (grouped mode).
        """
        if len(choices) != len(PROJECTIONS):
            raise ValueError(f"`choices` needs one entry per projection {PROJECTIONS}, got {len(choices)}.")
        confidences = [None] * len(PROJECTIONS) if confidences is None else list(confidences)
        qkv = [
            self.project(name, inputs, c, p, mode=mode, training=training)
            for name, c, p in zip(PROJECTIONS[:3], choices[:3], confidences[:3])
        ]
        attended = self.attend(*qkv)
        return self.finish(self.project("out", attended, choices[3], confidences[3], mode, training), training)

    def load_dense(self, qkv_kernel, qkv_bias, out_kernel, out_bias):
        """Truncated-SVD initialisation from a dense attention (``MoNEAttention``'s fused layout)."""
        d = self.hidden_dim
        if tuple(qkv_kernel.shape) != (d, 3 * d):
            raise ValueError(f"`qkv_kernel` must have shape {(d, 3 * d)}, got {tuple(qkv_kernel.shape)}.")
        for index, name in enumerate(PROJECTIONS[:3]):
            bias = None if qkv_bias is None else qkv_bias[index * d:(index + 1) * d]
            self.projections[name].load_dense(qkv_kernel[:, index * d:(index + 1) * d], bias)
        self.projections["out"].load_dense(out_kernel, out_bias)

    def compute_output_shape(self, input_shape):
        return input_shape

    def compute_output_spec(self, inputs, choices, confidences=None, mode=None, training=None):
        return keras.KerasTensor(inputs.shape, dtype=self.compute_dtype)

