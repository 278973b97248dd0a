"""How far one-pass LayerNorm statistics can be trusted (``layers.layer_norm``, issue 40).

``var = E[x^2] - E[x]^2`` loses precision as ``mean^2 / var`` of a token's features grows.
This prints (1) that ratio over every token row that the LayerNorms of shipped presets
see on the cluttered-digits test images (each ``LayerNormalization`` input recorded), and
(2) the largest error of each statistics form against float64 on random rows of a given
mean (std 1, D = 768)::

    KERAS_BACKEND=jax python bench/layer_norm_rows.py
    KERAS_BACKEND=jax python bench/layer_norm_rows.py --presets mone_vit_digits --images 64
"""

import argparse

import keras
import numpy as np
from gpu_forms import form_environment

from keras_mone import presets
from keras_mone.data.cluttered_digits import load_cluttered_digits
from keras_mone.layers import platform_forms
from keras_mone.layers.layer_norm import normalize


def row_ratios(preset, images):
    """``mean^2 / var`` of every token row the preset's LayerNorms normalise on ``images``."""
    ratios, original = [], keras.layers.LayerNormalization.call

    def recording(layer, inputs):
        x = np.asarray(keras.ops.convert_to_numpy(inputs), dtype=np.float64)
        ratios.append((x.mean(-1) ** 2 / np.maximum(x.var(-1), 1e-30)).ravel())
        return original(layer, inputs)

    keras.layers.LayerNormalization.call = recording
    try:
        model = presets.from_preset(preset)
        model(images, training=False)
    finally:
        keras.layers.LayerNormalization.call = original
    return np.concatenate(ratios)


def form_errors(mean, rows=4096, dim=768, seed=0):
    """``{form: max |normalize - float64 LayerNorm|}`` on rows of ``mean`` and std 1."""
    layer = keras.layers.LayerNormalization(epsilon=1e-6)
    layer.build((None, dim))
    x = np.random.default_rng(seed).normal(mean, 1.0, size=(rows, dim)).astype("float32")
    wide = x.astype(np.float64)
    exact = (wide - wide.mean(-1, keepdims=True)) / np.sqrt(wide.var(-1, keepdims=True) + 1e-6)
    errors = {}
    for form in platform_forms.STATISTICS_FORMS:
        with form_environment(f"{form}_statistics"):  # bench/gpu_forms.py's switches
            errors[form] = float(np.abs(keras.ops.convert_to_numpy(normalize(layer, x)) - exact).max())
    return errors


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", default="vit_digits,mone_vit_digits")
    parser.add_argument("--images", type=int, default=256, help="test images per preset")
    parser.add_argument("--means", default="10,100,1000", help="row means of the error table (std 1)")
    args = parser.parse_args(argv)
    images, _ = load_cluttered_digits(split="test")
    lines = ["| preset | token rows | mean^2/var median | 99.9th percentile | max |", "|---|---|---|---|---|"]
    for preset in filter(None, args.presets.split(",")):
        ratios = row_ratios(preset, images[: args.images])
        lines.append(f"| {preset} | {ratios.size} | {np.median(ratios):.2g} | {np.quantile(ratios, 0.999):.2g} "
                     f"| {ratios.max():.2g} |")
    forms = platform_forms.STATISTICS_FORMS
    lines += ["", "| row mean (std 1, D = 768) | mean^2/var | " + " | ".join(f"{f} max error" for f in forms) + " |",
              "|---" * (2 + len(forms)) + "|"]
    for mean in (float(m) for m in args.means.split(",")):
        errors = form_errors(mean)
        lines.append(f"| {mean:g} | {mean ** 2:.0e} | " + " | ".join(f"{errors[f]:.1e}" for f in forms) + " |")
    note = "" if keras.backend.backend() == "jax" else " (not jax: every form is Keras' layer)"
    text = f"backend {keras.backend.backend()}{note}\n\n" + "\n".join(lines) + "\n"
    print(text)
    return text


if __name__ == "__main__":
    main()
