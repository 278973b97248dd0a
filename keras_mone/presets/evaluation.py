"""The test data a shipped preset was scored on: ``evaluation_data(name)``."""

import os

from keras_mone.presets.publish import load_test_split
from keras_mone.presets.registry import get_preset, list_presets, shipped_presets


def evaluation_entry(name):
    """The manifest's ``eval`` entry of shipped preset ``name`` (setting,
    accuracy per capacity / width, dataset, test split); raises a
    ``ValueError`` naming the shipped presets if ``name`` has none (a preset
    folder, a remote handle, or a built-in preset without trained weights)."""
    which = f"{', '.join(shipped_presets()) or 'none'} (`keras-mone presets list` marks them [weights])"
    if not (isinstance(name, str) and name in list_presets()):
        shown = os.fspath(name) if isinstance(name, os.PathLike) else name
        raise ValueError(
            f"evaluation_data: {shown!r} is not a shipped preset; only shipped presets have evaluation data "
            f"(a preset folder or handle records no test split). Shipped presets: {which}."
        )
    entry = get_preset(name).get("weights")
    if not entry or "eval" not in entry:
        raise ValueError(
            f"evaluation_data: preset {name!r} ships no trained weights, so it has no evaluation data; "
            f"only shipped presets have it: {which}."
        )
    return entry["eval"]


def evaluation_data(name):
    """``(x, y)``: exactly the test split shipped preset ``name`` was scored
    on (the accuracies of ``get_preset(name)["weights"]["eval"]``), model-ready.

    ``x`` is float32 in [-1, 1], the range the presets expect: images
    ``(n, 32, 32, 3)`` for the cluttered-digits presets, clips
    ``(n, 8, 32, 32, 3)`` for the moving-digits ones. ``y`` is int64 class
    indices ``(n,)`` (10 digits; 40 digit x direction classes for clips).
    ``model.evaluate(x, y)`` with a sparse accuracy metric, or
    ``argmax(model.predict(x)) == y``, reproduces the manifest's accuracy.

    Args:
        name: a shipped preset (``keras_mone.presets.shipped_presets()``).
    """
    scored = evaluation_entry(name)
    x, y = load_test_split(scored["test_split"], scored.get("dataset", "cluttered_digits"))
    return x.astype("float32"), y
