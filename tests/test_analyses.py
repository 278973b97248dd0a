"""Issue 28's analyses (routing maps, argmax routing, leave-one-out importance, budget) on tiny models,
each against a numpy reference, and their ``keras-mone analyze`` commands (PNG + JSON)."""

import json

import keras
import numpy as np
import pytest
from conftest import images, to_numpy, videos
from harness import build_classifier, check_compiled_record

from keras_mone.analysis import budget, token_maps as tr
from keras_mone.analysis.argmax_routing import argmax_difficulty
from keras_mone.analysis.routing_maps import routing_maps, threshold_sweep
from keras_mone.analysis.token_importance import importance_vs_score, leave_one_out
from keras_mone.models import forward_with_record
from keras_mone.routing.capacity import expert_width_fractions

GRID = (4, 4)  # tiny images: 32x32, 8x8 patches


def test_rank_and_spearman_against_definitions():
    np.testing.assert_allclose(tr.rank([10, 20, 20, 30, 5]), [2, 3.5, 3.5, 5, 1])
    assert tr.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert tr.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(50), rng.standard_normal(50)
    ra, rb = np.argsort(np.argsort(a)) + 1, np.argsort(np.argsort(b)) + 1  # no ties: plain ranks
    expected = 1 - 6 * np.sum((ra - rb) ** 2) / (50 * (50 ** 2 - 1))
    assert tr.spearman(a, b) == pytest.approx(expected)
    assert np.isnan(tr.spearman([1, 1, 1], [1, 2, 3]))


def test_mone_record_matches_the_forward_record_and_argmax_reference():
    model = build_classifier("mone_vit")  # class token in front, 16 patch tokens
    model.set_capacity(0.4)
    x = images(batch=3, seed=1)
    record = tr.token_record(model, x, batch_size=2)  # the padded last batch is dropped
    _, raw = model.backbone(x, return_intermediates=True)
    probs = to_numpy(raw["router_probs"][0])[:, 1:]
    assert record["kind"] == "expert" and record["assignment"].shape == (3, *GRID)
    np.testing.assert_array_equal(record["assignment"].reshape(3, -1), to_numpy(raw["expert_index"][0])[:, 1:])
    np.testing.assert_allclose(record["score"].reshape(3, -1), probs[..., -1], atol=1e-5)
    widths = expert_width_fractions(probs.shape[-1])
    np.testing.assert_allclose(record["argmax_share"].reshape(3, -1), widths[probs.argmax(-1)], atol=1e-6)
    assert 0 < record["compute"].min() and record["compute"].max() <= 1


def test_compiled_record_follows_the_capacity_and_the_weights():
    """One compiled function per routing key, reading the weights at every call."""
    model = build_classifier("mone_vit")
    backbone, x = model.backbone, images(batch=3, seed=2)
    model.set_capacity(0.5)
    at_half = forward_with_record(backbone, x)[1]["expert_index"][0]
    model.set_capacity(0.2)
    check_compiled_record(backbone, x)
    at_fifth = forward_with_record(backbone, x)[1]["expert_index"][0]
    assert np.sum(at_fifth == 3) < np.sum(at_half == 3)  # fewer tokens reach the full expert
    model.set_capacity(0.5)  # back to a compiled key
    np.testing.assert_array_equal(forward_with_record(backbone, x)[1]["expert_index"][0], at_half)
    for variable in backbone.trainable_variables:
        variable.assign(variable * 0.5)
    check_compiled_record(backbone, x)  # new weights, same compiled function


def test_argmax_difficulty_against_numpy():
    model = build_classifier("mone_vit")
    x, y = images(batch=6, seed=2), np.array([0, 1, 2, 0, 1, 2])
    summary = argmax_difficulty(model, x, y, top=2)
    record = tr.token_record(model, x)
    widths = expert_width_fractions(record["probs"].shape[-1])
    compute = widths[record["probs"].argmax(-1)].reshape(6, -1).mean(axis=1)
    logits = to_numpy(model(x)).astype("float64")
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    loss = -log_probs[np.arange(6), y]
    np.testing.assert_allclose(summary["compute"], compute, atol=1e-6)
    np.testing.assert_allclose(summary["loss"], loss, rtol=1e-4, atol=1e-5)
    assert summary["spearman_compute_loss"] == pytest.approx(tr.spearman(compute, loss))
    assert summary["lowest"][0] == int(np.argmin(compute)) or compute[summary["lowest"][0]] == compute.min()
    with pytest.raises(ValueError, match="top-k token skipping"):
        argmax_difficulty(build_classifier("mod_vit"), x, y)


