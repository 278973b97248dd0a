"""Model analysis tools: analytic FLOP (multiply-accumulate) counts, throughput, routing,
router analyses (routing maps, argmax routing, token importance) and capacity for a budget.

A method family's own analyses (MoNE's token-merging sweep) and FLOP counters
(``register_flop_counter``) live in its folder and are exported here
(``keras_mone.exports``)."""

from keras_mone.exports import exported_names

from keras_mone.analysis.flops import (
    COMPONENTS,
    FlopCount,
    flop_ratio,
    flops,
    patch_embedding_macs,
    register_flop_counter,
    vit_block_macs,
)
from keras_mone.analysis.argmax_routing import argmax_compute, argmax_difficulty
from keras_mone.analysis.budget import capacity_for_budget
from keras_mone.analysis.routing import expert_share_of_tokens
from keras_mone.analysis.routing_maps import routing_maps, threshold_sweep
from keras_mone.analysis.token_importance import importance_vs_score, leave_one_out
from keras_mone.analysis.token_maps import spearman, token_record
from keras_mone.analysis.routing_plot import plot_routing, routing_grid, routing_map
from keras_mone.analysis.throughput import images_per_second

__getattr__, __dir__ = exported_names("keras_mone.analysis", globals())

__all__ = [
    "argmax_compute",
    "argmax_difficulty",
    "capacity_for_budget",
    "COMPONENTS",
    "expert_share_of_tokens",
    "FlopCount",
    "flop_ratio",
    "flops",
    "images_per_second",
    "importance_vs_score",
    "leave_one_out",
    "patch_embedding_macs",
    "plot_routing",
    "register_flop_counter",
    "routing_grid",
    "routing_map",
    "routing_maps",
    "spearman",
    "threshold_sweep",
    "token_record",
    "vit_block_macs",
]
