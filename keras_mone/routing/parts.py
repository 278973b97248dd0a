"""Token-routing parts: score -> assignment -> a per-block plan of token groups -> restore.

A backbone owns its blocks and router layers; its routing part decides, before
each block, which tokens the block runs and at what width, and, after it,
how they are laid out for the next one. The encoder loop
(``models.block_loop.run_blocks``) is written once and asks the part; the FLOP
counter reads the same part's static ``block_plan``, so the count is the
plan the forward pass runs.

* ``FullWidth``: every token, full width, every block (dense ViT).
* ``FixedWidths``: every token at one nested width per block (MatViT).
* ``NestedExperts``: a router scores tokens for E nested experts and Expert
  Preferred Routing (Algorithm 1) groups them by expert until the next router
  (MoNE, Sec. 4).
* ``TopKSkip``: in routed blocks each sequence keeps its top-``k`` tokens by
  a score (a learned router: MoD; the attention received in the previous
  block: A-MoD); the others skip the block.

A new method subclasses ``TokenRouting`` and overrides what differs.
"""

import keras
from keras import ops

from keras_mone.routing.epr import gather_token_major, gather_tokens, select_top_k
from keras_mone.routing.token_groups import TokenGroups
from keras_mone.routing.token_major import cut_groups


class TokenRouting:
    """Every token at full width in every block: the dense ViT.

    Args:
        depth: blocks of the encoder.
        hidden_dim: model dimension ``D``.
    """

    has_router = False
    """Whether the FLOP count lists a ``router`` component (0 when it is free)."""

    def __init__(self, depth, hidden_dim):
        self.depth = depth
        self.hidden_dim = hidden_dim

    # -- the static plan ------------------------------------------------------
    def block_plan(self, num_tokens):
        """Per block, the ``(tokens, width)`` groups it runs per sequence."""
        return [[(num_tokens, self.hidden_dim)]] * self.depth

    def router_macs(self, num_tokens):
        """MACs per sequence of scoring tokens (learned routers)."""
        return 0

    def describe(self, num_tokens):
        return f"{num_tokens} tokens"

    # -- the forward pass ---------------------------------------------------------
    def start(self, tokens):
        """The state before the first block."""
        return TokenGroups(tokens, self.hidden_dim)

    def wants_received_attention(self, index):
        """Whether block ``index`` must return the attention each token received."""
        return False

    def before_block(self, index, state, received, record):
        """The state block ``index`` runs on. ``received``: the attention
        received in the previous block, when asked for; ``record``: a
        ``BlockRecord`` to add scores to (or ``None``)."""
        return state

    def after_block(self, index, state):
        """The state after block ``index`` (its outputs are in ``state.groups``)."""
        return state


class FixedWidths(TokenRouting):
    """Every token at the nested width ``widths[i]`` in block ``i`` (MatViT)."""

    def __init__(self, widths, hidden_dim):
        super().__init__(len(widths), hidden_dim)
        self.widths = list(widths)

    def block_plan(self, num_tokens):
        return [[(num_tokens, width)] for width in self.widths]

    def describe(self, num_tokens):
        widths = sorted(set(self.widths))
        return f"widths {widths if len(widths) > 1 else widths[0]}"

    def before_block(self, index, state, received, record):
        state.widths = [self.widths[index]]
        return state


