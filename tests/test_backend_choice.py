"""A Keras backend is chosen when none is configured (issue 13, item 10).

Each case runs in a fresh interpreter with a temporary ``KERAS_HOME`` and a
meta-path hook that hides chosen backend packages, as on a machine that
installed only ``keras-mone[jax]``.
"""

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import importlib.abc, sys
HIDDEN = set(sys.argv[1].split(",")) - {""}
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None
sys.meta_path.insert(0, Hide())
import warnings
warnings.simplefilter("always")
try:
    import keras_mone, keras
    print("BACKEND", keras.backend.backend())
except ImportError as error:
    print("ERROR", error)
"""


def probe(tmp_path, hidden, keras_json=None, env_backend=None):
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    env["KERAS_HOME"] = str(tmp_path)
    if env_backend:
        env["KERAS_BACKEND"] = env_backend
    if keras_json:
        (tmp_path / "keras.json").write_text(json.dumps(keras_json))
    result = subprocess.run(
        [sys.executable, "-c", PROBE, ",".join(hidden)],
        capture_output=True, text=True, env=env, timeout=300,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith(("BACKEND", "ERROR"))]
    assert lines, result.stderr[-2000:]
    return lines[-1], result.stderr


KERAS_WRITES = {"floatx": "float32", "epsilon": 1e-07, "backend": "tensorflow", "image_data_format": "channels_last"}


@pytest.mark.parametrize("keras_json", [None, KERAS_WRITES], ids=["no keras.json", "the one Keras writes"])
def test_missing_default_backend_falls_back_to_an_installed_one_silently(tmp_path, keras_json):
    # Rules out issue 43's warning on every call after Keras wrote its default keras.json
    # (nobody chose tensorflow: there is nothing to warn about).
    line, stderr = probe(tmp_path, hidden=["tensorflow"], keras_json=keras_json)
    assert line == "BACKEND jax"
    assert "is not installed" not in stderr


def test_backend_named_in_keras_json_but_missing(tmp_path):
    line, stderr = probe(tmp_path, hidden=["torch"], keras_json={**KERAS_WRITES, "backend": "torch"})
    assert line == "BACKEND jax"
    assert "'torch' (keras.json) is not installed; keras_mone uses 'jax'" in stderr


def test_no_backend_installed_names_the_extras(tmp_path):
    line, _ = probe(tmp_path, hidden=["tensorflow", "jax", "torch"])
    assert line.startswith("ERROR") and 'keras-mone[jax]' in line


@pytest.mark.parametrize("backend", ["torch"])
def test_an_explicit_choice_is_kept(tmp_path, backend):
    line, _ = probe(tmp_path, hidden=[], env_backend=backend)
    assert line == f"BACKEND {backend}"


FINETUNE_WITHOUT_TF = """
import importlib.abc, os, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "tensorflow":
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None
sys.meta_path.insert(0, Hide())
import numpy as np
from PIL import Image
for name in ("a", "b"):
    os.makedirs(f"folder/train/{name}", exist_ok=True)
    for i in range(4):
        Image.fromarray(np.full((8, 8, 3), 40 * i, np.uint8)).save(f"folder/train/{name}/{i}.png")
from keras_mone.cli.main import main
print("EXIT", main(["finetune", "vit_digits", "folder", "output_dir=run"]))
"""


def test_training_on_a_folder_without_tensorflow_names_the_extra(tmp_path):
    # Rules out issue 43's ImportError traceback naming a bare package: the
    # jax user is told which extra adds the tf.data pipeline, in one line.
    env = {**os.environ, "KERAS_BACKEND": "jax", "KERAS_HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", FINETUNE_WITHOUT_TF], capture_output=True, text=True, env=env, timeout=300,
        cwd=tmp_path,
    )
    assert "EXIT 2" in done.stdout, done.stderr[-2000:]
    assert 'pip install "keras-mone[tensorflow]"' in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists()
