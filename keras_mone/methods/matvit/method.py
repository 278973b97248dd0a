"""MatViT (Kudugunta et al., MatFormer): one ViT whose blocks run at a nested width D/8..D.

Its recipe key is the ``width_fraction`` a model trains (mode ``fixed``) and
is evaluated at; mode ``joint`` trains every width at once. A MatViT is
scored at each of its nested widths.
"""

from keras_mone.methods.registry import Architecture, Method, RecipeKey, Scoring, register_method
from keras_mone.methods.matvit.backbone import MatViTBackbone
from keras_mone.methods.matvit.classifier import MatViTClassifier, MatViViTClassifier
from keras_mone.models.vivit_backbone import video_form
from keras_mone.training.modes import FIXED, JOINT, TrainingMode

#: The widths a MatViT's accuracy is recorded at (publish, model cards).
SCORED_WIDTHS = (0.125, 0.25, 0.5, 1.0)
WIDTH_FRACTION = RecipeKey(1.0, float, "MatViT width to evaluate at (1/8, 1/4, 1/2 or 1)", high=1.0, above=0.0)


def score_by_width(backbone):
    return Scoring("width", SCORED_WIDTHS, backbone.width_fraction)


def untrained_widths(backbone):
    return ["the smaller widths (only the full width comes from the checkpoint)"]


MATVIT = register_method(Method(
    "matvit",
    image=Architecture("matvit", MatViTBackbone, MatViTClassifier, video=False),
    video=Architecture("matvivit", video_form(MatViTBackbone), MatViViTClassifier, video=True),
    modes=(
        TrainingMode("fixed", FIXED.description + " (one width)", model_arguments=lambda recipe: {"joint_training": False}),
        JOINT,
    ),
    recipe_arguments=lambda recipe: dict(width_fraction=recipe["width_fraction"]),
    recipe_keys={"width_fraction": WIDTH_FRACTION},
    scored_at=score_by_width,
    untrained=untrained_widths,
))
