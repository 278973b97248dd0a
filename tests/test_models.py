"""ViTBackbone, MoNEViTBackbone and ImageClassifier (Sec. 4.1, Eq. 1, Eq. 8)."""

import keras
import numpy as np
import pytest

import numpy_reference as ref
from conftest import (
    BACKEND,
    BATCH,
    NUM_TOKENS,
    TINY,
    assert_f32_close,
    gradients,
    images,
    max_abs_diff,
    per_example_counts,
    randomize_weights,
    relative_weights,
    run_serialization_roundtrip,
    to_numpy,
)
from keras_mone import routing
from keras_mone.models import ImageClassifier, MoNEViTBackbone, ViTBackbone, transfer_weights


def dense_and_mone(config, seed=0, **mone_kwargs):
    """A dense ViT with random weights and a MoNE-ViT holding the same weights."""
    dense = ViTBackbone(**config)
    dense.build()
    randomize_weights(dense, seed=seed)
    mone = MoNEViTBackbone(**config, **mone_kwargs)
    mone.build()
    randomize_weights(mone, seed=seed + 1)  # routers (and alphas) random, rest overwritten below
    extras = transfer_weights(dense, mone)
    return dense, mone, extras


def reference_forward(model, x, expert_index=(), learned_router=True):
    return ref.vit_forward(
        relative_weights(model),
        x,
        patch_size=model.patch_size,
        depth=model.depth,
        num_heads=model.num_heads,
        num_experts=getattr(model, "num_experts", 4),
        router_positions=getattr(model, "router_positions", ()),
        expert_index=expert_index,
        learned_router=learned_router,
        use_class_token=model.use_class_token,
        epsilon=model.layer_norm_epsilon,
    )


# --------------------------------------------------------------------------
# capacity 1.0 == dense ViT
# --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "use_class_token, router_positions",
    [(False, (0,)), (True, (0,)), (False, (0, 1))],
    ids=["gap", "class_token", "two_routers"],
)
def test_full_capacity_equals_dense(use_class_token, router_positions):
    config = dict(TINY, use_class_token=use_class_token)
    dense, mone, extras = dense_and_mone(config, capacity=1.0, router_positions=router_positions)
    # transfer_weights reports exactly the MoNE-only weights ...
    expected_extras = {f"block_{i}/alpha" for i in range(min(router_positions), TINY["depth"])}
    for p in router_positions:
        expected_extras |= {f"router_{p}/dense/kernel", f"router_{p}/dense/bias"}
    assert set(extras) == expected_extras
    # ... and the alphas the transfer left alone are the randomised ones: reset them to the
    # MoNE initial value 0 (with alpha = 0 Eq. 1 has gate factor 1, the dense block).
    for block in mone.blocks:
        if block.alpha is not None:
            block.alpha.assign(0.0)
    x = images()
    want = to_numpy(dense(x))
    got = to_numpy(mone(x))
    assert got.shape == (BATCH, NUM_TOKENS + int(use_class_token), TINY["hidden_dim"])
    # Same maths on permuted tokens (EPR groups them, attention is permutation
    # equivariant, outputs are restored): only float32 summation order differs.
    assert max_abs_diff(got, want) <= 1e-5
    # The dense ViT itself matches the numpy reference.
    expected, _ = reference_forward(dense, x)
    assert_f32_close(want, expected)
    # Every token went to the full expert; the tokens were left in place (one group
    # holds them all), so the router probabilities are those of the embedded tokens.
    _, inter = mone(x, return_intermediates=True)
    for index in inter["expert_index"]:
        np.testing.assert_array_equal(to_numpy(index), np.full(index.shape, 3))
    first_probs = to_numpy(mone.routers[0](mone.patch_embedding(x)))
    np.testing.assert_array_equal(to_numpy(inter["router_probs"][0]), first_probs)


