"""The one layout every converter produces, and its loading into keras_mone models.

A *ViT state* is a dict of numpy arrays in keras_mone's own layout, whatever
the source format:

* ``patch_kernel`` (p, p, C, D), ``patch_bias`` (D,)
* ``class_token`` (D,) -- absent for models without one
* ``position_embedding`` (N [+ 1], D), the class position first when
  ``class_token`` is present; the grid part is square
* ``blocks``: one dict per block with ``norm1_gamma``, ``norm1_beta``,
  ``qkv_kernel`` (D, 3D: query, key, value, each head-major), ``qkv_bias``,
  ``out_kernel`` (D, D), ``out_bias``, ``norm2_gamma``, ``norm2_beta``,
  ``fc1_kernel`` (D, M), ``fc1_bias``, ``fc2_kernel`` (M, D), ``fc2_bias``
* ``norm_gamma``, ``norm_beta`` (the encoder's final LayerNorm) -- absent
  when the source has none (timm fc_norm models)
* ``head_kernel`` (D or R, K), ``head_bias`` (K,) -- optional
* ``pre_logits_kernel`` (D, R), ``pre_logits_bias`` (R,) -- optional (Dense + tanh)
* ``gelu_approximate``: the GELU the source computes (tanh form: flax codes)
* ``sources``: ``{"class_token" | "head" | "pre_logits": [checkpoint keys]}``
* ``unused``: ``{checkpoint key: reason}`` of keys the converter did not map

``load_vit_state`` writes it into a dense ViT, a MoNE-ViT (whose routers and
gates keep their fresh initialisation: at ``capacity=1.0`` the model then
computes what the dense one does) or their classifiers.
"""

import math
import warnings

import keras
import numpy as np

from keras_mone.convert.keys import STRICT_SCOPE, describe_unused, name_target, warn_unused
from keras_mone.layers.token_sequence import layout_positions
from keras_mone.models.weight_transfer import relative_weight_paths

BLOCK_KEYS = {
    "norm1_gamma": "norm1/gamma", "norm1_beta": "norm1/beta",
    "qkv_kernel": "attention/qkv/kernel", "qkv_bias": "attention/qkv/bias",
    "out_kernel": "attention/out/kernel", "out_bias": "attention/out/bias",
    "norm2_gamma": "norm2/gamma", "norm2_beta": "norm2/beta",
    "fc1_kernel": "mlp/fc1/kernel", "fc1_bias": "mlp/fc1/bias",
    "fc2_kernel": "mlp/fc2/kernel", "fc2_bias": "mlp/fc2/bias",
}


def fused_qkv(query, key, value):
    """``(D, 3D)`` kernel or ``(3D,)`` bias from per-projection ``(D, H, D/H)`` / ``(H, D/H)`` arrays."""
    parts = [np.asarray(p) for p in (query, key, value)]
    if parts[0].ndim == 3:
        return np.concatenate([p.reshape(p.shape[0], -1) for p in parts], axis=1)
    return np.concatenate([p.reshape(-1) for p in parts])


def load_vit_state(model, state, source="checkpoint", strict=True):
    """Writes ``state`` into ``model`` (a built ViT / MoNE-ViT backbone or classifier).

    Every shape is checked, and in strict mode every checkpoint key is used,
    before the first value is written. Position embeddings are resized when
    the model's patch grid differs. With ``strict=False`` the keys the model
    has no part for are skipped with a warning naming them: a class token
    the model does not use (dropped with its position), a head of another
    class count (or on a backbone), ... A shape mismatch is an error in
    either mode.

    Returns:
        A report: ``{"loaded": [paths], "kept": {path: reason}, "unused":
        {checkpoint key: reason}, "gelu_approximate": bool}``; ``kept`` lists
        the model's variables left as they were (routers, a head of another
        class count, ...), ``gelu_approximate`` the GELU the checkpoint was
        trained with (warned about when the model computes the other one).
    """
    backbone = getattr(model, "backbone", model)
    _check_model(backbone)
    if not model.built:
        model.build()
    targets = relative_weight_paths(model)
    prefix = "backbone/" if "backbone/norm/gamma" in targets else ""
    depth = len(state["blocks"])
    if depth != backbone.depth:
        raise ValueError(
            f"{source} has {depth} blocks but the model has `depth`={backbone.depth}; "
            "build the model with the checkpoint's depth."
        )
    values = {
        f"{prefix}patch_embedding/projection/kernel": state["patch_kernel"],
        f"{prefix}patch_embedding/projection/bias": state["patch_bias"],
    }
    if "norm_gamma" in state:
        values[f"{prefix}norm/gamma"], values[f"{prefix}norm/beta"] = state["norm_gamma"], state["norm_beta"]
    for index, block in enumerate(state["blocks"]):
        for key, path in BLOCK_KEYS.items():
            values[f"{prefix}block_{index}/{path}"] = block[key]
    unused, kept = name_target(state.get("unused", {}), backbone), {}
    values.update(_positions(state, targets, prefix, backbone, source, unused))
    values.update(_head(state, targets, source, unused, kept))
    mismatched = [
        f"{path}: {source} {tuple(np.shape(v))}, model {tuple(targets[path].shape)}"
        for path, v in values.items() if path not in targets or tuple(np.shape(v)) != tuple(targets[path].shape)
    ]
    if mismatched:
        raise ValueError(
            f"{source} does not fit the model (nothing was loaded); first mismatches:\n  "
            + "\n  ".join(mismatched[:5])
            + "\nBuild the model with the checkpoint's hidden_dim, mlp_dim, num_heads, patch_size "
            "and representation_size.\n" + STRICT_SCOPE + "."
        )
    if strict and unused:
        raise ValueError(
            f"{source}: {len(unused)} key(s) the model would not use (nothing was loaded):\n"
            + describe_unused(unused)
            + "\nBuild the model as a reason says, or pass strict=False to skip these keys (with a warning "
            "naming them; the model then computes something else than the checkpoint; the report's "
            "'unused' lists them)."
        )
    warn_unused(source, unused)
    for path, value in values.items():
        variable = targets[path]
        variable.assign(np.asarray(value, dtype=variable.dtype))
    for path in targets:
        if path not in values and path not in kept:
            kept[path] = "not in the checkpoint: left as initialised"
    gelu = bool(state.get("gelu_approximate", False))
    if getattr(backbone, "gelu_approximate", False) != gelu:
        warnings.warn(
            f"{source} was trained with the {_GELU[gelu]} GELU, the model computes the {_GELU[not gelu]} "
            f"one (outputs move by ~1e-3); build the backbone with gelu_approximate={gelu} to compute "
            "exactly what the checkpoint does.",
            stacklevel=3,
        )
    return {"loaded": sorted(values), "kept": kept, "unused": unused, "gelu_approximate": gelu}


