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


def size_decoder(table, family):
    """``variant -> arguments`` for a size ``table`` (``{"B": {...}}``): ``"B/16"`` gives
    ``{**table["B"], "patch_size": 16}``; an error names ``family`` and the sizes otherwise."""

    def decode(variant):
        size, _, patch = str(variant).partition("/")
        if size not in table or not patch.isdigit():
            raise ValueError(
                f"`variant` of a {family} must look like 'B/16' with a size in {list(table)}, got {variant!r}."
            )
        return {**table[size], "patch_size": int(patch)}

    return decode


decode_variant = size_decoder(VIT_SIZES, "ViT")
"""``"B/16"`` -> ``{hidden_dim, depth, num_heads, mlp_dim, patch_size}`` (the ViT size table)."""
