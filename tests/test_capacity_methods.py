"""Every capacity allocation of MoNE Table 2 as ``capacity_method`` on the model (issue 28 item 4)."""

import keras
import numpy as np
import pytest

import numpy_reference as ref
from conftest import TINY, assert_f32_close, images, randomize_weights, relative_weights, to_numpy
from keras_mone.models import ImageClassifier, MoNEViTBackbone
from keras_mone.routing import capacity as capacity_lib


def table2_capacities(method, e_c, num_experts=4):
    """Table 2's allocations from the paper's words (Sec. 6), smallest expert first."""
    w = ref.width_fractions(num_experts)
    if method == "uniform":  # "equal capacity to all experts"
        return np.full(num_experts, 1.0 / num_experts)
    if method == "proportionate":  # "inversely proportional to expert compute cost"
        return (1 / w) / np.sum(1 / w)
    if method == "mod_greedy":  # "entire budget to the largest expert and dropping other tokens"
        return np.eye(num_experts)[-1] * e_c
    if method == "greedy":  # largest expert as large as the budget allows, the rest at the smallest
        c_small, c_full = np.linalg.solve([[1.0, 1.0], [w[0], 1.0]], [1.0, e_c])
        c = np.zeros(num_experts)
        c[0], c[-1] = c_small, c_full
        return c
    return ref.entropy_regularised_optimum(e_c, 2.0 ** -np.arange(num_experts), 10.0)  # Eq. 3


# Table 2's columns: (method, e_c as the paper prints it)
TABLE2 = [("proportionate", 0.27), ("uniform", 0.47), ("mod_greedy", 0.4), ("greedy", 0.4), ("mone", 0.3), ("mone", 0.4)]


@pytest.mark.parametrize("num_experts", [3, 4, 5])
def test_static_methods_fix_their_own_capacity(num_experts):
    w = ref.width_fractions(num_experts)
    assert capacity_lib.static_effective_capacity("uniform", num_experts) == pytest.approx(np.mean(w), abs=1e-15)
    assert capacity_lib.static_effective_capacity("proportionate", num_experts) == pytest.approx(
        num_experts / np.sum(1 / w), abs=1e-15
    )
    for method in capacity_lib.CAPACITY_DISTRIBUTIONS:
        assert capacity_lib.static_effective_capacity(method, num_experts) is None


def test_method_capacity_accepts_the_printed_value_and_refuses_others():
    assert capacity_lib.method_capacity("uniform", 0.47) == 15 / 32
    assert capacity_lib.method_capacity("proportionate", 0.27) == pytest.approx(4 / 15, abs=1e-15)
    assert capacity_lib.method_capacity("greedy", 0.4) == 0.4
    assert capacity_lib.method_capacity("mod_greedy", 0.05) == 0.05  # drops tokens: below 1/8 allowed
    with pytest.raises(ValueError, match=r"fixes the effective capacity at 0\.46875"):
        capacity_lib.method_capacity("uniform", 0.5)
    with pytest.raises(ValueError, match="0.125"):
        capacity_lib.method_capacity("mone", 0.05)
    with pytest.raises(ValueError, match="capacity_method"):
        capacity_lib.method_capacity("random", 0.5)


@pytest.mark.parametrize("method, e_c", TABLE2)
def test_model_routes_with_each_allocation(method, e_c):
    model = MoNEViTBackbone(**TINY, capacity=e_c, capacity_method=method)
    expected = table2_capacities(method, model.capacity)
    np.testing.assert_allclose(model.expert_capacities, expected, rtol=0, atol=1e-5)
    assert abs(model.capacity - e_c) <= capacity_lib.STATIC_CAPACITY_TOLERANCE
    model.build()
    randomize_weights(model, seed=4)
    x = images(seed=2)
    out, inter = model(x, return_intermediates=True)
    probs, experts = to_numpy(inter["router_probs"][0]), to_numpy(inter["expert_index"][0])
    # Algorithm 1 with the allocation computed here, not the model's own.
    np.testing.assert_array_equal(experts, ref.expert_preferred_routing(probs, expected))
    want, _ = ref.vit_forward(
        relative_weights(model), x, patch_size=model.patch_size, depth=model.depth,
        num_heads=model.num_heads, num_experts=4, router_positions=model.router_positions,
        expert_index=[experts], learned_router=True, use_class_token=False,
        epsilon=model.layer_norm_epsilon,
    )
    assert_f32_close(to_numpy(out), want)


def test_allocations_give_different_models_at_the_same_capacity():
    # Same weights, e_c 0.4: Eq. 3, greedy and MoD greedy route differently, so outputs differ.
    outputs = {}
    for method in ("mone", "greedy", "mod_greedy"):
        model = ImageClassifier(MoNEViTBackbone(**TINY, capacity=0.4, capacity_method=method), num_classes=3)
        model.build()
        randomize_weights(model, seed=9)
        outputs[method] = to_numpy(model(images(seed=1)))
    assert np.abs(outputs["mone"] - outputs["greedy"]).max() > 1e-3
    assert np.abs(outputs["greedy"] - outputs["mod_greedy"]).max() > 1e-3


def test_static_method_serialises_and_refuses_other_budgets(tmp_path):
    model = ImageClassifier(MoNEViTBackbone(**TINY, capacity=0.27, capacity_method="proportionate"), num_classes=3)
    model.build()
    randomize_weights(model, seed=3)
    config = model.backbone.get_config()
    assert config["capacity_method"] == "proportionate" and config["capacity"] == pytest.approx(4 / 15)
    path = tmp_path / "proportionate.keras"
    model.save(path)
    restored = keras.saving.load_model(path, compile=False)
    assert restored.backbone.capacity_method == "proportionate"
    assert restored.backbone.expert_capacities == model.backbone.expert_capacities
    x = images(seed=4)
    np.testing.assert_array_equal(to_numpy(restored(x)), to_numpy(model(x)))
    with pytest.raises(ValueError, match="static budget"):
        model.set_capacity(0.5)
    assert model.backbone.capacity == pytest.approx(4 / 15)  # unchanged by the refused call


def test_recipe_selects_the_allocation(tmp_path):
    from keras_mone import recipes
    from recipe_helpers import TINY_MODEL, tiny_overrides

    overrides = tiny_overrides(
        tmp_path / "run", capacity=0.4, model_args=dict(TINY_MODEL, capacity_method="greedy"), steps_per_epoch=2,
    )
    setup = recipes.load("cluttered_digits_mone", **overrides)
    backbone = setup.model.backbone
    assert backbone.capacity_method == "greedy"
    np.testing.assert_allclose(backbone.expert_capacities, table2_capacities("greedy", 0.4), atol=1e-12)
    assert np.isfinite(setup.fit(verbose=0)["loss"])