def test_transfer_weights_between_classifiers_includes_the_head():
    dense = ImageClassifier(ViTBackbone(**TINY), num_classes=5)
    mone = ImageClassifier(MoNEViTBackbone(**TINY, capacity=1.0), num_classes=5)
    x = images(seed=4)
    dense(x)  # build both
    mone(x)
    randomize_weights(dense, seed=8)
    extras = transfer_weights(dense, mone)
    assert extras and all("router" in p or "alpha" in p for p in extras)
    expected = to_numpy(dense(x))
    assert max_abs_diff(expected, to_numpy(mone(x))) <= 1e-5
    # The target owns its copy: training the source afterwards (jax donates
    # the source's buffers) leaves the target intact.
    dense.compile(optimizer="sgd", loss="mse")
    dense.fit(x, np.zeros((x.shape[0], 5), "float32"), epochs=1, verbose=0)
    assert max_abs_diff(expected, to_numpy(mone(x))) <= 1e-5


def test_transfer_weights_rejects_mismatched_models():
    dense = ViTBackbone(**dict(TINY, mlp_dim=32))
    dense.build()
    mone = MoNEViTBackbone(**TINY, capacity=1.0)
    mone.build()
    before = [to_numpy(v) for v in mone.weights]
    with pytest.raises(ValueError, match="shape mismatches"):
        transfer_weights(dense, mone)
    for v, old in zip(mone.weights, before):  # nothing was copied
        np.testing.assert_array_equal(to_numpy(v), old)
    with pytest.raises(ValueError, match="absent in the target"):
        transfer_weights(mone, _built_dense())


def _built_dense():
    dense = ViTBackbone(**TINY)
    dense.build()
    return dense


# --------------------------------------------------------------------------
# lower capacities: intermediates and the Eq. 8 reference forward pass
# --------------------------------------------------------------------------
ROUTED_CASES = {
    "mone_0.3": dict(capacity=0.3),
    # block 0 dense (before the first router), routers at blocks 1 and 2
    "late_routers_class_token_0.5": dict(capacity=0.5, router_positions=(1, 2), use_class_token=True, depth=3),
    "mod_greedy_0.3": dict(capacity=0.3, capacity_method="mod_greedy"),
    "random_router_0.3": dict(capacity=0.3, router_type="random", router_seed=3),
}


@pytest.mark.parametrize("case", sorted(ROUTED_CASES))
def test_routed_forward_matches_reference(case):
    kwargs = dict(ROUTED_CASES[case])
    config = dict(TINY, use_class_token=kwargs.pop("use_class_token", False), depth=kwargs.pop("depth", TINY["depth"]))
    model = MoNEViTBackbone(**config, **kwargs)
    model.build()
    randomize_weights(model, seed=5)  # alphas in (0.2, 0.8): the gates of Eq. 1 matter
    x = images(seed=1)
    out, inter = model(x, return_intermediates=True)
    out = to_numpy(out)
    learned = model.router_type == "learned"

    counts, dropped = model.expert_token_counts()
    assert sum(counts) + dropped == model.num_tokens
    expert_index = [to_numpy(e) for e in inter["expert_index"]]
    assert len(expert_index) == len(model.router_positions)
    for e in expert_index:
        assert e.shape == (BATCH, model.num_tokens)
        # exact per-example counts, as promised by EPR
        np.testing.assert_array_equal(per_example_counts(e, 4), np.tile(list(counts) + [dropped], (BATCH, 1)))

    expected, ref_probs = reference_forward(model, x, expert_index, learned_router=learned)
    if learned:
        probs = [to_numpy(p) for p in inter["router_probs"]]
        for p, rp, e in zip(probs, ref_probs, expert_index):
            # probabilities in [0, 1] from a router on top of 0-2 blocks: the softmax
            # amplifies the logits' round-off (observed <= 3.2e-6); 1e-5 = 84 ulps of 1.
            assert max_abs_diff(p, rp) <= 1e-5
            # the assignment is Algorithm 1 on the model's own probabilities
            np.testing.assert_array_equal(e, ref.expert_preferred_routing(p, model.expert_capacities))
    # Eq. 8: every token processed at its expert's width (gated by alpha * r + 1).
    assert_f32_close(out, expected)
    # The routing matters: a full-width pass differs by far more than the tolerance.
    full, _ = reference_forward(
        model, x, [np.full_like(e, 3) for e in expert_index], learned_router=learned
    )
    assert max_abs_diff(full, expected) > 1e-2


