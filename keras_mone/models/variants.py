"""The one table of ViT sizes (Dosovitskiy et al. 2021; Steiner et al. 2021).

Everything that needs a size (presets, recipes, tests, the FLOP counter) reads
it from here: ``decode_variant("B/16")``.
"""

VIT_SIZES = {
    "Ti": dict(hidden_dim=192, depth=12, num_heads=3, mlp_dim=768),
    "S": dict(hidden_dim=384, depth=12, num_heads=6, mlp_dim=1536),
    "B": dict(hidden_dim=768, depth=12, num_heads=12, mlp_dim=3072),
    "L": dict(hidden_dim=1024, depth=24, num_heads=16, mlp_dim=4096),
    "H": dict(hidden_dim=1280, depth=32, num_heads=16, mlp_dim=5120),
    # The CPU size of the bundled digits tasks (presets *_digits, recipes *_digits_*).
    "Digits": dict(hidden_dim=64, depth=4, num_heads=4, mlp_dim=256),
}


def decode_variant(variant):
    """``"B/16"`` -> ``{hidden_dim, depth, num_heads, mlp_dim, patch_size}``."""
    size, _, patch = str(variant).partition("/")
    if size not in VIT_SIZES or not patch.isdigit():
        raise ValueError(
            f"`variant` must look like 'B/16' with a size in {list(VIT_SIZES)}, got {variant!r}."
        )
    return {**VIT_SIZES[size], "patch_size": int(patch)}
