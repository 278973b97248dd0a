"""Static learner quotas for ACM's grouped execution, and the reassignment rule.

ACM (Wojcik et al.) gives each token a learner count ``k`` in ``{0..N}``;
learner ``n`` runs on the tokens with ``k >= n``. For static shapes, learner
``n`` gets a fixed number of token slots ``caps[n-1]`` (non-increasing in
``n``), derived from the budget ``beta``:

* Shares: ``p_k``, the maximum-entropy histogram over ``{0..N}`` whose mean
  is ``beta * N`` (``p_k`` proportional to ``r**k``; uniform at ``beta = 0.5``,
  all ``N`` at ``beta = 1``). It is the histogram that meets the budget
  exactly (L_budget = 0) with the least L_entropy, the two terms ACM trains with.
* Caps: ``caps[n-1] = min(T, ceil(capacity_factor * T * sum_{k >= n} p_k))``
  for ``T`` tokens. With ``capacity_factor = 1`` the learners' total work is
  ``beta * N * T`` (up to rounding); a larger factor leaves slack.

Reassignment (``assign_counts``), per example: tokens are ranked by their
gate's count, then by gate confidence (both descending; ties go to the lower
token index). The token at rank ``p`` keeps ``min(k, L(p))``, where
``L(p) = #{n : p < caps[n-1]}``. So a token beyond its count's quota drops
to the next lower count that still has room at its rank, the lowest-confidence
tokens of a count dropping first; a dropped token ranks ahead of every token
that chose the lower count. Final counts never exceed the chosen ones and
never increase along the ranking, so learner ``n`` runs on the contiguous
first ``caps[n-1]`` ranked tokens (those of them with a final count below ``n``
are masked).
"""

import math

import numpy as np
from keras import ops

from keras_mone.arguments import integer, number
from keras_mone.routing.epr import gather_tokens, inverse_permutation, select_top_k


def check_beta(beta):
    """``beta`` as a float in ``(0, 1]``, or a ``ValueError`` naming it."""
    return number("beta", beta, 0.0, 1.0, low_open=True)


def max_entropy_shares(num_learners, beta):
    """``(p_0, ..., p_N)``: the maximum-entropy histogram of counts with mean ``beta * N``."""
    num_learners, beta = integer("num_learners", num_learners), check_beta(beta)
    counts = np.arange(num_learners + 1, dtype=np.float64)
    if beta == 1.0:
        return tuple(float(c == num_learners) for c in counts)

    def shares(log_r):
        w = np.exp(log_r * counts - np.max(log_r * counts))
        return w / w.sum()

    low, high = -60.0, 60.0  # mean count rises monotonically with log r
    for _ in range(200):
        mid = 0.5 * (low + high)
        if shares(mid) @ counts < beta * num_learners:
            low = mid
        else:
            high = mid
    return tuple(float(p) for p in shares(0.5 * (low + high)))


def learner_caps(num_tokens, num_learners, beta=None, capacity_factor=1.0):
    """Token slots of learners ``1..N`` (non-increasing); ``beta=None``: no quota (all ``T``)."""
    num_tokens, num_learners = integer("num_tokens", num_tokens), integer("num_learners", num_learners)
    if beta is None:
        return (num_tokens,) * num_learners
    capacity_factor = number("capacity_factor", capacity_factor, 1.0)
    tail = np.cumsum(max_entropy_shares(num_learners, beta)[::-1])[::-1][1:]  # sum_{k >= n} p_k
    # the epsilon keeps a share that is an exact multiple of 1 / T from rounding up
    return tuple(min(num_tokens, math.ceil(capacity_factor * num_tokens * s - 1e-9)) for s in tail)


def rank_limits(caps, num_tokens):
    """``L(p)``: the largest count allowed at rank ``p`` (int32 numpy, length ``T``)."""
    ranks = np.arange(num_tokens)[:, None]
    return (ranks < np.asarray(caps, dtype=np.int64)[None, :]).sum(axis=1).astype("int32")


def assign_counts(counts, confidence, caps):
    """The reassignment rule (module docstring) with static shapes.

    Args:
        counts: ``(batch, tokens)`` int learner counts the gate picked.
        confidence: ``(batch, tokens)`` gate confidence in ``[0, 1]``, or ``None``
            (then ties: the lower token index ranks first).
        caps: static token slots of learners ``1..N`` (``learner_caps``).

    Returns:
        ``(order, ranked_counts, final_counts)``: int32 ``(batch, tokens)``;
        ``order[b, p]`` is the token at rank ``p``, ``ranked_counts`` the final
        counts in rank order, ``final_counts`` in the original token order.
    """
    counts = ops.cast(counts, "int32")
    num_tokens = counts.shape[1]
    key = ops.cast(counts, "float32") * 2.0
    if confidence is not None:
        key = key + ops.clip(ops.cast(confidence, "float32"), 0.0, 1.0)
    order, _ = select_top_k(key, num_tokens)
    limits = ops.convert_to_tensor(rank_limits(caps, num_tokens))
    ranked = ops.minimum(gather_tokens(counts, order), ops.expand_dims(limits, 0))
    return order, ranked, gather_tokens(ranked, inverse_permutation(order))


def moved_share(counts, final_counts):
    """Share of tokens whose final count differs from the gate's choice (float32 scalar)."""
    moved = ops.not_equal(ops.cast(counts, "int32"), ops.cast(final_counts, "int32"))
    return ops.mean(ops.cast(moved, "float32"))
