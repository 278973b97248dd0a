"""Routing algorithms of MoNE: capacity distributions (Eq. 3, Table 2) and EPR (Alg. 1)."""

from keras_mone.routing.capacity import (
    capacity_distribution,
    effective_capacity,
    greedy_distribution,
    minimum_effective_capacity,
    mod_greedy_distribution,
    proportionate_distribution,
    uniform_distribution,
)
from keras_mone.routing.epr import (
    DROPPED,
    expert_preferred_routing,
    expert_token_counts,
    route_tokens,
)

__all__ = [
    "DROPPED",
    "capacity_distribution",
    "effective_capacity",
    "expert_preferred_routing",
    "expert_token_counts",
    "greedy_distribution",
    "minimum_effective_capacity",
    "mod_greedy_distribution",
    "proportionate_distribution",
    "route_tokens",
    "uniform_distribution",
]
