"""MLP-Mixer checkpoints into a ``MixerBackbone`` or an ``ImageClassifier`` on one.

Two source formats, named by the caller:

``"vision_transformer"`` (flax ``vit_jax/models_mixer.py``, ``.npz``)
    ``stem/kernel`` (p, p, C, D) and bias; per block ``MixerBlock_{i}/``
    ``LayerNorm_0`` (scale, bias), ``token_mixing/Dense_0`` (S, D_S) and
    ``Dense_1`` (D_S, S), ``LayerNorm_1``, ``channel_mixing/Dense_0`` (D, D_C)
    and ``Dense_1`` (D_C, D); ``pre_head_layer_norm``; ``head`` (D, K).
    flax's ``nn.gelu`` is the tanh approximation: build the backbone with
    ``gelu_approximate=True`` to compute exactly what the checkpoint does.
``"timm"`` (``timm/models/mlp_mixer.py``, ``.safetensors`` or ``.pth``)
    ``stem.proj.weight`` (D, C, p, p), per block ``blocks.{i}.norm1``,
    ``mlp_tokens.fc1`` / ``fc2``, ``norm2``, ``mlp_channels.fc1`` / ``fc2``;
    ``norm``; ``head``. torch ``Linear`` weights are (out, in), hence the
    transposes. timm computes the exact GELU (``gelu_approximate=False``).

A *Mixer state* is ``{"params": {backbone path: array}, "keys": {path:
checkpoint key}, "depth", "head_kernel" / "head_bias" (optional),
"gelu_approximate", "unused": {key: reason}}``; ``load_mixer_state`` writes
it after checking every shape and, in strict mode, that every key is used.
"""

import re
import warnings

import numpy as np

from keras_mone.convert.checkpoint_file import read_checkpoint_file
from keras_mone.convert.loaders import register_checkpoint_loader
from keras_mone.convert.keys import (
    STRICT_SCOPE,
    KeyReader,
    contiguous_blocks,
    describe_unused,
    name_target,
    warn_unused,
)
from keras_mone.methods.mixer.backbone import MixerBackbone, SparseMLPBackbone
from keras_mone.models.weight_transfer import relative_weight_paths

FORMATS = ("vision_transformer", "timm")

#: keras_mone sublayer -> (flax name, timm name) inside a block.
BLOCK_PARTS = {
    "layer_norm_0": ("LayerNorm_0", "norm1"), "layer_norm_1": ("LayerNorm_1", "norm2"),
    "token_mixing/dense_0": ("token_mixing/Dense_0", "mlp_tokens.fc1"),
    "token_mixing/dense_1": ("token_mixing/Dense_1", "mlp_tokens.fc2"),
    "channel_mixing/dense_0": ("channel_mixing/Dense_0", "mlp_channels.fc1"),
    "channel_mixing/dense_1": ("channel_mixing/Dense_1", "mlp_channels.fc2"),
}

_TIMM_REASONS = [
    (r"(linear_tokens|\.ls[12]|\.alpha$|\.beta$|\.gate\.)", "a part of ResMLP / gMLP (timm's other MLP models), "
                                                          "not of an MLP-Mixer"),
    (r"^stem\.norm\.", "a LayerNorm after the stem (timm stem_norm=True): keras_mone's Mixer has none"),
]
_NPZ_REASONS = [(r"^pre_logits/", "a representation layer: the vision_transformer Mixer has none, nor does "
                                  "keras_mone's Mixer classifier")]


def read_mixer_state(path, format):
    """The Mixer state of the checkpoint file at ``path`` in ``format``."""
    if format not in FORMATS:
        raise ValueError(f"MLP-Mixer checkpoints come in the formats {FORMATS}, got `format`={format!r}.")
    return read_checkpoint_file(path, format, ("vision_transformer",), mixer_state_from_npz, mixer_state_from_timm)


