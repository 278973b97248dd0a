"""Every backbone of the zoo hands its block options to every block it builds: a ViViT's
temporal transformer once ran the exact GELU whatever ``gelu_approximate`` said."""

import warnings

import keras
import pytest
from conftest import TINY, TINY_VIDEO

import keras_mone.models

BACKBONES = sorted(name for name in dir(keras_mone.models) if name.endswith("Backbone") and name != "Backbone")
TOKEN_MIXERS = ("MixerBackbone", "SparseMLPBackbone")  # no attention heads, no MLP width argument


def _tiny(name):
    if name in TOKEN_MIXERS:
        return dict(image_size=32, patch_size=8, hidden_dim=32, depth=2)
    return dict(TINY_VIDEO if "ViViT" in name else TINY)


def test_every_backbone_is_listed():
    assert len(BACKBONES) >= 13 and {"ViViTBackbone", "MoNEViViTBackbone", "MixerBackbone"} <= set(BACKBONES)


@pytest.mark.parametrize("name", BACKBONES)
def test_the_gelu_and_the_layernorm_epsilon_reach_every_sublayer(name):
    cls = getattr(keras_mone.models, name)
    with warnings.catch_warnings():  # tiny models round their capacities (a UserWarning)
        warnings.simplefilter("ignore", UserWarning)
        model = cls(**_tiny(name), gelu_approximate=True, layer_norm_epsilon=1e-5)
    norms = [layer for layer in model._flatten_layers(include_self=False)
             if isinstance(layer, keras.layers.LayerNormalization)]
    gelus = [layer for layer in model._flatten_layers(include_self=False) if hasattr(layer, "gelu_approximate")]
    assert norms and gelus
    assert [layer.name for layer in norms if layer.epsilon != 1e-5] == []
    assert [layer.name for layer in gelus if layer.gelu_approximate is not True] == []
