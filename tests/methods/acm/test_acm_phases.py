"""ACM's conversion in phases (issue 25 items 2 and 4): learner distillation, both
initialisations, the three phases in one run directory, resume between phases."""

import csv
import os

import keras
import numpy as np
import pytest
from conftest import TINY, images, randomize_weights, to_numpy
from recipe_helpers import tiny_overrides

from keras_mone import models, recipes
from keras_mone.methods.acm import losses as acm_losses

RECIPE = "cluttered_digits_acm_convert"


def _dense_file(tmp_path):
    """A tiny dense ViT classifier with random (non-trivial) weights, saved as the teacher."""
    model = models.ImageClassifier(models.ViTBackbone(**TINY), num_classes=10)
    model.build()
    randomize_weights(model, seed=3)
    path = str(tmp_path / "dense.keras")
    model.save(path)
    return model, path


def _distill_error(model, x):
    """Phase 1's loss on ``x`` in the teacher stream, per module stack, and ||h(z, N) - o|| per module."""
    _, record = model.backbone(x, training=True, return_intermediates=True)
    loss = float(to_numpy(acm_losses.distillation_loss(record["acm_outputs"], record["acm_targets"])))
    top = [float(np.abs(to_numpy(o[..., -1, :] - t)).max()) for o, t in zip(record["acm_outputs"], record["acm_targets"])]
    return loss, top


def _weights(model):
    return {v.path.split("/", 1)[1]: to_numpy(v) for v in model.weights if "seed_generator" not in v.path}


@pytest.mark.parametrize("acm_init", ["slices", "random"])
def test_distillation_trains_only_learners_and_lowers_the_error(tmp_path, acm_init):
    # Rules out: a teacher that is the ACM itself (slices would then be exact
    # whatever the learners do, and the loss a moving target), targets that are
    # not the dense MLP's outputs, random init leaving the dense slices in
    # place, and a phase that moves attention, gates or head.
    dense, path = _dense_file(tmp_path)
    setup = recipes.load(
        RECIPE,
        **tiny_overrides(tmp_path / "run", init_from=path, phases=[], phase_epochs=[], phase_learning_rates=[],
                         mode="distill", acm_init=acm_init, learning_rate=0.01, steps_per_epoch=8, epochs=1),
    )
    model = setup.model
    trainable = {v.path.split("/", 2)[2] for v in model.trainable_variables}
    assert trainable == {f"block_{i}/mlp/{p}/{w}" for i in range(2) for p in ("fc1", "fc2") for w in ("kernel", "bias")}
    x = images(batch=8, size=TINY["image_size"])
    # the targets are the dense model's MLP outputs on the dense model's stream
    tokens = dense.backbone.patch_embedding(x)
    block = dense.backbone.blocks[0]
    tokens = tokens + block.attention([block.norm1(tokens)])[0]
    _, record = model.backbone(x, training=True, return_intermediates=True)
    np.testing.assert_allclose(to_numpy(record["acm_targets"][0]), to_numpy(block.mlp(block.norm2(tokens))), atol=1e-5)
    before, top = _distill_error(model, x)
    if acm_init == "slices":
        assert max(top) < 1e-4  # exact at k = N from the first step
    else:
        assert min(top) > 1e-2
    frozen = {k: v for k, v in _weights(model).items() if "/mlp/" not in k}
    setup.fit(verbose=0, save=False)
    after, _ = _distill_error(model, x)
    assert after < 0.95 * before
    for key, value in _weights(model).items():
        if key in frozen:
            np.testing.assert_array_equal(value, frozen[key], err_msg=key)


def _phased(tmp_path, out, path, **extra):
    return recipes.load(
        RECIPE,
        **tiny_overrides(tmp_path / out, init_from=path, phases=["distill", "gates"], phase_epochs=[1, 1],
                         phase_learning_rates=[0.01, 0.05], acm_init="random", steps_per_epoch=3, **extra),
    )


