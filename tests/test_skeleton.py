"""The transformer skeleton: blocks built from parts, routing parts, intermediates, FLOPs from the plan."""

import keras
import numpy as np
import pytest
from conftest import BATCH, NUM_TOKENS, TINY, TINY_VIDEO, assert_f32_close, images, randomize_weights, to_numpy, videos

from keras_mone import analysis, layers, models
from keras_mone.routing import parts
from keras_mone.routing.token_groups import SKIPPED

D, HEADS, MLP = TINY["hidden_dim"], TINY["num_heads"], TINY["mlp_dim"]


def built(model, seed=0):
    model.build()
    randomize_weights(model, seed=seed)
    return model


ROUTED_MODELS = {
    "vit": lambda: models.ViTBackbone(**TINY),
    "matvit": lambda: models.MatViTBackbone(**TINY, width_fraction=0.25),
    "mone": lambda: models.MoNEViTBackbone(**TINY, capacity=0.4, router_positions=(0, 1)),
    "mone_random": lambda: models.MoNEViTBackbone(**TINY, capacity=0.4, router_type="random", router_seed=1),
    "mod": lambda: models.MoDViTBackbone(**TINY, capacity=0.25, routed_blocks=(0, 1)),
    "amod": lambda: models.AMoDViTBackbone(**TINY, capacity=0.25, routed_blocks=(1,)),
}


@pytest.mark.parametrize("name", sorted(ROUTED_MODELS))
def test_intermediates_name_assignment_and_compute_per_block(name):
    model = built(ROUTED_MODELS[name]())
    out, inter = model(images(), return_intermediates=True)
    if name != "mone_random":  # (a random router draws anew on every call)
        assert_f32_close(to_numpy(out), to_numpy(model(images())), ulps=0)  # the record changes nothing
    blocks = inter["blocks"]
    assert len(blocks) == model.depth
    plan = model.token_routing().block_plan(NUM_TOKENS)
    for entry, groups in zip(blocks, plan):
        assignment, compute = to_numpy(entry["assignment"]), to_numpy(entry["compute"])
        assert assignment.shape == compute.shape == (BATCH, NUM_TOKENS)
        # Per image, the tokens at each width are exactly those of the static plan.
        for b in range(BATCH):
            got = sorted(int(round(c * D)) for c in compute[b] if c > 0)
            want = sorted(w for tokens, w in groups for _ in range(tokens))
            assert got == want
            assert ((assignment[b] == SKIPPED) == (compute[b] == 0)).all()


def test_flops_equal_the_compute_the_forward_pass_reports():
    """The qkv MACs of the counter are 3 D^2 x the summed width shares the model ran at."""
    for make in ROUTED_MODELS.values():
        model = built(make())
        _, inter = model(images(), return_intermediates=True)
        share = sum(float(to_numpy(e["compute"])[0].sum()) for e in inter["blocks"])
        assert analysis.flops(model).breakdown["qkv"] == pytest.approx(3 * D * D * share, rel=1e-6)


def test_mone_block_records_agree_with_the_router_lists():
    model = built(ROUTED_MODELS["mone"]())
    _, inter = model(images(), return_intermediates=True)
    np.testing.assert_array_equal(to_numpy(inter["blocks"][0]["assignment"]), to_numpy(inter["expert_index"][0]))
    np.testing.assert_array_equal(to_numpy(inter["blocks"][1]["assignment"]), to_numpy(inter["expert_index"][1]))
    assert_f32_close(to_numpy(inter["blocks"][1]["scores"]), to_numpy(inter["router_probs"][1]), ulps=0)


def test_score_gate_scales_the_whole_update():
    block = layers.ViTBlock(D, HEADS, MLP, gate="score")
    plain = layers.ViTBlock(D, HEADS, MLP)
    x = keras.random.normal((BATCH, 5, D), seed=1)
    block.build(x.shape), plain.build(x.shape)
    plain.set_weights(block.get_weights())
    g = keras.random.uniform((BATCH, 5), seed=2)
    expected = to_numpy(x) + to_numpy(g)[..., None] * (to_numpy(plain(x)) - to_numpy(x))
    assert_f32_close(to_numpy(block([x], widths=[D], gates=[g])[0]), expected)
    assert block.alpha is None and not block.weights[-1].name == "alpha"


def test_block_takes_attention_and_mlp_parts_and_round_trips(tmp_path):
    class_name = "keras_mone>NestedMLP"
    mlp = layers.NestedMLP(D, 2 * MLP, name="wide_mlp")
    block = layers.ViTBlock(D, HEADS, MLP, mlp=mlp, gate="mone", alpha_init=0.25)
    x = keras.random.normal((BATCH, 5, D), seed=1)
    y = block(x)
    assert block.mlp is mlp and block.mlp.fc1.kernel.shape == (D, 2 * MLP)
    config = block.get_config()
    assert config["mlp"]["registered_name"] == class_name and config["attention"] is None
    restored = layers.ViTBlock.from_config(config)
    restored.build(x.shape)
    restored.set_weights(block.get_weights())
    assert_f32_close(to_numpy(restored(x)), to_numpy(y), ulps=0)


def test_bad_gate_names_the_argument():
    with pytest.raises(ValueError, match="`gate`"):
        layers.ViTBlock(D, HEADS, MLP, gate="sigmoid")


