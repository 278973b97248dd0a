"""Token merging with MoNE (issue 28 item 6; MoNE App. A.2): ToMe's bipartite merge against a
numpy re-implementation, the invariants it must keep, and the merging context on trained-shape models."""

import numpy as np
import pytest
from conftest import TINY, images, randomize_weights, to_numpy

from keras_mone import flops, models
from keras_mone.analysis import merged_gmacs, merging_tokens, token_merging_sweep
from keras_mone.routing.token_merging import bipartite_merge


def numpy_merge(tokens, sizes, r, protected=0):
    """ToMe's bipartite soft matching, written out per example (the reference)."""
    out_tokens, out_sizes, out_source = [], [], []
    n = tokens.shape[1]
    a_index, b_index = np.arange(protected, n)[0::2], np.arange(protected, n)[1::2]
    for x, s in zip(tokens.astype("float64"), sizes.astype("float64")):
        unit = x / np.linalg.norm(x, axis=-1, keepdims=True)
        similarity = unit[a_index] @ unit[b_index].T
        partner, score = similarity.argmax(-1), similarity.max(-1)
        merged = np.argsort(-score, kind="stable")[:r]
        kept = sorted(set(range(len(a_index))) - set(merged))
        b_sum = x[b_index] * s[b_index, None]
        b_size = s[b_index].copy()
        for a in merged:
            b_sum[partner[a]] += x[a_index[a]] * s[a_index[a]]
            b_size[partner[a]] += s[a_index[a]]
        new_x = np.concatenate([x[:protected], x[a_index[kept]], b_sum / b_size[:, None]])
        new_s = np.concatenate([s[:protected], s[a_index[kept]], b_size])
        position = np.zeros(n, int)
        position[:protected] = np.arange(protected)
        for slot, a in enumerate(kept):
            position[a_index[a]] = protected + slot
        for a in merged:
            position[a_index[a]] = protected + len(kept) + partner[a]
        position[b_index] = protected + len(kept) + np.arange(len(b_index))
        out_tokens.append(new_x), out_sizes.append(new_s), out_source.append(position)
    return np.stack(out_tokens), np.stack(out_sizes), np.stack(out_source)


def _tokens(batch=3, n=17, d=8, seed=0):
    return np.random.default_rng(seed).normal(size=(batch, n, d)).astype("float32")


