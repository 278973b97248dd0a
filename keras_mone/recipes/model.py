"""The classifier a recipe trains: ``{**size table, **recipe keys, **model_args}``."""

from keras_mone.layers.config import config_argument_names
from keras_mone.models.image_classifier import ImageClassifier
from keras_mone.models.matvit_backbone import MatViTBackbone
from keras_mone.models.matvit_classifier import MatViTClassifier
from keras_mone.models.mone_vit_backbone import MoNEViTBackbone
from keras_mone.models.variants import decode_variant
from keras_mone.models.vit_backbone import ViTBackbone

BACKBONES = {"vit": ViTBackbone, "mone_vit": MoNEViTBackbone, "matvit": MatViTBackbone}
TASKS = {"vit": ImageClassifier, "mone_vit": ImageClassifier, "matvit": MatViTClassifier}


def _allowed_args(architecture):
    backbone = set(config_argument_names(BACKBONES[architecture]))
    task = set(config_argument_names(TASKS[architecture])) - {"backbone"}
    return backbone, task


def check_model_args(architecture, model_args):
    """Raises ``ValueError`` if a ``model_args`` key is no constructor argument."""
    backbone, task = _allowed_args(architecture)
    unknown = sorted(set(model_args) - backbone - task)
    if unknown:
        raise ValueError(
            f"unknown argument(s) {unknown} for architecture {architecture!r}. "
            f"Allowed: {sorted(backbone | task)}."
        )


def build_classifier(recipe, num_classes):
    """The recipe's (built) classifier with a ``num_classes`` head."""
    architecture = recipe["architecture"]
    config = {
        **decode_variant(recipe["variant"]),
        "image_size": recipe["image_size"],
        "dropout_rate": recipe["dropout_rate"],
        "drop_path_rate": recipe["drop_path_rate"],
        "num_classes": num_classes,
        "pooling": recipe["pooling"],
        "head_bias_init": recipe["head_bias_init"],
    }
    if architecture == "mone_vit":
        config.update(
            capacity=recipe["capacity"], router_type=recipe["router_type"], router_seed=recipe["seed"]
        )
    if architecture == "matvit":
        config.update(width_fraction=recipe["width_fraction"], joint_training=recipe["mode"] == "joint")
    config.update(recipe["model_args"])
    if recipe["pooling"] == "token":
        config.setdefault("use_class_token", True)
    backbone_keys, task_keys = _allowed_args(architecture)
    backbone = BACKBONES[architecture](**{k: v for k, v in config.items() if k in backbone_keys})
    model = TASKS[architecture](backbone, **{k: v for k, v in config.items() if k in task_keys})
    model.build()
    return model
