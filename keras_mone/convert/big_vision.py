"""ViT checkpoints of google-research/vision_transformer (AugReg) and big_vision, as ``.npz``.

Two layouts, named by the caller (never guessed from the keys):

``"vision_transformer"`` (AugReg files, the original ViT release)
    ``embedding/kernel`` (p, p, C, D), ``cls`` (1, 1, D),
    ``Transformer/posembed_input/pos_embedding`` (1, N + 1, D) with the class
    position, blocks ``Transformer/encoderblock_{i}/`` with ``LayerNorm_0``,
    ``MultiHeadDotProductAttention_1/{query,key,value}`` (kernels (D, H, D/H),
    biases (H, D/H)) and ``out`` ((H, D/H, D), (D,)), ``LayerNorm_2``,
    ``MlpBlock_3/Dense_{0,1}``; ``Transformer/encoder_norm``; ``head``.
``"big_vision"`` (big_vision's own ``vit.py``)
    the same under a ``params/`` prefix, with ``pos_embedding`` (1, N, D) on
    the model (no class position), ``LayerNorm_0`` / ``LayerNorm_1``,
    ``MultiHeadDotProductAttention_0``, ``MlpBlock_0``, and either
    ``encoderblock_{i}/`` per block or one scanned ``encoderblock/`` whose
    arrays carry the depth as their first axis.

AugReg models use the tanh approximation of GELU; keras_mone's MLP uses the
exact form, as timm does for the same weights (logits move by ~1e-3).
"""

import re
import zipfile

import numpy as np

from keras_mone.convert.vit_state import fused_qkv

LAYOUTS = ("vision_transformer", "big_vision")

_NAMES = {
    "vision_transformer": dict(prefix="", positions="Transformer/posembed_input/pos_embedding",
                               ln1="LayerNorm_0", attention="MultiHeadDotProductAttention_1",
                               ln2="LayerNorm_2", mlp="MlpBlock_3", class_position=True),
    "big_vision": dict(prefix="params/", positions="pos_embedding",
                       ln1="LayerNorm_0", attention="MultiHeadDotProductAttention_0",
                       ln2="LayerNorm_1", mlp="MlpBlock_0", class_position=False),
}


def read_npz(path):
    """``{name: array}`` of an ``.npz`` file, with a clear error for anything else."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
        raise ValueError(f"{path!r} is not a readable .npz checkpoint (truncated or another format): {error}") from error


def vit_state_from_npz(arrays, layout):
    """A ViT state (see ``keras_mone.convert.vit_state``) from ``.npz`` arrays in ``layout``."""
    if layout not in LAYOUTS:
        raise ValueError(f"`layout` must be one of {LAYOUTS}, got {layout!r}.")
    names = _NAMES[layout]
    params = {k[len(names["prefix"]):]: v for k, v in arrays.items() if k.startswith(names["prefix"])}
    _require(params, ["embedding/kernel", names["positions"], "Transformer/encoder_norm/scale"], layout)
    state = {
        "patch_kernel": params["embedding/kernel"],
        "patch_bias": params["embedding/bias"],
        "norm_gamma": params["Transformer/encoder_norm/scale"],
        "norm_beta": params["Transformer/encoder_norm/bias"],
        "blocks": [_block(block, names) for block in _blocks(params)],
    }
    positions = params[names["positions"]][0]
    if "cls" in params:
        state["class_token"] = params["cls"].reshape(-1)
        if not names["class_position"]:  # big_vision adds the class token after the positions
            positions = np.concatenate([np.zeros_like(positions[:1]), positions])
    elif names["class_position"]:
        raise ValueError("a 'vision_transformer' checkpoint without 'cls' is not a ViT classifier checkpoint.")
    state["position_embedding"] = positions
    if "head/kernel" in params:
        state["head_kernel"], state["head_bias"] = params["head/kernel"], params["head/bias"]
    return state


def _blocks(params):
    """Per-block ``{name below the block: array}``, from numbered or scanned blocks."""
    numbered = {}
    for key, value in params.items():
        match = re.match(r"Transformer/encoderblock_(\d+)/(.+)", key)
        if match:
            numbered.setdefault(int(match.group(1)), {})[match.group(2)] = value
    if numbered:
        return [numbered[i] for i in sorted(numbered)]
    scanned = {k[len("Transformer/encoderblock/"):]: v for k, v in params.items()
               if k.startswith("Transformer/encoderblock/")}
    if not scanned:
        raise ValueError("the checkpoint has no 'Transformer/encoderblock_{i}' nor a scanned 'Transformer/encoderblock'.")
    depth = next(iter(scanned.values())).shape[0]
    return [{k: v[i] for k, v in scanned.items()} for i in range(depth)]


def _block(block, names):
    attention, mlp = names["attention"], names["mlp"]
    projection = {p: (block[f"{attention}/{p}/kernel"], block[f"{attention}/{p}/bias"]) for p in ("query", "key", "value")}
    out_kernel = block[f"{attention}/out/kernel"]
    return {
        "norm1_gamma": block[f"{names['ln1']}/scale"], "norm1_beta": block[f"{names['ln1']}/bias"],
        "qkv_kernel": fused_qkv(*(projection[p][0] for p in ("query", "key", "value"))),
        "qkv_bias": fused_qkv(*(projection[p][1] for p in ("query", "key", "value"))),
        "out_kernel": out_kernel.reshape(-1, out_kernel.shape[-1]),
        "out_bias": block[f"{attention}/out/bias"],
        "norm2_gamma": block[f"{names['ln2']}/scale"], "norm2_beta": block[f"{names['ln2']}/bias"],
        "fc1_kernel": block[f"{mlp}/Dense_0/kernel"], "fc1_bias": block[f"{mlp}/Dense_0/bias"],
        "fc2_kernel": block[f"{mlp}/Dense_1/kernel"], "fc2_bias": block[f"{mlp}/Dense_1/bias"],
    }


def _require(params, keys, layout):
    missing = [k for k in keys if k not in params]
    if missing:
        raise ValueError(
            f"not a {layout!r} ViT checkpoint: {missing} missing (found e.g. {sorted(params)[:4]}); "
            f"the other layouts are {[name for name in LAYOUTS if name != layout]}."
        )
