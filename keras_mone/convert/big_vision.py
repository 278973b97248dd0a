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

Files without ``cls`` are GAP models (``*-gap-norep``): grid-only positions.
``pre_logits`` (Dense + tanh before the head) loads into a classifier built
with ``representation_size``; a MAP head has no keras_mone counterpart. Both
codes use the tanh approximation of GELU: the state asks for
``gelu_approximate=True`` (timm's exact form moves logits by ~1e-3).
"""

import re
import zipfile

import numpy as np

from keras_mone.convert.keys import KeyReader, contiguous_blocks
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
    prefix = names["prefix"]
    _require({k[len(prefix):] for k in arrays if k.startswith(prefix)},
             ["embedding/kernel", names["positions"], "Transformer/encoder_norm/scale"], layout)
    outside = [(f"^(?!{prefix})", f"outside {prefix!r}: not a model parameter")] if prefix else []
    reader = KeyReader(arrays, _REASONS + outside)

    def get(name, where="the checkpoint"):
        return reader(prefix + name, where)

    state = {
        "patch_kernel": get("embedding/kernel"), "patch_bias": get("embedding/bias"),
        "norm_gamma": get("Transformer/encoder_norm/scale"), "norm_beta": get("Transformer/encoder_norm/bias"),
        "blocks": [_block(block, names) for block in _blocks(reader, prefix)],
        "gelu_approximate": True,  # flax nn.gelu's default
        "sources": {},
    }
    positions = get(names["positions"])[0]
    if prefix + "cls" in reader:
        state["class_token"] = get("cls").reshape(-1)
        state["sources"]["class_token"] = [prefix + "cls"]
        if not names["class_position"]:  # big_vision adds the class token after the positions
            positions = np.concatenate([np.zeros_like(positions[:1]), positions])
    state["position_embedding"] = positions  # without 'cls' (GAP models): the grid only
    for part in ("head", "pre_logits"):
        if prefix + f"{part}/kernel" in reader:
            state[f"{part}_kernel"], state[f"{part}_bias"] = get(f"{part}/kernel"), get(f"{part}/bias")
            state["sources"][part] = [prefix + f"{part}/kernel", prefix + f"{part}/bias"]
    state["unused"] = reader.unused()
    return state


_REASONS = [
    (r"MAPHead_0/", "a MAP head (attention pooling, big_vision pool_type='map'): keras_mone's classifiers "
                    "pool by 'gap' or 'token' and have no MAP head"),
]


class _Block(dict):
    """One block's ``{name below the block: key}``, read through the checkpoint's reader."""

    def __init__(self, reader, keys, where, index=None):
        super().__init__(keys)
        self.reader, self.where, self.index = reader, where, index

    def __getitem__(self, name):
        if name not in self:
            raise ValueError(f"{self.where} has no {name!r}.")
        value = self.reader(dict.__getitem__(self, name), self.where)
        return value if self.index is None else value[self.index]


def _blocks(reader, prefix):
    """Per-block views, from numbered or scanned blocks."""
    numbered = {}
    for key in reader.arrays:
        match = re.match(re.escape(prefix) + r"Transformer/encoderblock_(\d+)/(.+)", key)
        if match:
            numbered.setdefault(int(match.group(1)), {})[match.group(2)] = key
    if numbered:
        indices = contiguous_blocks(numbered, f"'{prefix}Transformer/encoderblock_{{i}}/'")
        return [_Block(reader, numbered[i], f"block {i} ('{prefix}Transformer/encoderblock_{i}/')") for i in indices]
    scan = prefix + "Transformer/encoderblock/"
    scanned = {k[len(scan):]: k for k in reader.arrays if k.startswith(scan)}
    if not scanned:
        raise ValueError("the checkpoint has no 'Transformer/encoderblock_{i}' nor a scanned 'Transformer/encoderblock'.")
    depth = reader.arrays[next(iter(scanned.values()))].shape[0]
    return [_Block(reader, scanned, f"scanned block {i} of '{scan}'", index=i) for i in range(depth)]


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


def _require(names, keys, layout):
    missing = [k for k in keys if k not in names]
    if missing:
        raise ValueError(
            f"not a {layout!r} ViT checkpoint: {missing} missing (found e.g. {sorted(names)[:4]}); "
            f"the other layouts are {[name for name in LAYOUTS if name != layout]}."
        )