def test_phases_resume_between_phases_equal_an_uninterrupted_run(tmp_path):
    # Rules out: a rerun repeating a finished phase (phase 1's files are not
    # touched), phase 2 not starting from phase 1's weights, the teacher lost
    # after phase 1, and a history without the phase of each row.
    _, path = _dense_file(tmp_path)
    whole = _phased(tmp_path, "whole", path)
    whole.fit(verbose=0)
    keras.backend.clear_session()
    first = _phased(tmp_path, "split", path)
    assert first.current == 0
    first.fit(verbose=0, until=1)
    phase1 = tmp_path / "split" / "phases" / "1_distill" / "model.keras"
    stamp = os.stat(phase1).st_mtime_ns
    assert not (tmp_path / "split" / "model.keras").exists()
    keras.backend.clear_session()
    second = _phased(tmp_path, "split", path)  # the same command again
    assert second.current == 1 and second.initial_step == 3 and second.total_steps == 6
    second.fit(verbose=0)
    assert os.stat(phase1).st_mtime_ns == stamp
    final = {k: v for k, v in _weights(keras.saving.load_model(tmp_path / "split" / "model.keras")).items()}
    reference = _weights(keras.saving.load_model(tmp_path / "whole" / "model.keras"))
    assert final.keys() == reference.keys()
    for key, value in reference.items():
        np.testing.assert_array_equal(final[key], value, err_msg=key)
    with open(tmp_path / "split" / "history.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["phase"] for r in rows] == ["distill", "gates"]
    assert rows[0]["acm_distill"] and rows[1]["acm_gate_ce"] and not rows[1]["acm_distill"]


@pytest.mark.parametrize("change, message", [
    (dict(phases=["distill", "gate", "end_to_end"]), "'gate' is no training mode"),
    (dict(phase_epochs=[1, 1]), "one entry per phase"),
    (dict(mode="end_to_end"), "either key 'phases'"),
    (dict(beta_target=1.5), "beta_target"),
    (dict(model_args=dict(num_learners=3)), "num_learners"),
    (dict(phases=["gates", "end_to_end"], phase_epochs=[], phase_learning_rates=[], acm_init="random"), "acm_init"),
    (dict(teacher_from="preset:no_such_preset"), "teacher_from"),
    (dict(acm_loss_weights=[0.1, 0.05]), "acm_loss_weights"),
    (dict(acm_loss_weights=[0.1, "0", 0.0]), "acm_loss_weights"),
])
def test_bad_phase_recipes_fail_before_any_run_directory(tmp_path, change, message):
    overrides = tiny_overrides(tmp_path / "run", init_from="preset:vit_digits")
    overrides["model_args"] = {**overrides["model_args"], **change.pop("model_args", {})}
    with pytest.raises(recipes.RecipeError, match=message):
        recipes.load(RECIPE, **{**overrides, **change})
    assert not (tmp_path / "run").exists()


def test_projection_learners_are_distilled_from_the_dense_attention(tmp_path):
    # Rules out: distillation reading only the MLPs (the record's projection
    # entries ignored), a projection teacher taken from the wrong third of the
    # fused qkv kernel, and random init skipping the projection learners.
    dense, path = _dense_file(tmp_path)
    model_args = dict(tiny_overrides(tmp_path)["model_args"], acm_projections=True)
    setup = recipes.load(
        RECIPE,
        **tiny_overrides(tmp_path / "run", init_from=path, phases=[], phase_epochs=[], phase_learning_rates=[],
                         mode="distill", acm_init="random", learning_rate=0.01, steps_per_epoch=8, model_args=model_args),
    )
    model = setup.model
    trainable = {v.path.split("/", 2)[2] for v in model.trainable_variables}
    parts = ["mlp/fc1", "mlp/fc2"] + [f"attention/{p}/{w}" for p in ("query", "key", "value", "out") for w in ("down", "up")]
    assert trainable == {f"block_{i}/{p}/{w}" for i in range(2) for p in parts for w in ("kernel", "bias")}
    x = images(batch=8, size=TINY["image_size"])
    _, record = model.backbone(x, training=True, return_intermediates=True)
    assert len(record["acm_outputs"]) == len(record["acm_targets"]) == 5 * 2
    block = dense.backbone.blocks[0]
    z = block.norm1(dense.backbone.patch_embedding(x))
    d = TINY["hidden_dim"]
    key = to_numpy(z) @ to_numpy(block.attention.qkv.kernel)[:, d:2 * d] + to_numpy(block.attention.qkv.bias)[d:2 * d]
    np.testing.assert_allclose(to_numpy(record["acm_targets"][2 + 1]), key, atol=1e-4)  # block 0's key projection
    projections = slice(2, None)
    before = float(to_numpy(acm_losses.distillation_loss(record["acm_outputs"][projections], record["acm_targets"][projections])))
    setup.fit(verbose=0, save=False)
    _, record = model.backbone(x, training=True, return_intermediates=True)
    after = float(to_numpy(acm_losses.distillation_loss(record["acm_outputs"][projections], record["acm_targets"][projections])))
    assert after < 0.95 * before


def test_acm_loss_weights_reach_the_end_to_end_terms(tmp_path):
    """Fig. 8's ablation (budget loss alone) is a recipe key: the phase-3 terms carry its weights."""
    _, dense = _dense_file(tmp_path)
    setup = recipes.load(
        "cluttered_digits_acm_from_dense", **tiny_overrides(tmp_path / "run", init_from=dense),
        mode="end_to_end", acm_loss_weights=[0.1, 0, 0],
    )
    terms = {term.name: term.weight for term in setup.model.loss_terms}
    assert terms == {"acm_budget": 0.1, "acm_entropy": 0.0, "acm_diversity": 0.0}
    default = recipes.load(
        "cluttered_digits_acm_from_dense", **tiny_overrides(tmp_path / "default", init_from=dense),
        mode="end_to_end",
    )
    assert {t.name: t.weight for t in default.model.loss_terms} == {
        "acm_budget": 0.1, "acm_entropy": 0.05, "acm_diversity": -0.05
    }
