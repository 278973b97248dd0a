"""Benchmark models: the dense / MoNE specs of a variant, their builds and inputs,
the routing probes (patch embedding + router + EPR + gathers) and the keras-hub peer."""

import importlib
import inspect

import keras
import numpy as np

from keras_mone.layers.config import config_argument_names
from keras_mone.methods.mone.backbone import MoNEViTBackbone
from keras_mone.models.variants import decode_variant
from keras_mone.models.vit_backbone import ViTBackbone

DEFAULT_CAPACITIES = (0.2, 0.3, 0.5, 0.75, 1.0)
SCHEMA_VERSION = 1
DENSE = "dense"
PROBE_CALLS = 5
"""Calls per timing sample of the (cheap) routing probes; their times are per call."""
PEER = "keras_hub ViTBackbone"
TIMM = "timm vit_base_patch16_224"
"""Timing key of the timm peer (``bench_device.build_timm_peer``)."""

# Backbone arguments that only MoNE models accept: model_overrides with these
# keys go to the MoNE models only.
_MONE_ONLY = tuple(
    sorted(set(config_argument_names(MoNEViTBackbone)) - set(config_argument_names(ViTBackbone)))
)


def mone_label(capacity):
    """Row label of the MoNE model at effective capacity ``capacity``."""
    return f"mone e_c={capacity:g}"


# ---------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------
FAMILIES = {"vit": "vit_{}", "vivit": "vivit_fe_{}"}
"""Model families the bench times: dense preset name pattern (MoNE: ``mone_`` + it)."""


def _preset_names(variant, family="vit"):
    """Dense and MoNE preset names of ``variant`` in ``family``, plus size overrides.

    A variant without presets (e.g. "H/14") builds from the family's B/16
    presets with the variant's size table entry as overrides.
    """
    from keras_mone.presets import list_presets

    if family not in FAMILIES:
        raise ValueError(f"`family` must be one of {sorted(FAMILIES)}, got {family!r}.")
    size = decode_variant(variant)  # validates the variant
    key = str(variant).replace("/", "").lower()
    dense = FAMILIES[family].format(key)
    available = set(list_presets())
    if dense in available and "mone_" + dense in available:
        return dense, "mone_" + dense, {}
    dense = FAMILIES[family].format("b16")
    return dense, "mone_" + dense, size


def _model_specs(variant, capacities, image_size, model_overrides, family="vit"):
    """``[(label, preset, kwargs)]``: the dense model, then one MoNE model per capacity."""
    overrides = dict(model_overrides or {})
    if "capacity" in overrides:
        raise ValueError("Pass MoNE capacities with `capacities`, not in `model_overrides`.")
    dense_preset, mone_preset, size = _preset_names(variant, family)
    common = {**size, "image_size": image_size}
    common.update({k: v for k, v in overrides.items() if k not in _MONE_ONLY})
    mone_only = {k: v for k, v in overrides.items() if k in _MONE_ONLY}
    specs = [(DENSE, dense_preset, dict(common))]
    for capacity in capacities:
        specs.append((mone_label(capacity), mone_preset, {**common, **mone_only, "capacity": capacity}))
    return specs


def _build(preset, kwargs):
    from keras_mone.presets import from_preset

    return from_preset(preset, load_weights=False, **kwargs)


def _compile(model, train):
    if train:
        model.compile(
            optimizer=keras.optimizers.AdamW(1e-4),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile="auto",
        )
    else:
        model.compile(jit_compile="auto")
    return model


def _batch(backbone, num_classes, batch_size, seed):
    rng = np.random.default_rng(seed)
    shape = (batch_size, *backbone.input_shape_per_example)
    images = rng.uniform(-1.0, 1.0, shape).astype("float32")
    labels = rng.integers(0, num_classes, (batch_size,)).astype("int32")
    return images, labels


# ---------------------------------------------------------------------------
# routing probes
# ---------------------------------------------------------------------------
class _EmbeddingProbe(keras.Model):
    """Patch embedding of a backbone, alone (the baseline of the routing probes)."""

    def __init__(self, backbone, **kwargs):
        super().__init__(**kwargs)
        self.patch_embedding = backbone.patch_embedding
        self.built = True

    def call(self, images):
        return _checksum([self.patch_embedding(images)])


