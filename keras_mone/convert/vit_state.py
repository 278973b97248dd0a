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
* ``norm_gamma``, ``norm_beta`` (the encoder's final LayerNorm)
* ``head_kernel`` (D, K), ``head_bias`` (K,) -- optional

``load_vit_state`` writes it into a dense ViT, a MoNE-ViT (whose routers and
gates keep their fresh initialisation: at ``capacity=1.0`` the model then
computes what the dense one does) or their classifiers.
"""

import math

import keras
import numpy as np

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


def load_vit_state(model, state, source="checkpoint"):
    """Writes ``state`` into ``model`` (a built ViT / MoNE-ViT backbone or classifier).

    Every shape is checked before the first value is written. Position
    embeddings are resized when the model's patch grid differs; a class token
    the model does not use is dropped with its position; the head is loaded
    only when the model has one of the same class count.

    Returns:
        A report: ``{"loaded": [paths], "kept": {path: reason}}``; ``kept``
        lists the model's variables left as they were (routers, a head of
        another class count, ...).
    """
    if not model.built:
        model.build()
    targets = relative_weight_paths(model)
    prefix = "backbone/" if "backbone/norm/gamma" in targets else ""
    backbone = getattr(model, "backbone", model)
    depth = len(state["blocks"])
    if depth != backbone.depth:
        raise ValueError(
            f"{source} has {depth} blocks but the model has `depth`={backbone.depth}; "
            "build the model with the checkpoint's depth."
        )
    values = {
        f"{prefix}patch_embedding/projection/kernel": state["patch_kernel"],
        f"{prefix}patch_embedding/projection/bias": state["patch_bias"],
        f"{prefix}norm/gamma": state["norm_gamma"],
        f"{prefix}norm/beta": state["norm_beta"],
    }
    for index, block in enumerate(state["blocks"]):
        for key, path in BLOCK_KEYS.items():
            values[f"{prefix}block_{index}/{path}"] = block[key]
    values.update(_positions(state, targets, prefix, backbone, source))
    kept = {}
    if "head/kernel" in targets:
        head_shape = tuple(targets["head/kernel"].shape)
        if "head_kernel" in state and tuple(np.shape(state["head_kernel"])) == head_shape:
            values["head/kernel"], values["head/bias"] = state["head_kernel"], state["head_bias"]
        else:
            found = np.shape(state["head_kernel"])[-1] if "head_kernel" in state else "no"
            kept["head/kernel"] = kept["head/bias"] = (
                f"{source} has {found} head classes, the model {head_shape[-1]}: head left as initialised"
            )
    mismatched = [
        f"{path}: {source} {tuple(np.shape(v))}, model {tuple(targets[path].shape)}"
        for path, v in values.items() if path not in targets or tuple(np.shape(v)) != tuple(targets[path].shape)
    ]
    if mismatched:
        raise ValueError(
            f"{source} does not fit the model (nothing was loaded); first mismatches:\n  "
            + "\n  ".join(mismatched[:5])
            + "\nBuild the model with the checkpoint's hidden_dim, mlp_dim, num_heads and patch_size."
        )
    for path, value in values.items():
        variable = targets[path]
        variable.assign(np.asarray(value, dtype=variable.dtype))
    for path in targets:
        if path not in values and path not in kept:
            kept[path] = "not in the checkpoint: left as initialised"
    return {"loaded": sorted(values), "kept": kept}


def _positions(state, targets, prefix, backbone, source):
    positions = np.asarray(state["position_embedding"])[None]
    source_cls = "class_token" in state
    grid_tokens = positions.shape[1] - int(source_cls)
    side = math.isqrt(grid_tokens)
    if side * side != grid_tokens:
        raise ValueError(f"{source}: {grid_tokens} position embeddings do not form a square patch grid.")
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
    return values
