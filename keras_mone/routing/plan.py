"""MoNE's routing plan: the one owner of a model's capacity (MoNE Sec. 4.3, Algorithm 1).

``ExpertPreferredPlan`` holds the number of experts ``E``, the capacity
method, the effective capacity ``e_c`` and the per-expert capacities ``c``
it gives (Eq. 3, or a Table 2 method), and turns them into the static token
counts of Algorithm 1 and the per-expert index groups of a forward pass. It
has no weights and is no layer; ``MoNEViTBackbone.capacity`` and the EPR
layer (``keras_mone.layers.ExpertPreferredRouting``) read it. Capacities are
solved once per ``(method, e_c, E, beta, delta)`` and token counts once per
``(capacities, tokens)`` (both cached), so a capacity sampled every training
step (adaptive modes) costs one solve per value.
"""

import functools

from keras_mone.routing import capacity as capacity_lib
from keras_mone.routing import epr


class ExpertPreferredPlan:
    """Capacities and Expert Preferred Routing at a settable ``e_c``.

    Args:
        num_experts: ``E``, nested experts of widths ``D/2**(E-1) .. D``.
        effective_capacity: ``e_c`` in ``(0, 1]`` (``set_capacity`` changes it).
        capacity_method: "mone" (Eq. 3) or a Table 2 method
            (``keras_mone.routing.CAPACITY_METHODS``).
        beta, delta: Eq. 3's entropy weight and reward ratio.
    """

    def __init__(self, num_experts=4, effective_capacity=1.0, capacity_method="mone", beta=10.0, delta=2.0):
        self.num_experts = num_experts
        self.capacity_method = capacity_method
        self.beta = beta
        self.delta = delta
        self.effective_capacity = None
        self.capacities = None
        self._counts = {}  # {num_tokens: token_counts(num_tokens)} at the current capacities
        self.set_capacity(effective_capacity)

    def set_capacity(self, effective_capacity):
        """Sets ``e_c`` (validated, naming ``effective_capacity``) and the capacities it gives;
        the token counts of every token count asked for so far are derived again here."""
        self.capacities = _capacities(self.capacity_method, effective_capacity, self.num_experts, self.beta, self.delta)
        self.effective_capacity = float(effective_capacity)
        self._counts = {n: _token_counts(self.capacities, n) for n in self._counts}

    def token_counts(self, num_tokens):
        """``(tokens per expert, smallest first; dropped tokens)`` for ``num_tokens`` tokens.

        Read from a plain dict filled on first use (eagerly: Keras builds every
        layer before it compiles a step) and on ``set_capacity``, so a traced
        step looks the counts up instead of tracing their numpy arithmetic,
        which ``torch.compile`` turns into tensors and a graph break."""
        if not isinstance(num_tokens, int):  # e.g. a symbolic size while tracing
            return epr.expert_token_counts(self.capacities, num_tokens)
        if num_tokens not in self._counts:
            self._counts[num_tokens] = _token_counts(self.capacities, num_tokens)
        return self._counts[num_tokens]

    def group(self, router_probs):
        """``(groups, dropped)`` index tensors of Algorithm 1 (``routing.epr.route_tokens``)."""
        counts, num_dropped = self.token_counts(router_probs.shape[1])
        return epr.route_tokens(router_probs, counts, num_dropped)

    def assignment(self, router_probs):
        """Each token's expert (0 = smallest, -1 = dropped), int32 ``(batch, tokens)``."""
        groups, dropped = self.group(router_probs)
        return epr.assignment_from_groups(groups, dropped, router_probs.shape[1])


def _solve(method, effective_capacity, num_experts, beta, delta):
    """Eq. 3 for "mone", else the Table 2 method; each validates ``effective_capacity``."""
    if method == "mone":
        c = capacity_lib.capacity_distribution(effective_capacity, num_experts, beta=beta, delta=delta)
    else:
        c = capacity_lib.distribution_for(method, effective_capacity, num_experts)
    return tuple(float(x) for x in c)


_solved = functools.lru_cache(maxsize=256)(_solve)


def _capacities(method, effective_capacity, num_experts, beta, delta):
    """The capacities ``c`` (smallest expert first), solved once per argument tuple
    (an unhashable argument goes to the solver's checks uncached)."""
    try:
        hash((method, effective_capacity, num_experts, beta, delta))
    except TypeError:
        return _solve(method, effective_capacity, num_experts, beta, delta)
    return _solved(method, effective_capacity, num_experts, beta, delta)


@functools.lru_cache(maxsize=256)
def _token_counts(capacities, num_tokens):
    return epr.expert_token_counts(capacities, num_tokens)