@pytest.mark.parametrize("capacity, router_positions", [(0.3, (0,)), (0.5, (1, 2))])
def test_class_token_to_full_expert(capacity, router_positions):
    # The class token goes to the largest expert with capacity, at every router
    # (also after the tokens were regrouped by an earlier one); the other
    # tokens follow Algorithm 1 as usual, and the forward pass is still Eq. 8.
    config = dict(TINY, use_class_token=True, depth=3)
    model = MoNEViTBackbone(
        **config, capacity=capacity, router_positions=router_positions, class_token_to_full_expert=True
    )
    model.build()
    randomize_weights(model, seed=5)
    x = images(seed=1)
    out, inter = model(x, return_intermediates=True)
    counts, _ = model.expert_token_counts()
    largest = max(j for j, count in enumerate(counts) if count)
    for probs, experts in zip(inter["router_probs"], inter["expert_index"]):
        probs, experts = to_numpy(probs), to_numpy(experts)
        np.testing.assert_array_equal(experts[:, 0], np.full(BATCH, largest))
        lifted = probs.copy()
        lifted[:, 0] += 2.0
        np.testing.assert_array_equal(experts, ref.expert_preferred_routing(lifted, model.expert_capacities))
    expected, _ = reference_forward(model, x, [to_numpy(e) for e in inter["expert_index"]])
    assert_f32_close(to_numpy(out), expected)


def test_mod_greedy_with_every_token_dropped():
    # capacity 0.05 is accepted for mod_greedy, and floor(0.05 * 16) = 0: no
    # token is processed by any routed block (they all skip it, MoD style).
    model = MoNEViTBackbone(**TINY, capacity=0.05, capacity_method="mod_greedy")
    assert model.expert_token_counts() == ((0, 0, 0, 0), NUM_TOKENS)
    model.build()
    randomize_weights(model, seed=12)
    x = images(seed=3)
    out, inter = model(x, return_intermediates=True)
    np.testing.assert_array_equal(to_numpy(inter["expert_index"][0]), np.full((BATCH, NUM_TOKENS), -1))
    expected, _ = reference_forward(model, x, [np.full((BATCH, NUM_TOKENS), -1)])
    assert_f32_close(to_numpy(out), expected)


def test_gates_are_used_by_learned_router_only():
    # Same weights and assignment: changing alpha changes a learned-router model
    # (gate alpha * r + 1) but not a random-router one (no gate).
    for router_type, should_change in (("learned", True), ("random", False)):
        model = MoNEViTBackbone(**TINY, capacity=0.5, router_type=router_type, router_seed=0)
        model.build()
        randomize_weights(model, seed=6)
        x = images(seed=2)
        out, inter = model(x, return_intermediates=True)
        assignment = [to_numpy(e) for e in inter["expert_index"]]
        for block in model.blocks:
            block.alpha.assign(0.9)
        new, _ = reference_forward(model, x, assignment, learned_router=router_type == "learned")
        changed = max_abs_diff(new, to_numpy(out)) > 1e-3
        assert changed == should_change, router_type


def test_random_router_keeps_exact_counts_and_has_no_weights():
    model = MoNEViTBackbone(**TINY, capacity=0.45, router_type="random", router_seed=1)
    model.build()
    dense = _built_dense()
    alphas = TINY["depth"]
    assert model.count_params() == dense.count_params() + alphas
    counts, dropped = model.expert_token_counts()
    seen = []
    for seed in range(3):
        _, inter = model(images(seed=seed), return_intermediates=True)
        e = to_numpy(inter["expert_index"][0])
        np.testing.assert_array_equal(per_example_counts(e, 4), np.tile(list(counts) + [dropped], (BATCH, 1)))
        seen.append(e)
    assert not all(np.array_equal(seen[0], s) for s in seen[1:])  # it is random


