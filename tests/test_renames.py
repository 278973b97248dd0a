"""Issue 41 item 5, names that say what things are: the renamed names keep their old behaviour.

``MoNEBlock`` -> ``ViTBlock`` (files saved before the rename still load, no
weight path moves), ``analysis.token_merging`` -> ``analysis.merging_sweep``,
the two ``DISTRIBUTIONS`` -> ``CAPACITY_DISTRIBUTIONS`` /
``DISTRIBUTION_STRATEGIES``, and ``init_from``'s copy -> the neutral
``copy_matching_weights`` with ACM's SVD as ACM's hook.
"""

import ast
import pathlib
import zipfile

import h5py
import keras
import numpy as np
import pytest
from conftest import TINY, randomize_weights, relative_weights, to_numpy

from keras_mone import analysis, layers, models
from keras_mone.layers import block as block_module
from keras_mone.methods.acm.transfer import acm_from_dense
from keras_mone.methods.acm.backbone import ACMViTBackbone
from keras_mone.models.weight_transfer import copy_matching_weights, transfer_weights
from keras_mone.routing import capacity
from keras_mone.training import distribution

D, HEADS, MLP = TINY["hidden_dim"], TINY["num_heads"], TINY["mlp_dim"]

# A block's config as a .keras file written before the rename holds it.
OLD_BLOCK_CONFIG = {
    "module": "keras_mone.layers.block",
    "class_name": "MoNEBlock",
    "config": {
        "name": "block_0", "trainable": True,
        "dtype": {"module": "keras", "class_name": "DTypePolicy", "config": {"name": "float32"}, "registered_name": None},
        "hidden_dim": 32, "num_heads": 4, "mlp_dim": 64, "dropout_rate": 0.0, "drop_path_rate": 0.1,
        "layer_norm_epsilon": 1e-06, "alpha_init": 0.25, "gate": "mone", "attention": None, "mlp": None,
        "gelu_approximate": False,
    },
    "registered_name": "keras_mone>MoNEBlock",
}


def test_mone_block_is_an_alias_of_vit_block():
    assert layers.MoNEBlock is layers.ViTBlock is block_module.MoNEBlock
    assert "ViTBlock" in layers.__all__ and "MoNEBlock" not in layers.__all__
    assert keras.saving.get_registered_name(layers.ViTBlock) == "keras_mone>ViTBlock"
    for name in ("keras_mone>ViTBlock", "keras_mone>MoNEBlock"):
        assert keras.saving.get_registered_object(name) is layers.ViTBlock


def test_a_config_with_the_old_registered_name_deserialises():
    # rules out: the old name dropped from Keras' table (an old .keras file no longer loads)
    block = keras.saving.deserialize_keras_object(OLD_BLOCK_CONFIG)
    assert type(block) is layers.ViTBlock
    assert (block.name, block.gate, block.alpha_init, block.drop_path_rate) == ("block_0", "mone", 0.25, 0.1)
    config = keras.saving.serialize_keras_object(block)
    assert config["registered_name"] == "keras_mone>ViTBlock"
    assert config["config"] == OLD_BLOCK_CONFIG["config"]


def test_weight_paths_and_default_layer_names_are_unchanged(tmp_path):
    # rules out: Keras keying the blocks of a saved backbone by the new class name
    # ("vi_t_block"), so that every weights file saved before the rename (the zoo's) no longer loads.
    assert layers.ViTBlock(D, HEADS, MLP).name.startswith("mo_ne_block")
    backbone = models.MoNEViTBackbone(**TINY)
    backbone.build()
    path = str(tmp_path / "backbone.weights.h5")
    backbone.save_weights(path)
    with h5py.File(path) as file:
        assert sorted(file["blocks"]) == ["mo_ne_block", "mo_ne_block_1"]


