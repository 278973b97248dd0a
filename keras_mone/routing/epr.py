"""Expert Preferred Routing (MoNE paper, Algorithm 1) with static shapes.

Every function here uses ``keras.ops`` and static per-expert token counts, so
it compiles under ``jax.jit``, ``tf.function`` and ``torch.compile``. On torch,
where eager calls pay per op on the host, a few functions take a shorter form
with the same results (``_top_k_indices``, ``inverse_permutation``,
``gather_tokens``) and small index constants are made once per device
(``_arange``); none of them reads a tensor's values on the host.
"""

import math

import keras
import numpy as np
from keras import ops

DROPPED = -1
"""Expert index of a token that no expert processes (only with ``mod_greedy``)."""

_NULLED = -1.0  # below every probability, so an assigned token is never re-picked
_NON_FINITE = -0.5  # NaN / inf scores: below every probability, above _NULLED


def one_hot(indices, depth, dtype):
    """``ops.one_hot`` as a comparison with ``arange(depth)`` (an index outside
    ``[0, depth)`` gives a zero row on every backend). Unlike torch's
    ``one_hot`` it checks no values at run time, so ``torch.export`` (and with
    it ONNX export) can trace it."""
    return ops.cast(ops.expand_dims(indices, -1) == _arange(depth, indices), dtype)


def expert_token_counts(capacities, num_tokens):
    """Static per-expert token counts ``k_j`` for ``num_tokens`` tokens.

    ``k_j = floor(c_j * N)`` for every expert but the smallest, which also takes
    the tokens left over by integer packing (Algorithm 1, lines 1-3). When the
    capacities sum to less than one (``mod_greedy``), the smallest expert gets
    ``floor(c_1 * N)`` and the rest are dropped.

    Returns:
        ``(counts, num_dropped)``: a tuple of ``E`` ints (smallest expert first)
        and the number of dropped tokens.
    """
    c = np.asarray(capacities, dtype=np.float64)
    if c.ndim != 1 or c.size == 0 or np.any(c < 0) or c.sum() > 1.0 + 1e-6:
        raise ValueError(
            "`capacities` must be a non-empty 1-D list of non-negative numbers "
            f"summing to at most 1, got {capacities!r}."
        )
    # The small epsilon keeps 0.57 * 100 = 56.99999999999999 from flooring to 56.
    counts = [int(math.floor(x * num_tokens + 1e-9)) for x in c]
    if c.sum() >= 1.0 - 1e-6:
        counts[0] = num_tokens - sum(counts[1:])
    return tuple(counts), num_tokens - sum(counts)


def route_tokens(router_probs, counts, num_dropped=0):
    """Algorithm 1 on a batch, returning each expert's tokens as index lists.

    From the largest expert to the smallest, expert ``j`` takes the ``k_j``
    still-unassigned tokens with the highest router probability for ``j``.
    Ties go to the lower token index and non-finite probabilities (NaN, inf)
    count as lower than every finite one, so the assignment is the same on
    every backend and defined for every input.

    Args:
        router_probs: ``(batch, tokens, experts)``, non-negative.
        counts: static token count per expert, smallest first (see
            ``expert_token_counts``); they and ``num_dropped`` sum to ``tokens``.
        num_dropped: tokens left to no expert.

    Returns:
        ``(groups, dropped)``: a list with one ``(batch, k_j)`` int32 tensor of
        token indices per expert (smallest first) and a ``(batch, num_dropped)``
        tensor of dropped tokens.
    """
    probs = ops.cast(router_probs, "float32")
    probs = ops.where(ops.isfinite(probs), probs, _NON_FINITE)
    num_tokens, num_experts = probs.shape[1], probs.shape[2]
    if len(counts) != num_experts or sum(counts) + num_dropped != num_tokens:
        raise ValueError(
            f"`counts` {tuple(counts)} (+{num_dropped} dropped) must have one entry "
            f"per expert ({num_experts}) and sum to the number of tokens ({num_tokens})."
        )
    empty = ops.cast(probs[:, :0, 0], "int32")
    taken = ops.zeros_like(probs[..., 0])
    groups = [empty] * num_experts
    remaining = num_tokens
    for j in reversed(range(num_experts)):
        if counts[j] == 0:
            continue
        if counts[j] == remaining:
            # This expert takes every unassigned token: no ranking needed.
            groups[j] = _unassigned_indices(taken, counts[j])
        else:
            scores = ops.where(taken > 0, _NULLED, probs[..., j])
            groups[j] = _top_k_indices(scores, counts[j])
        remaining -= counts[j]
        if remaining:
            taken = taken + ops.sum(one_hot(groups[j], num_tokens, dtype="float32"), axis=1)
    dropped = empty
    if num_dropped:
        dropped = _unassigned_indices(taken, num_dropped)
    return groups, dropped


