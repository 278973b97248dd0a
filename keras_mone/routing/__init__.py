"""Routing: MoNE's capacity distributions (Eq. 3, Table 2) and EPR (Alg. 1); top-k token selection (MoD, A-MoD)."""

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
    select_top_k,
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
    "select_top_k",
    "uniform_distribution",
]
