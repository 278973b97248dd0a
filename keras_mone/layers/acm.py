"""ACMMLP: an MLP split into learners run per token (Adaptive Computation Modules).

Wojcik et al., "Adaptive Computation Modules" (``../shared/papers/acm.txt``).
The gate is ``layers.acm_gate.ACMGate``; the quota rule of grouped execution
is documented in ``routing.acm_quotas``.
"""

import keras
import numpy as np
from keras import ops

from keras_mone.layers.arguments import integer, number
from keras_mone.layers.config import ConfigMixin, register
from keras_mone.layers.nested_dense import NestedDense
from keras_mone.routing import acm_quotas
from keras_mone.routing.epr import gather_tokens, inverse_permutation, one_hot

MODES = ("exact", "grouped")


@register
class ACMMLP(ConfigMixin, keras.layers.Layer):
    """The ViT MLP as ``N`` learners: ``h(z, k)`` is the MLP at hidden width ``k M / N``.

    Learner ``n`` owns hidden units ``(n-1) M/N .. n M/N`` of one ``fc1`` /
    ``fc2`` pair (the dense MLP's weight paths, so a dense ViT MLP's weights
    load unchanged). ``h(z, k) = sum_{n <= k} s_n(z)`` takes the full-width
    token and returns a full-width output; ``fc2``'s bias belongs to learner 1.
    Hence ``k = 0`` gives exactly 0 (the residual carries the token) and
    ``k = N`` gives exactly the dense MLP: slices of a trained MLP are an
    initialisation exact at ``k = N``. The paper's learners have no output
    bias; here learner 1 carries the dense one.

    Two execution modes, one set of weights:

    * ``"exact"``: every token gets the count its gate picked, learners as
      masked hidden units. With a one-hot ``choices`` the output is
      ``sum_k choices_k h(z, k)``, so straight-through gradients reach the gate.
      The reference and the training path.
    * ``"grouped"`` (inference): tokens ranked by count and confidence; learner
      ``n`` runs only on its static quota of tokens (``routing.acm_quotas``),
      gathered into ``(batch, caps[n-1], D)`` and scattered back. Without
      ``beta`` no quota binds and it equals ``"exact"``.

    Args:
        hidden_dim: model dimension ``D``.
        mlp_dim: hidden width ``M`` (divisible by ``num_learners``).
        num_learners: ``N``; counts ``k`` run over ``0..N``.
        mode: ``"exact"`` or ``"grouped"`` (``call(mode=...)`` overrides it).
        beta: budget of grouped execution in ``(0, 1]``; ``None``: no quotas.
        capacity_factor: slack (>= 1) on the grouped quotas.
        dropout_rate: dropout after the activation and the output (exact mode).
        gelu_approximate: tanh-approximate GELU (as ``NestedMLP``).
        kernel_initializer: initialiser of both projections.

    Example:
        >>> mlp = ACMMLP(64, 256)
        >>> y = mlp(z, choices)                  # choices: (batch, tokens, 5) one-hot
        >>> stack = mlp.all_outputs(z)           # (batch, tokens, 5, 64): h(z, 0..4)
    """

    def __init__(
        self, hidden_dim, mlp_dim, num_learners=4, mode="exact", beta=None, capacity_factor=1.0,
        dropout_rate=0.0, gelu_approximate=False, kernel_initializer="glorot_uniform", **kwargs,
    ):
        super().__init__(**kwargs)
        self.hidden_dim = integer("hidden_dim", hidden_dim)
        self.mlp_dim = integer("mlp_dim", mlp_dim)
        self.num_learners = integer("num_learners", num_learners)
        if self.mlp_dim % self.num_learners:
            raise ValueError(
                f"`num_learners` must divide `mlp_dim` ({self.mlp_dim}), got {num_learners!r}."
            )
        self.mode = _check_mode(mode)
        self.beta = None if beta is None else acm_quotas.check_beta(beta)
        self.capacity_factor = number("capacity_factor", capacity_factor, 1.0)
        self.dropout_rate = number("dropout_rate", dropout_rate, 0.0, 1.0, high_open=True)
        self.gelu_approximate = bool(gelu_approximate)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        small = keras.initializers.RandomNormal(stddev=1e-6)  # as NestedMLP's biases
        self.fc1 = NestedDense(
            self.mlp_dim, kernel_initializer=kernel_initializer, bias_initializer=small,
            dtype=self.dtype_policy, name="fc1",
        )
        self.fc2 = NestedDense(
            self.hidden_dim, kernel_initializer=kernel_initializer, bias_initializer=small,
            dtype=self.dtype_policy, name="fc2",
        )
        self.dropout = keras.layers.Dropout(self.dropout_rate, dtype=self.dtype_policy)
        unit_learner = np.arange(self.mlp_dim) // self.learner_width + 1
        # _reach[k, u] = 1 if hidden unit u belongs to a learner n <= k
        self._reach = (np.arange(self.num_learners + 1)[:, None] >= unit_learner[None, :]).astype("float32")

    @property
    def learner_width(self):
        return self.mlp_dim // self.num_learners

    def build(self, input_shape):
        self.fc1.build((None, None, self.hidden_dim))
        self.fc2.build((None, None, self.mlp_dim))

    def _gelu(self, x):
        return ops.gelu(x, approximate=self.gelu_approximate)

    def output_at(self, inputs, k):
        """``h(z, k)`` for one static ``k`` in ``0..N`` (the MLP at hidden width ``k M / N``)."""
        k = integer("k", k, low=0)
        if k > self.num_learners:
            raise ValueError(f"`k` must lie in [0, {self.num_learners}], got {k}.")
        if k == 0:
            return ops.zeros_like(inputs)
        width = k * self.learner_width
        hidden = self._gelu(self.fc1(inputs, out_width=width, pad_output=False))
        return self.fc2(hidden, in_width=width)

    def all_outputs(self, inputs):
        """``(..., N + 1, D)``: ``h(z, k)`` for every ``k = 0..N`` (phases 1 and 2)."""
        hidden = self._gelu(self.fc1(inputs))
        parts = ops.reshape(hidden, (-1,) + tuple(hidden.shape[1:-1]) + (self.num_learners, self.learner_width))
        kernel = ops.reshape(
            ops.cast(self.fc2.kernel, self.compute_dtype), (self.num_learners, self.learner_width, self.hidden_dim)
        )
        learners = ops.einsum("...nm,nmd->...nd", parts, kernel)  # s_n(z) without bias
        outputs = ops.cumsum(learners, axis=-2) + ops.cast(self.fc2.bias, self.compute_dtype)
        outputs = ops.concatenate([ops.zeros_like(outputs[..., :1, :]), outputs], axis=-2)
        return ops.reshape(outputs, (-1,) + tuple(inputs.shape[1:-1]) + (self.num_learners + 1, self.hidden_dim))

    def call(self, inputs, choices, confidence=None, mode=None, training=None):
        """``h(z, k)`` per token.

        Args:
            inputs: ``(batch, tokens, D)``.
            choices: one-hot ``(batch, tokens, N + 1)`` over ``k = 0..N`` (the
                gate's output), or int counts ``(batch, tokens)``.
            confidence: ``(batch, tokens)`` gate confidence; grouped mode drops
                the least confident tokens first when a quota binds.
            mode: overrides the layer's ``mode``.
        """
        mode = self.mode if mode is None else _check_mode(mode)
        if mode == "grouped":
            counts = self._counts(choices)
            return self._grouped(inputs, counts, confidence)
        return self._exact(inputs, self._one_hot(choices), training)

    def final_counts(self, choices, confidence=None, mode=None):
        """``(batch, tokens)`` int32 counts actually run (after quotas in grouped mode)."""
        counts = self._counts(choices)
        if (self.mode if mode is None else _check_mode(mode)) == "exact":
            return counts
        caps = self.caps(counts.shape[1])
        return acm_quotas.assign_counts(counts, confidence, caps)[2]

    def caps(self, num_tokens):
        """Static token slots of learners ``1..N`` for ``num_tokens`` tokens."""
        return acm_quotas.learner_caps(num_tokens, self.num_learners, self.beta, self.capacity_factor)

    def _one_hot(self, choices):
        if len(choices.shape) == 2:
            return one_hot(ops.cast(choices, "int32"), self.num_learners + 1, self.compute_dtype)
        _check_choices(choices, self.num_learners)
        return ops.cast(choices, self.compute_dtype)

    def _counts(self, choices):
        if len(choices.shape) == 2:
            return ops.cast(choices, "int32")
        _check_choices(choices, self.num_learners)
        return ops.cast(ops.argmax(choices, axis=-1), "int32")

    def _exact(self, inputs, choices, training):
        hidden = self.dropout(self._gelu(self.fc1(inputs)), training=training)
        mask = ops.matmul(choices, ops.convert_to_tensor(self._reach, dtype=self.compute_dtype))
        outputs = ops.matmul(hidden * mask, ops.cast(self.fc2.kernel, self.compute_dtype))
        runs = ops.sum(choices[..., 1:], axis=-1, keepdims=True)  # the output bias belongs to learner 1
        outputs = outputs + runs * ops.cast(self.fc2.bias, self.compute_dtype)
        return self.dropout(outputs, training=training)

    def _grouped(self, inputs, counts, confidence):
        num_tokens = inputs.shape[1]
        caps = self.caps(num_tokens)
        order, ranked, _ = acm_quotas.assign_counts(counts, confidence, caps)
        dtype = self.compute_dtype
        w1, b1 = ops.cast(self.fc1.kernel, dtype), ops.cast(self.fc1.bias, dtype)
        w2, b2 = ops.cast(self.fc2.kernel, dtype), ops.cast(self.fc2.bias, dtype)
        ranked_out = None
        for n, cap in enumerate(caps, start=1):
            if cap == 0:
                break
            lo, hi = (n - 1) * self.learner_width, n * self.learner_width
            tokens = gather_tokens(inputs, order[:, :cap])
            part = ops.matmul(self._gelu(ops.matmul(tokens, w1[:, lo:hi]) + b1[lo:hi]), w2[lo:hi])
            if n == 1:
                part = part + b2
            part = part * ops.cast(ops.expand_dims(ranked[:, :cap] >= n, -1), dtype)
            if cap < num_tokens:
                part = ops.pad(part, [[0, 0], [0, num_tokens - cap], [0, 0]])
            ranked_out = part if ranked_out is None else ranked_out + part
        if ranked_out is None:
            return ops.zeros_like(inputs)
        return gather_tokens(ranked_out, inverse_permutation(order))

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def compute_output_spec(self, inputs, choices, confidence=None, mode=None, training=None):
        return keras.KerasTensor(inputs.shape, dtype=self.compute_dtype)


def _check_mode(mode):
    if mode not in MODES:
        raise ValueError(f"`mode` must be one of {list(MODES)}, got {mode!r}.")
    return mode


def _check_choices(choices, num_learners):
    if choices.shape[-1] != num_learners + 1:
        raise ValueError(
            f"`choices` must be a one-hot over k = 0..{num_learners} (last axis {num_learners + 1}) "
            f"or int counts (batch, tokens), got shape {tuple(choices.shape)}."
        )
