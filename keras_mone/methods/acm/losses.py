"""ACM's training losses as pure ``keras.ops`` functions (Wojcik et al., Sec. 3).

Conventions: a module's stack of outputs is ``(..., N + 1, D)``, ``h(z, k)``
for ``k = 0..N`` (``ACMMLP.all_outputs``); a module's gate choices are
``(batch, tokens, N + 1)`` over ``k = 0..N`` (one-hot, straight-through in
training, so these losses reach the gates). A module whose counts start at 1
puts 0 in column 0 (``with_zero_choice``). Arguments taking several modules accept a list (one
entry per module) or one tensor. Every loss returns a float32 scalar.

Phase 1 (learners, teacher frozen): ``distillation_loss``.
Phase 2 (gates, learners frozen): ``gate_labels`` then ``gate_cross_entropy``.
Phase 3 (end to end): ``CE + 0.1 budget_loss + 0.05 entropy_loss - 0.05 diversity_loss``.
"""

import math

from keras import ops

from keras_mone.methods.acm.mlp import with_zero_choice  # noqa: F401  (re-exported: the losses' input convention)
from keras_mone.arguments import number


def _modules(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _learner_counts(choices):
    """float32 ``(batch, tokens)`` count ``k = sum_c c * choices_c`` and ``N``."""
    choices = ops.cast(choices, "float32")
    num_learners = choices.shape[-1] - 1
    return ops.einsum("btc,c->bt", choices, ops.arange(num_learners + 1, dtype="float32")), num_learners


def distillation_loss(outputs, targets):
    """Phase 1: mean over tokens, modules and ``n = 1..N`` of ``||h(z, n) - o||^2``.

    ``outputs``: per module ``(..., N + 1, D)`` (``k = 0`` is left out);
    ``targets``: per module the teacher's output ``o``, ``(..., D)``. The
    squared norm sums over features; modules are averaged with equal weight
    (the paper's mean when they see the same tokens). Gradients flow through
    every term (the official code detaches each learner's predecessors).
    The paper's Sec. 3.2 formula writes the target as ``o_i^l`` (per image);
    it is each token's output ``o_{i,j}^l``, as in its ``d(n)`` and Sec. 5.1.
    ``o`` is the frozen dense module's output on the dense model's stream
    (``acm.teacher``); ``k = 0`` (zeros) is no choice to fit.
    """
    losses = []
    for out, target in zip(_modules(outputs), _modules(targets), strict=True):
        error = ops.cast(out[..., 1:, :], "float32") - ops.expand_dims(ops.cast(target, "float32"), -2)
        losses.append(ops.mean(ops.sum(ops.square(error), axis=-1)))
    return ops.mean(ops.stack(losses))


def gate_labels(outputs, targets, tau):
    """Phase 2 labels by the tau rule, int32 ``(...)`` with values in ``{2..N}``.

    ``d(n) = ||h(z, n) - o||`` (L2 over features) for ``n = 1..N``; the label
    is the smallest ``n`` in ``{2..N}`` with ``d(n) >= tau * d(n - 1)`` (the
    paper's ``d(n) / d(n-1) >= tau`` without the division, so ``d(n-1) = 0``
    counts as "no further improvement" and labels ``n``), else ``N``. As in
    the paper, ``n = 1`` and ``k = 0`` are never labels (phase 3's budget loss
    can still move tokens there); with ``N = 1`` every label is 1. The
    official code differs in one case: when ``d(1) / d(0) >= tau`` (``d(0) = ||o||``)
    it labels ``N``. ``tau`` in ``(0, inf)``; the official factor 1.2 is ``tau = 1/1.2``.
    """
    tau = number("tau", tau, 0.0, low_open=True)
    if isinstance(outputs, (list, tuple)) or isinstance(targets, (list, tuple)):
        raise ValueError("`gate_labels` takes one module's `outputs` and `targets`, not lists.")
    out = ops.cast(outputs, "float32")
    num_learners = out.shape[-2] - 1
    error = out[..., 1:, :] - ops.expand_dims(ops.cast(targets, "float32"), -2)
    distance = ops.sqrt(ops.sum(ops.square(error), axis=-1))
    if num_learners < 2:
        return ops.cast(ops.full(distance.shape[:-1], num_learners), "int32")
    stalled = ops.cast(distance[..., 1:] >= tau * distance[..., :-1], "int32")  # n = 2..N
    first = ops.cast(ops.argmax(stalled, axis=-1), "int32") + 2
    return ops.where(ops.max(stalled, axis=-1) > 0, first, num_learners)


def gate_cross_entropy(probs, labels):
    """Phase 2: mean of ``-log probs[label]`` over tokens (and modules, given lists)."""
    losses = []
    for p, label in zip(_modules(probs), _modules(labels), strict=True):
        p = ops.cast(p, "float32")
        picked = ops.sum(p * ops.one_hot(ops.cast(label, "int32"), p.shape[-1], dtype="float32"), axis=-1)
        losses.append(ops.mean(-ops.log(ops.maximum(picked, 1e-20))))
    return ops.mean(ops.stack(losses))


def learner_fraction(choices, learner_costs=None):
    """``(batch,)``: per image, learner compute used over available, over all modules.

    ``sum_{j,l} k p_l / sum_{j,l} N_l p_l``; ``learner_costs`` = ``p_l``, the
    cost of one learner of module ``l`` (default 1 each: the paper's ``b_i``).
    """
    choices = _modules(choices)
    costs = [1.0] * len(choices) if learner_costs is None else list(learner_costs)
    if len(costs) != len(choices):
        raise ValueError(f"`learner_costs` needs one cost per module ({len(choices)}), got {len(costs)}.")
    used, available = 0.0, 0.0
    for c, cost in zip(choices, costs):
        counts, num_learners = _learner_counts(c)
        used = used + float(cost) * ops.sum(counts, axis=1)
        available += float(cost) * num_learners * c.shape[1]
    return used / available


def budget_loss(choices, beta_target, learner_costs=None):
    """L_budget = ``|mean over images of learner_fraction - beta_target|`` (Sec. 3.3).

    The paper's ``p^l`` are ``learner_costs``; leaving them out weighs every
    module alike, which is the paper's loss only when every module's learner
    costs the same (ACM on the MLPs alone)."""
    beta_target = number("beta_target", beta_target, 0.0, 1.0, low_open=True, high_open=True)
    return ops.abs(ops.mean(learner_fraction(choices, learner_costs)) - beta_target)


def entropy_loss(choices):
    """L_entropy = mean over images and modules of ``sum_c a_c log a_c / log C``.

    ``a``: the image's normalised histogram of choices over its tokens, ``C``
    its number of choices (``N + 1`` with ``k = 0``, as the official code).
    This is minus the normalised entropy, in ``[-1, 0]``: minimising it spreads
    each image's choices. ``0 log 0 = 0``.
    """
    losses = []
    for c in _modules(choices):
        c = ops.cast(c, "float32")
        hist = ops.sum(c, axis=1)
        hist = hist / ops.sum(hist, axis=-1, keepdims=True)
        plogp = hist * ops.log(ops.maximum(hist, 1e-20))
        losses.append(ops.mean(ops.sum(plogp, axis=-1)) / math.log(c.shape[-1]))
    return ops.mean(ops.stack(losses))


def diversity_loss(choices):
    """L_diversity = mean over image pairs ``(i, m)`` of ``|b_i - b_m|`` (``b`` = ``learner_fraction``)."""
    b = learner_fraction(choices)
    return ops.mean(ops.abs(ops.expand_dims(b, 0) - ops.expand_dims(b, 1)))