def mixer_state_from_npz(arrays):
    """A Mixer state from the arrays of a vision_transformer Mixer ``.npz``."""
    reader = KeyReader(arrays, _NPZ_REASONS)
    _require(reader, ["stem/kernel", "MixerBlock_0/LayerNorm_0/scale", "pre_head_layer_norm/scale"],
             "vision_transformer")
    state = _State(reader)
    state.add("patch_embedding/projection/kernel", "stem/kernel")
    state.add("patch_embedding/projection/bias", "stem/bias")
    indices = contiguous_blocks(_block_indices(reader, r"MixerBlock_(\d+)/"), "'MixerBlock_{i}/'")
    for i in indices:
        for part, (flax, _) in BLOCK_PARTS.items():
            names = (("gamma", "scale"), ("beta", "bias")) if part.startswith("layer_norm") else \
                (("kernel", "kernel"), ("bias", "bias"))
            for mine, theirs in names:
                state.add(f"block_{i}/{part}/{mine}", f"MixerBlock_{i}/{flax}/{theirs}", f"block 'MixerBlock_{i}'")
    state.add("norm/gamma", "pre_head_layer_norm/scale")
    state.add("norm/beta", "pre_head_layer_norm/bias")
    state.head("head/kernel", "head/bias", transpose=False)
    return state.finish(len(indices), gelu_approximate=True)  # flax nn.gelu's default


def mixer_state_from_timm(state_dict):
    """A Mixer state from a timm ``MlpMixer`` state dict."""
    reader = KeyReader(state_dict, _TIMM_REASONS)
    _require(reader, ["stem.proj.weight", "blocks.0.mlp_tokens.fc1.weight", "norm.weight"], "timm")
    state = _State(reader)
    state.add("patch_embedding/projection/kernel", "stem.proj.weight", transform=lambda w: w.transpose(2, 3, 1, 0))
    state.add("patch_embedding/projection/bias", "stem.proj.bias")
    indices = contiguous_blocks(_block_indices(reader, r"blocks\.(\d+)\."), "'blocks.{i}.'")
    for i in indices:
        for part, (_, name) in BLOCK_PARTS.items():
            where = f"block 'blocks.{i}'"
            norm = part.startswith("layer_norm")
            transform = None if norm else np.transpose
            state.add(f"block_{i}/{part}/{'gamma' if norm else 'kernel'}", f"blocks.{i}.{name}.weight", where,
                      transform)
            state.add(f"block_{i}/{part}/{'beta' if norm else 'bias'}", f"blocks.{i}.{name}.bias", where)
    state.add("norm/gamma", "norm.weight")
    state.add("norm/beta", "norm.bias")
    state.head("head.weight", "head.bias", transpose=True)
    return state.finish(len(indices), gelu_approximate=False)  # torch nn.GELU's default


class _State:
    """Collects ``path -> (key, array)`` through the checkpoint's ``KeyReader``."""

    def __init__(self, reader):
        self.reader, self.params, self.keys, self.extra = reader, {}, {}, {}

    def add(self, path, key, where="the checkpoint", transform=None):
        value = np.asarray(self.reader(key, where))
        self.params[path], self.keys[path] = (value if transform is None else transform(value)), key

    def head(self, kernel_key, bias_key, transpose):
        if kernel_key in self.reader:
            kernel = np.asarray(self.reader(kernel_key))
            self.extra["head_kernel"] = kernel.T if transpose else kernel
            self.extra["head_bias"] = np.asarray(self.reader(bias_key, "the head"))
            self.keys["head/kernel"], self.keys["head/bias"] = kernel_key, bias_key

    def finish(self, depth, gelu_approximate):
        return {"params": self.params, "keys": self.keys, "depth": depth, **self.extra,
                "gelu_approximate": gelu_approximate, "unused": self.reader.unused()}


def _block_indices(reader, pattern):
    return [int(m.group(1)) for key in reader.arrays if (m := re.match(pattern, key))]


def _require(reader, keys, format):
    missing = [key for key in keys if key not in reader]
    if missing:
        raise ValueError(
            f"not a {format!r} MLP-Mixer checkpoint: {missing} missing (found e.g. {sorted(reader.arrays)[:4]})."
        )


def check_mixer_model(model):
    """The ``MixerBackbone`` of ``model``; a ``TypeError`` for anything else."""
    backbone = getattr(model, "backbone", model)
    if isinstance(backbone, SparseMLPBackbone):
        raise TypeError(
            "Mixer checkpoints load into a MixerBackbone (or an ImageClassifier on one); a "
            "SparseMLPBackbone's RR and sparse blocks have no counterpart in them."
        )
    if not isinstance(backbone, MixerBackbone):
        raise TypeError(f"`model` must be a MixerBackbone or a classifier on one, got {type(backbone).__name__}.")
    return backbone


