"""Writing a keras_mone model as a third-party checkpoint: the inverse of ``load_checkpoint``.

``write_checkpoint(model, path, format)`` writes the model's weights in the
key layout and conventions the loader of ``format`` reads (the modules
``big_vision``, ``timm``, ``keras_hub`` and ``mixer`` describe them;
docs/presets.md tables them), so that ``load_checkpoint(fresh_model, path,
format)`` into a model of the same configuration reproduces it: every
weight bit for bit (but big_vision's class token, below), hence every output.

* ViT models (``ViTBackbone``, a backbone of its layout such as MatViT or A-MoD, or a classifier on one):
  ``"vision_transformer"`` and ``"big_vision"`` (``.npz``), ``"timm"``
  (``.safetensors``, written directly, or ``.pth`` / ``.pt`` / ``.bin``
  through torch) and ``"keras_hub"`` (a keras-hub preset folder of a
  ``ViTBackbone`` / ``ViTImageClassifier``; read it back with
  ``keras_hub.models.ViTImageClassifier.from_preset(path)`` and load that
  object). big_vision adds the class token after the positions: a class
  position is folded into ``cls`` (outputs unchanged; the loaded class token
  is ``cls + pos[0]``, its position zero).
* A backbone whose family registers a writer (``convert.loaders.register_checkpoint_writer``),
  or a classifier on one: that family's formats and layout; the MLP-Mixer's
  are ``"vision_transformer"`` (``.npz``) and ``"timm"``
  (``keras_mone.methods.mixer.checkpoints``).

Weights no key of the format holds (MoNE routers and ``alpha``, ...) are an
error naming them (``strict=False``: left out, with a warning). Files are
written beside ``path`` and renamed into place; an existing ``path`` is
replaced only with ``overwrite=True``.
"""

import importlib.util
import os
import re
import warnings

import keras
import numpy as np

from keras_mone.convert.big_vision import _NAMES as NPZ_NAMES
from keras_mone.convert.file_output import TORCH_SUFFIXES, publish, write_arrays
from keras_mone.convert.keys import describe_unused
from keras_mone.convert.loaders import registered_writers, writer_for
from keras_mone.convert.vit_state import BLOCK_KEYS
from keras_mone.models.weight_transfer import relative_weight_paths

VIT_FORMATS = ("vision_transformer", "big_vision", "timm", "keras_hub")
#: The GELU the models of each format compute (tanh form: the flax codes).
FORMAT_GELU = {"vision_transformer": True, "big_vision": True, "timm": False, "keras_hub": False}
_HUB_BLOCK = dict(ln1="ln_1", ln2="ln_2", norm=("gamma", "beta"), attention="mha/", out="attention_output",
                  fc1="mlp/dense_1", fc2="mlp/dense_2")
_GELU = {True: "tanh-approximate", False: "exact (erf)"}
#: timm ViT block parts: ViT-state name -> timm module.
_TIMM_BLOCK = {"norm1": "norm1", "qkv": "attn.qkv", "out": "attn.proj", "norm2": "norm2", "fc1": "mlp.fc1",
               "fc2": "mlp.fc2"}