@pytest.mark.parametrize("name, kind", [("mod_vit", "kept"), ("amod_vit", "kept"), ("acm_vit", "learners")])
def test_skipping_and_acm_records(name, kind):
    model = build_classifier(name)
    if kind == "kept":
        model.set_capacity(0.5)
    record, sweep, summary = routing_maps(model, images(batch=2), fractions=(1.0, 0.5))
    assert record["kind"] == kind and record["score"].shape == (2, *GRID)
    if kind == "kept":  # every image keeps exactly k = 8 of its 16 tokens in the routed block
        np.testing.assert_array_equal(record["assignment"].reshape(2, -1).sum(axis=1), [8, 8])
        assert record["argmax_share"] is None
    else:
        learners = model.backbone.num_learners
        assert 0 <= record["assignment"].min() and record["assignment"].max() <= learners
        assert 0 <= record["argmax_share"].min() and record["argmax_share"].max() <= 1
    assert summary["sweep"][0]["mean_share"] == 1.0 and sweep["masks"].shape == (2, 2, *GRID)


def test_video_maps_are_per_frame_index_and_unrouted_models_refuse():
    model = build_classifier("mone_vivit")
    record, _, summary = routing_maps(model, videos(batch=2), fractions=(0.5,))
    backbone = model.backbone
    grid = tuple(backbone.patch_embedding.grid_size)
    assert record["assignment"].shape == (2, backbone.num_frame_indices, *grid)
    assert summary["map_shape"] == [backbone.num_frame_indices, *grid]
    for name in ("vit", "matvit"):
        with pytest.raises(ValueError, match="routes no tokens"):
            tr.token_record(build_classifier(name), images(batch=1))


def test_threshold_sweep_keeps_the_requested_shares():
    scores = np.random.default_rng(0).permutation(64).reshape(4, 4, 4).astype(float)
    sweep = threshold_sweep(scores, (1.0, 0.5, 0.25))
    np.testing.assert_allclose(sweep["masks"].reshape(3, -1).mean(axis=1), [1.0, 0.5, 0.25])
    np.testing.assert_allclose(sweep["per_example"].mean(axis=1), [1.0, 0.5, 0.25])
    with pytest.raises(ValueError, match="fractions"):
        threshold_sweep(scores, (0.0,))


def _one_token_model(num_classes=3):
    """A dense ViT whose blocks are identities (all block weights zero) and whose positions are
    zero: a token is its patch's embedding, so on an image blank but for one patch only that
    token is non-zero, and the logits are ``W LN(t) / (tokens left) + b`` while it is present."""
    from keras_mone.models import ImageClassifier, ViTBackbone

    backbone = ViTBackbone(image_size=32, patch_size=8, hidden_dim=32, depth=1, num_heads=4, mlp_dim=64)
    model = ImageClassifier(backbone, num_classes=num_classes)
    model.build()
    rng = np.random.default_rng(0)
    for v in model.weights:
        zero = v.path.startswith(model.name + "/vit_backbone/block") or "position" in v.path or v.path.endswith(("bias", "beta"))
        keep_gamma = v.path.endswith("gamma") and not zero
        value = np.ones(v.shape) if keep_gamma else (np.zeros(v.shape) if zero else 0.3 * rng.standard_normal(v.shape))
        v.assign(value.astype("float32"))
    return model


def test_leave_one_out_on_a_model_that_depends_on_one_token():
    model = _one_token_model()
    backbone = model.backbone
    x = np.zeros((2, 32, 32, 3), "float32")
    x[0, 8:16, 16:24] = np.random.default_rng(1).standard_normal((8, 8, 3))  # token 6 of image 0
    x[1, 24:32, 0:8] = np.random.default_rng(2).standard_normal((8, 8, 3))  # token 12 of image 1
    y = np.array([1, 2])
    importance, full_loss = leave_one_out(model, x, y, images_per_pass=1)
    tokens = to_numpy(backbone.patch_embedding(x)).astype("float64")
    eps = backbone.norm.epsilon
    w, b = (to_numpy(v).astype("float64") for v in (model.head.kernel, model.head.bias))

    def loss(features, label):
        logits = features @ w + b
        return np.log(np.exp(logits).sum()) - logits[label]

    for i, token in ((0, 6), (1, 12)):
        t = tokens[i, token]
        normed = (t - t.mean()) / np.sqrt(t.var() + eps)
        base = loss(normed / 16, y[i])
        expected = np.full(16, loss(normed / 15, y[i]) - base)
        expected[token] = loss(np.zeros(32), y[i]) - base
        assert full_loss[i] == pytest.approx(base, rel=1e-4, abs=1e-5)
        np.testing.assert_allclose(importance[i].ravel(), expected, rtol=1e-3, atol=1e-5)
        assert np.argmax(np.abs(importance[i].ravel())) == token