class _RoutingProbe(keras.Model):
    """Patch embedding + first router + EPR grouping + token gathers of a MoNE backbone.

    It runs the backbone's own routing part at its first router
    (``token_routing().before_block``: router probabilities, EPR grouping,
    gathers of tokens and gates, the token order). With
    ``restore=True`` it also concatenates the groups and puts the tokens back
    in their original order, as the backbone does after its last block. Both
    probes return a per-example checksum of what they computed.
    """

    def __init__(self, backbone, restore=False, **kwargs):
        super().__init__(**kwargs)
        self.source = _Untracked(backbone)  # not tracked: the probe holds no block weights
        self.patch_embedding = backbone.patch_embedding
        self.router = backbone.routers[0]
        self.restore = restore
        self.built = True

    def call(self, images):
        backbone = self.source.value
        routing = backbone.token_routing()
        state = routing.start(self.patch_embedding(images))
        # Exactly the model's own routing step (EPR grouping, token and gate gathers).
        state = routing.before_block(routing.first_router, state, None, None)
        if self.restore:
            return _checksum([state.restored()])
        dropped = [state.passed] if state.passed is not None else []
        gates = list(state.gates or [])
        order = [] if state.order is None else [keras.ops.cast(state.order, "float32")]
        return _checksum([*state.groups, *dropped, *gates, *order])


def _checksum(tensors):
    """One number per example that depends on every element of ``tensors``.

    The probes return this rather than token features so that copying their
    outputs to numpy costs next to nothing; the gathers still have to run.
    """
    total = None
    for x in tensors:
        part = keras.ops.sum(keras.ops.reshape(keras.ops.cast(x, "float32"), (keras.ops.shape(x)[0], -1)), axis=1)
        total = part if total is None else total + part
    return total


class _Untracked:
    """Holds a layer without Keras tracking it (and its weights) as a sub-layer."""

    def __init__(self, value):
        self.value = value


def _sublayers(layer):
    """``layer`` and every layer it holds, at any depth, in attributes or in
    lists / tuples / dicts of them (Keras has no public recursive listing)."""
    found, stack = {}, [layer]
    while stack:
        current = stack.pop()
        if id(current) in found:
            continue
        found[id(current)] = current
        for value in vars(current).values():
            items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
            stack.extend(item for item in items if isinstance(item, keras.layers.Layer))
    return list(found.values())


def _unbuilt_layers(model):
    """Paths of the layers of ``model`` (itself included) whose ``built`` is False."""
    return [getattr(layer, "path", None) or layer.name for layer in _sublayers(model) if not layer.built]


def _probe(probe):
    probe.compile(jit_compile="auto")
    return probe


# ---------------------------------------------------------------------------
# peer (keras_hub)
# ---------------------------------------------------------------------------
def _build_peer(backbone):
    """``(model, info)``: keras_hub's ViTBackbone of the same size, or ``(None, info)``."""
    try:
        keras_hub = importlib.import_module("keras_hub")
    except Exception as error:  # ImportError, or a broken install
        return None, {
            "available": False,
            "reason": f"keras_hub is not importable ({type(error).__name__}: {error}); "
            "install keras-hub to compare with it.",
        }
    info = {"available": True, "package": "keras_hub", "version": getattr(keras_hub, "__version__", "?")}
    height, width = backbone.image_size
    config = dict(
        image_shape=(height, width, backbone.num_channels),
        patch_size=backbone.patch_size,
        num_layers=backbone.depth,
        num_heads=backbone.num_heads,
        hidden_dim=backbone.hidden_dim,
        mlp_dim=backbone.mlp_dim,
    )
    try:
        cls = keras_hub.models.ViTBackbone
        accepted = inspect.signature(cls.__init__).parameters
        optional = {
            "dropout_rate": 0.0,
            "dropout": 0.0,
            "attention_dropout": 0.0,
            "layer_norm_epsilon": backbone.layer_norm_epsilon,
            "use_class_token": backbone.use_class_token,
        }
        config.update({k: v for k, v in optional.items() if k in accepted})
        model = cls(**config)
    except Exception as error:
        info.update(available=False, reason=f"keras_hub ViTBackbone could not be built: {error}")
        return None, info
    info["config"] = {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}
    info["parameters"] = int(model.count_params())
    return model, info


# ---------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------
