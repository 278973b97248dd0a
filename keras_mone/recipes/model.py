"""The classifier a recipe trains: ``{**size table, **recipe keys, **model_args}``."""

from keras_mone.models.dense_pruning import prune_dense_vit
from keras_mone.methods.registry import architectures, method_of
from keras_mone.models.video_init import load_image_weights
from keras_mone.models.vit_backbone import ViTBackbone
from keras_mone.models.vivit_backbone import ViViTBackbone
from keras_mone.models.weight_transfer import copy_matching_weights, relative_weight_paths
from keras_mone.models.weights_file import load_saved_model
from keras_mone.recipes.schema import PRESET_PREFIX, allowed_args


def build_classifier(recipe, num_classes):
    """The recipe's (built) classifier with a ``num_classes`` head.

    Its configuration is the architecture's size table entry for ``variant``,
    the recipe keys every architecture shares (image size, dropout, pooling,
    ...), the method's and the training mode's arguments, then ``model_args``.
    A size-table, method, mode or ``model_args`` argument that neither the
    backbone nor the task takes is an error naming it; a shared recipe key
    the architecture has no use for is skipped (recipe validation,
    ``schema.changed_unused_keys``, has refused it unless at its default).
    """
    architecture_name = recipe["architecture"]
    architecture = architectures()[architecture_name]
    method = method_of(architecture_name)
    shared = {
        "image_size": recipe["image_size"],
        "dropout_rate": recipe["dropout_rate"],
        "drop_path_rate": recipe["drop_path_rate"],
        "num_classes": num_classes,
        "pooling": recipe["pooling"],
        "head_bias_init": recipe["head_bias_init"],
    }
    if architecture.video:
        shared.update(num_frames=recipe["num_frames"], tubelet_size=recipe["tubelet_size"])
    specific = {
        **architecture.decode_variant(recipe["variant"]),
        **method.recipe_arguments(recipe),
        **method.mode(recipe["mode"]).model_arguments(recipe),
    }
    backbone_keys, task_keys = allowed_args(architecture_name)
    accepted = backbone_keys | task_keys
    # shared keys the architecture does not take: schema.validate refused them unless at their default
    config = {k: v for k, v in shared.items() if k in accepted}
    config.update(specific)
    config.update(recipe["model_args"])
    if recipe["pooling"] == "token" and "use_class_token" in backbone_keys:
        config.setdefault("use_class_token", True)
    unknown = sorted(set(config) - accepted)
    if unknown:
        raise ValueError(
            f"architecture {architecture_name!r} takes no argument(s) {unknown}; "
            f"its backbone and task take {sorted(accepted)}."
        )
    backbone = architecture.build_backbone(**{k: v for k, v in config.items() if k in backbone_keys})
    model = architecture.task(backbone, **{k: v for k, v in config.items() if k in task_keys})
    model.build()
    return model


def _saved_model(path):
    if path.startswith(PRESET_PREFIX):
        from keras_mone.presets import from_preset

        return from_preset(path[len(PRESET_PREFIX):])
    try:
        return load_saved_model(path, compile=False)
    except Exception as error:  # any unreadable / foreign file
        raise ValueError(f"cannot read model {path!r}: {error}") from error


def _copy_with_head(saved, backbone, model):
    same_head = saved is not backbone and tuple(saved.head.kernel.shape) == tuple(model.head.kernel.shape)
    if same_head:
        return copy_matching_weights(saved, model)  # by path, plus the target's conversions (ACM: SVD)
    left = copy_matching_weights(backbone, model.backbone)
    return sorted(left + [p for p in relative_weight_paths(model) if not p.startswith("backbone/")])


def init_from_saved_model(model, path, prune=False):
    """Initialises ``model`` from the model saved at ``path`` (a ``.keras``
    file, or ``"preset:<name>"``: a preset with shipped weights).

    A model whose backbone is of the model's own class (e.g. a Mixer or
    Sparse-MLP into the same) is copied weight by weight, its head too when
    the class counts agree. Image classifiers copy an image model of the same layout weight by weight
    (``copy_matching_weights``: e.g. a dense ViT into MoD / A-MoD / MoNE, whose
    routers keep their initialisation), its head too when the class counts
    agree. For a video classifier, an image model (``.keras``: ``ImageClassifier`` or ViT / MoNE-ViT / MatViT
    backbone) fills the spatial transformer (``load_image_weights``, central-frame
    inflation). A video model (any ViViT, e.g. the MatViT-ViViT baseline the MoNE
    paper starts its video models from, Sec. 4.4) is copied weight by weight
    (``copy_matching_weights``), its head too when the class counts agree. Raises
    ``ValueError`` if the file is missing or does not fit; returns the paths of
    ``model`` left at their initialisation.

    With ``prune``, ``model`` is a dense ViT classifier started from the
    leading blocks, heads and features of the larger dense ViT at ``path``
    (``prune_dense_vit``; the recipe key ``init_prune``).
    """
    saved = _saved_model(path)
    if prune:
        return prune_dense_vit(saved, model)
    backbone = getattr(saved, "backbone", saved)
    if type(backbone) is type(model.backbone) and not isinstance(backbone, ViTBackbone):
        return _copy_with_head(saved, backbone, model)  # e.g. a Mixer into a Mixer, weight by weight
    if not isinstance(model.backbone, ViViTBackbone):
        if isinstance(backbone, ViViTBackbone) or not isinstance(backbone, ViTBackbone):
            raise ValueError(f"{path!r} holds a {type(backbone).__name__}; an image ViT of the same size is needed.")
        return _copy_with_head(saved, backbone, model)
    if isinstance(backbone, ViViTBackbone):
        return _copy_with_head(saved, backbone, model)
    if not isinstance(backbone, ViTBackbone):
        raise ValueError(
            f"{path!r} holds a {type(backbone).__name__}; a ViT / MoNE-ViT image model or a "
            "ViViT video model is needed."
        )
    return load_image_weights(model.backbone, backbone)