_GELU = {True: "tanh-approximate", False: "exact (erf)"}


def _check_model(backbone):
    if hasattr(backbone, "temporal_depth"):
        raise TypeError(
            "load_checkpoint loads image ViT checkpoints into image models; for a ViViT, load the "
            "checkpoint into an image model first, then use "
            "keras_mone.models.vivit_from_image_backbone(image_model.backbone, ...)."
        )
    if not (hasattr(backbone, "patch_embedding") and hasattr(backbone, "blocks")):
        raise TypeError(
            f"`model` must be a keras_mone ViT backbone or classifier (e.g. models.ViTBackbone, "
            f"models.ImageClassifier), got {type(backbone).__name__}."
        )


def _head(state, targets, source, unused, kept):
    """Head and representation-layer values; what cannot load goes to ``unused`` / ``kept``."""
    sources, values = state.get("sources", {}), {}
    pre_logits = "pre_logits_kernel" in state
    if "pre_logits/kernel" in targets:
        if pre_logits:
            values["pre_logits/kernel"], values["pre_logits/bias"] = state["pre_logits_kernel"], state["pre_logits_bias"]
    elif pre_logits:
        width = np.shape(state["pre_logits_kernel"])[-1]
        for key in sources.get("pre_logits", ["pre_logits"]):
            unused[key] = (
                f"a representation layer (Dense + tanh before the head) of width {width}: build the "
                f"classifier with representation_size={width}"
            )
    if "head_kernel" not in state:
        return values
    found = np.shape(state["head_kernel"])
    if "head/kernel" not in targets:
        reason = "the model has no head (a backbone); load into a classifier to use it"
    elif pre_logits and "pre_logits/kernel" not in targets:
        reason = "the head reads the representation layer, which the model lacks"
    elif found != tuple(targets["head/kernel"].shape):
        reason = (f"the head has {found[-1]} classes, the model {targets['head/kernel'].shape[-1]}: build it "
                  f"with num_classes={found[-1]} to use it")
    else:
        values["head/kernel"], values["head/bias"] = state["head_kernel"], state["head_bias"]
        return values
    for key in sources.get("head", ["head"]):
        unused[key] = reason
    if "head/kernel" in targets:
        kept["head/kernel"] = kept["head/bias"] = f"{source}: {reason}; head left as initialised"
    return values


def _positions(state, targets, prefix, backbone, source, unused):
    positions = np.asarray(state["position_embedding"])[None]
    source_cls = "class_token" in state
    grid_tokens = positions.shape[1] - int(source_cls)
    side = math.isqrt(grid_tokens)
    if side * side != grid_tokens:
        raise ValueError(
            f"{source}: {grid_tokens} position embeddings (besides the class token's: "
            f"{source_cls}) do not form a square patch grid."
        )
    path = f"{prefix}patch_embedding/position_embedding"
    target = targets[path]
    target_cls = backbone.use_class_token
    values = {
        path: layout_positions(
            positions, source_cls, (side, side), keras.ops.convert_to_numpy(target),
            target_cls, backbone.patch_embedding.grid_size,
        )[0][None],
    }
    if target_cls:
        if not source_cls:
            raise ValueError(
                f"{source} has no class token but the model uses one; build it with "
                "use_class_token=False (and pooling='gap')."
            )
        values[f"{prefix}patch_embedding/class_token"] = np.asarray(state["class_token"]).reshape(1, 1, -1)
    elif source_cls:
        for key in state.get("sources", {}).get("class_token", ["class_token"]):
            unused[key] = (
                "a class token (and its position), which a model without one drops, so it computes "
                "something else: build it with use_class_token=True, pooling=\"token\""
            )
    return values