def test_a_keras_file_saved_before_the_rename_loads(tmp_path):
    # A functional model holds its blocks' configs and keys their weights by class name:
    # the file of the old code is the new one with the old registered name.
    inputs = keras.Input((4, D))
    model = keras.Model(inputs, layers.ViTBlock(D, HEADS, MLP)(layers.ViTBlock(D, HEADS, MLP, gate="mone")(inputs)))
    randomize_weights(model, seed=4)
    x = np.random.default_rng(0).standard_normal((2, 4, D)).astype("float32")
    expected = to_numpy(model(x))
    new, old = tmp_path / "new.keras", tmp_path / "old.keras"
    model.save(new)
    with zipfile.ZipFile(new) as source, zipfile.ZipFile(old, "w") as target:
        for item in source.infolist():
            data = source.read(item.filename)
            if item.filename == "config.json":
                text = data.decode()
                assert '"keras_mone>ViTBlock"' in text
                data = text.replace('"keras_mone>ViTBlock"', '"keras_mone>MoNEBlock"').encode()
            target.writestr(item, data)
    restored = keras.saving.load_model(old)
    assert [type(layer) for layer in restored.layers[1:]] == [layers.ViTBlock] * 2
    np.testing.assert_allclose(to_numpy(restored(x)), expected, rtol=0, atol=0)


def test_the_merging_sweep_module_and_the_analysis_exports():
    from keras_mone.methods.mone import merging_sweep

    for name in ("merged_gmacs", "merging_tokens", "token_merging_sweep"):
        assert getattr(analysis, name) is getattr(merging_sweep, name)
        assert name in dir(analysis)


def test_the_two_distribution_tables_have_their_own_names():
    assert capacity.CAPACITY_DISTRIBUTIONS is capacity.DISTRIBUTIONS
    assert capacity.STATIC_CAPACITY_DISTRIBUTIONS is capacity.STATIC_DISTRIBUTIONS
    assert set(capacity.CAPACITY_DISTRIBUTIONS) == {"mone", "greedy", "mod_greedy"}
    assert distribution.DISTRIBUTION_STRATEGIES is distribution.DISTRIBUTIONS
    assert distribution.DISTRIBUTION_STRATEGIES == ("none", "data_parallel", "model_parallel", "auto")


def _dense(seed=0):
    dense = models.ViTBackbone(**TINY)
    dense.build()
    randomize_weights(dense, seed=seed)
    return dense


def test_copy_matching_weights_is_transfer_weights_without_a_hook():
    dense = _dense()
    by_hook, by_path = models.MoNEViTBackbone(**TINY), models.MoNEViTBackbone(**TINY)
    by_hook.build(), by_path.build()
    assert copy_matching_weights(dense, by_hook) == transfer_weights(dense, by_path)
    for key, value in relative_weights(dense).items():  # the routers keep their own initialisation
        np.testing.assert_array_equal(relative_weights(by_hook)[key], value)
    narrow = models.ViTBackbone(**{**TINY, "hidden_dim": 16})
    narrow.build()
    with pytest.raises(ValueError, match="Cannot transfer weights from .*shape mismatches"):
        copy_matching_weights(narrow, by_hook)


@pytest.mark.parametrize("projections", [True, False])
def test_copy_matching_weights_runs_acms_hook_as_acm_from_dense_did(projections):
    # rules out: init_from skipping ACM's SVD of the dense attention now that it calls the neutral copy
    dense = _dense()
    targets = []
    for _ in range(2):
        acm = ACMViTBackbone(**TINY, gate_seed=0, beta=0.5, acm_projections=projections)
        acm.build()
        randomize_weights(acm, seed=1)
        targets.append(acm)
    left = copy_matching_weights(dense, targets[0])
    assert left == acm_from_dense(dense, targets[1])
    assert left and all("gate" in path for path in left)
    for key, value in relative_weights(targets[1]).items():
        np.testing.assert_array_equal(relative_weights(targets[0])[key], value)
    shallow = models.ViTBackbone(**{**TINY, "depth": 1})
    shallow.build()
    if projections:
        with pytest.raises(ValueError, match="no dense attention kernels"):
            copy_matching_weights(shallow, targets[0])


def test_recipes_copy_through_the_neutral_function():
    source = pathlib.Path(__file__).resolve().parent.parent / "keras_mone" / "recipes" / "model.py"
    imported = {
        alias.name for node in ast.walk(ast.parse(source.read_text()))
        if isinstance(node, ast.ImportFrom) for alias in node.names
    }
    assert "copy_matching_weights" in imported and "acm_from_dense" not in imported