class NestedExperts(TokenRouting):
    """MoNE: routers at ``routers`` (block index -> layer) assign tokens to nested
    experts with Expert Preferred Routing; the grouping holds until the next
    router (Sec. 6), blocks before the first router run at full width.

    Args:
        routing: the ``ExpertPreferredRouting`` layer (capacities, EPR).
        routers: ``{block index: router layer}``; a router maps tokens to
            ``(batch, tokens, E)`` probabilities.
        expert_widths: width of each expert, smallest first.
        gated: the router probability gates the MLP update (learned routers).
        class_token_first: lift token 0 (the class token) above every other
            token, so the largest expert with capacity takes it.
    """

    has_router = True

    def __init__(self, depth, hidden_dim, routing, routers, expert_widths, gated, class_token_first=False):
        super().__init__(depth, hidden_dim)
        self.routing = routing
        self.routers = dict(routers)
        self.expert_widths = list(expert_widths)
        self.gated = gated
        self.class_token_first = class_token_first
        self.first_router = min(self.routers)

    def block_plan(self, num_tokens):
        counts, _ = self.routing.token_counts(num_tokens)
        routed = [(k, w) for k, w in zip(counts, self.expert_widths) if k]
        full = [(num_tokens, self.hidden_dim)]
        return [full] * self.first_router + [routed] * (self.depth - self.first_router)

    def router_macs(self, num_tokens):
        if not self.gated:  # random routers cost nothing
            return 0
        return num_tokens * self.hidden_dim * len(self.expert_widths) * len(self.routers)

    def describe(self, num_tokens):
        counts, dropped = self.routing.token_counts(num_tokens)
        return (
            f"e_c={self.routing.effective_capacity:g}, tokens per expert {tuple(counts)}"
            + (f", {dropped} dropped" if dropped else "")
            + f", routers at {sorted(self.routers)}"
        )

    def start(self, tokens):
        state = TokenGroups(tokens, self.hidden_dim)
        state.labels = [len(self.expert_widths) - 1]
        return state

    def before_block(self, index, state, received, record):
        if index not in self.routers:
            return state
        probs = self.routers[index](state.merged())
        state = self.regroup(state, probs)
        if record is not None:  # probs are laid out in the previous order
            record.add("router_probs", state.previous_order, probs)
            record.add("expert_index", None, state.assignment(probs))
            record.set_scores(index, state.previous_order, probs)
        return state

    def regroup(self, state, probs):
        """Assigns the current tokens to experts (EPR) and groups them.

        When one expert takes every token (e.g. capacity 1.0), EPR's
        assignment is the same for any token order and a block is
        equivariant to token order (positions are embedded), so the tokens
        stay where they are: no gather now, no restoring permutation later.
        """
        current = state.merged()
        num_tokens = probs.shape[1]
        counts, dropped_count = self.routing.token_counts(num_tokens)
        new = TokenGroups()
        new.previous_order = state.order
        if dropped_count == 0 and max(counts) == num_tokens:
            expert = counts.index(num_tokens)
            new.add_group(current, self.expert_widths[expert], expert, self._gate(probs, expert, None))
            new.order = state.order
            return new
        index_groups, dropped = self.routing.group(self._scores(probs, state.order))
        kept = [(expert, indices) for expert, indices in enumerate(index_groups) if indices.shape[1]]
        positions = [indices for _, indices in kept] + ([dropped] if dropped.shape[1] else [])
        order = ops.concatenate(positions, axis=1) if len(positions) > 1 else positions[0]
        if keras.backend.backend() == "torch":
            self._gather_once(new, current, probs, order, kept)
        else:
            for expert, indices in kept:
                gate = self._gate(probs, expert, indices)
                new.add_group(gather_tokens(current, indices), self.expert_widths[expert], expert, gate)
            if dropped.shape[1]:
                new.passed = gather_tokens(current, dropped)
        new.order = order if state.order is None else gather_tokens(state.order, order)
        return new

    def _gather_once(self, new, current, probs, order, kept):
        """The groups (and gates) as slices of one gather of all tokens in ``order``:
        two gathers instead of two per expert (torch, where each op costs host time).
        The gather is token-major (``gather_token_major``), the layout the packed
        blocks run in: the first block packs the groups, its first rows, without a
        copy (``routing.token_major``, ``layers.packed_block.token_major``)."""
        tokens = gather_token_major(current, order)
        gates = gather_token_major(probs, order) if self.gated else None
        groups = cut_groups(tokens, [indices.shape[1] for _, indices in kept])
        start = 0
        for (expert, indices), group in zip(kept, groups):
            stop = start + indices.shape[1]
            gate = None if gates is None else gates[start:stop, :, expert].transpose(0, 1)
            new.add_group(group, self.expert_widths[expert], expert, gate)
            start = stop
        if start < order.shape[1]:
            new.passed = tokens[start:].transpose(0, 1)

    def _gate(self, probs, expert, indices):
        if not self.gated:
            return None
        gate = probs[..., expert]
        return gate if indices is None else gather_tokens(gate, indices)

    def _scores(self, probs, order):
        if not self.class_token_first:
            return probs
        if order is None:
            is_class = ops.broadcast_to(ops.arange(probs.shape[1]) == 0, ops.shape(probs)[:2])
        else:
            is_class = order == 0
        return probs + 2.0 * ops.expand_dims(ops.cast(is_class, probs.dtype), -1)


class TopKSkip(TokenRouting):
    """Token skipping (MoD, A-MoD): a routed block runs each sequence's top-``k``
    tokens by score, gathered into a static ``(batch, k, D)`` group; the
    others pass it unchanged; tokens return to their order after the block.

    Args:
        selected: ``k``, tokens a routed block runs per sequence.
        routed_blocks: indices of the routed blocks.
        routers: ``{block index: layer}`` mapping tokens to ``(batch, tokens, 1)``
            scores (MoD), or ``None`` to score by the attention each token
            received in the previous block (A-MoD).
    """

    has_router = True

    def __init__(self, depth, hidden_dim, selected, routed_blocks, routers=None):
        super().__init__(depth, hidden_dim)
        self.selected = selected
        self.routed_blocks = sorted(routed_blocks)
        self.routers = None if routers is None else dict(routers)

    def _skips(self, index, num_tokens=None):
        return index in self.routed_blocks and (num_tokens is None or self.selected < num_tokens)

    def block_plan(self, num_tokens):
        return [
            [(self.selected if self._skips(i, num_tokens) else num_tokens, self.hidden_dim)]
            for i in range(self.depth)
        ]

    def router_macs(self, num_tokens):
        return 0 if self.routers is None else num_tokens * self.hidden_dim * len(self.routers)

    def describe(self, num_tokens):
        return f"{self.selected} of {num_tokens} tokens in blocks {self.routed_blocks}"

    def start(self, tokens):
        self._active = self.selected < tokens.shape[1]
        return super().start(tokens)

    def wants_received_attention(self, index):
        return self.routers is None and self._active and self._skips(index + 1)

    def before_block(self, index, state, received, record):
        if not (self._active and self._skips(index)):
            return state
        tokens = state.merged()
        scores = received if self.routers is None else self.routers[index](tokens)[..., 0]
        selected, skipped = select_top_k(scores, self.selected)
        new = TokenGroups()
        gate = None if self.routers is None else gather_tokens(scores, selected)
        new.add_group(gather_tokens(tokens, selected), self.hidden_dim, 0, gate)
        new.passed = gather_tokens(tokens, skipped)
        new.order = ops.concatenate([selected, skipped], axis=1)
        if record is not None:
            record.add("scores", None, ops.cast(scores, "float32"))
            record.add("selected", None, selected)
            record.set_scores(index, None, ops.cast(scores, "float32"))
        return new

    def after_block(self, index, state):
        if not (self._active and self._skips(index)):
            return state
        return TokenGroups(state.restored(), self.hidden_dim)
