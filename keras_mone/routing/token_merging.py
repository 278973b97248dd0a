"""Token merging (ToMe, Bolya et al. 2023) before a routed model's first routing decision.

The MoNE paper (App. A.2, Fig. 10) applies ToMe in the first, full-capacity
layers of a MoNE model and routes the merged tokens after them: the savings
compound. Here:

* ``bipartite_merge``: one step of ToMe's bipartite soft matching with static
  shapes. The unprotected tokens alternate into sets A and B; every A token
  finds its most similar B token (cosine similarity of the token features);
  the ``r`` A tokens with the highest similarity are merged into their B
  token as a size-weighted mean, and sizes add. ``N`` tokens become ``N - r``;
  the size-weighted mean of all tokens is unchanged.
* ``MergedTokens``: a routing part (``keras_mone.routing.parts``) wrapping a
  model's own part: it merges ``r`` tokens before each block listed in
  ``merges`` (all before the part's first routing decision), then, after the
  last block, *unmerges*: every original token takes the value of the token
  it was merged into, so pooling, the head and the FLOP plan after the
  blocks are unchanged (GAP over the unmerged tokens is the size-weighted
  mean of the merged ones).

Departures from ToMe, stated: the similarity is taken on the block's input
features rather than the attention keys, merging happens between blocks
rather than between attention and MLP, and attention is not size-weighted
(no proportional attention). Use ``keras_mone.methods.mone.merging_sweep`` to
evaluate a trained model with it.
"""

import numpy as np
from keras import ops

from keras_mone.routing.token_groups import TokenGroups


def _split_indices(num_tokens, protected):
    """Static indices of the sets A (even unprotected positions) and B (odd)."""
    free = np.arange(protected, num_tokens)
    return free[0::2], free[1::2]


def bipartite_merge(tokens, sizes, source, r, protected=0):
    """Merges ``r`` tokens of each sequence into their most similar partners.

    Args:
        tokens: ``(batch, N, D)`` token features.
        sizes: ``(batch, N)`` float: original tokens each token stands for.
        source: ``(batch, N0)`` int32: for each original token, its position in ``tokens``.
        r: tokens removed (static; at most the size of set A).
        protected: leading tokens never merged (a class token).

    Returns:
        ``(tokens, sizes, source)`` with ``N - r`` tokens, laid out as
        protected, the unmerged A tokens (original order), then B.
    """
    num_tokens = tokens.shape[1]
    a_index, b_index = _split_indices(num_tokens, protected)
    if not 0 <= r <= len(a_index):
        raise ValueError(
            f"token merging: `r`={r!r} must be in [0, {len(a_index)}] for {num_tokens} tokens "
            f"({protected} protected)."
        )
    if r == 0:
        return tokens, sizes, source
    a, b = ops.take(tokens, a_index, axis=1), ops.take(tokens, b_index, axis=1)
    size_a, size_b = ops.take(sizes, a_index, axis=1), ops.take(sizes, b_index, axis=1)
    unit = lambda x: x / ops.sqrt(ops.sum(ops.square(x), axis=-1, keepdims=True) + 1e-12)  # noqa: E731
    similarity = ops.einsum("bad,bnd->ban", unit(a), unit(b))
    partner = ops.argmax(similarity, axis=-1)  # (batch, |A|)
    rank = ops.argsort(-ops.max(similarity, axis=-1), axis=-1)
    merged, kept = rank[:, :r], ops.sort(rank[:, r:], axis=-1)
    destination = ops.take_along_axis(partner, merged, axis=1)  # (batch, r) into B
    to_b = ops.one_hot(destination, len(b_index), dtype=tokens.dtype)  # (batch, r, |B|)
    merged_size = ops.take_along_axis(size_a, merged, axis=1)
    merged_sum = ops.take_along_axis(a, merged[..., None], axis=1) * merged_size[..., None]
    new_size_b = size_b + ops.einsum("brn,br->bn", to_b, merged_size)
    new_b = (b * size_b[..., None] + ops.einsum("brn,brd->bnd", to_b, merged_sum)) / new_size_b[..., None]
    kept_a = ops.take_along_axis(a, kept[..., None], axis=1)
    parts = ([tokens[:, :protected]] if protected else []) + [kept_a, new_b]
    size_parts = ([sizes[:, :protected]] if protected else []) + [ops.take_along_axis(size_a, kept, axis=1), new_size_b]
    new_tokens = ops.concatenate(parts, axis=1)
    new_sizes = ops.concatenate(size_parts, axis=1)
    is_merged = ops.sum(ops.one_hot(merged, len(a_index), dtype="int32"), axis=1)  # (batch, |A|)
    moved = _new_positions(num_tokens, protected, r, is_merged, ops.cast(partner, "int32"))
    return new_tokens, new_sizes, ops.take_along_axis(moved, source, axis=1)


