"""Mixture of Nested Experts (Jain et al., ``mone.txt``) and its random-router ablation (Fig. 7c).

MoNE's recipe keys: the effective capacity ``capacity`` (e_c, Sec. 3.3) it
trains (mode ``fixed``) and is evaluated at, the ``router_type`` and the e_c
values ``adaptive_capacities`` drawn per step by the modes ``adaptive`` and
``adaptive_isoflops`` (Sec. 5, "one model for every budget").
"""

from keras_mone.methods.registry import Architecture, Method, RecipeKey, register_method
from keras_mone.models.image_classifier import ImageClassifier
from keras_mone.methods.mone.backbone import MoNEViTBackbone
from keras_mone.models.video_classifier import VideoClassifier
from keras_mone.models.vivit_backbone import video_form

#: Shared with the methods that skip tokens at a capacity (MoD, A-MoD).
CAPACITY = RecipeKey(0.5, float, "MoNE effective capacity e_c to train (fixed) and evaluate at", high=1.0, above=0.0)
ADAPTIVE_CAPACITIES = RecipeKey(
    [round(0.15 + 0.1 * i, 2) for i in range(9)], list,
    "e_c values drawn per step (mode='adaptive' or 'adaptive_isoflops')",
)
ROUTER_TYPE = RecipeKey("learned", str, "MoNE router", ("learned", "random"))


def check_recipe(recipe, fail):
    """``adaptive_capacities`` holds capacities in (0, 1]."""
    for value in recipe["adaptive_capacities"]:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            fail(f"key 'adaptive_capacities' must hold numbers in (0, 1], got {recipe['adaptive_capacities']!r}.")


def untrained_experts(backbone):
    """A dense checkpoint trains neither MoNE's routers nor its smaller experts."""
    parts = ["the routers"] if backbone.router_type == "learned" else ["nothing trained to use the random router"]
    widths = backbone.expert_widths
    return parts + [f"the smaller experts (widths {', '.join(str(w) for w in widths[:-1])} of {widths[-1]})"]


MONE = register_method(Method(
    "mone",
    image=Architecture("mone_vit", MoNEViTBackbone, ImageClassifier, video=False),
    video=Architecture("mone_vivit", video_form(MoNEViTBackbone), VideoClassifier, video=True),
    modes=("fixed", "adaptive", "isoflops", "adaptive_isoflops"),
    recipe_arguments=lambda recipe: dict(
        capacity=recipe["capacity"], router_type=recipe["router_type"], router_seed=recipe["seed"]
    ),
    recipe_keys={"capacity": CAPACITY, "router_type": ROUTER_TYPE, "adaptive_capacities": ADAPTIVE_CAPACITIES},
    check_recipe=check_recipe,
    untrained=untrained_experts,
))

RANDOM_ROUTER = register_method(Method(
    "random_router",
    image=Architecture("random_mone_vit", MoNEViTBackbone, ImageClassifier, video=False,
                       defaults={"router_type": "random"}),
    video=Architecture("random_mone_vivit", video_form(MoNEViTBackbone), VideoClassifier, video=True,
                       defaults={"router_type": "random"}),
    recipe_arguments=lambda recipe: dict(capacity=recipe["capacity"], router_seed=recipe["seed"]),
    recipe_keys={"capacity": CAPACITY},
    untrained=untrained_experts,
))