def write_checkpoint(model, path, format, overwrite=False, strict=True):
    """Writes ``model``'s weights to ``path`` as a ``format`` checkpoint; returns a report.

    Args:
        model: a ViT-layout backbone or a classifier on one (``VIT_FORMATS``),
            or a backbone with a registered writer (the MLP-Mixer's formats:
            ``keras_mone.methods.mixer.checkpoints.FORMATS``) or a classifier on one.
        path: the file to write (``.npz`` for ``"vision_transformer"`` /
            ``"big_vision"``; ``.safetensors`` or ``.pth`` / ``.pt`` / ``.bin``
            for ``"timm"``) or, for ``"keras_hub"``, the preset folder.
        format: the checkpoint format, named as for ``load_checkpoint``.
        overwrite: replace an existing ``path`` of the same kind (file or
            folder); without it an existing ``path`` is a ``FileExistsError``.
        strict: model weights the format has no key for are an error naming
            them (nothing written); ``False`` leaves them out with a warning.

    Returns:
        ``{"path", "format", "keys": [keys written], "dropped": {model weight: reason}}``.
    """
    backbone = getattr(model, "backbone", model)
    family = writer_for(model)
    allowed = family.formats if family else VIT_FORMATS
    if format not in allowed:
        others = "".join(f"; {w.name} formats: {w.formats}" for w in registered_writers())
        raise ValueError(
            f"`format` must be one of {allowed} for a {type(backbone).__name__} "
            f"(ViT formats: {VIT_FORMATS}{others}), got {format!r}."
        )
    if family:
        family.check(model)
    else:
        _check_vit(backbone)
    path = os.fspath(path)
    _check_destination(path, format, overwrite)
    weights = _Weights(model)
    content = family.arrays(weights, backbone, format) if family else _vit_state(weights, backbone)
    _refuse_or_warn(weights.dropped(format), backbone, format, strict)  # before anything is built or written
    if not family:
        content = _keras_hub_model(content, model, backbone) if format == "keras_hub" else _VIT_LAYOUTS[format](content)
    gelu = bool(backbone.gelu_approximate)
    if gelu != FORMAT_GELU[format]:
        warnings.warn(
            f"The model computes the {_GELU[gelu]} GELU; {format!r} checkpoints are read as computing the "
            f"{_GELU[not gelu]} one (load_checkpoint warns about it, code of that format computes outputs "
            "~1e-3 away). The weights are written as they are; a keras_mone model built like this one "
            "reproduces them exactly.",
            stacklevel=2,
        )
    if format == "keras_hub":
        publish(path, overwrite, content.save_to_preset)
        keys = [variable.path for variable in content.weights]
    else:
        write_arrays(path, overwrite, content)
        keys = list(content)
    return {"path": path, "format": format, "keys": keys, "dropped": weights.dropped(format)}


def _check_vit(backbone):
    if hasattr(backbone, "temporal_depth"):
        raise TypeError("write_checkpoint writes image models; a ViViT has no counterpart in these formats.")
    if not (hasattr(backbone, "patch_embedding") and hasattr(backbone, "blocks")):
        raise TypeError(
            "`model` must be a keras_mone ViT or MLP-Mixer backbone or a classifier on one, got "
            f"{type(backbone).__name__}."
        )
    grid = tuple(backbone.patch_embedding.grid_size)
    if grid[0] != grid[1]:
        raise ValueError(f"load_checkpoint reads square patch grids only; the model's grid is {grid}.")


def _check_destination(path, format, overwrite):
    """Refuses a wrong file type, a missing folder or (without ``overwrite``) an existing ``path``."""
    if format in ("vision_transformer", "big_vision") and not path.endswith(".npz"):
        raise ValueError(f"{format!r} checkpoints are .npz files, got {path!r}.")
    if format == "timm" and not path.endswith((".safetensors", *TORCH_SUFFIXES)):
        raise ValueError(f"timm checkpoints are .safetensors or .pth / .pt / .bin files, got {path!r}.")
    if path.endswith(TORCH_SUFFIXES) and importlib.util.find_spec("torch") is None:
        raise ImportError('Writing .pth files needs torch: pip install "keras-mone[torch]" (or write .safetensors).')
    if format == "keras_hub" and importlib.util.find_spec("keras_hub") is None:
        raise ImportError("format 'keras_hub' writes a keras-hub preset folder: pip install keras-hub.")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"The folder {folder!r} of {path!r} does not exist.")
    if os.path.lexists(path):
        if not overwrite:
            raise FileExistsError(f"{path!r} exists; pass overwrite=True to replace it.")
        if os.path.isdir(path) != (format == "keras_hub"):
            kind = "a folder" if os.path.isdir(path) else "a file"
            raise FileExistsError(f"{path!r} is {kind}; overwrite=True replaces only a {format!r} checkpoint's kind.")


class _Weights(dict):
    """``{model path: array}``; ``take(path)`` returns one and remembers it as written."""

    def __init__(self, model):
        if not model.built:
            model.build()
        variables = relative_weight_paths(model)
        super().__init__({path: keras.ops.convert_to_numpy(v.value) for path, v in variables.items()})
        self.prefix = "" if getattr(model, "backbone", model) is model else "backbone/"
        self.taken = set()

    def take(self, path, in_backbone=True):
        path = (self.prefix if in_backbone else "") + path
        self.taken.add(path)
        return self[path]

    def dropped(self, format):
        reason = f"no {format!r} key holds it: a model loading the file keeps its own initial value"
        return {path: reason for path in self if path not in self.taken}


def _refuse_or_warn(dropped, backbone, format, strict):
    if not dropped:
        return
    text = (f"{type(backbone).__name__} has {len(dropped)} weight(s) that {format!r} checkpoints have no key for"
            f":\n{describe_unused(dropped)}\n")
    if strict:
        raise ValueError(text + "Nothing was written; pass strict=False to write the rest (with a warning).")
    warnings.warn(text + "strict=False: written without them.", stacklevel=3)


