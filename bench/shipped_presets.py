"""The trained presets that ship with the package: test accuracy against GMACs; writes BENCHMARKS.md.

Reads each shipped preset's manifest entry (``zoo/weights/manifest.toml``,
written by ``keras-mone presets publish``, which measured the accuracies on
the recipe's 5026-image test split), loads the preset (checking its sha256)
and counts its GMACs at every recorded capacity or width::

    KERAS_BACKEND=jax python bench/shipped_presets.py
"""

import argparse
import sys

from keras_mone import presets
from keras_mone.analysis import flops
from keras_mone.methods.registry import set_setting
from training_targets import write_section

SECTION = "## Shipped presets (trained by the project)"


def rows():
    """``(preset, setting, value, accuracy, GMACs)`` for every recorded setting."""
    table = []
    for name in presets.shipped_presets():
        entry = presets.get_preset(name)["weights"]
        model = presets.from_preset(name)
        setting = entry["eval"]["setting"]
        for value, accuracy in entry["eval"]["accuracy"].items():
            value = _value(value)  # "0.5" -> 0.5; ACM's "exact" / "grouped" stay
            set_setting(model, setting, value)  # the method's set_<setting> (keras_mone.methods)
            table.append((name, setting, value, accuracy, flops(model).gmacs))
    return table


def _value(text):
    try:
        return float(text)
    except ValueError:
        return text


def markdown(table):
    dense = {name: gmacs for name, _, _, _, gmacs in table if name in ("vit_digits", "vivit_fe_digits")}
    lines = [
        SECTION, "",
        "Command: `KERAS_BACKEND=jax python bench/shipped_presets.py`. Test accuracy as measured by "
        "`keras-mone presets publish` on the 5026-example test split of cluttered digits (images) or moving digits (8-frame clips, ratios against vivit_fe_digits) (and checked on "
        "every backend by `tests/test_shipped_presets.py`); each preset's training command is in "
        "`zoo/weights/manifest.toml`.", "",
        "| preset | e_c, width or execution | test accuracy | GMACs / example | vs the dense preset |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, setting, value, accuracy, gmacs in table:
        reference = dense.get("vivit_fe_digits" if "vivit" in name else "vit_digits")
        ratio = f"{gmacs / reference:.2f}x" if reference else ""
        shown = value if isinstance(value, str) else f"{value:g}"
        lines.append(f"| {name} | {setting} {shown} | {100 * accuracy:.2f}% | {gmacs:.5f} | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--benchmarks", default="BENCHMARKS.md")
    args = parser.parse_args(argv)
    text = markdown(rows())
    write_section(text, args.benchmarks, SECTION)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
