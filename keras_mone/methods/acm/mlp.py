"""ACMMLP: an MLP split into learners run per token (Adaptive Computation Modules).

Wojcik et al., "Adaptive Computation Modules" (``../shared/papers/acm.txt``).
``LearnerStack`` holds what ``ACMMLP`` and ``acm.linear.ACMLinear``
share; the gate is ``acm.gate.ACMGate``; the quota rule of grouped
execution is documented in ``acm.quotas``.
"""

import keras
import numpy as np
from keras import ops

from keras_mone.arguments import integer, number
from keras_mone.layers.config import ConfigMixin, register
from keras_mone.layers.nested_dense import NestedDense
from keras_mone.methods.acm import quotas as acm_quotas
from keras_mone.routing.epr import gather_tokens, inverse_permutation, one_hot

MODES = ("exact", "grouped")



def with_zero_choice(choices):
    """A one-hot over ``k = 1..N`` (``ACMLinear``'s gate) as one over ``k = 0..N``."""
    return ops.pad(ops.cast(choices, "float32"), [[0, 0]] * (len(choices.shape) - 1) + [[1, 0]])

class LearnerStack(keras.layers.Layer):
    """Shared base of ``ACMMLP`` and ``ACMLinear``: ``N`` learners as hidden-unit chunks.

    ``fc1`` (in -> ``N`` chunks of ``learner_width``) and ``fc2`` (chunks -> out);
    learner ``n`` is chunk ``n`` of both, ``fc2``'s bias belongs to learner 1.
    Counts ``k`` run over ``min_count..N``; a one-hot ``choices`` has one column
    per allowed count. Subclasses call ``_setup`` and define ``_activate``.
    """

    min_count = 0

    def _setup(self, out_dim, hidden, num_learners, mode, beta, capacity_factor, kernel_initializer, names, dropout=0.0):
        self.num_learners = integer("num_learners", num_learners)
        if hidden % self.num_learners:
            raise ValueError(f"`num_learners` must divide the hidden width ({hidden}), got {num_learners!r}.")
        self.learner_width = hidden // self.num_learners
        self.out_dim = out_dim
        self.mode = _check_mode(mode)
        self.beta = None if beta is None else acm_quotas.check_beta(beta)
        if self.beta is not None and self.beta * self.num_learners <= self.min_count:
            raise ValueError(
                f"`beta` must exceed {self.min_count}/{self.num_learners} (every token runs "
                f"{self.min_count} learner), got {beta!r}."
            )
        self.capacity_factor = number("capacity_factor", capacity_factor, 1.0)
        small = keras.initializers.RandomNormal(stddev=1e-6)  # as NestedMLP's biases
        self.fc1 = NestedDense(
            hidden, kernel_initializer=kernel_initializer, bias_initializer=small,
            dtype=self.dtype_policy, name=names[0],
        )
        self.fc2 = NestedDense(
            out_dim, kernel_initializer=kernel_initializer, bias_initializer=small,
            dtype=self.dtype_policy, name=names[1],
        )
        self.dropout = keras.layers.Dropout(dropout, dtype=self.dtype_policy)
        counts = np.arange(self.min_count, self.num_learners + 1)
        unit_learner = np.arange(hidden) // self.learner_width + 1
        # _reach[c, u] = 1 if hidden unit u belongs to a learner n <= k_c; _runs[c] = 1 if k_c >= 1
        self._reach = (counts[:, None] >= unit_learner[None, :]).astype("float32")
        self._runs = (counts >= 1).astype("float32")[:, None]

    def _activate(self, x):
        raise NotImplementedError

    def output_at(self, inputs, k):
        """``h(z, k)`` for one static ``k`` in ``0..N`` (hidden width ``k`` learner widths)."""
        k = integer("k", k, low=0)
        if k > self.num_learners:
            raise ValueError(f"`k` must lie in [0, {self.num_learners}], got {k}.")
        if k == 0:
            return ops.zeros(ops.shape(inputs)[:-1] + (self.out_dim,), self.compute_dtype)
        width = k * self.learner_width
        hidden = self._activate(self.fc1(inputs, out_width=width, pad_output=False))
        return self.fc2(hidden, in_width=width)

    def all_outputs(self, inputs):
        """``(..., N + 1, out)``: ``h(z, k)`` for every ``k = 0..N`` (phases 1 and 2).

        ``k = 0`` (zeros) is included even where it is no choice, so every
        ACM's stack has one layout (``acm.losses``)."""
        hidden = self._activate(self.fc1(inputs))
        parts = ops.reshape(hidden, (-1,) + tuple(hidden.shape[1:-1]) + (self.num_learners, self.learner_width))
        kernel = ops.reshape(
            ops.cast(self.fc2.kernel, self.compute_dtype), (self.num_learners, self.learner_width, self.out_dim)
        )
        learners = ops.einsum("...nm,nmd->...nd", parts, kernel)  # s_n(z) without bias
        outputs = ops.cumsum(learners, axis=-2) + ops.cast(self.fc2.bias, self.compute_dtype)
        outputs = ops.concatenate([ops.zeros_like(outputs[..., :1, :]), outputs], axis=-2)
        return ops.reshape(outputs, (-1,) + tuple(inputs.shape[1:-1]) + (self.num_learners + 1, self.out_dim))

    def call(self, inputs, choices, confidence=None, mode=None, training=None):
        """``h(z, k)`` per token.

        Args:
            inputs: ``(batch, tokens, D)``.
            choices: one-hot ``(batch, tokens, N + 1 - min_count)`` over
                ``k = min_count..N`` (the gate's output), or int counts ``(batch, tokens)``.
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
        return self._assign(counts, confidence)[2]

    @property
    def learner_macs(self):
        """MACs of one learner on one token, ``in -> learner_width -> out`` (ACM's ``p^l``, Sec. 3.3)."""
        return (self.hidden_dim + self.out_dim) * self.learner_width

    def caps(self, num_tokens):
        """Static token slots of learners ``1..N`` for ``num_tokens`` tokens.

        Learners every token runs (``n <= min_count``) take all tokens; the
        others share the budget left, ``(beta N - min_count) / (N - min_count)``.
        """
        optional = self.num_learners - self.min_count
        beta = self.beta
        if beta is not None and optional:
            beta = min(1.0, (beta * self.num_learners - self.min_count) / optional)
        rest = acm_quotas.learner_caps(num_tokens, optional, beta, self.capacity_factor) if optional else ()
        return (num_tokens,) * self.min_count + tuple(rest)

    def _assign(self, counts, confidence):
        caps = self.caps(counts.shape[1])[self.min_count:]
        order, ranked, final = acm_quotas.assign_counts(counts - self.min_count, confidence, caps)
        return order, ranked + self.min_count, final + self.min_count

    def _one_hot(self, choices):
        columns = self.num_learners + 1 - self.min_count
        if len(choices.shape) == 2:
            return one_hot(ops.cast(choices, "int32") - self.min_count, columns, self.compute_dtype)
        self._check_choices(choices)
        return ops.cast(choices, self.compute_dtype)

    def _counts(self, choices):
        if len(choices.shape) == 2:
            return ops.cast(choices, "int32")
        self._check_choices(choices)
        return ops.cast(ops.argmax(choices, axis=-1), "int32") + self.min_count

    def _check_choices(self, choices):
        low, high = self.min_count, self.num_learners
        if choices.shape[-1] != high + 1 - low:
            raise ValueError(
                f"`choices` must be a one-hot over k = {low}..{high} (last axis {high + 1 - low}) "
                f"or int counts (batch, tokens), got shape {tuple(choices.shape)}."
            )

    def _exact(self, inputs, choices, training):
        hidden = self.dropout(self._activate(self.fc1(inputs)), training=training)
        mask = ops.matmul(choices, ops.convert_to_tensor(self._reach, dtype=self.compute_dtype))
        outputs = ops.matmul(hidden * mask, ops.cast(self.fc2.kernel, self.compute_dtype))
        runs = ops.matmul(choices, ops.convert_to_tensor(self._runs, dtype=self.compute_dtype))  # bias: learner 1
        outputs = outputs + runs * ops.cast(self.fc2.bias, self.compute_dtype)
        return self.dropout(outputs, training=training)

    def _grouped(self, inputs, counts, confidence):
        num_tokens = inputs.shape[1]
        caps = self.caps(num_tokens)
        order, ranked, _ = self._assign(counts, confidence)
        dtype = self.compute_dtype
        w1, b1 = ops.cast(self.fc1.kernel, dtype), ops.cast(self.fc1.bias, dtype)
        w2, b2 = ops.cast(self.fc2.kernel, dtype), ops.cast(self.fc2.bias, dtype)
        ranked_out = None
        for n, cap in enumerate(caps, start=1):
            if cap == 0:
                break
            lo, hi = (n - 1) * self.learner_width, n * self.learner_width
            tokens = gather_tokens(inputs, order[:, :cap])
            part = ops.matmul(self._activate(ops.matmul(tokens, w1[:, lo:hi]) + b1[lo:hi]), w2[lo:hi])
            if n == 1:
                part = part + b2
            if n > self.min_count:
                part = part * ops.cast(ops.expand_dims(ranked[:, :cap] >= n, -1), dtype)
            if cap < num_tokens:
                part = ops.pad(part, [[0, 0], [0, num_tokens - cap], [0, 0]])
            ranked_out = part if ranked_out is None else ranked_out + part
        if ranked_out is None:
            return ops.zeros(ops.shape(inputs)[:-1] + (self.out_dim,), dtype)
        return gather_tokens(ranked_out, inverse_permutation(order))

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self.out_dim,)

    def compute_output_spec(self, inputs, choices, confidence=None, mode=None, training=None):
        return keras.KerasTensor(self.compute_output_shape(inputs.shape), dtype=self.compute_dtype)


@register
class ACMMLP(ConfigMixin, LearnerStack):
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
      ``n`` runs only on its static quota of tokens (``acm.quotas``),
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
        self.dropout_rate = number("dropout_rate", dropout_rate, 0.0, 1.0, high_open=True)
        self.gelu_approximate = bool(gelu_approximate)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self._setup(
            self.hidden_dim, self.mlp_dim, num_learners, mode, beta, capacity_factor, kernel_initializer,
            ("fc1", "fc2"), dropout=self.dropout_rate,
        )

    def build(self, input_shape):
        self.fc1.build((None, None, self.hidden_dim))
        self.fc2.build((None, None, self.mlp_dim))

    def _activate(self, x):
        return ops.gelu(x, approximate=self.gelu_approximate)

def _check_mode(mode):
    if mode not in MODES:
        raise ValueError(f"`mode` must be one of {list(MODES)}, got {mode!r}.")
    return mode

