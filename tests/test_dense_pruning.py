"""prune_dense_vit: a smaller dense ViT from a larger one's leading blocks, heads, features and MLP units."""

import numpy as np
import pytest

import numpy_reference as ref
from conftest import TINY, assert_f32_close, images, randomize_weights, relative_weights, to_numpy
from keras_mone.models import ImageClassifier, MoNEViTBackbone, ViTBackbone, prune_dense_vit

# TINY: hidden 32, 4 heads of 8 features, MLP 64, 2 blocks; the source is one block deeper.
SOURCE = dict(TINY, depth=3)
SMALL = dict(TINY, depth=2, hidden_dim=16, num_heads=2, mlp_dim=24)


def built(cls=ViTBackbone, seed=0, **config):
    backbone = cls(**config)
    backbone.build()
    randomize_weights(backbone, seed=seed)
    return backbone


def pruned_reference_weights(source_weights, hidden, heads, mlp, head_width):
    """The pruned model's weights, selected index by index from the source's (float64)."""
    full = source_weights["patch_embedding/projection/kernel"].shape[-1]
    qkv_columns = np.array([part * full + head * head_width + j
                            for part in range(3) for head in range(heads) for j in range(head_width)])
    out = {}
    for path, array in source_weights.items():
        if path.endswith("qkv/kernel"):
            out[path] = array[:hidden][:, qkv_columns]
        elif path.endswith("qkv/bias"):
            out[path] = array[qkv_columns]
        elif path.endswith("fc1/kernel"):
            out[path] = array[:hidden, :mlp]
        elif path.endswith("fc1/bias"):
            out[path] = array[:mlp]
        elif path.endswith("fc2/kernel"):
            out[path] = array[:mlp, :hidden]
        elif path.endswith("attention/out/kernel"):
            out[path] = array[:hidden, :hidden]
        else:  # embeddings, norms, biases of the residual stream: its first features
            out[path] = array[..., :hidden]
    return out


def test_pruned_model_computes_the_source_restricted_to_its_leading_parts():
    # Against the numpy ViT on weights picked index by index: rules out q / k / v
    # columns of the wrong heads, rows and columns swapped, or a dropped bias.
    source = built(**SOURCE)
    target = built(seed=7, **SMALL)
    assert prune_dense_vit(source, target) == []
    weights = pruned_reference_weights(relative_weights(source), hidden=16, heads=2, mlp=24, head_width=8)
    x = images()
    expected, _ = ref.vit_forward(weights, x, patch_size=TINY["patch_size"], depth=2, num_heads=2)
    assert_f32_close(to_numpy(target(x)), expected)


def test_pruning_at_equal_size_is_an_exact_copy_of_the_classifier():
    source = ImageClassifier(built(**SOURCE), num_classes=5)
    source.build()
    randomize_weights(source, seed=3)
    target = ImageClassifier(built(seed=9, **SOURCE), num_classes=5)
    target.build()
    assert prune_dense_vit(source, target) == []
    x = images()
    np.testing.assert_array_equal(to_numpy(target(x)), to_numpy(source(x)))


def test_a_head_of_another_class_count_keeps_its_initialisation():
    source = ImageClassifier(built(**SOURCE), num_classes=5)
    source.build()
    target = ImageClassifier(built(seed=9, **SMALL), num_classes=3)
    target.build()
    before = to_numpy(target.head.kernel)
    assert prune_dense_vit(source, target) == ["head/bias", "head/kernel"]
    np.testing.assert_array_equal(to_numpy(target.head.kernel), before)
    np.testing.assert_array_equal(
        to_numpy(target.backbone.norm.gamma), to_numpy(source.backbone.norm.gamma)[:16]
    )


@pytest.mark.parametrize(
    "target_config, match",
    [
        (dict(SOURCE, depth=4), "larger in the target.*depth"),
        (dict(SOURCE, mlp_dim=128), "larger in the target.*mlp_dim"),
        (dict(SMALL, num_heads=4), "head width: 8 vs 4"),
        (dict(SMALL, patch_size=16), "patch_size: 8 vs 16"),
    ],
)
def test_a_target_that_does_not_fit_is_refused_and_left_untouched(target_config, match):
    source = built(**SOURCE)
    target = built(seed=9, **target_config)
    before = {k: v.copy() for k, v in relative_weights(target).items()}
    with pytest.raises(ValueError, match=match):
        prune_dense_vit(source, target)
    for path, value in relative_weights(target).items():
        np.testing.assert_array_equal(value, before[path])


def test_only_dense_vits_are_pruned():
    with pytest.raises(ValueError, match="the target is a MoNEViTBackbone"):
        prune_dense_vit(built(**SOURCE), built(MoNEViTBackbone, **SMALL))
    with pytest.raises(ValueError, match="two backbones or two classifiers"):
        prune_dense_vit(ImageClassifier(built(**SOURCE), num_classes=5), built(**SMALL))


def test_the_recipe_prunes_the_shipped_dense_preset(tmp_path):
    # At vit_digits' own size the pruned model is vit_digits; smaller, it trains.
    from keras_mone import presets, recipes
    from recipe_helpers import tiny_overrides

    full = recipes.load("cluttered_digits_vit_from_dense",
                        **tiny_overrides(tmp_path / "full", image_size=32, model_args={}, test_samples_per_digit=1))
    dense = presets.from_preset("vit_digits")
    x = presets.evaluation_data("vit_digits")[0][:16]
    np.testing.assert_array_equal(to_numpy(full.model.predict(x, verbose=0)), to_numpy(dense.predict(x, verbose=0)))
    small = recipes.load("cluttered_digits_vit_from_dense", **tiny_overrides(
        tmp_path / "small", image_size=32, test_samples_per_digit=1,
        model_args=dict(depth=2, hidden_dim=32, num_heads=2, mlp_dim=128)))
    np.testing.assert_array_equal(to_numpy(small.model.backbone.blocks[1].mlp.fc2.bias),
                                  to_numpy(dense.backbone.blocks[1].mlp.fc2.bias)[:32])
    assert np.isfinite(small.fit(verbose=0)["loss"])


def test_init_prune_needs_a_dense_vit_and_init_from():
    from keras_mone import recipes

    with pytest.raises(recipes.RecipeError, match="init_prune.*architecture 'vit'"):
        recipes.resolve("cluttered_digits_mone", init_from="preset:vit_digits", init_prune=True)
    with pytest.raises(recipes.RecipeError, match="init_prune.*init_from ''"):
        recipes.resolve("cluttered_digits_vit", init_prune=True)