def _vit_state(weights, backbone):
    """The model's ViT state (``keras_mone.convert.vit_state``'s layout) and its head."""
    take = weights.take
    state = {
        "patch_kernel": take("patch_embedding/projection/kernel"),
        "patch_bias": take("patch_embedding/projection/bias"),
        "position_embedding": take("patch_embedding/position_embedding")[0],
        "norm_gamma": take("norm/gamma"), "norm_beta": take("norm/beta"),
        "blocks": [{key: take(f"block_{i}/{path}") for key, path in BLOCK_KEYS.items()} for i in range(backbone.depth)],
        "num_heads": backbone.num_heads,
    }
    if backbone.use_class_token:
        state["class_token"] = take("patch_embedding/class_token").reshape(-1)
    for part in ("head", "pre_logits"):
        if f"{part}/kernel" in weights:
            state[f"{part}_kernel"] = take(f"{part}/kernel", in_backbone=False)
            state[f"{part}_bias"] = take(f"{part}/bias", in_backbone=False)
    return state


def _heads(block, num_heads):
    """Per-projection ``{"query" | "key" | "value" | "out": (kernel, bias)}`` of a fused block:
    kernels (D, H, D/H) and biases (H, D/H); ``out`` (H, D/H, D) and (D,)."""
    width = block["qkv_kernel"].shape[1] // 3
    split = {
        name: (block["qkv_kernel"][:, i * width:(i + 1) * width].reshape(-1, num_heads, width // num_heads),
               block["qkv_bias"][i * width:(i + 1) * width].reshape(num_heads, width // num_heads))
        for i, name in enumerate(("query", "key", "value"))
    }
    split["out"] = (block["out_kernel"].reshape(num_heads, width // num_heads, -1), block["out_bias"])
    return split


def _split_block(block, num_heads, ln1, ln2, norm, attention, out, fc1, fc2):
    """One block in the per-projection layout of flax and keras: LayerNorms with parameters named
    ``norm``, query / key / value / ``out`` under ``attention``, Dense layers ``fc1`` and ``fc2``."""
    arrays = {}
    for name, part in ((ln1, "norm1"), (ln2, "norm2")):
        arrays[f"{name}/{norm[0]}"], arrays[f"{name}/{norm[1]}"] = block[f"{part}_gamma"], block[f"{part}_beta"]
    for projection, (kernel, bias) in _heads(block, num_heads).items():
        name = attention + (out if projection == "out" else projection)
        arrays[f"{name}/kernel"], arrays[f"{name}/bias"] = kernel, bias
    for name, part in ((fc1, "fc1"), (fc2, "fc2")):
        arrays[f"{name}/kernel"], arrays[f"{name}/bias"] = block[f"{part}_kernel"], block[f"{part}_bias"]
    return arrays


def _vit_npz(state, layout):
    """``{key: array}`` of a ``"vision_transformer"`` or ``"big_vision"`` ``.npz``."""
    names = NPZ_NAMES[layout]
    positions = state["position_embedding"]
    arrays = {"embedding/kernel": state["patch_kernel"], "embedding/bias": state["patch_bias"]}
    if "class_token" in state:
        token = state["class_token"]
        if not names["class_position"]:  # big_vision: the class token gets no position, so it carries it
            token, positions = token + positions[0], positions[1:]
        arrays["cls"] = token.reshape(1, 1, -1)
    arrays[names["positions"]] = positions[None]
    block_names = dict(ln1=names["ln1"], ln2=names["ln2"], norm=("scale", "bias"), attention=names["attention"] + "/",
                       out="out", fc1=names["mlp"] + "/Dense_0", fc2=names["mlp"] + "/Dense_1")
    for i, block in enumerate(state["blocks"]):
        split = _split_block(block, state["num_heads"], **block_names)
        arrays.update({f"Transformer/encoderblock_{i}/{key}": value for key, value in split.items()})
    arrays["Transformer/encoder_norm/scale"] = state["norm_gamma"]
    arrays["Transformer/encoder_norm/bias"] = state["norm_beta"]
    for part in ("pre_logits", "head"):
        if f"{part}_kernel" in state:
            arrays[f"{part}/kernel"], arrays[f"{part}/bias"] = state[f"{part}_kernel"], state[f"{part}_bias"]
    return {names["prefix"] + key: value for key, value in arrays.items()}


def _vit_timm(state):
    """``{key: array}`` of a timm ViT state dict: torch (out, in) weights, conv (out, in, kh, kw)."""
    arrays = {"patch_embed.proj.weight": state["patch_kernel"].transpose(3, 2, 0, 1),
              "patch_embed.proj.bias": state["patch_bias"]}
    if "class_token" in state:
        arrays["cls_token"] = state["class_token"].reshape(1, 1, -1)
    arrays["pos_embed"] = state["position_embedding"][None]  # the class position first, if any
    for i, block in enumerate(state["blocks"]):
        for part, module in _TIMM_BLOCK.items():
            norm = part.startswith("norm")
            weight = block[f"{part}_gamma"] if norm else block[f"{part}_kernel"].T
            arrays[f"blocks.{i}.{module}.weight"] = weight
            arrays[f"blocks.{i}.{module}.bias"] = block[f"{part}_beta" if norm else f"{part}_bias"]
    arrays["norm.weight"], arrays["norm.bias"] = state["norm_gamma"], state["norm_beta"]
    for part, module in (("pre_logits", "pre_logits.fc"), ("head", "head")):
        if f"{part}_kernel" in state:
            arrays[f"{module}.weight"], arrays[f"{module}.bias"] = state[f"{part}_kernel"].T, state[f"{part}_bias"]
    return arrays


_VIT_LAYOUTS = {"vision_transformer": lambda s: _vit_npz(s, "vision_transformer"),
                "big_vision": lambda s: _vit_npz(s, "big_vision"), "timm": _vit_timm}


def _keras_hub_model(state, model, backbone):
    """A keras-hub ``ViTBackbone`` (or ``ViTImageClassifier`` for a classifier) holding ``state``."""
    import keras_hub

    hub = keras_hub.models.ViTBackbone(
        image_shape=(*backbone.image_size, backbone.num_channels), patch_size=backbone.patch_size,
        num_layers=backbone.depth, num_heads=backbone.num_heads, hidden_dim=backbone.hidden_dim,
        mlp_dim=backbone.mlp_dim, layer_norm_epsilon=backbone.layer_norm_epsilon,
        use_class_token=backbone.use_class_token,
    )
    values = {"patch_embedding/kernel": state["patch_kernel"], "patch_embedding/bias": state["patch_bias"],
              "position_embedding/embeddings": state["position_embedding"],
              "vit_encoder/ln/gamma": state["norm_gamma"], "vit_encoder/ln/beta": state["norm_beta"]}
    if "class_token" in state:
        values["class_token"] = state["class_token"].reshape(1, 1, -1)
    # keras numbers the blocks by unique layer names, not always from 0: in order of their number
    numbers = sorted({int(m.group(1)) for v in hub.weights if (m := re.search(r"transformer_block_(\d+)/", v.path))})
    for number, block in zip(numbers, state["blocks"]):
        split = _split_block(block, state["num_heads"], **_HUB_BLOCK)
        values.update({f"transformer_block_{number}/{key}": value for key, value in split.items()})
    _assign_by_suffix(hub.weights, values)
    if "head_kernel" not in state:
        return hub
    task = keras_hub.models.ViTImageClassifier(
        hub, num_classes=state["head_kernel"].shape[-1],
        pooling=getattr(model, "pooling", "token" if backbone.use_class_token else "gap"),
        intermediate_dim=state["pre_logits_kernel"].shape[-1] if "pre_logits_kernel" in state else None,
    )
    for layer, part in (("output_dense", "head"), ("intermediate_layer", "pre_logits")):
        if f"{part}_kernel" not in state:
            continue
        getattr(task, layer).kernel.assign(state[f"{part}_kernel"])
        getattr(task, layer).bias.assign(state[f"{part}_bias"])
    return task


def _assign_by_suffix(variables, values):
    """Assigns ``values[suffix]`` to the one variable whose path ends with ``/suffix``; all must pair up."""
    unassigned = set(values)
    for variable in variables:
        key = next((k for k in values if variable.path == k or variable.path.endswith("/" + k)), None)
        if key is None or tuple(variable.shape) != tuple(np.shape(values[key])):
            raise ValueError(f"keras-hub ViT weight {variable.path!r} {tuple(variable.shape)} has no counterpart.")
        variable.assign(np.asarray(values[key], dtype=variable.dtype))
        unassigned.discard(key)
    if unassigned:
        raise ValueError(f"keras-hub's ViT has no weight for {sorted(unassigned)}.")