def assignment_from_groups(groups, dropped, num_tokens):
    """Per-token expert index ``(batch, tokens)`` from ``route_tokens`` output."""
    assignment = None
    for expert, indices in enumerate(list(groups) + [dropped]):
        if indices.shape[1] == 0:
            continue
        label = DROPPED if expert == len(groups) else expert
        hits = ops.sum(one_hot(indices, num_tokens, dtype="int32"), axis=1) * label
        assignment = hits if assignment is None else assignment + hits
    return assignment


def expert_preferred_routing(router_probs, capacities):
    """Expert Preferred Routing (Algorithm 1) as a function on arrays.

    Args:
        router_probs: ``(batch, tokens, experts)`` router probabilities.
        capacities: capacity distribution over the experts, smallest first
            (e.g. from ``capacity_distribution``).

    Returns:
        int32 ``(batch, tokens)``: the expert of every token, 0 = smallest,
        ``-1`` (``DROPPED``) for tokens no expert takes.

    Ties go to the lower token index and non-finite probabilities rank last,
    identically on every backend; every per-example count per expert is exact.
    """
    router_probs = ops.convert_to_tensor(router_probs)
    if len(router_probs.shape) != 3:
        raise ValueError(
            "`router_probs` must have shape (batch, tokens, experts), got "
            f"{tuple(router_probs.shape)}."
        )
    num_tokens, num_experts = router_probs.shape[1], router_probs.shape[2]
    if len(capacities) != num_experts:
        raise ValueError(
            f"`capacities` has {len(capacities)} entries but `router_probs` has "
            f"{num_experts} experts."
        )
    counts, num_dropped = expert_token_counts(capacities, num_tokens)
    groups, dropped = route_tokens(router_probs, counts, num_dropped)
    return assignment_from_groups(groups, dropped, num_tokens)


def select_top_k(scores, k):
    """Mixture-of-Depths selection: the ``k`` highest-scoring tokens and the rest.

    Args:
        scores: ``(batch, tokens)`` real scores (any sign; non-finite ones rank
            last); ties go to the lower token index, on every backend.
        k: static number of tokens to select, ``0 < k <= tokens``.

    Returns:
        ``(selected, skipped)``: int32 ``(batch, k)`` indices, highest score
        first, and ``(batch, tokens - k)`` indices of the others, ascending.
    """
    scores = ops.cast(scores, "float32")
    num_tokens = scores.shape[1]
    if not 0 < k <= num_tokens:
        raise ValueError(f"`k` must lie in [1, {num_tokens}], got {k}.")
    scores = ops.where(ops.isfinite(scores), scores, float("-inf"))
    selected = _top_k_indices(scores, k)
    if k == num_tokens:
        return selected, ops.cast(scores[:, :0], "int32")
    taken = ops.sum(one_hot(selected, num_tokens, dtype="float32"), axis=1)
    return selected, _unassigned_indices(taken, num_tokens - k)


def _top_k_indices(scores, k):
    """Indices of the ``k`` highest scores per example, highest first.

    A token's rank is the number of tokens that beat it: a higher score, or
    the same score and a lower index. The ranks are a strict order built from
    exact comparisons, so ties resolve identically on every backend (the
    backends' ``top_k`` order tied values differently), and the one-hot of the
    rank places each of the first ``k`` tokens in its slot without a sort. The
    ``(batch, N, N)`` comparison is small next to a block's matmuls.

    On torch it is a stable sort of the negated scores: the same order by
    definition (higher score first, ties to the lower index), in three ops
    (not when exporting: torch's ONNX exporters have no stable sort).
    """
    if _sorting():
        return ops.argsort(ops.negative(scores), axis=1)[:, :k]
    num_tokens = scores.shape[1]
    index = ops.arange(num_tokens, dtype="int32")
    lower_index = ops.expand_dims(index, 1) > ops.expand_dims(index, 0)  # [i, j]: j < i
    mine, theirs = ops.expand_dims(scores, 2), ops.expand_dims(scores, 1)
    beaten = ops.logical_or(theirs > mine, ops.logical_and(theirs == mine, lower_index))
    rank = ops.sum(ops.cast(beaten, "int32"), axis=2)
    slots = one_hot(ops.minimum(rank, k), k + 1, dtype="float32")[..., :k]
    positions = ops.arange(num_tokens, dtype="float32")
    return ops.cast(ops.einsum("bnk,n->bk", slots, positions), "int32")


