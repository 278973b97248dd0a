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


def test_missing_default_backend_falls_back_to_an_installed_one(tmp_path):
    line, stderr = probe(tmp_path, hidden=["tensorflow"])
    assert line == "BACKEND jax"
    assert "'tensorflow' (default) is not installed; keras_mone uses 'jax'" in stderr


def test_backend_named_in_keras_json_but_missing(tmp_path):
    line, _ = probe(tmp_path, hidden=["torch"], keras_json={"backend": "torch"})
    assert line == "BACKEND jax"


def test_no_backend_installed_names_the_extras(tmp_path):
    line, _ = probe(tmp_path, hidden=["tensorflow", "jax", "torch"])
    assert line.startswith("ERROR") and 'keras-mone[jax]' in line


@pytest.mark.parametrize("backend", ["torch"])
def test_an_explicit_choice_is_kept(tmp_path, backend):
    line, _ = probe(tmp_path, hidden=[], env_backend=backend)
    assert line == f"BACKEND {backend}"
