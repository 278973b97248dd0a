"""``get_config`` round trips of every public layer: each non-default argument survives and is used."""

import keras
import numpy as np
import pytest
from conftest import config_roundtrip, randomize_weights, to_numpy
from nested_layer_cases import D, HEADS, MLP, SIZES, WIDTHS, mixed_groups

from keras_mone import layers
from keras_mone.data import augment
from keras_mone.exports import exported


# --------------------------------------------------------------------------
# get_config round trip of every public layer
# --------------------------------------------------------------------------
PUBLIC_LAYERS = {
    "NestedDense": lambda: layers.NestedDense(24, use_bias=False, bias_initializer="ones"),
    "MoNEAttention": lambda: layers.MoNEAttention(D, HEADS, use_bias=False, dropout_rate=0.1),
    "NestedMLP": lambda: layers.NestedMLP(D, MLP, dropout_rate=0.2),
    "ViTBlock": lambda: layers.ViTBlock(D, HEADS, MLP, routed=True, drop_path_rate=0.1, layer_norm_epsilon=1e-5),
    "PatchEmbedding": lambda: layers.PatchEmbedding(
        (16, 24), 8, D, num_channels=1, use_class_token=True, use_position_embedding=False
    ),
    "DropPath": lambda: layers.DropPath(0.25, seed=7),
    "Router": lambda: layers.Router(3),
    "RandomRouter": lambda: layers.RandomRouter(5, seed=11),
    "ExpertPreferredRouting": lambda: layers.ExpertPreferredRouting(
        3, 0.4, capacity_method="greedy", beta=5.0, delta=3.0
    ),
    "TubeletEmbedding": lambda: layers.TubeletEmbedding(
        6, (16, 24), 8, D, tubelet_size=3, num_channels=1, use_class_token=False
    ),
    "SequenceEncoder": lambda: layers.SequenceEncoder(
        5, D, 2, HEADS, MLP, use_class_token=False, drop_path_rate=0.1, layer_norm_epsilon=1e-5
    ),
    "InceptionCrop": lambda: augment.InceptionCrop(12, 10, area_range=(0.2, 0.9), seed=3),
    "RolledMixUp": lambda: augment.RolledMixUp(alpha=0.5, seed=4),
    "ACMMLP": lambda: layers.ACMMLP(D, MLP, num_learners=2, mode="grouped", beta=0.4, dropout_rate=0.1),
    "ACMGate": lambda: layers.ACMGate(3, hidden_units=8, temperature=0.5, seed=2),
    "ACMLinear": lambda: layers.ACMLinear(D, num_learners=2, rank=4, beta=0.6),
    "MlpBlock": lambda: layers.MlpBlock(D, 12, gelu_approximate=True),
    "MixerBlock": lambda: layers.MixerBlock(6, D, 5, 12, layer_norm_epsilon=1e-5),
    "SparseMixerBlock": lambda: layers.SparseMixerBlock(
        6, D, 2, 8, 0, 16, capacity_factor=2.0, aux_loss_weight=0.02, seed=3
    ),
    "SparseMoE": lambda: layers.SparseMoE(3, 8, 2, capacity_factor=1.5, noise=False, seed=5),
    "ReRepresent1": lambda: layers.ReRepresent1(6, D, 12, 4),
    "ReRepresent2": lambda: layers.ReRepresent2(12, 4, 6, D),
}


def test_every_public_layer_is_covered():
    # A family's layers are exported into keras_mone.layers from its folder (keras_mone.exports).
    public = {name for module in (layers, augment) for name in {*module.__all__, *exported(module.__name__)}
              if isinstance(getattr(module, name), type) and issubclass(getattr(module, name), keras.layers.Layer)}
    assert public == set(PUBLIC_LAYERS)


@pytest.mark.parametrize("name", sorted(PUBLIC_LAYERS))
def test_get_config_round_trip(name):
    layer = PUBLIC_LAYERS[name]()
    clone = config_roundtrip(layer)
    config = layer.get_config()
    # the non-default constructor arguments survive
    for key, value in config.items():
        if key in ("name", "trainable", "dtype"):
            continue
        assert clone.get_config()[key] == value
    # ...and are really used by the clone, not just echoed
    for attr in ("units", "use_bias", "dropout_rate", "routed", "drop_path_rate", "layer_norm_epsilon",
                 "use_class_token", "num_channels", "rate", "seed", "num_experts", "capacity_method",
                 "effective_capacity", "beta", "delta", "capacities", "num_frames", "tubelet_size",
                 "image_size", "sequence_length", "depth", "area_range", "alpha", "num_learners", "mode",
                 "temperature", "top_k", "capacity_factor", "aux_loss_weight", "noise", "gelu_approximate",
                 "num_tokens", "output_tokens", "output_dim", "use_position_embedding"):
        if hasattr(layer, attr):
            assert getattr(clone, attr) == getattr(layer, attr), attr


def test_half_open_unit_interval_serialises():
    constraint = layers.HalfOpenUnitInterval()
    restored = keras.constraints.deserialize(keras.constraints.serialize(constraint))
    assert isinstance(restored, layers.HalfOpenUnitInterval)


def test_routed_block_round_trip_keeps_outputs():
    block = layers.ViTBlock(D, HEADS, MLP, routed=True)
    block.build((None, None, D))
    randomize_weights(block, seed=8)
    clone = config_roundtrip(block)
    clone.build((None, None, D))
    clone.set_weights(block.get_weights())
    groups, _ = mixed_groups()
    gates = [np.full((2, k), 0.3, "float32") for k in SIZES]
    for a, b in zip(block(groups, widths=WIDTHS, gates=gates), clone(groups, widths=WIDTHS, gates=gates)):
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b))