@pytest.mark.parametrize("r, protected", [(1, 0), (4, 0), (8, 1), (5, 1)])
def test_merge_equals_the_numpy_reference_and_keeps_the_weighted_mean(r, protected):
    x = _tokens()
    sizes = np.random.default_rng(1).integers(1, 4, x.shape[:2]).astype("float32")
    source = np.broadcast_to(np.arange(x.shape[1]), x.shape[:2]).astype("int32")
    merged, new_sizes, new_source = (to_numpy(t) for t in bipartite_merge(x, sizes, source, r, protected))
    ref_x, ref_s, ref_source = numpy_merge(x, sizes, r, protected)
    assert merged.shape == (3, 17 - r, 8) and new_sizes.shape == (3, 17 - r)
    np.testing.assert_allclose(merged, ref_x, rtol=1e-5, atol=1e-6)  # float32 sums of a few terms
    np.testing.assert_array_equal(new_sizes, ref_s)
    np.testing.assert_array_equal(new_source, ref_source)
    weighted = lambda t, s: (t * s[..., None]).sum(1) / s.sum(1, keepdims=True)  # noqa: E731
    np.testing.assert_allclose(weighted(merged, new_sizes), weighted(x, sizes), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(new_sizes.sum(1), sizes.sum(1))
    if protected:
        np.testing.assert_array_equal(merged[:, 0], x[:, 0])  # the class token is never merged


def test_source_reads_every_original_token_from_what_it_became():
    x = _tokens(n=16)
    ones = np.ones(x.shape[:2], "float32")
    source = np.broadcast_to(np.arange(16), x.shape[:2]).astype("int32")
    merged, sizes, source = bipartite_merge(x, ones, source, 4)
    merged, sizes, source = bipartite_merge(merged, sizes, source, 3)
    merged, sizes, source = (to_numpy(t) for t in (merged, sizes, source))
    unmerged = np.take_along_axis(merged, source[..., None], axis=1)
    np.testing.assert_allclose(unmerged.mean(1), x.mean(1), rtol=1e-5, atol=1e-6)  # GAP is unchanged
    np.testing.assert_array_equal(np.stack([np.bincount(s, minlength=9) for s in source]), sizes.astype(int))


def test_merge_counts_are_checked():
    x = _tokens(n=8)
    with pytest.raises(ValueError, match="`r`=5 must be in \\[0, 4\\]"):
        bipartite_merge(x, np.ones((3, 8), "float32"), np.zeros((3, 8), "int32"), 5)


def _classifier(cls, **kwargs):
    model = models.ImageClassifier(cls(**TINY, **kwargs), num_classes=5)
    model.build()
    randomize_weights(model, seed=2)
    return model


def test_dense_vit_merging_runs_fewer_tokens_and_is_undone_on_exit():
    model = _classifier(models.ViTBackbone)
    x = images(batch=4)
    before, dense_gmacs = to_numpy(model.predict(x, verbose=0)), flops(model).gmacs
    with merging_tokens(model, {0: 4, 1: 2}):
        merged = to_numpy(model.predict(x, verbose=0))
        plan = model.backbone.token_routing().block_plan(model.backbone.num_tokens)
        assert [groups[0][0] for groups in plan] == [12, 10]
    assert merged.shape == before.shape and not np.allclose(merged, before)
    np.testing.assert_allclose(to_numpy(model.predict(x, verbose=0)), before, rtol=1e-6, atol=1e-6)
    assert merged_gmacs(model, {0: 4, 1: 2}) < dense_gmacs == flops(model).gmacs


def test_merging_nothing_changes_nothing():
    model = _classifier(models.MoNEViTBackbone, capacity=0.5)
    x = images(batch=4)
    before = to_numpy(model.predict(x, verbose=0))
    with merging_tokens(model, {0: 0}):
        np.testing.assert_allclose(to_numpy(model.predict(x, verbose=0)), before, rtol=1e-6, atol=1e-6)


def test_mone_routes_the_merged_tokens_and_late_merges_are_refused():
    model = _classifier(models.MoNEViTBackbone, capacity=0.5, router_positions=(1,))
    x, y = images(batch=4), np.arange(4) % 5
    rows = token_merging_sweep(model, x, y, [{}, {0: 4}, {0: 2, 1: 2}], capacities=(0.5, 0.3))
    assert [r["tokens_after"] for r in rows] == [16, 12, 12] * 2
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in rows)
    assert rows[1]["gmacs"] < rows[0]["gmacs"] and rows[4]["gmacs"] < rows[3]["gmacs"] < rows[0]["gmacs"]
    assert model.capacity == 0.5  # restored
    router_first = _classifier(models.MoNEViTBackbone, capacity=0.5)
    with pytest.raises(ValueError, match="`merges`: blocks \\[1\\] come after the model's first router \\(block 0\\)"):
        merged_gmacs(router_first, {1: 2})


def test_methods_without_a_merge_point_are_refused():
    model = _classifier(models.MoDViTBackbone, capacity=0.5)
    with pytest.raises(ValueError, match="token merging: needs a dense ViT or MoNE-ViT"):
        merged_gmacs(model, {0: 2})


def test_cli_writes_png_and_json_and_names_bad_schedules(tmp_path, capsys):
    import json

    from keras_mone.cli.analyze_merging import parse_schedules
    from keras_mone.cli.main import main

    model = _classifier(models.MoNEViTBackbone, capacity=0.5, use_class_token=True)
    path = str(tmp_path / "tiny.keras")
    model.save(path)
    status = main(["analyze", "token-merging", path, "--data", "mone_vit_digits", "--num-images", "4",
                   "--schedules", "0:4,0:2+0:2", "--capacities", "0.5,1", "--output", str(tmp_path / "out")])
    assert status == 0
    assert (tmp_path / "out" / "token_merging.png").stat().st_size > 1000
    rows = json.loads((tmp_path / "out" / "token_merging.json").read_text())["rows"]
    assert [(r["capacity"], r["tokens_after"]) for r in rows] == [(0.5, 17), (0.5, 13), (0.5, 15), (1.0, 17), (1.0, 13), (1.0, 15)]
    assert parse_schedules("0:8+1:4") == [{}, {0: 8, 1: 4}]
    with pytest.raises(ValueError, match="--schedules: '0-8'"):
        parse_schedules("0-8")
    assert main(["analyze", "token-merging", path, "--data", "mone_vit_digits", "--num-images", "4",
                 "--schedules", "0:9", "--output", str(tmp_path / "bad")]) == 2
    assert "`r`=9 must be in [0, 8]" in capsys.readouterr().err
