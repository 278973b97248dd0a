"""keras_mone run from a source checkout without an install (``bench/gpu.sh`` on a bare GPU
machine): the zoo's presets and the bundled recipes are found beside the package."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]  # no editable install
sys.path.insert(0, {root!r})
import keras_mone
assert keras_mone.__file__.startswith({root!r}), keras_mone.__file__
from keras_mone.presets import from_preset, list_presets
from keras_mone.recipes import files
assert "mone_vit_b16" in list_presets()
assert "cluttered_digits_mone" in files.list_recipes()
print(keras_mone.zoo.__file__)
"""


def test_a_checkout_finds_its_zoo_and_recipes_without_an_install():
    result = subprocess.run(
        [sys.executable, "-c", PROBE.format(root=ROOT)], capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    found = result.stdout.strip().splitlines()[-1]
    assert os.path.realpath(found) == os.path.realpath(os.path.join(ROOT, "zoo", "__init__.py"))