def test_video_forms_are_derived_from_the_image_classes():
    assert models.video_form(models.MoNEViTBackbone) is models.MoNEViViTBackbone
    assert models.video_form(models.ViTBackbone) is models.ViViTBackbone
    assert models.video_form(models.MoNEViViTBackbone) is models.MoNEViViTBackbone
    assert keras.saving.get_registered_name(models.MoDViViTBackbone) == "keras_mone>MoDViViTBackbone"
    assert models.MoDViViTBackbone.default_name == "mod_vivit_backbone"
    with pytest.raises(TypeError, match="image_backbone"):
        models.video_form(keras.layers.Dense)


def test_amod_refuses_neighbouring_routed_blocks():
    with pytest.raises(ValueError, match="neighbours"):
        models.AMoDViTBackbone(**dict(TINY, depth=4), routed_blocks=(1, 2))


def test_a_routing_part_is_all_a_new_method_needs():
    """A part that keeps every other token (no router) runs through the shared loop
    and the FLOP counter with no other change."""

    class EveryOtherToken(parts.TokenRouting):
        def block_plan(self, num_tokens):
            return [[((num_tokens + 1) // 2, self.hidden_dim)]] * self.depth

        def before_block(self, index, state, received, record):
            tokens = state.restored()
            batch, n = keras.ops.shape(tokens)[0], tokens.shape[1]
            kept = keras.ops.broadcast_to(keras.ops.arange(0, n, 2), (batch, (n + 1) // 2))
            other = keras.ops.broadcast_to(keras.ops.arange(1, n, 2), (batch, n // 2))
            new = parts.TokenGroups()
            new.add_group(parts.gather_tokens(tokens, kept), self.hidden_dim, 0)
            new.passed = parts.gather_tokens(tokens, other)
            new.order = keras.ops.concatenate([kept, other], axis=1)
            return new

    class HalfViT(models.ViTBackbone):
        def token_routing(self):
            return EveryOtherToken(self.depth, self.hidden_dim)

    # Its video form comes with it: the same routing per frame index.
    video = models.video_form(HalfViT)(**TINY_VIDEO)
    assert type(video).__name__ == "HalfViViT" and models.video_form(HalfViT) is type(video)
    assert tuple(video(videos()).shape) == (BATCH, video.num_output_tokens, D)
    dense_video = models.ViViTBackbone(**TINY_VIDEO)
    tokens = dense_video.num_tokens  # per frame index: 3 of 5 tokens run the blocks
    assert analysis.flops(video).breakdown["mlp"] == analysis.flops(dense_video).breakdown["mlp"] * ((tokens + 1) // 2) // tokens

    model = built(HalfViT(**TINY))
    dense = built(models.ViTBackbone(**TINY))
    dense.set_weights(model.get_weights())
    x = images()
    out = to_numpy(model(x))
    tokens = dense.patch_embedding(x)
    kept = tokens[:, ::2]
    for block in dense.blocks:
        kept = block(kept)
    expected = to_numpy(tokens).copy()
    expected[:, ::2] = to_numpy(kept)
    assert_f32_close(out, to_numpy(dense.norm(keras.ops.convert_to_tensor(expected))))
    full = analysis.flops(dense).breakdown["mlp"]
    assert analysis.flops(model).breakdown["mlp"] == full // 2


def test_a_method_registered_at_runtime_is_seen_everywhere(monkeypatch, tmp_path):
    # A plug-in registers a method after keras_mone was imported: the registry
    # views that presets, recipes, training modes and FLOPs read see it at once.
    from keras_mone import flops, recipes
    from keras_mone.methods import registry as methods
    from keras_mone.models.image_classifier import ImageClassifier
    from keras_mone.recipes.schema import ARCHITECTURES, VIDEO_ARCHITECTURES, RecipeError
    from keras_mone.methods.registry import ARCHITECTURE_MODES
    from recipe_helpers import tiny_overrides

    monkeypatch.setattr(methods, "METHODS", dict(methods.METHODS))
    assert "two_expert_mone_vit" not in ARCHITECTURES
    with pytest.raises(RecipeError, match="architecture"):
        recipes.load("cluttered_digits_mone", **tiny_overrides(tmp_path / "a", architecture="two_expert_mone_vit"))
    methods.register_method(methods.Method(
        "two_expert_mone",
        image=methods.Architecture("two_expert_mone_vit", models.MoNEViTBackbone, ImageClassifier, video=False,
                                   defaults={"num_experts": 2}),
        modes=("fixed", "adaptive"),
        recipe_arguments=lambda recipe: dict(capacity=recipe["capacity"], router_seed=recipe["seed"]),
    ))
    assert methods.ARCHITECTURES["two_expert_mone_vit"] is models.MoNEViTBackbone
    assert methods.TASKS["two_expert_mone_vit"] is ImageClassifier
    assert ARCHITECTURE_MODES["two_expert_mone_vit"] == ("fixed", "adaptive")
    assert "two_expert_mone_vit" in ARCHITECTURES and "two_expert_mone_vit" not in VIDEO_ARCHITECTURES
    setup = recipes.load("cluttered_digits_mone", **tiny_overrides(tmp_path / "b", architecture="two_expert_mone_vit"))
    backbone = setup.model.backbone
    assert backbone.num_experts == 2 and backbone.capacity == setup.recipe["capacity"]
    assert len(backbone.expert_widths) == 2 and flops(setup.model).total > 0
    with pytest.raises(RecipeError, match="mode"):  # modes come from the entry too
        recipes.load("cluttered_digits_mone", **tiny_overrides(tmp_path / "c", architecture="two_expert_mone_vit",
                                                              mode="isoflops"))
    with pytest.raises(ValueError, match="registered twice"):
        methods.register_method(methods.Method("other", image=methods.Architecture(
            "two_expert_mone_vit", models.ViTBackbone, ImageClassifier, video=False)))
