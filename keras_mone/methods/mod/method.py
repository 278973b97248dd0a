"""Mixture-of-Depths (Raposo et al.) and A-MoD (Gadhikar et al.) on ViTs: routed blocks that skip tokens.

Both take MoNE's ``capacity`` key: the share of tokens a routed block runs.
MoD scores tokens with a learned router; A-MoD with the attention each token
received in the block before, so it has no router parameters.
"""

from keras_mone.methods.mone.method import CAPACITY
from keras_mone.methods.registry import Architecture, Method, register_method
from keras_mone.models.image_classifier import ImageClassifier
from keras_mone.methods.mod.backbone import AMoDViTBackbone, MoDViTBackbone
from keras_mone.models.video_classifier import VideoClassifier
from keras_mone.models.vivit_backbone import video_form


def untrained_router(backbone):
    return ["the routers"]


def untrained_skipping(backbone):
    return ["the blocks, never trained to skip tokens (A-MoD has no router parameters)"]


MOD = register_method(Method(
    "mod",
    image=Architecture("mod_vit", MoDViTBackbone, ImageClassifier, video=False),
    video=Architecture("mod_vivit", video_form(MoDViTBackbone), VideoClassifier, video=True),
    recipe_arguments=lambda recipe: dict(capacity=recipe["capacity"]),
    recipe_keys={"capacity": CAPACITY},
    untrained=untrained_router,
))
AMOD = register_method(Method(
    "amod",
    image=Architecture("amod_vit", AMoDViTBackbone, ImageClassifier, video=False),
    video=Architecture("amod_vivit", video_form(AMoDViTBackbone), VideoClassifier, video=True),
    recipe_arguments=lambda recipe: dict(capacity=recipe["capacity"]),
    recipe_keys={"capacity": CAPACITY},
    untrained=untrained_skipping,
))
