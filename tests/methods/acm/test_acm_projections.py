"""ACM on the attention projections (issue 25 items 2, 3, 5): ACMAttention in ACMViTBackbone.

References: float64 numpy (per-token low-rank learners, multi-head attention),
the dense ViT (truncated SVD exact when N r = D), hand MAC counts from the
configuration. Each test names the wrong variant it rules out.
"""

import keras
import numpy as np
import pytest
from conftest import BATCH, TINY, assert_f32_close, images, randomize_weights, run_serialization_roundtrip, to_numpy

from keras_mone import flops, models
from keras_mone.methods.acm.attention import PROJECTIONS, ACMAttention
from keras_mone.methods.acm import method as acm_method
from keras_mone.methods.acm.transfer import acm_from_dense
from keras_mone.methods.acm.backbone import ACMViTBackbone
from keras_mone.methods.acm import quotas as acm_quotas

D, H, N, T, R = TINY["hidden_dim"], TINY["num_heads"], 4, 6, 3


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


def ref_projection(z, counts, layer):
    w = {v.path.rsplit("/", 2)[-2] + "/" + v.path.rsplit("/", 1)[-1]: to_numpy(v).astype(np.float64) for v in layer.weights}
    out = np.zeros(z.shape[:-1] + (layer.units,))
    for b, t in np.ndindex(*counts.shape):
        width = int(counts[b, t]) * layer.rank
        hidden = z[b, t].astype(np.float64) @ w["down/kernel"][:, :width] + w["down/bias"][:width]
        out[b, t] = hidden @ w["up/kernel"][:width] + w["up/bias"]
    return out


