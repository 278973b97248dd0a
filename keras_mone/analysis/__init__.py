"""Model analysis tools: analytic FLOP (multiply-accumulate) counts, throughput."""

from keras_mone.analysis.flops import (
    COMPONENTS,
    FlopCount,
    flop_ratio,
    flops,
    patch_embedding_macs,
    register_flop_counter,
    vit_block_macs,
)
from keras_mone.analysis.throughput import images_per_second

__all__ = [
    "COMPONENTS",
    "FlopCount",
    "flop_ratio",
    "flops",
    "images_per_second",
    "patch_embedding_macs",
    "register_flop_counter",
    "vit_block_macs",
]