def load_mixer_state(model, state, source="checkpoint", strict=True):
    """Writes Mixer ``state`` into ``model``; returns ``{"loaded", "kept", "unused", "gelu_approximate"}``.

    Every shape is checked (a mismatch names the checkpoint key and both
    shapes) and, when ``strict``, every key must be used, before the first
    value is written. A head of another class count, or a head with a
    backbone, stays unused (strict: an error; ``strict=False``: skipped with
    a warning naming every skipped key). A shape mismatch is an error in
    either mode.
    """
    backbone = check_mixer_model(model)
    if not model.built:
        model.build()
    if state["depth"] != backbone.depth:
        raise ValueError(
            f"{source} has {state['depth']} blocks but the model has `depth`={backbone.depth}; build the "
            "model with the checkpoint's depth."
        )
    targets = relative_weight_paths(model)
    prefix = "backbone/" if model is not backbone else ""
    values = {prefix + path: (state["keys"][path], value) for path, value in state["params"].items()}
    unused, kept = name_target(state["unused"], backbone), {}
    if "head_kernel" in state:
        head = _head(state, targets)
        if head is None:
            values["head/kernel"] = (state["keys"]["head/kernel"], state["head_kernel"])
            values["head/bias"] = (state["keys"]["head/bias"], state["head_bias"])
        else:
            unused[state["keys"]["head/kernel"]] = unused[state["keys"]["head/bias"]] = head
            if "head/kernel" in targets:
                kept["head/kernel"] = kept["head/bias"] = f"{source}: {head}; head left as initialised"
    mismatched = [
        f"{key!r} {tuple(np.shape(v))} -> model {path!r} "
        + (f"{tuple(targets[path].shape)}" if path in targets else "(absent)")
        for path, (key, v) in values.items() if path not in targets or tuple(np.shape(v)) != tuple(targets[path].shape)
    ]
    if mismatched:
        raise ValueError(
            f"{source} does not fit the model (nothing was loaded); mismatches (checkpoint key and shape -> "
            "model weight and shape):\n  " + "\n  ".join(mismatched[:5])
            + "\nBuild the model with the checkpoint's image_size, patch_size, hidden_dim, token_mlp_dim "
            "and channel_mlp_dim (token mixing has one weight per patch: the patch grid must match).\n"
            + STRICT_SCOPE + "."
        )
    if strict and unused:
        raise ValueError(
            f"{source}: {len(unused)} key(s) the model would not use (nothing was loaded):\n"
            + describe_unused(unused)
            + "\nBuild the model as a reason says, or pass strict=False to skip these keys (with a warning "
            "naming them; the report's 'unused' lists them)."
        )
    warn_unused(source, unused)
    for path, (_, value) in values.items():
        targets[path].assign(np.asarray(value, dtype=targets[path].dtype))
    for path in targets:
        if path not in values and path not in kept:
            kept[path] = "not in the checkpoint: left as initialised"
    gelu = bool(state["gelu_approximate"])
    if backbone.gelu_approximate != gelu:
        warnings.warn(
            f"{source} was trained with the {_GELU[gelu]} GELU, the model computes the {_GELU[not gelu]} one; "
            f"build the MixerBackbone with gelu_approximate={gelu} to compute exactly what the checkpoint does.",
            stacklevel=3,
        )
    return {"loaded": sorted(values), "kept": kept, "unused": unused, "gelu_approximate": gelu}


_GELU = {True: "tanh-approximate", False: "exact (erf)"}


def _head(state, targets):
    """``None`` if the checkpoint's head loads, else the reason it stays unused."""
    found = np.shape(state["head_kernel"])
    if "head/kernel" not in targets:
        return "the model has no head (a backbone); load into an ImageClassifier to use it"
    wanted = tuple(targets["head/kernel"].shape)
    if found[-1] != wanted[-1]:
        return f"the head has {found[-1]} classes, the model {wanted[-1]}: build it with num_classes={found[-1]}"
    return None


@register_checkpoint_loader(MixerBackbone)
def _load_mixer_checkpoint(model, source, format, strict, name):
    """``convert.load_checkpoint`` for Mixer models: MLP-Mixer's own formats."""
    check_mixer_model(model)
    state = read_mixer_state(source, format)
    return load_mixer_state(model, state, source=f"{format} checkpoint {name!r}", strict=strict)
