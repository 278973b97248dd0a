"""Stored outputs of tiny models on fixed weights: a guard against silent numeric drift.

``python tests/reference_outputs.py`` (once per backend, e.g. with
``KERAS_BACKEND=torch``) writes the current outputs of every model family to
``tests/data/reference_outputs_<backend>.npz``; ``test_reference_outputs.py``
compares the models of the day with them. Weights are numpy draws
(``randomize_weights``), so the stored values do not depend on a backend's
initialisers; they are stored per backend because float rounding differs.
Regenerate only when a change is *meant* to alter the numbers, and say so.
"""

import os
import sys

import keras
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import TINY, TINY_VIDEO, images, randomize_weights, to_numpy, videos  # noqa: E402

from keras_mone import models  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def reference_file(backend=None):
    return os.path.join(DATA, f"reference_outputs_{backend or keras.backend.backend()}.npz")


def reference_models():
    """``{name: (model, inputs)}``: every backbone family, tiny, on fixed weights."""
    built = {
        "vit": (models.ViTBackbone(**TINY, use_class_token=True), images()),
        "mone_vit_0.5": (models.MoNEViTBackbone(**TINY, capacity=0.5), images()),
        "mone_vit_0.3": (models.MoNEViTBackbone(**TINY, capacity=0.3, router_positions=(0, 1)), images()),
        "matvit_0.5": (models.MatViTBackbone(**TINY, width_fraction=0.5), images()),
        "vivit": (models.ViViTBackbone(**TINY_VIDEO), videos()),
        "mone_vivit_0.5": (models.MoNEViViTBackbone(**TINY_VIDEO, capacity=0.5), videos()),
        "mod_vit_0.5": (models.MoDViTBackbone(**TINY, capacity=0.5, routed_blocks=(0, 1)), images()),
        "amod_vit_0.5": (models.AMoDViTBackbone(**TINY, capacity=0.5, routed_blocks=(1,)), images()),
        "mod_vivit_0.5": (models.MoDViViTBackbone(**TINY_VIDEO, capacity=0.5), videos()),
    }
    for seed, (model, _) in enumerate(built.values()):
        model.build()
        randomize_weights(model, seed=seed)
    return built


def current_outputs():
    return {name: to_numpy(model(inputs)) for name, (model, inputs) in reference_models().items()}


if __name__ == "__main__":
    os.makedirs(DATA, exist_ok=True)
    np.savez(reference_file(), **current_outputs())
    print("wrote", reference_file())
