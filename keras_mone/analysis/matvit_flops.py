"""MAC counter of ``MatViTBackbone``: every token at the blocks' nested width."""

from keras_mone.analysis.flops import (
    FlopCount,
    patch_embedding_macs,
    register_flop_counter,
    vit_block_macs,
)
from keras_mone.models.matvit_backbone import MatViTBackbone


@register_flop_counter(MatViTBackbone)
def _matvit_backbone_flops(backbone):
    """All ``N`` tokens of block ``i`` use width ``d_i`` in the QKV, output and
    MLP projections; attention runs at ``D`` (as for a MoNE expert)."""
    counts = {
        "patch_embedding": patch_embedding_macs(
            backbone.image_size, backbone.patch_size, backbone.num_channels, backbone.hidden_dim
        )
    }
    widths = backbone.layer_widths()
    for width in widths:
        block = vit_block_macs([(backbone.num_tokens, width)], backbone.hidden_dim, backbone.mlp_dim)
        for name, value in block.items():
            counts[name] = counts.get(name, 0) + value
    height, width_px = backbone.image_size
    shown = sorted(set(widths))
    label = (
        f"MatViTBackbone({height}x{width_px}/{backbone.patch_size}, D={backbone.hidden_dim}, "
        f"depth={backbone.depth}, widths {shown if len(shown) > 1 else shown[0]})"
    )
    return FlopCount(counts, label=label)
