"""A smaller dense ViT started from a larger trained one (structured pruning).

The converted isoFLOP baseline of the across-budget comparison (MoNE paper
Fig. 3 compares MoNE with dense ViTs of matched FLOPs): a dense ViT of fewer
blocks, heads and features, initialised from the leading blocks, heads,
residual features and MLP units of a trained dense ViT, then fine-tuned like
the methods converted from the same model.
"""

import numpy as np
from keras import ops

from keras_mone.models.vit_backbone import ViTBackbone
from keras_mone.models.weight_transfer import relative_weight_paths

#: Backbone arguments both models must share (the token grid and its layout).
SHARED = ("image_size", "patch_size", "num_channels", "use_class_token")
#: Backbone arguments the target may only shrink.
SHRINKABLE = ("depth", "num_heads", "hidden_dim", "mlp_dim")


def _check(source, target):
    for model, role in ((source, "source"), (target, "target")):
        if type(model) is not ViTBackbone:
            raise ValueError(f"pruning copies a dense ViTBackbone; the {role} is a {type(model).__name__}.")
    source_config, target_config = source.get_config(), target.get_config()
    differ = [f"{k}: {source_config[k]} vs {target_config[k]}" for k in SHARED if source_config[k] != target_config[k]]
    larger = [f"{k}: {source_config[k]} < {target_config[k]}" for k in SHRINKABLE if source_config[k] < target_config[k]]
    head_widths = (source.hidden_dim // source.num_heads, target.hidden_dim // target.num_heads)
    if head_widths[0] != head_widths[1]:
        differ.append(f"head width: {head_widths[0]} vs {head_widths[1]}")
    if differ or larger:
        raise ValueError(
            f"Cannot prune '{source.name}' into '{target.name}': the source must be a dense ViT of the same "
            f"token grid and head width, at least as deep, wide and with as many heads; differing: {differ}; "
            f"larger in the target: {larger}."
        )


def _leading(array, shape):
    """``array[:shape[0], :shape[1], ...]``: the leading entries along every axis."""
    return array[tuple(slice(0, n) for n in shape)]


def _first_heads(array, heads, head_width):
    """The q, k and v columns of the first ``heads`` heads of a fused ``qkv`` kernel or bias.

    Columns are ordered (q / k / v, head, feature within the head)
    (``MoNEAttention``'s reshape to ``(3, H, head_dim)``)."""
    rows = array.shape[:-1]
    split = array.reshape(rows + (3, array.shape[-1] // (3 * head_width), head_width))
    return split[..., :heads, :].reshape(rows + (3 * heads * head_width,))


def prune_dense_vit(source, target):
    """Copies the leading part of a trained dense ViT into a smaller dense ViT.

    ``target`` keeps ``source``'s first ``target.depth`` blocks, in every
    attention the first ``target.num_heads`` heads (their q, k and v columns
    and their rows of the output projection), the first ``target.hidden_dim``
    features of the residual stream (patch and position embeddings, class
    token, norms, every projection's input and output rows / columns) and the
    first ``target.mlp_dim`` hidden units of every MLP; between classifiers of
    the same class count, the head's rows for the kept features. At equal
    sizes this is a plain copy. The leading features are not ranked: the pruned
    model is a starting point to fine-tune, not an approximation of the source.

    Args:
        source: a built ``ViTBackbone`` or classifier of one.
        target: a built ``ViTBackbone`` or classifier of one (both backbones
            or both classifiers), with the same image size, patch size,
            channels, class-token use and head width, and no dimension larger
            than ``source``'s.

    Returns:
        Sorted paths of ``target`` weights left at their initialisation (the
        head when the class counts differ; nothing otherwise).

    Raises:
        ValueError: a model is not a dense ViT, the two differ in the token
            grid or head width, or the target is larger along some dimension;
            nothing is copied then.
    """
    source_backbone = getattr(source, "backbone", source)
    target_backbone = getattr(target, "backbone", target)
    if (source is source_backbone) != (target is target_backbone):
        raise ValueError("prune_dense_vit takes two backbones or two classifiers.")
    _check(source_backbone, target_backbone)
    source_weights, target_weights = relative_weight_paths(source), relative_weight_paths(target)
    head_width = target_backbone.hidden_dim // target_backbone.num_heads
    copies, left = {}, []
    for path, variable in target_weights.items():
        if path not in source_weights:
            raise ValueError(f"Cannot prune '{source.name}' into '{target.name}': no source weight at {path!r}.")
        array = np.asarray(ops.convert_to_numpy(source_weights[path]))
        shape = tuple(variable.shape)
        if path.endswith("attention/qkv/kernel") or path.endswith("attention/qkv/bias"):
            array = _first_heads(array, target_backbone.num_heads, head_width)
            array = _leading(array, shape)
        elif path.split("/")[0] == "head" and array.shape[-1] != shape[-1]:
            left.append(path)  # another class count: the head keeps its initialisation
            continue
        else:
            array = _leading(array, shape)
        if array.shape != shape:
            raise ValueError(f"Cannot prune '{source.name}' into '{target.name}': {path} {array.shape} vs {shape}.")
        copies[path] = array
    for path, array in copies.items():
        target_weights[path].assign(array)
    return sorted(left)
