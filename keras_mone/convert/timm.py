"""ViT state dicts of timm (``vision_transformer.py``), from ``.safetensors`` or ``.pth``.

Keys: ``patch_embed.proj.weight`` (D, C, p, p) and bias, ``cls_token``
(1, 1, D), ``pos_embed`` (1, N [+ 1], D), ``blocks.{i}.norm1``,
``blocks.{i}.attn.qkv`` (weight (3D, D): query, key, value stacked, heads
contiguous), ``blocks.{i}.attn.proj``, ``blocks.{i}.norm2``,
``blocks.{i}.mlp.fc1`` / ``fc2``, ``norm``, ``head``. torch ``Linear``
weights are (out, in), hence the transposes. Models without a class token
(``class_token=False``) have no ``cls_token`` and a grid-only ``pos_embed``;
with ``no_embed_class`` the class token has no position (zero is used).
``pre_logits.fc`` (Linear + Tanh) loads into a classifier built with
``representation_size``. Layer scale (``blocks.{i}.ls1.gamma`` / ``ls2.gamma``:
DeiT-III, DINOv2) is folded into the attention out-projection and ``fc2``
(exact: a per-channel scale of their outputs). timm computes the exact GELU (``gelu_approximate=False``).
"""

import json
import math
import re
import struct

import numpy as np

from keras_mone.convert.keys import KeyReader, contiguous_blocks

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
    reader = KeyReader(state_dict, _REASONS)
    norm = "norm.weight" if "norm.weight" in reader or "fc_norm.weight" not in reader else "fc_norm.weight"
    missing = [k for k in ("patch_embed.proj.weight", "pos_embed", norm, "blocks.0.attn.qkv.weight") if k not in reader]
    if missing:
        raise ValueError(f"not a timm ViT state dict: {missing} missing (found e.g. {sorted(reader.arrays)[:4]}).")
    indices = contiguous_blocks([int(m.group(1)) for k in reader.arrays if (m := re.match(r"blocks\.(\d+)\.", k))],
                                "'blocks.{i}.'")
    state = {
        "patch_kernel": reader("patch_embed.proj.weight").transpose(2, 3, 1, 0),
        "patch_bias": reader("patch_embed.proj.bias"),
        "blocks": [_block(reader, f"blocks.{i}.") for i in indices],
        "gelu_approximate": False,  # torch's nn.GELU default
        "sources": {},
    }
    if norm == "norm.weight":  # a GAP model with fc_norm has none (Identity): the fc_norm keys stay unused
        state["norm_gamma"], state["norm_beta"] = reader("norm.weight"), reader("norm.bias")
    positions = reader("pos_embed")[0]
    if "cls_token" in reader:
        state["class_token"] = reader("cls_token").reshape(-1)
        state["sources"]["class_token"] = ["cls_token"]
        if math.isqrt(len(positions)) ** 2 == len(positions):  # no_embed_class: no class position
            positions = np.concatenate([np.zeros_like(positions[:1]), positions])
    state["position_embedding"] = positions
    for part, name in (("head", "head"), ("pre_logits", "pre_logits.fc")):
        if f"{name}.weight" in reader:
            state[f"{part}_kernel"], state[f"{part}_bias"] = reader(f"{name}.weight").T, reader(f"{name}.bias")
            state["sources"][part] = [f"{name}.weight", f"{name}.bias"]
    state["unused"] = reader.unused()
    return state


_REASONS = [
    (r"^reg_token$", "register tokens: keras_mone's ViT has no register tokens"),
    (r"^fc_norm\.", "a LayerNorm after pooling (timm's fc_norm, with `norm` an Identity): keras_mone's ViT "
                    "normalises every token before pooling and has no such part"),
    (r"^(dist_token|head_dist\.)", "DeiT distillation: keras_mone's ViT has no distillation token or head"),
    (r"^attn_pool\.", "an attention-pooling (MAP) head: keras_mone's classifiers pool by 'gap' or 'token'"),
]


def _block(reader, prefix):
    where = f"block {prefix[:-1]!r}"

    def linear(name):
        return reader(f"{prefix}{name}.weight", where).T, reader(f"{prefix}{name}.bias", where)

    qkv_kernel, qkv_bias = linear("attn.qkv")
    out_kernel, out_bias = _scaled(reader, prefix + "ls1.gamma", *linear("attn.proj"))
    fc1_kernel, fc1_bias = linear("mlp.fc1")
    fc2_kernel, fc2_bias = _scaled(reader, prefix + "ls2.gamma", *linear("mlp.fc2"))
    return {
        "norm1_gamma": reader(f"{prefix}norm1.weight", where), "norm1_beta": reader(f"{prefix}norm1.bias", where),
        "qkv_kernel": qkv_kernel, "qkv_bias": qkv_bias, "out_kernel": out_kernel, "out_bias": out_bias,
        "norm2_gamma": reader(f"{prefix}norm2.weight", where), "norm2_beta": reader(f"{prefix}norm2.bias", where),
        "fc1_kernel": fc1_kernel, "fc1_bias": fc1_bias, "fc2_kernel": fc2_kernel, "fc2_bias": fc2_bias,
    }


def _scaled(reader, key, kernel, bias):
    """Layer scale ``gamma * (x @ W + b)`` folded into ``(W * gamma, b * gamma)``: exact, also
    for nested widths (a width-d token reads the first d output columns and gamma[:d])."""
    gamma = reader.optional(key)
    return (kernel, bias) if gamma is None else (kernel * gamma[None, :], bias * gamma)
