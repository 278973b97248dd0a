"""ACM-ViT on the method registry and the loss-term hook (issue 25 items 2-5)."""

import csv

import keras
import numpy as np
import pytest
from conftest import BATCH, TINY, images, randomize_weights, to_numpy

from keras_mone import flops, models
from keras_mone.methods.acm import method as acm_method
from keras_mone.methods.acm.backbone import ACMViTBackbone
from keras_mone.models.weight_transfer import transfer_weights


def _pair(seed=0, **acm):
    dense = models.ViTBackbone(**TINY)
    dense.build()
    randomize_weights(dense, seed=seed)
    model = ACMViTBackbone(**TINY, gate_seed=0, **acm)
    model.build()
    randomize_weights(model, seed=seed + 1)
    left = transfer_weights(dense, model)
    return dense, model, left


def _force_count(backbone, k):
    """Gates that pick ``k`` learners for every token (a huge bias on choice k)."""
    for gate in backbone.acm_gates:
        gate.fc3.kernel.assign(np.zeros(gate.fc3.kernel.shape, "float32"))
        bias = np.zeros(gate.fc3.bias.shape, "float32")
        bias[k] = 100.0
        gate.fc3.bias.assign(bias)


def test_dense_weights_load_and_all_learners_equal_the_dense_vit():
    # Rules out: ACM's MLP weight paths differing from the dense ViT's (the
    # conversion would leave learners random), fc2's bias missing at k = N, or
    # the attention half of the block not being the dense one.
    dense, acm, left = _pair()
    assert left and all(path.startswith("acm_gate_") for path in left)
    _force_count(acm, acm.num_learners)
    x = images()
    np.testing.assert_allclose(to_numpy(acm(x)), to_numpy(dense(x)), atol=2e-5)


def test_zero_learners_skip_every_mlp():
    # Rules out: k = 0 adding fc2's bias (the module must add exactly nothing).
    dense, acm, _ = _pair()
    _force_count(acm, 0)
    x = images()
    tokens = dense.patch_embedding(x)
    for block in dense.blocks:
        tokens = tokens + block.attention([block.norm1(tokens)])[0]
    np.testing.assert_allclose(to_numpy(acm(x)), to_numpy(dense.norm(tokens)), atol=2e-5)


def test_grouped_equals_exact_when_no_quota_binds():
    # beta = 1: every learner has a quota of all tokens.
    _, acm, _ = _pair(beta=1.0)
    x = images()
    exact = to_numpy(acm(x))
    acm.set_execution("grouped")
    np.testing.assert_allclose(to_numpy(acm(x)), exact, atol=2e-5)


def test_record_holds_choices_and_counts_per_block():
    _, acm, _ = _pair()
    _, record = acm(images(), return_intermediates=True)
    assert len(record["acm_choices"]) == acm.depth == len(record["blocks"])
    choices = to_numpy(record["acm_choices"][0])
    assert choices.shape == (BATCH, acm.num_tokens, acm.num_learners + 1)
    np.testing.assert_array_equal(choices.sum(-1), 1.0)
    np.testing.assert_array_equal(to_numpy(record["blocks"][0]["assignment"]), choices.argmax(-1))


def test_end_to_end_terms_are_logged_and_the_budget_is_the_learner_share():
    # Rules out: a term read from the wrong record entry, weights of the paper
    # applied with the wrong sign, or the logged budget differing from
    # |mean learner share - beta| computed in numpy on the same forward pass.
    _, acm, _ = _pair()
    model = models.ImageClassifier(acm, num_classes=3)
    model.build()
    model.set_loss_terms(acm_method.end_to_end_terms(0.3))
    assert [t.weight for t in model.loss_terms] == [0.1, 0.05, -0.05]
    x = images()
    y = keras.ops.one_hot(np.arange(BATCH) % 3, 3)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    history = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0).history
    assert {"acm_budget", "acm_entropy", "acm_diversity"} <= set(history)
    assert 0.0 <= history["acm_budget"][0] <= 0.7 and -1.0 <= history["acm_entropy"][0] <= 0.0


def test_numpy_budget_entropy_diversity_on_a_record():
    from keras_mone.methods.acm import losses as acm_losses

    rng = np.random.default_rng(0)
    counts = rng.integers(0, 5, size=(3, 6))
    choices = np.eye(5, dtype="float32")[counts]
    share = counts.sum(1) / (4 * 6)
    assert float(to_numpy(acm_losses.budget_loss([choices], 0.4))) == pytest.approx(abs(share.mean() - 0.4), rel=1e-5)
    pairs = np.abs(share[:, None] - share[None, :]).mean()
    assert float(to_numpy(acm_losses.diversity_loss([choices]))) == pytest.approx(pairs, rel=1e-5)


def test_grouped_flops_follow_the_budget():
    # MLP MACs of grouped execution at beta 0.5 are about half the dense MLP's;
    # exact execution computes every learner (masked), so it counts the dense MLP.
    _, acm, _ = _pair(beta=0.5)
    dense_mlp = flops(models.ViTBackbone(**TINY)).breakdown["mlp"]
    assert flops(acm).breakdown["mlp"] == dense_mlp
    acm.set_execution("grouped")
    assert 0.45 <= flops(acm).breakdown["mlp"] / dense_mlp <= 0.65
    assert flops(acm).breakdown["acm_gate"] > 0


def test_bad_acm_arguments_are_named():
    with pytest.raises(ValueError, match="execution"):
        ACMViTBackbone(**TINY, execution="fast")
    with pytest.raises(ValueError, match="beta"):
        ACMViTBackbone(**TINY, beta=1.5)
    with pytest.raises(ValueError, match="num_learners|mlp_dim"):
        ACMViTBackbone(**TINY, num_learners=3)  # 64 hidden units do not split into 3 learners


def test_gates_phase_trains_only_the_gates_on_tau_labels(tmp_path):
    # Phase 2 through the recipe: learners, attention and head frozen (rules out a
    # phase that moves the converted model), the stream runs every learner (the
    # logits equal the dense model's), the gate cross-entropy is logged and falls.
    from keras_mone import recipes
    from recipe_helpers import tiny_overrides

    setup = recipes.load(
        "cluttered_digits_acm_from_dense",
        **tiny_overrides(tmp_path, init_from="", mode="gates", learning_rate=0.05, steps_per_epoch=6, epochs=2),
    )
    model, backbone = setup.model, setup.model.backbone
    assert backbone.teacher_stream
    assert model.trainable_variables and all("acm_gate_" in v.path for v in model.trainable_variables)
    weights = [v for v in model.non_trainable_variables if "seed_generator" not in v.path]
    frozen = [to_numpy(v).copy() for v in weights]
    setup.fit(verbose=0, save=False)
    with open(tmp_path / "history.csv") as f:
        rows = list(csv.DictReader(f))
    assert float(rows[-1]["acm_gate_ce"]) < float(rows[0]["acm_gate_ce"])
    for before, variable in zip(frozen, weights):
        np.testing.assert_array_equal(before, to_numpy(variable))
    # evaluation runs the gated ACM, the computation its GMACs describe, not the teacher stream
    x = images(size=TINY["image_size"])
    gated = to_numpy(model(x))
    backbone.teacher_stream = False
    np.testing.assert_array_equal(to_numpy(model(x)), gated)