def test_expert_token_counts_of_the_backbone():
    model = MoNEViTBackbone(**TINY, capacity=0.3)
    assert model.expert_token_counts() == ((7, 5, 3, 1), 0)
    np.testing.assert_allclose(model.expert_capacities, routing.capacity_distribution(0.3), rtol=0, atol=0)
    model.set_capacity(1.0)
    assert model.expert_token_counts() == ((0, 0, 0, 16), 0)
    model = MoNEViTBackbone(**TINY, capacity=0.3, capacity_method="mod_greedy")
    assert model.expert_token_counts() == ((0, 0, 0, 4), 12)


@pytest.mark.parametrize("use_class_token", [False, True])
def test_expert_share_of_tokens(use_class_token):
    from keras_mone.analysis import expert_share_of_tokens

    model = tiny_classifier(capacity=0.3, use_class_token=use_class_token)
    x = images(batch=3, seed=5)
    patches = NUM_TOKENS
    everything = np.ones((3, patches), bool)
    counts = np.array(model.backbone.expert_token_counts()[0], float)
    if not use_class_token:  # every token counted: exactly the static per-expert counts
        np.testing.assert_allclose(expert_share_of_tokens(model, x, everything, batch_size=2), counts / counts.sum())
    # One token per image: the share is where that token went, read off the intermediates.
    one = np.zeros((3, patches), bool)
    one[:, 5] = True
    _, extra = model.backbone(x, return_intermediates=True)
    expert = to_numpy(extra["expert_index"][0])[:, int(use_class_token) + 5]
    expected = np.bincount(expert, minlength=4) / 3
    np.testing.assert_allclose(expert_share_of_tokens(model, x, one), expected)


# --------------------------------------------------------------------------
# training: gradients reach the router and every alpha
# --------------------------------------------------------------------------
def tiny_classifier(capacity=0.5, alpha=0.5, seed=7, **kwargs):
    backbone = MoNEViTBackbone(**TINY, capacity=capacity, **kwargs)
    model = ImageClassifier(backbone, num_classes=3)
    model.build()
    randomize_weights(model, seed=seed)  # head kernel must be non-zero for gradients to flow
    for block in backbone.blocks:
        if block.alpha is not None:
            block.alpha.assign(alpha)
    return model


def router_and_alphas(model):
    backbone = model.backbone
    return [backbone.routers[0].dense.kernel] + [b.alpha for b in backbone.blocks if b.alpha is not None]


def test_gradients_reach_router_and_alpha():
    model = tiny_classifier(alpha=0.5)
    weights = keras.ops.convert_to_tensor(np.random.default_rng(0).standard_normal((BATCH, 3)).astype("float32"))
    loss = lambda logits: keras.ops.sum(keras.ops.multiply(logits, weights))  # noqa: E731
    variables = router_and_alphas(model)
    assert len(variables) == 1 + TINY["depth"]
    grads = gradients(model, loss, images(), variables)
    for v, g in zip(variables, grads):
        assert g is not None, v.path
        assert np.all(np.isfinite(g)) and np.abs(g).max() > 1e-6, v.path
    # Eq. 1: the router enters only through alpha * r, so at alpha = 0 (its
    # initial value) the router gets no gradient, while alpha does.
    for v in variables[1:]:
        v.assign(0.0)
    grads = gradients(model, loss, images(), variables)
    assert grads[0] is None or np.all(grads[0] == 0.0)
    for g in grads[1:]:
        assert np.abs(g).max() > 1e-6