def ref_attention(q, k, v, heads):
    b, t, d = q.shape
    split = lambda x: x.reshape(b, t, heads, d // heads).transpose(0, 2, 1, 3)  # noqa: E731
    scores = split(q) @ split(k).transpose(0, 1, 3, 2) / np.sqrt(d // heads)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return (weights @ split(v)).transpose(0, 2, 1, 3).reshape(b, t, d)


def test_attention_matches_the_numpy_reference_per_token_counts():
    # rules out: a projection reading another projection's counts, the rank slice
    # of the wrong width, the out projection applied before the attention.
    layer = ACMAttention(D, H, num_learners=N, rank=R)
    layer.build((None, T, D))
    randomize_weights(layer, seed=1, scale=0.4)
    z = rand(BATCH, T, D)
    counts = [np.random.default_rng(i).integers(1, N + 1, (BATCH, T)) for i in range(4)]
    q, k, v = (ref_projection(z, c, layer.projections[p]) for c, p in zip(counts[:3], PROJECTIONS))
    expected = ref_projection(ref_attention(q, k, v, H), counts[3], layer.out)
    assert_f32_close(to_numpy(layer(z, counts)), expected, ulps=4096)
    one_hot = [np.eye(N, dtype="float32")[c - 1] for c in counts]
    assert_f32_close(to_numpy(layer(z, one_hot)), expected, ulps=4096)
    with pytest.raises(ValueError, match="choices"):
        layer(z, counts[:3])


def _pair(beta=0.5, seed=0, rank=None):
    dense = models.ViTBackbone(**TINY)
    dense.build()
    randomize_weights(dense, seed=seed)
    acm = ACMViTBackbone(**TINY, gate_seed=0, beta=beta, acm_projections=True, projection_rank=rank)
    acm.build()
    randomize_weights(acm, seed=seed + 1)
    return dense, acm, acm_from_dense(dense, acm)


def _force(backbone, mlp_count, projection_count):
    for gates, k in ((backbone.acm_gates, mlp_count), (backbone.acm_projection_gates, projection_count - 1)):
        for gate in gates:
            gate.fc3.kernel.assign(np.zeros(gate.fc3.kernel.shape, "float32"))
            bias = np.zeros(gate.fc3.bias.shape, "float32")
            bias[k] = 100.0
            gate.fc3.bias.assign(bias)


def test_svd_transfer_with_full_rank_learners_equals_the_dense_vit():
    # rules out: Q/K/V cut from the wrong columns of the fused kernel, the dense biases
    # lost, projection gates wired to the wrong modules, a non-dense path at k = N.
    dense, acm, left = _pair(rank=D // N)  # N r = D: the SVD is exact
    assert left and all("acm_gate_" in path for path in left)
    _force(acm, N, N)
    x = images()
    np.testing.assert_allclose(to_numpy(acm(x)), to_numpy(dense(x)), atol=5e-5)
    # the paper's rank (below D / N): k = N is the best rank-N r approximation, not exact
    dense, acm, _ = _pair()
    _force(acm, N, N)
    assert acm.blocks[0].attention.rank == round((D * D + D) / (N * (2 * D + 1)))
    assert np.max(np.abs(to_numpy(acm(x)) - to_numpy(dense(x)))) > 1e-3


def test_record_holds_every_module_in_the_documented_order():
    # rules out: projection entries with N columns (the losses need k = 0..N), counts
    # shifted by one, a record order differing from acm_module_names / learner costs.
    _, acm, _ = _pair()
    _, record = acm(images(), return_intermediates=True)
    names = acm.acm_module_names()
    assert len(record["acm_choices"]) == len(record["acm_probs"]) == len(names) == 5 * acm.depth
    assert names[acm.depth:acm.depth + 4] == [f"block_0/{p}" for p in PROJECTIONS]
    costs = acm.acm_learner_costs()
    assert costs[0] == 2 * D * TINY["mlp_dim"] // N and costs[-1] == 2 * D * acm.blocks[0].attention.rank
    for choice, prob, counts in zip(record["acm_choices"][acm.depth:], record["acm_probs"][acm.depth:],
                                    record["acm_counts"][acm.depth:]):
        choice, prob = to_numpy(choice), to_numpy(prob)
        assert choice.shape == prob.shape == (BATCH, acm.num_tokens, N + 1)
        np.testing.assert_array_equal(choice[..., 0], 0.0)
        np.testing.assert_array_equal(prob[..., 0], 0.0)
        np.testing.assert_allclose(prob.sum(-1), 1.0, rtol=1e-5)
        np.testing.assert_array_equal(to_numpy(counts), choice.argmax(-1))
    assert len(record["blocks"]) == acm.depth


def test_grouped_equals_exact_when_no_quota_binds_and_follows_quotas_otherwise():
    # rules out: the grouped projections computing something else than the exact path.
    _, acm, _ = _pair(beta=1.0)
    x = images()
    exact = to_numpy(acm(x))
    acm.set_execution("grouped")
    np.testing.assert_allclose(to_numpy(acm(x)), exact, atol=5e-5)
    _, acm, _ = _pair(beta=0.5)
    acm.set_execution("grouped")
    _, record = acm(x, return_intermediates=True)
    caps = acm.blocks[0].attention.query.caps(acm.num_tokens)
    for counts in record["acm_counts"][acm.depth:]:
        ran = np.stack([(to_numpy(counts) >= n).sum(1) for n in range(1, N + 1)], 1)
        assert (ran <= np.asarray(caps)).all() and (ran[:, 0] == acm.num_tokens).all()


def test_task_loss_reaches_the_projection_gates_and_the_phase_3_terms_run():
    # rules out: projection gates outside the straight-through path, or losses that
    # cannot read the projections' entries.
    _, acm, _ = _pair()
    model = models.ImageClassifier(acm, num_classes=3)
    model.build()
    model.set_loss_terms(acm_method.end_to_end_terms(0.5))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    gate = acm.acm_projection_gates[-1]
    before = to_numpy(gate.fc3.kernel).copy()
    y = keras.ops.one_hot(np.arange(BATCH) % 3, 3)
    history = model.fit(images(), y, batch_size=BATCH, epochs=1, verbose=0).history
    assert np.isfinite(history["acm_budget"][0]) and not np.array_equal(before, to_numpy(gate.fc3.kernel))


def test_teacher_stream_records_every_modules_outputs():
    # rules out: the gates phase missing the projections (their tau labels need h(z, 0..N)).
    _, acm, _ = _pair()
    acm.teacher_stream = True
    _, record = acm(images(), training=True, return_intermediates=True)
    assert len(record["acm_outputs"]) == 5 * acm.depth
    stack = to_numpy(record["acm_outputs"][-1])
    assert stack.shape == (BATCH, acm.num_tokens, N + 1, D)
    loss = acm_method.gate_terms(0.833)[0].fn(record, None, None)
    assert np.isfinite(float(to_numpy(loss)))


def test_keras_round_trip_with_acm_projections(tmp_path):
    # rules out: acm_projections / projection_rank missing from the config, projection
    # gates or learners not saved.
    _, acm, _ = _pair(rank=2)
    model = models.ImageClassifier(acm, num_classes=3)
    model.build()
    randomize_weights(model, seed=4)
    restored = run_serialization_roundtrip(model, images(), tmp_path, atol=1e-6)
    assert restored.backbone.acm_projections and restored.backbone.blocks[0].attention.rank == 2
    restored.backbone.set_execution("grouped")
    model.backbone.set_execution("grouped")
    np.testing.assert_allclose(to_numpy(restored(images())), to_numpy(model(images())), atol=1e-6)


def _hand_count(beta, execution, d, m, depth, tokens, patches, patch_macs, r):
    caps = lambda learners, share: acm_quotas.learner_caps(tokens, learners, share)  # noqa: E731
    if execution == "grouped":
        mlp_tokens = sum(caps(N, beta))
        projection_tokens = tokens + sum(caps(N - 1, (beta * N - 1) / (N - 1)))
    else:
        mlp_tokens, projection_tokens = N * tokens, N * tokens
    gates = tokens * ((d * 16 + 16 * 16) * 5 + 16 * (N + 1) + 4 * 16 * N)
    per_block = (
        mlp_tokens * 2 * d * m // N + 4 * projection_tokens * 2 * d * r + 2 * tokens * tokens * d + gates
    )
    return patches * patch_macs * d + depth * per_block


@pytest.mark.parametrize("execution", ["exact", "grouped"])
def test_flops_match_a_hand_count(execution):
    # rules out: projections counted as dense D x D layers, gates of projections left
    # out, quotas of learner 1 applied to projections.
    acm = ACMViTBackbone(**TINY, beta=0.6, acm_projections=True, execution=execution)
    tokens, r = acm.num_tokens, acm.blocks[0].attention.rank
    expected = _hand_count(0.6, execution, D, TINY["mlp_dim"], TINY["depth"], tokens, tokens, 8 * 8 * 3, r)
    assert flops(acm).total == expected


@pytest.mark.parametrize("beta", [0.4, 0.5, 0.75, 1.0])
def test_vit_b16_costs_about_098_plus_1673_beta_gmacs(beta):
    # The "about 0.84 + 16.7 beta" leaves out the 5 gates per block (0.149 GMACs).
    acm = ACMViTBackbone(use_class_token=True, acm_projections=True, execution="grouped", beta=beta)
    count = flops(acm)
    dense = flops(models.ViTBackbone(use_class_token=True)).breakdown
    fixed = dense["patch_embedding"] + dense["attention"] + count.breakdown["acm_gate"]
    adaptive = dense["mlp"] + dense["qkv"] + dense["attention_output"]
    assert count.breakdown["acm_gate"] == pytest.approx(0.149e9, rel=0.01)
    assert fixed == pytest.approx(0.98e9, rel=0.01) and adaptive == pytest.approx(16.73e9, rel=0.001)
    # quotas round up: at most one token per learner and module above beta * dense
    rounding = acm.depth * N * sum(acm.acm_learner_costs()[::acm.depth])  # MLP + 4 projection learners
    assert 0 <= count.total - (fixed + beta * adaptive) <= rounding
    assert count.total - count.breakdown["acm_gate"] == pytest.approx((0.84 + 16.7 * beta) * 1e9, abs=0.06e9)


def test_bad_projection_arguments_are_named():
    with pytest.raises(ValueError, match="beta"):
        ACMViTBackbone(**TINY, beta=0.25, acm_projections=True)  # 1 of 4 learners per projection already
    with pytest.raises(ValueError, match="acm_projections"):
        ACMViTBackbone(**TINY, acm_projections="yes")
    _, acm, _ = _pair()
    shallow = models.ViTBackbone(**{**TINY, "depth": 1})
    shallow.build()
    with pytest.raises(ValueError, match="qkv"):  # no dense attention for block 1
        acm_from_dense(shallow, acm)


def test_init_from_a_saved_dense_classifier_converts_the_projections(tmp_path):
    # rules out: recipes' init_from refusing an ACM model with projections (no qkv path
    # in the target) or copying the head but not the SVD projections.
    from keras_mone.recipes.model import init_from_saved_model

    dense = models.ImageClassifier(models.ViTBackbone(**TINY), num_classes=3)
    dense.build()
    randomize_weights(dense, seed=5)
    dense.save(tmp_path / "dense.keras")
    acm = models.ImageClassifier(
        ACMViTBackbone(**TINY, acm_projections=True, projection_rank=D // N, gate_seed=0), num_classes=3
    )
    acm.build()
    left = init_from_saved_model(acm, str(tmp_path / "dense.keras"))
    assert left and all("acm_gate_" in path for path in left)
    _force(acm.backbone, N, N)
    np.testing.assert_allclose(to_numpy(acm(images())), to_numpy(dense(images())), atol=5e-5)
