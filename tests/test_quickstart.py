"""The README's main job (`keras-mone quickstart`) end to end, on a shrunken config."""

import json
import os

from keras_mone.training.quickstart import QuickstartConfig, format_results, run_quickstart

TINY_QUICKSTART = QuickstartConfig(
    image_size=16, patch_size=8, hidden_dim=32, depth=1, num_heads=4, mlp_dim=64,
    digit_scale=1, clutter=1, samples_per_digit=1, test_samples_per_digit=1, epochs=1,
    batch_size=128, eval_capacities=(0.2, 0.5, 1.0),
)


def test_quickstart_writes_results_and_figures(tmp_path):
    results = run_quickstart(str(tmp_path), TINY_QUICKSTART, verbose=0)
    for name in ("results.json", "accuracy_vs_gmacs.png", "routing.png"):
        assert os.path.getsize(tmp_path / name) > 0, name
    with open(tmp_path / "results.json") as f:
        saved = json.load(f)
    assert [r["capacity"] for r in saved["mone"]] == [0.2, 0.5, 1.0]
    rows = [saved["dense"], *saved["mone"]]
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["images_per_second"] > 0 for r in rows)
    # MACs fall with the capacity; MoNE at 1.0 costs the dense model plus its router.
    gmacs = [r["gmacs"] for r in saved["mone"]]
    assert gmacs == sorted(gmacs) and gmacs[-1] > saved["dense"]["gmacs"] > gmacs[0]
    assert "MoNE-ViT" in format_results(results) and "dense ViT" in format_results(results)