def _unassigned_indices(taken, count):
    """Indices (ascending) of the ``count`` tokens with ``taken == 0``, per example.

    Each free token's rank among the free tokens (a cumulative sum) places it;
    no sort is needed, which keeps routing cheap on CPUs.
    """
    num_tokens = taken.shape[1]
    free = 1.0 - taken
    rank = ops.cast(ops.cumsum(free, axis=1) - 1.0, "int32")
    slots = one_hot(rank, count, dtype="float32") * ops.expand_dims(free, -1)
    positions = _arange(num_tokens, taken, "float32")
    return ops.cast(ops.einsum("bnk,n->bk", slots, positions), "int32")


def gather_tokens(x, indices):
    """``x[b, indices[b, i]]`` for ``x`` of shape (batch, tokens, ...).

    One ``take`` from the flattened (batch * tokens, ...) array with offset
    indices: a plain row gather on every backend, where ``take_along_axis``
    first broadcasts the indices to the full feature shape (much slower on
    tensorflow and torch; the router + EPR share in ``keras-mone bench``
    shows the difference).
    """
    indices = ops.cast(indices, "int32")
    if _torch():
        return _torch_gather_tokens(x, indices)
    offsets = ops.expand_dims(ops.arange(ops.shape(x)[0], dtype="int32") * x.shape[1], -1)
    if len(x.shape) == 2:
        # Rows of one feature: Keras' torch ``take`` of a 1-D array ends in a
        # ``squeeze`` that is not valid ONNX, so gather (B * N, 1) rows instead.
        return gather_tokens(ops.expand_dims(x, -1), indices)[..., 0]
    flat = ops.reshape(x, (-1,) + tuple(x.shape[2:]))
    return ops.take(flat, indices + offsets, axis=0)


def inverse_permutation(permutation):
    """Per-example inverse of a (batch, tokens) permutation (one-hot, no sort;
    on torch a sort, one op, as in ``_top_k_indices``)."""
    if _sorting():
        return ops.argsort(permutation, axis=1)
    num_tokens = permutation.shape[1]
    moved = one_hot(permutation, num_tokens, dtype="float32")
    positions = ops.arange(num_tokens, dtype="float32")
    return ops.cast(ops.einsum("bpn,p->bn", moved, positions), "int32")


def _torch_gather_tokens(x, indices, token_major=False):
    """``gather_tokens`` on torch: one ``index_select`` of the flattened rows
    (``token_major``: laid out ``(k, batch, ...)``, see ``gather_token_major``).

    ``ops.take`` adds an int64 cast and a wrap-around of negative indices
    (four more kernels per gather); token indices are never negative.
    """
    import torch

    offsets = _arange(x.shape[0], indices, "int32", scale=x.shape[1])
    rows = indices + offsets[:, None]
    shape = tuple(indices.shape)
    if token_major:
        rows, shape = rows.transpose(0, 1), shape[::-1]
    features = tuple(x.shape[2:])
    return torch.index_select(x.reshape((-1,) + features), 0, rows.reshape(-1)).reshape(shape + features)


def gather_token_major(x, indices):
    """``gather_tokens(x, indices)`` transposed: ``(k, batch, ...)``, contiguous, row
    ``i * batch + b`` = ``x[b, indices[b, i]]`` (torch only).

    The layout of a packed block (``layers.packed_block``): groups cut from it
    as ``(batch, k_j, ...)`` views (``gathered[start:stop].transpose(0, 1)``)
    reach the first block without a transposing copy."""
    return _torch_gather_tokens(x, indices, token_major=True)


def _torch():
    return keras.backend.backend() == "torch"


def _sorting():
    """Whether to rank by a stable sort: on torch, unless exporting (``torch.export``,
    TorchScript tracing), whose ONNX exporters have no stable sort."""
    if not _torch():
        return False
    import torch

    return not (torch.compiler.is_exporting() or torch.jit.is_tracing())


_CONSTANTS = {}


def _arange(n, like, dtype=None, scale=1):
    """``ops.arange(n, dtype) * scale`` on ``like``'s device.

    On torch, outside tracing (``torch.compile``, ``torch.export``, TorchScript),
    each is made once per device and kept: the same constant, without a kernel
    launch per call.
    """
    dtype = dtype or keras.backend.standardize_dtype(like.dtype)
    if not _torch():
        values = ops.arange(n, dtype=dtype)
        return values if scale == 1 else values * scale
    import torch

    device = like.device
    key = (n, dtype, scale, str(device))
    cacheable = isinstance(n, int) and device.type != "meta" and not (torch.compiler.is_compiling() or torch.jit.is_tracing())
    if not cacheable:
        return torch.arange(n, dtype=getattr(torch, dtype), device=device) * scale
    if key not in _CONSTANTS:
        if len(_CONSTANTS) > 256:
            _CONSTANTS.clear()
        with torch.inference_mode(False), torch.no_grad():  # a plain tensor, even if made in inference mode
            _CONSTANTS[key] = torch.arange(n, dtype=getattr(torch, dtype), device=device) * scale
    return _CONSTANTS[key]
