"""ACMLinear: a linear projection (Q, K, V or O) as low-rank ACM learners."""

import keras
import numpy as np
from keras import ops

from keras_mone.methods.acm.mlp import LearnerStack
from keras_mone.arguments import integer
from keras_mone.layers.config import ConfigMixin, register
from keras_mone.routing.epr import gather_tokens, inverse_permutation


def default_rank(input_dim, units, num_learners):
    """The learner rank ``r``: ``N`` learners have about the parameters of one dense layer.

    ``r = round((D_in D_out + D_out) / (N (D_in + D_out + 1)))`` (at least 1),
    i.e. ``(D^2 + D) / (N (2D + 1))`` for a square projection (96 for ViT-B, N = 4).
    The paper gives the rule, not the number (Sec. 3.1: "we always pick N and
    the size of a single learner such that the entire ACM module has
    approximately the same computational cost and the number of parameters
    as the substituted block"); the formula is the official code's
    ``attention_linear_block_dim`` with ``block_flops_factor = 1 / N``
    (``acmize_vit``), recorded in ``../shared/notes/methods.md``. For ViT-B the
    ``N`` learners then cost exactly ``D^2`` MACs per token, the dense projection's.
    """
    return max(1, round((input_dim * units + units) / (num_learners * (input_dim + units + 1))))


@register
class ACMLinear(ConfigMixin, LearnerStack):
    """``N`` low-rank learners ``Linear(D -> r) -> Linear(r -> units)``; counts ``k`` in ``1..N``.

    Learner ``n`` is chunk ``n`` of one ``down`` (``D -> N r``) / ``up``
    (``N r -> units``) pair, no activation; ``up``'s bias belongs to learner 1,
    which every token runs. ``choices`` is a one-hot over ``k = 1..N`` (the
    output of ``ACMGate(N)``) or int counts; execution modes and quotas as
    ``ACMMLP`` (``caps`` gives learner 1 every token).
    ``load_dense(kernel, bias)`` initialises the learners from a dense
    projection by truncated SVD: learner ``n`` takes singular directions
    ``(n-1) r .. n r``, so ``h(z, k)`` is the best rank-``k r`` approximation.

    Args:
        hidden_dim: input width ``D``.
        units: output width (default ``D``).
        num_learners: ``N``.
        rank: ``r`` per learner (default ``default_rank``).
        mode, beta, capacity_factor: as ``ACMMLP`` (``beta`` above ``1 / N``).
        kernel_initializer: initialiser of both projections.
    """

    min_count = 1

    def __init__(
        self, hidden_dim, units=None, num_learners=4, rank=None, mode="exact", beta=None, capacity_factor=1.0,
        kernel_initializer="glorot_uniform", **kwargs,
    ):
        super().__init__(**kwargs)
        self.hidden_dim = integer("hidden_dim", hidden_dim)
        self.units = self.hidden_dim if units is None else integer("units", units)
        learners = integer("num_learners", num_learners)
        self.rank = default_rank(self.hidden_dim, self.units, learners) if rank is None else integer("rank", rank)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self._setup(
            self.units, learners * self.rank, learners, mode, beta, capacity_factor, kernel_initializer,
            ("down", "up"),
        )

    def build(self, input_shape):
        self.fc1.build((None, None, self.hidden_dim))
        self.fc2.build((None, None, self.num_learners * self.rank))

    def _activate(self, x):
        return x

    def _grouped(self, inputs, counts, confidence):
        """Grouped execution (``LearnerStack``'s quotas and reassignment): learner 1,
        which every token runs, on the tokens in place; learners ``2..N`` on one
        gather of the first ``caps[1]`` ranked tokens (each on its prefix
        ``caps[n-1]``), scattered back once. Same result, fewer token copies."""
        num_tokens, width = inputs.shape[1], self.learner_width
        caps = self.caps(num_tokens)
        dtype = self.compute_dtype
        w1, b1 = ops.cast(self.fc1.kernel, dtype), ops.cast(self.fc1.bias, dtype)
        w2, b2 = ops.cast(self.fc2.kernel, dtype), ops.cast(self.fc2.bias, dtype)
        outputs = ops.matmul(ops.matmul(inputs, w1[:, :width]) + b1[:width], w2[:width]) + b2
        if self.num_learners == 1 or caps[1] == 0:
            return outputs
        order, ranked, _ = self._assign(counts, confidence)
        ranked_tokens = gather_tokens(inputs, order[:, :caps[1]])
        extra = None
        for n, cap in enumerate(caps[1:], start=2):
            if cap == 0:
                break
            lo, hi = (n - 1) * width, n * width
            part = ops.matmul(ops.matmul(ranked_tokens[:, :cap], w1[:, lo:hi]) + b1[lo:hi], w2[lo:hi])
            part = part * ops.cast(ops.expand_dims(ranked[:, :cap] >= n, -1), dtype)
            if cap < caps[1]:
                part = ops.pad(part, [[0, 0], [0, caps[1] - cap], [0, 0]])
            extra = part if extra is None else extra + part
        if caps[1] < num_tokens:
            extra = ops.pad(extra, [[0, 0], [0, num_tokens - caps[1]], [0, 0]])
        return outputs + gather_tokens(extra, inverse_permutation(order))

    def load_dense(self, kernel, bias=None):
        """Sets the learners to the truncated SVD of a dense ``(D, units)`` kernel (+ bias)."""
        kernel = np.asarray(kernel, np.float64)
        if kernel.shape != (self.hidden_dim, self.units):
            raise ValueError(f"`kernel` must have shape {(self.hidden_dim, self.units)}, got {kernel.shape}.")
        if not self.built:
            self.build((None, None, self.hidden_dim))
        width = self.num_learners * self.rank
        u, s, vt = np.linalg.svd(kernel, full_matrices=False)
        used = min(width, s.size)  # directions beyond the kernel's rank stay zero
        down, up = np.zeros((self.hidden_dim, width)), np.zeros((width, self.units))
        down[:, :used] = u[:, :used] * np.sqrt(s[:used])
        up[:used] = np.sqrt(s[:used])[:, None] * vt[:used]
        self.fc1.kernel.assign(down.astype("float32"))
        self.fc1.bias.assign(np.zeros(width, "float32"))
        self.fc2.kernel.assign(up.astype("float32"))
        self.fc2.bias.assign(np.zeros(self.units, "float32") if bias is None else np.asarray(bias, "float32"))