@pytest.mark.parametrize("name", ["mone_vit", "mod_vit", "acm_vit"])
def test_importance_vs_score_runs_on_routed_methods(name):
    model = build_classifier(name)
    x, y = images(batch=3, seed=3), np.array([0, 1, 2])
    importance, score, summary = importance_vs_score(model, x, y, images_per_pass=2)
    assert importance.shape == score.shape == (3, *GRID) and np.isfinite(importance).all()
    assert -1 <= summary["spearman_pooled"] <= 1 and len(summary["per_image_spearman"]) == 3
    assert 0 <= summary["top_quarter_overlap"] <= 1 and summary["top_quarter_overlap_by_chance"] == 0.25


class StubClock:
    """A clock that advances ``seconds_per_capacity * capacity`` on every reading: each timed
    call of the model then lasts exactly that long."""

    def __init__(self, model, seconds_per_capacity=0.01):
        self.model, self.rate, self.now = model, seconds_per_capacity, 0.0

    def __call__(self):
        self.now += self.rate * self.model.capacity
        return self.now


def test_latency_budget_picks_the_largest_capacity_that_fits_a_stubbed_timer():
    model = build_classifier("mone_vit")
    choice = budget.capacity_for_budget(
        model, latency=0.0055, inputs=images(batch=2), capacities=[1.0, 0.8, 0.6, 0.5, 0.4, 0.3],
        repeats=2, warmup=0, timer=StubClock(model),
    )
    assert choice["capacity"] == 0.5 and model.capacity == 0.5
    assert choice["cost"] == pytest.approx(0.005) and choice["cost"] <= choice["target"]
    assert [c for c, _ in choice["tried"]] == [1.0, 0.8, 0.6, 0.5]
    with pytest.raises(ValueError, match="No capacity fits"):
        budget.capacity_for_budget(model, latency=0.001, inputs=images(batch=2), capacities=[1.0, 0.5],
                                   repeats=1, warmup=0, timer=StubClock(model))
    assert model.capacity == 0.5  # restored after a failed search


def test_gmacs_budget_against_the_flop_counter():
    from keras_mone import flops

    model = build_classifier("mod_vit")
    capacities = budget.default_capacities(model, step=0.25)
    curve = dict(budget.cost_curve(model, budget.gmacs_cost, capacities))
    target = (curve[0.75] + curve[0.5]) / 2
    choice = budget.capacity_for_budget(model, gmacs=target, capacities=capacities)
    assert choice["capacity"] == 0.5 and choice["cost"] <= target
    assert flops(model).gmacs == pytest.approx(choice["cost"])
    with pytest.raises(ValueError, match="no capacity to set"):
        budget.default_capacities(build_classifier("vit"))


@pytest.mark.parametrize("analysis, extra", [
    ("routing-maps", ["--shown", "2", "--fractions", "1,0.5"]),
    ("argmax-routing", ["--top", "2"]),
    ("token-importance", ["--shown", "2", "--images-per-pass", "4"]),
    ("budget", ["--gmacs", "1e-3", "--step", "0.25"]),
])
def test_cli_writes_png_and_json(tmp_path, analysis, extra):
    from keras_mone.cli.main import main
    from keras_mone.methods.registry import architectures

    architecture = architectures()["mone_vit"]
    model = architecture.task(architecture.build_backbone(**architecture.tiny_config), num_classes=10)
    model.build()
    path = str(tmp_path / "tiny.keras")
    model.save(path)
    output = tmp_path / "out"
    status = main(["analyze", analysis, path, "--data", "mone_vit_digits", "--num-images", "4",
                   "--output", str(output), *extra])
    assert status == 0
    name = analysis.replace("-", "_")
    assert (output / f"{name}.png").stat().st_size > 1000
    summary = json.loads((output / f"{name}.json").read_text())
    assert summary["model"] == path
    assert keras.backend.backend()  # the command ran on the current backend
