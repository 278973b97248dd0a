"""keras-hub ``ViTBackbone`` / ``ViTImageClassifier`` weights (the original ViT, converted by keras-hub).

Read from a built keras-hub model object (``keras_hub.models.ViTBackbone.from_preset(...)``):
``class_token`` (1, 1, D), ``patch_embedding`` (Conv2D), ``position_embedding``
(an ``Embedding`` of (N + 1, D)), blocks ``transformer_block_{i}`` with
``ln_1``, ``mha`` (``keras.layers.MultiHeadAttention``: query / key / value
kernels (D, H, D/H), ``attention_output`` (H, D/H, D)), ``ln_2``,
``mlp/dense_1`` and ``dense_2``, and the final ``ln``. keras-hub's ViT
preprocessing maps pixels to [-1, 1], like AugReg and keras_mone's recipes.
"""

import re

import keras
import numpy as np

from keras_mone.convert.keys import KeyReader
from keras_mone.convert.vit_state import fused_qkv


def vit_state_from_keras_hub(model):
    """A ViT state (see ``keras_mone.convert.vit_state``) from a keras-hub ViT backbone or classifier."""
    if isinstance(model, (dict, str, bytes)) or not hasattr(getattr(model, "backbone", model), "weights"):
        raise TypeError(
            "format 'keras_hub' takes a keras-hub model object (keras_hub.models.ViTBackbone or "
            f"ViTImageClassifier, e.g. from_preset(...)), got {type(model).__name__}; "
            "checkpoint files take the format 'vision_transformer', 'big_vision' or 'timm'."
        )
    backbone = getattr(model, "backbone", model)
    arrays = {variable.path: keras.ops.convert_to_numpy(variable) for variable in backbone.weights}
    reader = KeyReader(arrays)

    def find(suffix):
        hits = [k for k in arrays if k.endswith(suffix)]
        if len(hits) != 1:
            raise ValueError(f"not a keras-hub ViTBackbone: {len(hits)} weights end with {suffix!r}.")
        return reader(hits[0])

    # keras' unique layer names may not start at 0: the blocks in order of their number
    blocks = sorted({int(m.group(1)) for k in arrays if (m := re.search(r"transformer_block_(\d+)/", k))})
    state = {
        "patch_kernel": find("patch_embedding/kernel"),
        "patch_bias": find("patch_embedding/bias") if backbone.use_patch_bias else np.zeros(backbone.hidden_dim, "float32"),
        "position_embedding": find("position_embedding/embeddings"),
        "norm_gamma": find("vit_encoder/ln/gamma"), "norm_beta": find("vit_encoder/ln/beta"),
        "blocks": [_block(find, f"transformer_block_{i}/") for i in blocks],
        "gelu_approximate": False,  # keras' "gelu" activation is the exact form
        "sources": {},
    }
    if backbone.use_class_token:
        state["class_token"] = find("class_token").reshape(-1)
        state["sources"]["class_token"] = [k for k in arrays if k.endswith("class_token")]
    for part, layer in (("head", "output_dense"), ("pre_logits", "intermediate_layer")):
        layer = getattr(model, layer, None) if model is not backbone else None
        if layer is not None:
            state[f"{part}_kernel"], state[f"{part}_bias"] = (keras.ops.convert_to_numpy(w) for w in layer.weights[:2])
            state["sources"][part] = [w.path for w in layer.weights[:2]]
    state["unused"] = reader.unused()
    return state


def _block(find, prefix):
    mha = prefix + "mha/"
    return {
        "norm1_gamma": find(prefix + "ln_1/gamma"), "norm1_beta": find(prefix + "ln_1/beta"),
        "qkv_kernel": fused_qkv(*(find(f"{mha}{p}/kernel") for p in ("query", "key", "value"))),
        "qkv_bias": fused_qkv(*(find(f"{mha}{p}/bias") for p in ("query", "key", "value"))),
        "out_kernel": find(mha + "attention_output/kernel").reshape(-1, find(mha + "attention_output/kernel").shape[-1]),
        "out_bias": find(mha + "attention_output/bias"),
        "norm2_gamma": find(prefix + "ln_2/gamma"), "norm2_beta": find(prefix + "ln_2/beta"),
        "fc1_kernel": find(prefix + "mlp/dense_1/kernel"), "fc1_bias": find(prefix + "mlp/dense_1/bias"),
        "fc2_kernel": find(prefix + "mlp/dense_2/kernel"), "fc2_bias": find(prefix + "mlp/dense_2/bias"),
    }
