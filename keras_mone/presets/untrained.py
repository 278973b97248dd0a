"""The load-time warning for a routed or nested preset initialised from a dense checkpoint.

A MoNE, MoD, A-MoD, random-router or MatViT preset takes the weights tags of
its dense preset (``tags_from``) as an initialisation: the dense weights fit,
the parts only the routed model has (routers, smaller experts or widths) do
not come from any training. Such a model equals the dense checkpoint at
capacity (or width) 1.0 and computes something close to meaningless below
it until trained; ``warn_untrained`` says so when it is loaded.
"""

import warnings

from keras_mone.methods.registry import architecture_of, method_of


class UntrainedWeightsWarning(UserWarning):
    """A model whose routing or smaller experts were not trained (a dense checkpoint loaded as initialisation)."""


def untrained_parts(backbone, architecture=None):
    """Phrases naming what a dense checkpoint leaves untrained in ``backbone``
    (its method's ``untrained``, ``keras_mone.methods``; empty for a dense model)."""
    return method_of(architecture or architecture_of(backbone)).untrained(backbone)


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
    method = method_of(architecture)
    parts = method.untrained(backbone)
    if not parts:
        return
    command = training_command(architecture, variant)
    if method.untrained_advice is not None:
        advice = method.untrained_advice(backbone, parts, command)
    else:
        scored = method.scored_at(backbone)
        advice = (
            f"At {scored.setting}=1.0 it equals the dense checkpoint; at {scored.setting} {scored.current} it "
            f"computes something close to meaningless until trained. Train the rest with {command}."
        )
    warnings.warn(
        f"Preset {name!r} loaded the dense checkpoint {tag!r} as an initialisation: untrained are "
        f"{'; '.join(parts)}. {advice}",
        UntrainedWeightsWarning,
        stacklevel=3,
    )
