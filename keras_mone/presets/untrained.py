"""The load-time warning for a routed or nested preset initialised from a dense checkpoint.

A MoNE, MoD, A-MoD, random-router or MatViT preset takes the weights tags of
its dense preset (``tags_from``) as an initialisation: the dense weights fit,
the parts only the routed model has (routers, smaller experts or widths) do
not come from any training. Such a model equals the dense checkpoint at
capacity (or width) 1.0 and computes something close to meaningless below
it until trained; ``warn_untrained`` says so when it is loaded.
"""

import warnings


class UntrainedWeightsWarning(UserWarning):
    """A model whose routing or smaller experts were not trained (a dense checkpoint loaded as initialisation)."""


def untrained_parts(backbone):
    """Phrases naming what a dense checkpoint leaves untrained in ``backbone`` (empty for a dense model)."""
    parts = []
    if getattr(backbone, "router_type", None) == "learned" or getattr(backbone, "score", None) == "learned":
        parts.append("the routers")
    if getattr(backbone, "router_type", None) == "random":
        parts.append("nothing trained to use the random router")
    widths = getattr(backbone, "expert_widths", None)
    if widths:
        parts.append(f"the smaller experts (widths {', '.join(str(w) for w in widths[:-1])} of {widths[-1]})")
    if getattr(backbone, "score", None) == "attention":
        parts.append("the blocks, never trained to skip tokens (A-MoD has no router parameters)")
    if hasattr(backbone, "set_width"):
        parts.append("the smaller widths (only the full width comes from the checkpoint)")
    if hasattr(backbone, "acm_gates"):
        parts.append("the ACM gates (each token's learner count) and the learners' partial sums")
    return parts


def training_command(architecture, variant):
    """The bundled recipe (a ``keras-mone train`` command) that trains ``architecture`` at ``variant``."""
    from keras_mone.recipe_files import bundled_names  # the recipe files, not the recipes package above

    size = variant.replace("/", "").lower()
    names = bundled_names()
    for candidate in (f"augreg_{architecture}_{size}_i1k", f"augreg_{architecture}_{size}_i21k"):
        if candidate in names:
            return f"recipe {candidate} (keras-mone train {candidate})"
    same = sorted(n for n in names if n.startswith(f"augreg_{architecture}_") and n.endswith("_i1k"))
    if same:
        return f"recipe {same[0]} with variant={variant} (keras-mone train {same[0]} variant={variant})"
    if f"augreg_vit_{size}_i1k" in names:
        return (f"recipe augreg_vit_{size}_i1k with architecture={architecture} "
                f"(keras-mone train augreg_vit_{size}_i1k architecture={architecture})")
    return f"a recipe with architecture={architecture} (keras-mone train --list lists them)"


def warn_untrained(model, name, tag, architecture, variant):
    """Warns (``UntrainedWeightsWarning``) if dense checkpoint ``tag`` left parts of ``model`` untrained."""
    backbone = model.backbone
    parts = untrained_parts(backbone)
    if not parts:
        return
    setting = "width=1.0" if hasattr(backbone, "set_width") else "capacity=1.0"
    if hasattr(backbone, "acm_gates"):
        warnings.warn(
            f"Preset {name!r} loaded the dense checkpoint {tag!r} as an initialisation: untrained are "
            f"{'; '.join(parts)}. With every gate choosing all learners it equals the dense checkpoint; "
            "its gates choose at random until trained. Train them with the ACM recipe's end_to_end mode "
            "(keras-mone train cluttered_digits_acm_from_dense shows the keys: architecture=acm_vit "
            "mode=end_to_end beta_target=... init_from=...).",
            UntrainedWeightsWarning,
            stacklevel=3,
        )
        return
    current = getattr(backbone, "width_fraction", None) if hasattr(backbone, "set_width") else getattr(backbone, "capacity", None)
    warnings.warn(
        f"Preset {name!r} loaded the dense checkpoint {tag!r} as an initialisation: untrained are "
        f"{'; '.join(parts)}. At {setting} it equals the dense checkpoint; at "
        f"{setting.split('=')[0]} {current} it computes something close to meaningless until trained. "
        f"Train the rest with {training_command(architecture, variant)}.",
        UntrainedWeightsWarning,
        stacklevel=3,
    )