def test_alpha_init_starts_routed_blocks_and_round_trips():
    backbone = MoNEViTBackbone(**TINY, capacity=0.5, router_positions=(1,), alpha_init=0.3)
    backbone.build()
    assert backbone.blocks[0].alpha is None  # before the first router: not routed
    assert [float(to_numpy(b.alpha)) for b in backbone.blocks[1:]] == pytest.approx([0.3] * (TINY["depth"] - 1))
    restored = MoNEViTBackbone.from_config(backbone.get_config())
    restored.build()
    assert restored.alpha_init == 0.3 and float(to_numpy(restored.blocks[1].alpha)) == pytest.approx(0.3)
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="alpha_init"):
            MoNEViTBackbone(**TINY, alpha_init=bad)


def test_fit_updates_router_and_alpha_within_bounds():
    model = tiny_classifier(alpha=0.5)
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    variables = router_and_alphas(model)
    # one alpha starts at the upper edge: the constraint must keep it below 1
    variables[-1].assign(1.0 - 1e-6)
    before = [to_numpy(v).copy() for v in variables]
    x = images(batch=4, seed=3)
    y = np.random.default_rng(1).standard_normal((4, 3)).astype("float32") * 10
    history = model.fit(x, y, batch_size=2, epochs=2, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    after = [to_numpy(v) for v in variables]
    assert max_abs_diff(after[0], before[0]) > 1e-4, "router kernel did not move"
    for b, a, v in zip(before[1:-1], after[1:-1], variables[1:-1]):
        assert abs(float(a) - float(b)) > 1e-4, f"{v.path} did not move"
    for a in after[1:]:
        assert 0.0 <= float(a) < 1.0


# --------------------------------------------------------------------------
# saving, compiled predict, set_capacity, bfloat16
# --------------------------------------------------------------------------
def test_keras_save_and_load_keeps_outputs_and_capacity(tmp_path):
    model = tiny_classifier(capacity=0.3, alpha=0.4)
    x = images(seed=4)
    restored = run_serialization_roundtrip(model, x, tmp_path)
    assert restored.capacity == 0.3
    assert restored.backbone.expert_capacities == model.backbone.expert_capacities
    assert restored.backbone.expert_token_counts() == ((7, 5, 3, 1), 0)
    for a, b in zip(model.weights, restored.weights):
        np.testing.assert_array_equal(to_numpy(a), to_numpy(b))
    # a capacity set after construction is what gets saved
    model.set_capacity(0.6)
    (tmp_path / "second").mkdir()
    restored = run_serialization_roundtrip(model, x, tmp_path / "second")
    assert restored.capacity == 0.6


def test_config_round_trip_of_models():
    backbone = MoNEViTBackbone(
        **TINY, capacity=0.4, capacity_method="greedy", router_positions=(1, 0),
        router_type="random", router_seed=5, num_experts=3,
    )
    model = ImageClassifier(backbone, num_classes=7, pooling="gap", head_bias_init=-2.0)
    config = model.get_config()
    clone = ImageClassifier.from_config(config)
    assert clone.get_config() == config
    cb = clone.backbone
    assert (cb.capacity, cb.capacity_method, cb.router_positions, cb.router_type, cb.num_experts) == (
        0.4, "greedy", [0, 1], "random", 3
    )
    dense = ViTBackbone(**dict(TINY, use_class_token=True, drop_path_rate=0.1))
    assert ViTBackbone.from_config(dense.get_config()).get_config() == dense.get_config()


def test_compiled_predict_follows_set_capacity():
    model = tiny_classifier(capacity=0.3, alpha=0.4)
    if BACKEND == "torch":
        model.compile(loss="mse")  # torch.compile support is not what is tested here
    else:
        model.compile(loss="mse", jit_compile=True)
    x = images(seed=5)
    eager_03 = to_numpy(model(x))
    pred_03 = model.predict(x, verbose=0)
    assert max_abs_diff(pred_03, eager_03) <= 1e-5  # compiled vs eager: fusion / summation order only
    model.set_capacity(0.6)
    assert model.capacity == 0.6
    pred_06 = model.predict(x, verbose=0)
    assert max_abs_diff(pred_06, pred_03) > 1e-3, "predict ignored set_capacity"
    assert max_abs_diff(pred_06, to_numpy(model(x))) <= 1e-5
    # evaluate follows too (its compiled function is rebuilt as well)
    y = np.zeros((BATCH, 3), "float32")
    loss_06 = model.evaluate(x, y, verbose=0)
    assert loss_06 == pytest.approx(float(np.mean(pred_06.astype(np.float64) ** 2)), rel=1e-5)
    model.set_capacity(0.3)
    np.testing.assert_allclose(model.predict(x, verbose=0), pred_03, rtol=0, atol=1e-6)
    # A second capacity change must rebuild evaluate too: on jax, jit caches
    # traces of equal bound methods, which once kept the 0.6 trace here.
    loss_03 = model.evaluate(x, y, verbose=0)
    assert loss_03 == pytest.approx(float(np.mean(pred_03.astype(np.float64) ** 2)), rel=1e-5)


def test_adaptive_capacity_draws_a_capacity_per_step():
    from keras_mone.training import AdaptiveCapacity

    model = tiny_classifier(capacity=0.5, alpha=0.4)
    model.compile(optimizer="sgd", loss="mse")
    x = images(batch=8, seed=3)
    y = np.zeros((8, 3), "float32")
    callback = AdaptiveCapacity(capacities=(0.25, 0.75), eval_capacity=0.5, seed=1)
    model.fit(x, y, batch_size=2, epochs=2, verbose=0, callbacks=[callback])
    assert len(callback.history) == 8 and set(callback.history) == {0.25, 0.75}
    assert model.capacity == 0.5
    # The compiled train step really runs at the drawn capacity: one step at
    # each capacity from the same weights gives that capacity's loss.
    for capacity in (0.25, 0.75):
        model.set_capacity(capacity)
        expected = float(np.mean(to_numpy(model(x[:2])).astype(np.float64) ** 2))
        weights = [to_numpy(v) for v in model.trainable_variables]
        loss = model.train_on_batch(x[:2], y[:2])
        assert loss == pytest.approx(expected, rel=1e-4)
        for v, w in zip(model.trainable_variables, weights):
            v.assign(w)


@pytest.mark.parametrize("policy", ["bfloat16", "mixed_bfloat16"])
def test_bfloat16_forward_is_finite(policy):
    backbone = MoNEViTBackbone(**TINY, capacity=0.3, dtype=policy)
    model = ImageClassifier(backbone, num_classes=3)
    model.build()
    randomize_weights(model, seed=9)
    x = images(seed=6)
    tokens, inter = backbone(x, return_intermediates=True)
    assert keras.backend.standardize_dtype(tokens.dtype) == "bfloat16"
    assert np.all(np.isfinite(to_numpy(keras.ops.cast(tokens, "float32"))))
    counts, dropped = backbone.expert_token_counts()
    np.testing.assert_array_equal(
        per_example_counts(to_numpy(inter["expert_index"][0]), 4), np.tile(list(counts) + [dropped], (BATCH, 1))
    )
    logits = model(x)
    assert keras.backend.standardize_dtype(logits.dtype) == "float32"
    logits = to_numpy(logits)
    assert np.all(np.isfinite(logits)) and np.abs(logits).max() > 0


# --------------------------------------------------------------------------
# bad input: clear errors naming the argument
# --------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0.0, -0.2, 1.2, float("nan"), 0.1])
def test_bad_capacity(bad):
    with pytest.raises(ValueError, match="`capacity`"):
        MoNEViTBackbone(**TINY, capacity=bad)
    backbone = MoNEViTBackbone(**TINY, capacity=0.5)
    with pytest.raises(ValueError, match="`capacity`"):
        backbone.set_capacity(bad)
    assert backbone.capacity == 0.5 and backbone.expert_token_counts() == MoNEViTBackbone(**TINY).expert_token_counts()
    model = ImageClassifier(backbone, num_classes=2)
    with pytest.raises(ValueError, match="`capacity`"):
        model.set_capacity(bad)
    assert model.capacity == 0.5


def test_mod_greedy_accepts_small_capacity():
    assert MoNEViTBackbone(**TINY, capacity=0.05, capacity_method="mod_greedy").capacity == 0.05


def test_image_size_not_divisible_by_patch_size():
    for cls in (ViTBackbone, MoNEViTBackbone):
        with pytest.raises(ValueError, match="`image_size`.*divisible by `patch_size`"):
            cls(**dict(TINY, image_size=36))


@pytest.mark.parametrize("cls", [ViTBackbone, MoNEViTBackbone])
def test_wrong_images_at_call_time(cls):
    backbone = cls(**TINY)
    backbone.build()
    with pytest.raises(ValueError, match="num_channels"):
        backbone(np.zeros((1, 32, 32, 1), "float32"))
    with pytest.raises(ValueError, match="image_size"):
        backbone(np.zeros((1, 24, 24, 3), "float32"))
    model = ImageClassifier(backbone, num_classes=2)
    with pytest.raises(ValueError, match="image_size"):
        model(np.zeros((1, 40, 40, 3), "float32"))


def test_other_constructor_errors():
    with pytest.raises(ValueError, match="router_positions"):
        MoNEViTBackbone(**TINY, router_positions=(2,))
    with pytest.raises(ValueError, match="router_type"):
        MoNEViTBackbone(**TINY, router_type="argmax")
    with pytest.raises(ValueError, match="num_experts"):
        MoNEViTBackbone(**TINY, num_experts=7)  # 32 is not divisible by 2**6
    with pytest.raises(ValueError, match="capacity_method"):
        MoNEViTBackbone(**TINY, capacity_method="optimal")
    dense = ViTBackbone(**TINY)
    with pytest.raises(ValueError, match="use_class_token"):
        ImageClassifier(dense, pooling="token")
    with pytest.raises(ValueError, match="pooling"):
        ImageClassifier(dense, pooling="max")
    with pytest.raises(ValueError, match="num_classes"):
        ImageClassifier(dense, num_classes=0)
    with pytest.raises(ValueError, match="capacity"):
        ImageClassifier(dense).set_capacity(0.5)
    with pytest.raises(ValueError, match="fixed at 1.0"):
        dense.set_capacity(0.5)  # issue 13: an AttributeError before
    with pytest.raises(ValueError, match="capacity"):
        dense.set_capacity("0.5")
    dense.set_capacity(1.0)
    assert ImageClassifier(dense).capacity == 1.0 and not dense.routed


@pytest.mark.parametrize(
    "recipe", ["cluttered_digits_mone_from_dense", "cluttered_digits_mone_adaptive_from_dense",
               "cluttered_digits_matvit_from_dense"],
)
def test_models_converted_from_the_dense_preset_are_that_model_at_full_capacity(tmp_path, recipe):
    """The ``*_from_dense`` recipes of MoNE (fixed, adaptive) and MatViT: the
    nested experts / widths are slices of ``vit_digits``' weights and MoNE's
    alpha starts at 0, so before any training the model at full capacity
    (MatViT: full width) gives the dense preset's logits."""
    from keras_mone import presets, recipes
    from keras_mone.models import MatViTClassifier
    from recipe_helpers import tiny_overrides

    overrides = tiny_overrides(tmp_path, image_size=32, model_args={}, test_samples_per_digit=1)
    model = recipes.load(recipe, **overrides).model
    if isinstance(model, MatViTClassifier):
        model.set_width(1.0)
    else:
        assert isinstance(model.backbone, MoNEViTBackbone)
        model.set_capacity(1.0)
    dense = presets.from_preset("vit_digits")
    images = presets.evaluation_data("vit_digits")[0][:16]
    expected = to_numpy(dense.predict(images, verbose=0))
    assert_f32_close(to_numpy(model.predict(images, verbose=0)), expected, ulps=64)
