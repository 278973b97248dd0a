"""ViT state dicts of timm (``vision_transformer.py``), from ``.safetensors`` or ``.pth``.

Keys: ``patch_embed.proj.weight`` (D, C, p, p) and bias, ``cls_token``
(1, 1, D), ``pos_embed`` (1, N [+ 1], D), ``blocks.{i}.norm1``,
``blocks.{i}.attn.qkv`` (weight (3D, D): query, key, value stacked, heads
contiguous), ``blocks.{i}.attn.proj``, ``blocks.{i}.norm2``,
``blocks.{i}.mlp.fc1`` / ``fc2``, ``norm``, ``head``. torch ``Linear``
weights are (out, in), hence the transposes. Models without a class token
(``class_token=False``) have no ``cls_token`` and a grid-only ``pos_embed``.
"""

import json
import re
import struct

import numpy as np

_SAFETENSORS_DTYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "BF16": None}


def read_safetensors(path):
    """``{name: array}`` of a ``.safetensors`` file (the format is read directly, no extra package)."""
    try:
        with open(path, "rb") as file:
            (header_size,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(header_size))
            data = file.read()
    except (OSError, ValueError, struct.error) as error:
        raise ValueError(f"{path!r} is not a readable .safetensors file: {error}") from error
    arrays = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        if end > len(data):
            raise ValueError(f"{path!r} is truncated: tensor {name!r} ends at byte {end} of {len(data)}.")
        raw = data[start:end]
        if info["dtype"] == "BF16":  # bfloat16: the high half of a float32
            values = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
        elif info["dtype"] in _SAFETENSORS_DTYPES:
            values = np.frombuffer(raw, _SAFETENSORS_DTYPES[info["dtype"]])
        else:
            raise ValueError(f"{path!r}: tensor {name!r} has dtype {info['dtype']}, not a float type.")
        arrays[name] = values.reshape(info["shape"])
    return arrays


def read_pth(path):
    """``{name: array}`` of a torch ``.pth`` state dict (needs torch: ``pip install "keras-mone[torch]"``)."""
    try:
        import torch
    except ImportError as error:
        raise ImportError('Reading .pth files needs torch: pip install "keras-mone[torch]".') from error
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises RuntimeError / UnpicklingError / EOFError
        raise ValueError(f"{path!r} is not a readable torch state dict: {error}") from error
    state = state.get("state_dict", state.get("model", state)) if isinstance(state, dict) else state
    return {k: v.float().numpy() for k, v in state.items() if hasattr(v, "numpy")}


def vit_state_from_timm(state_dict):
    """A ViT state (see ``keras_mone.convert.vit_state``) from a timm ViT state dict."""
    sd = dict(state_dict)
    missing = [k for k in ("patch_embed.proj.weight", "pos_embed", "norm.weight", "blocks.0.attn.qkv.weight") if k not in sd]
    if missing:
        raise ValueError(f"not a timm ViT state dict: {missing} missing (found e.g. {sorted(sd)[:4]}).")
    depth = 1 + max(int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k)))
    state = {
        "patch_kernel": sd["patch_embed.proj.weight"].transpose(2, 3, 1, 0),
        "patch_bias": sd["patch_embed.proj.bias"],
        "position_embedding": sd["pos_embed"][0],
        "norm_gamma": sd["norm.weight"], "norm_beta": sd["norm.bias"],
        "blocks": [_block(sd, f"blocks.{i}.") for i in range(depth)],
    }
    if "cls_token" in sd:
        state["class_token"] = sd["cls_token"].reshape(-1)
    if "head.weight" in sd:
        state["head_kernel"], state["head_bias"] = sd["head.weight"].T, sd["head.bias"]
    return state


def _block(sd, prefix):
    def linear(name):
        return sd[f"{prefix}{name}.weight"].T, sd[f"{prefix}{name}.bias"]

    qkv_kernel, qkv_bias = linear("attn.qkv")
    out_kernel, out_bias = linear("attn.proj")
    fc1_kernel, fc1_bias = linear("mlp.fc1")
    fc2_kernel, fc2_bias = linear("mlp.fc2")
    return {
        "norm1_gamma": sd[f"{prefix}norm1.weight"], "norm1_beta": sd[f"{prefix}norm1.bias"],
        "qkv_kernel": qkv_kernel, "qkv_bias": qkv_bias, "out_kernel": out_kernel, "out_bias": out_bias,
        "norm2_gamma": sd[f"{prefix}norm2.weight"], "norm2_beta": sd[f"{prefix}norm2.bias"],
        "fc1_kernel": fc1_kernel, "fc1_bias": fc1_bias, "fc2_kernel": fc2_kernel, "fc2_bias": fc2_bias,
    }
