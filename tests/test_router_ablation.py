"""Routing ablations on a tiny model: twins, learned vs random router (App. A.3), Table 2 allocations, CLI."""

import argparse
import json

import numpy as np
import pytest

from conftest import TINY, images, randomize_weights, to_numpy
from keras_mone.analysis import capacity_methods as cm
from keras_mone.analysis.router_ablation import learned_vs_random_router
from keras_mone.models import ImageClassifier, MoNEViTBackbone, ViTBackbone


def tiny_classifier(seed=0, **kwargs):
    model = ImageClassifier(MoNEViTBackbone(**TINY, **{"capacity": 0.5, **kwargs}), num_classes=4)
    model.build()
    randomize_weights(model, seed=seed)  # alphas in (0.2, 0.8): the gates matter
    return model


def data(count=12, seed=0):
    return images(batch=count, seed=seed), np.random.default_rng(seed).integers(0, 4, count)


def test_model_variant_copies_every_shared_weight():
    model = tiny_classifier(seed=1)
    x, _ = data()
    twin, left = cm.model_variant(model)
    assert left == []
    np.testing.assert_array_equal(to_numpy(twin(x)), to_numpy(model(x)))
    random, left = cm.model_variant(model, router_type="random", router_seed=0)
    assert left == ["backbone/router_0/dense/bias", "backbone/router_0/dense/kernel"]
    assert random.backbone.router_type == "random" and model.backbone.router_type == "learned"


def test_learned_vs_random_router_rows():
    model = tiny_classifier(seed=2)
    x, y = data()
    logits = to_numpy(model(x))
    y = np.argmax(logits, axis=-1)  # the learned model is right on every example
    records = learned_vs_random_router(model, x, y, capacities=(0.3, 1.0), seeds=(0, 1), batch_size=4)
    assert [r["capacity"] for r in records] == [0.3, 1.0] and model.capacity == 0.5
    for r in records:
        assert r["learned"] == 1.0 and len(r["random"]) == 2
        assert all(0.0 <= a <= 1.0 for a in r["random"] + [r["learned_no_gate"]])
        assert r["drop"] == pytest.approx(r["learned"] - np.mean(r["random"]))
        assert r["random_std"] == pytest.approx(np.std(r["random"], ddof=1))
    # At e_c 1 every token is at the full expert whatever the router: the random
    # router (no gate) is exactly the learned routing with its gate at 1.
    assert records[1]["random"] == [records[1]["learned_no_gate"]] * 2
    # ... and that is the model with every alpha at 0.
    for block in model.backbone.blocks:
        block.alpha.assign(0.0)
    model.set_capacity(1.0)
    assert records[1]["learned_no_gate"] == np.mean(np.argmax(to_numpy(model(x)), -1) == y)


def test_learned_vs_random_router_refuses_models_without_a_learned_router():
    x, y = data()
    dense = ImageClassifier(ViTBackbone(**TINY), num_classes=4)
    with pytest.raises(ValueError, match="learned router"):
        learned_vs_random_router(dense, x, y)
    with pytest.raises(ValueError, match="learned router"):
        learned_vs_random_router(tiny_classifier(router_type="random"), x, y)


def test_compare_capacity_methods_rows():
    model = tiny_classifier(seed=3)
    x, y = data()
    every = cm.table2_settings(4, capacities=(0.4,))
    assert len(every) == 3 * 3 + 2 and every == sorted(every, key=lambda s: (s[1], s[0]))
    assert ("uniform", 15 / 32) in every and ("greedy", 0.4) in every and ("proportionate", 4 / 15) in every
    settings = cm.table2_settings(4, capacities=(0.4,), methods=("mone", "greedy", "mod_greedy"))
    assert settings == [("greedy", 0.4), ("mod_greedy", 0.4), ("mone", 0.4)]  # no static e_c without a static method
    records = cm.compare_capacity_methods(model, x, y, settings, batch_size=4)
    assert [(r["method"], r["capacity"]) for r in records] == settings
    for r in records:
        assert 0.0 <= r["accuracy"] <= 1.0 and r["gmacs"] > 0
        assert sum(r["token_counts"]) == model.backbone.num_tokens
    by = {(r["method"], r["capacity"]): r for r in records}
    assert by[("mod_greedy", 0.4)]["token_counts"][-1] > 0  # MoD greedy drops tokens
    assert by[("mod_greedy", 0.4)]["gmacs"] < by[("mone", 0.4)]["gmacs"] * 1.2
    assert model.backbone.capacity_method == "mone" and model.capacity == 0.5  # the model is untouched
    # one row against the twin built by hand
    twin, _ = cm.model_variant(model, capacity_method="greedy", capacity=0.4)
    assert by[("greedy", 0.4)]["accuracy"] == np.mean(np.argmax(to_numpy(twin(x)), -1) == y)
    markdown = cm.markdown_table(records)
    assert markdown.count("\n") == 2 + len({r["capacity"] for r in records}) - 1


@pytest.mark.parametrize("command", ["capacity-methods", "random-router"])
def test_cli_commands_write_png_and_json(tmp_path, command):
    from keras_mone.cli.analyze_ablations import COMMANDS

    model = tiny_classifier(seed=4)
    path = tmp_path / "tiny.keras"
    model.save(path)
    add_arguments, run, _ = COMMANDS[command]
    parser = argparse.ArgumentParser()
    from keras_mone.cli.analyze_common import common_arguments

    common_arguments(parser)
    add_arguments(parser)
    args = parser.parse_args(
        [str(path), "--data", "vit_digits", "--output", str(tmp_path / "out"), "--num-images", "8", "--capacities", "0.4"]
        + (["--seeds", "0,1"] if command == "random-router" else ["--methods", "greedy,uniform"])
    )
    assert run(args) == 0
    name = command.replace("-", "_")
    assert (tmp_path / "out" / f"{name}.png").stat().st_size > 0
    summary = json.loads((tmp_path / "out" / f"{name}.json").read_text())
    assert summary["examples"] == 8
    if command == "capacity-methods":
        assert [(r["method"], r["capacity"]) for r in summary["records"]] == [("greedy", 0.4), ("greedy", 15 / 32), ("uniform", 15 / 32)]
    else:
        assert [r["capacity"] for r in summary["records"]] == [0.4] and len(summary["records"][0]["random"]) == 2
