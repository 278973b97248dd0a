"""Model analysis tools: analytic FLOP (multiply-accumulate) counts, throughput, routing."""

from keras_mone.analysis.flops import (
    COMPONENTS,
    FlopCount,
    flop_ratio,
    flops,
    patch_embedding_macs,
    register_flop_counter,
    vit_block_macs,
)
from keras_mone.analysis import acm_flops, mixer_flops  # noqa: F401  (register their counters)
from keras_mone.analysis.routing import expert_share_of_tokens
from keras_mone.analysis.routing_plot import plot_routing, routing_map
from keras_mone.analysis.throughput import images_per_second

__all__ = [
    "COMPONENTS",
    "expert_share_of_tokens",
    "FlopCount",
    "flop_ratio",
    "flops",
    "images_per_second",
    "patch_embedding_macs",
    "plot_routing",
    "register_flop_counter",
    "routing_map",
    "vit_block_macs",
]
