"""Tokens grouped for a block: contiguous groups of static size, each at one width.

The state a token-routing part (``routing.parts``) hands to every block:
``groups`` (one ``(batch, k_j, D)`` tensor per group), their ``widths``
and ``gates`` (router scores, or ``None``), tokens that skip the block
(``passed``: MoNE's dropped tokens, MoD's unselected ones) and the
permutation that puts everything back in the original token order.
"""

from keras import ops

from keras_mone.routing.epr import gather_tokens, inverse_permutation

SKIPPED = -1
"""Assignment label of a token that skips the block (MoNE ``DROPPED``, MoD unselected)."""


class TokenGroups:
    """Token features in groups, with the permutation that undoes the grouping.

    Attributes:
        groups: ``(batch, k_j, D)`` tensors, one per group.
        widths: the width each group runs at.
        labels: the assignment label of each group (expert index for MoNE,
            0 for a single group).
        gates: one ``(batch, k_j)`` tensor of gate values per group, or ``None``.
        passed: ``(batch, n, D)`` tokens that skip blocks, or ``None``.
        order: ``order[b, p]`` is the original index of the token at position
            ``p`` of ``groups + [passed]``; ``None`` = original order.
        previous_order: the order before the last regrouping.
        gate_forms: forms of ``gates`` that blocks derive (a packed torch block's gates cast to
            its dtype and joined into token-major rows), made once and shared by every block
            that takes these gates: ``with_outputs`` copies share the dict, a regrouping starts
            a new one.
    """

    def __init__(self, tokens=None, width=None):
        self.groups = [] if tokens is None else [tokens]
        self.widths = [] if tokens is None else [width]
        self.labels = [] if tokens is None else [0]
        self.gates = None
        self.passed = None
        self.order = None
        self.previous_order = None
        self.gate_forms = {}

    def add_group(self, tokens, width, label, gate=None):
        self.groups.append(tokens)
        self.widths.append(width)
        self.labels.append(label)
        if gate is not None:
            self.gates = (self.gates or [None] * (len(self.groups) - 1)) + [gate]
        elif self.gates is not None:
            self.gates.append(None)

    def merged(self):
        """All tokens, ``groups`` then ``passed``, in the current order."""
        parts = self.groups + ([self.passed] if self.passed is not None else [])
        return parts[0] if len(parts) == 1 else ops.concatenate(parts, axis=1)

    def restored(self):
        """All tokens in their original order."""
        return to_original(self.merged(), self.order)

    def with_outputs(self, outputs):
        """A copy whose groups are a block's ``outputs`` (same layout)."""
        new = TokenGroups()
        new.__dict__.update(self.__dict__)
        new.groups = list(outputs)
        return new

    def assignment(self, batch_like):
        """``(batch, tokens)`` int32 label of each token, in the original order."""
        labels = [ops.full((g.shape[1],), label, dtype="int32") for g, label in zip(self.groups, self.labels)]
        if self.passed is not None:
            labels.append(ops.full((self.passed.shape[1],), SKIPPED, dtype="int32"))
        labels = ops.concatenate(labels) if len(labels) > 1 else labels[0]
        return to_original(ops.broadcast_to(labels, (ops.shape(batch_like)[0], *labels.shape)), self.order)

    def compute_per_token(self, batch_like, hidden_dim):
        """``(batch, tokens)`` float32 share of the full width each token runs at
        in a block (0 for tokens that skip it), in the original order."""
        shares = [ops.full((g.shape[1],), w / hidden_dim, dtype="float32") for g, w in zip(self.groups, self.widths)]
        if self.passed is not None:
            shares.append(ops.zeros((self.passed.shape[1],), dtype="float32"))
        shares = ops.concatenate(shares) if len(shares) > 1 else shares[0]
        return to_original(ops.broadcast_to(shares, (ops.shape(batch_like)[0], *shares.shape)), self.order)


def to_original(x, order):
    """``x`` (batch, tokens, ...) laid out in ``order`` (``None`` = original order already),
    back in the original order."""
    return x if order is None else gather_tokens(x, inverse_permutation(order))
