"""The dense ViT and ViViT (Dosovitskiy et al.; Arnab et al., factorised encoder): the zoo's reference.

Its one recipe key of its own is ``init_prune``: start a smaller dense ViT
from the first blocks, heads, features and MLP units of a larger one (the
converted isoFLOP dense baseline, ``keras_mone.models.dense_pruning``).
"""

from keras_mone.methods.registry import Architecture, Method, RecipeKey, register_method
from keras_mone.models.image_classifier import ImageClassifier
from keras_mone.models.video_classifier import VideoClassifier
from keras_mone.models.vit_backbone import ViTBackbone
from keras_mone.models.vivit_backbone import video_form

INIT_PRUNE = RecipeKey(
    False, bool,
    "architecture 'vit': init_from is a larger dense ViT whose first blocks, heads, features and MLP units "
    "start this smaller one (structured pruning: the converted isoFLOP dense baseline)",
)


def check_recipe(recipe, fail):
    """``init_prune`` prunes a dense image ViT named by ``init_from``."""
    if recipe["init_prune"] and (recipe["architecture"] != "vit" or not recipe["init_from"]):
        fail(
            "key 'init_prune' needs architecture 'vit' (a dense ViT) and key 'init_from' (the larger dense ViT), "
            f"got architecture {recipe['architecture']!r}, init_from {recipe['init_from']!r}."
        )


DENSE = register_method(Method(
    "dense",
    image=Architecture("vit", ViTBackbone, ImageClassifier, video=False),
    video=Architecture("vivit", video_form(ViTBackbone), VideoClassifier, video=True),
    recipe_keys={"init_prune": INIT_PRUNE},
    check_recipe=check_recipe,
))