def _new_positions(num_tokens, protected, r, is_merged, partner):
    """``(batch, N)`` int32: where each old position lands after the merge (``is_merged``: 1 for the
    merged A tokens; ``partner``: each A token's B partner)."""
    a_index, b_index = _split_indices(num_tokens, protected)
    batch = ops.shape(is_merged)[0]
    b_start = protected + len(a_index) - r
    kept_rank = ops.cumsum(1 - is_merged, axis=1) - 1  # a kept A token's place among the kept, in order
    a_target = ops.where(is_merged > 0, b_start + partner, protected + kept_rank)
    ones = ops.ones((batch, 1), "int32")
    b_target = ones * (b_start + np.arange(len(b_index), dtype="int32"))[None]
    parts = ([ones * np.arange(protected, dtype="int32")[None]] if protected else []) + [a_target, b_target]
    positions = ops.concatenate(parts, axis=1)  # laid out as protected, A, B
    layout = np.concatenate([np.arange(protected), a_index, b_index])
    return ops.take(positions, np.argsort(layout), axis=1)


class MergedTokens:
    """A routing part that merges tokens before given blocks, then runs ``inner`` as it would.

    Args:
        inner: the model's own routing part (``backbone.token_routing()``).
        merges: ``{block index: r}``: merge ``r`` tokens right before that block.
            Every merge must come before ``inner``'s first routing decision
            (the state is still one full-width group in the original order).
        protected: leading tokens never merged (1 with a class token).
    """

    def __init__(self, inner, merges, protected=0):
        self.inner = inner
        self.merges = {int(index): int(r) for index, r in dict(merges).items() if int(r)}
        if any(index < 0 or index >= inner.depth for index in self.merges):
            raise ValueError(f"token merging: block indices must be in [0, {inner.depth - 1}], got {sorted(self.merges)}.")
        self.protected = protected
        self.depth, self.hidden_dim, self.has_router = inner.depth, inner.hidden_dim, inner.has_router

    def tokens_per_block(self, num_tokens):
        """Tokens each block runs on (before the inner part's routing)."""
        counts = []
        for index in range(self.depth):
            num_tokens -= self.merges.get(index, 0)
            counts.append(num_tokens)
        return counts

    # -- the static plan ----------------------------------------------------
    def block_plan(self, num_tokens):
        return [self.inner.block_plan(n)[i] for i, n in enumerate(self.tokens_per_block(num_tokens))]

    def router_macs(self, num_tokens):
        return self.inner.router_macs(self.tokens_per_block(num_tokens)[-1])

    def describe(self, num_tokens):
        counts = self.tokens_per_block(num_tokens)
        return f"{self.inner.describe(counts[-1])}; ToMe {self.merges} ({num_tokens} -> {counts[-1]} tokens)"

    # -- the forward pass ---------------------------------------------------
    def start(self, tokens):
        batch, num_tokens = ops.shape(tokens)[0], tokens.shape[1]
        self._sizes = ops.ones((batch, num_tokens), tokens.dtype)
        self._source = ops.ones((batch, 1), "int32") * np.arange(num_tokens, dtype="int32")[None]
        return self.inner.start(tokens)

    def wants_received_attention(self, index):
        return self.inner.wants_received_attention(index)

    def before_block(self, index, state, received, record):
        if record is not None:
            raise ValueError("token merging: per-token intermediates (return_intermediates=True) are not available.")
        if index in self.merges:
            if len(state.groups) != 1 or state.order is not None or state.passed is not None:
                raise ValueError(
                    f"token merging before block {index}: tokens are already routed there; merge only in blocks "
                    "before the model's first routing decision (e.g. before its first router)."
                )
            tokens, self._sizes, self._source = bipartite_merge(
                state.groups[0], self._sizes, self._source, self.merges[index], self.protected
            )
            state = _single_group(tokens, self.hidden_dim, state.labels)
        return self.inner.before_block(index, state, received, record)

    def after_block(self, index, state):
        state = self.inner.after_block(index, state)
        if index == self.depth - 1 and self.merges:  # unmerge: every original token reads its merged token
            unmerged = ops.take_along_axis(state.restored(), self._source[..., None], axis=1)
            state = _single_group(unmerged, self.hidden_dim, state.labels[:1])
        return state


def _single_group(tokens, width, labels):
    state = TokenGroups(tokens, width)
    state.labels = list(labels)
    return state


def merge_macs(num_tokens, hidden_dim, merges, protected=0):
    """MACs per sequence of the similarity products of ``merges`` (``{block: r}``), from ``num_tokens``."""
    total = 0
    for index in sorted(merges):
        a_index, b_index = _split_indices(num_tokens, protected)
        total += len(a_index) * len(b_index) * hidden_dim
        num_tokens -= merges[index]
    return total
