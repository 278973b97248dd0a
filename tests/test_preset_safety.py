"""Preset folders and the download cache never lose or keep the wrong files (issue 24 items 1, 4, 5, 7, 14; issue 29).

Local only: a standard-library HTTP server on 127.0.0.1 (``server`` from
test_preset_handles) serves preset folders and a synthetic AugReg ``.npz``.
"""

import os
import stat
import warnings

import numpy as np
import pytest

from conftest import images, to_numpy
from keras_mone import presets
from keras_mone.presets import registry
from keras_mone.presets.handles import cache_root, download
from keras_mone.presets.untrained import UntrainedWeightsWarning
from keras_mone.presets.weights import ZOO_PATH_ENV, sha256_of
from test_convert import CLASSES, D, DEPTH, H, M, P, reference_params, to_npz_arrays
from test_preset_handles import server, tiny_classifier  # noqa: F401 (server is a fixture)

PRESET_FILES = {"config.json", "model.weights.h5", "metadata.json"}


def snapshot(folder):
    """``{relative path: bytes}`` of every file and ``{relative path: None}`` of every folder under ``folder``."""
    found = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            found[os.path.relpath(os.path.join(root, name), folder)] = None
        for name in files:
            path = os.path.join(root, name)
            found[os.path.relpath(path, folder)] = open(path, "rb").read()
    return found


def cache_entries():
    """Every file and folder under the cache root (a folder that does not exist has none)."""
    return sorted(snapshot(cache_root())) if os.path.isdir(cache_root()) else []


# -- item 1: save_to_preset writes only where it may, atomically ---------------------


def test_save_to_preset_refuses_a_non_empty_folder_that_is_not_a_preset(tmp_path):
    # the bug: save_to_preset(m, ".") in a project folder deleted everything in it
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "notes.txt").write_text("mine")
    (project / "src" / "train.py").write_text("print(1)")
    (project / "config.json").write_text("{}")  # a config.json alone does not make a preset
    before = snapshot(project)
    with pytest.raises(ValueError, match="project.*not empty and is not a preset folder"):
        presets.save_to_preset(tiny_classifier(), project)
    assert snapshot(project) == before
    assert sorted(os.listdir(tmp_path)) == ["project"]  # no staging folder left beside it
    with pytest.raises(ValueError, match="notes.txt' exists and is not a folder"):
        presets.save_to_preset(tiny_classifier(), project / "notes.txt")
    assert snapshot(project) == before


def test_save_to_preset_overwrites_a_preset_only_when_asked_and_keeps_other_files(tmp_path):
    target = tmp_path / "mine"
    first = tiny_classifier(num_classes=CLASSES)
    presets.save_to_preset(first, target)
    (target / "README.md").write_text("model card")  # e.g. a hub folder's card
    before = snapshot(target)
    with pytest.raises(ValueError, match="mine.*already holds a preset; pass overwrite=True"):
        presets.save_to_preset(tiny_classifier(num_classes=3), target)
    assert snapshot(target) == before
    presets.save_to_preset(tiny_classifier(num_classes=3), target, overwrite=True)
    assert set(os.listdir(target)) == PRESET_FILES | {"README.md"}
    assert (target / "README.md").read_text() == "model card"
    assert presets.from_preset(str(target)).num_classes == 3  # not the old preset
    assert sorted(os.listdir(tmp_path)) == ["mine"]  # nothing moved aside is left


def test_save_to_preset_into_an_empty_folder_and_a_failure_leaves_the_old_preset(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    presets.save_to_preset(tiny_classifier(), empty)
    assert set(os.listdir(empty)) == PRESET_FILES
    before = snapshot(empty)
    model = tiny_classifier(num_classes=3)

    def fail(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(model, "save_weights", fail)
    with pytest.raises(RuntimeError, match="disk full"):
        presets.save_to_preset(model, empty, overwrite=True)
    assert snapshot(empty) == before  # not removed before the new one was complete
    assert sorted(os.listdir(tmp_path)) == ["empty"]


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_save_to_preset_folder_gets_the_umask_permissions(tmp_path, umask):
    # the bug: tempfile.mkdtemp's 0700 whatever the umask
    old = os.umask(umask)
    try:
        presets.save_to_preset(tiny_classifier(), tmp_path / "mine")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "mine").st_mode) == 0o777 & ~umask


# -- item 4: from_preset(folder, sha256=..., weights=...) ------------------------------


def test_folder_handle_checks_sha256_and_refuses_a_weights_tag(tmp_path):
    presets.save_to_preset(tiny_classifier(), tmp_path / "mine")
    actual = sha256_of(tmp_path / "mine" / "metadata.json")
    with pytest.raises(ValueError, match=f"sha256 {actual}, but sha256='{'0' * 64}'"):
        presets.from_preset(str(tmp_path / "mine"), sha256="0" * 64)
    assert presets.from_preset(str(tmp_path / "mine"), sha256=actual).num_classes == CLASSES
    with pytest.raises(ValueError, match="weights='augreg_in21k'.*one set of weights"):
        presets.from_preset(str(tmp_path / "mine"), weights="augreg_in21k")
    with pytest.raises(ValueError, match="sha256= pins .*built-in preset 'vit_digits'"):
        presets.from_preset("vit_digits", sha256=actual)


# -- item 5 and issue 29: the download cache ----------------------------------------------


def test_failed_preset_downloads_leave_nothing_and_a_retry_succeeds(server):
    model = tiny_classifier()
    presets.save_to_preset(model, server["root"] / "mine")
    url = server["url"] + "mine/"
    with pytest.raises(OSError, match="failed"):  # 404
        presets.from_preset(server["url"] + "nowhere/")
    assert cache_entries() == []
    pinned = sha256_of(server["root"] / "mine" / "metadata.json")
    with pytest.raises(ValueError, match="expected 0{64}"):  # wrong pinned hash
        presets.from_preset(url, sha256="0" * 64)
    assert cache_entries() == []
    weights = server["root"] / "mine" / "model.weights.h5"
    good = weights.read_bytes()
    weights.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # tampered on the server
    with pytest.raises(ValueError, match="model.weights.h5 has sha256"):
        presets.from_preset(url, sha256=pinned)
    assert cache_entries() == []  # the bug: metadata.json and config.json stayed
    weights.write_bytes(good)
    loaded = presets.from_preset(url, sha256=pinned)  # the retry is not blocked by stale files
    np.testing.assert_array_equal(to_numpy(loaded(images())), to_numpy(model(images())))
    assert [e for e in cache_entries() if os.path.basename(e).startswith(".")] == []


def test_failed_file_download_leaves_no_empty_folder(server):
    # issue 29: empty staging folders stayed under downloads/
    with pytest.raises(OSError, match="failed"):
        download(server["url"] + "missing.bin")
    assert cache_entries() == []
    (server["root"] / "blob.bin").write_bytes(b"y" * 1000)
    with pytest.raises(ValueError, match="expected 0{64}"):
        download(server["url"] + "blob.bin", sha256="0" * 64)
    assert cache_entries() == []


def test_force_download_sees_a_new_version_of_an_unpinned_handle(server):
    url = server["url"] + "mine/"
    first, second = tiny_classifier(capacity=0.5), tiny_classifier(capacity=0.3)
    presets.save_to_preset(first, server["root"] / "mine")
    assert presets.from_preset(url).capacity == 0.5
    presets.save_to_preset(second, server["root"] / "mine", overwrite=True)
    assert presets.from_preset(url).capacity == 0.5  # unpinned: the cache answers
    renewed = presets.from_preset(url, force_download=True)
    assert renewed.capacity == 0.3
    np.testing.assert_array_equal(to_numpy(renewed(images())), to_numpy(second(images())))
    assert presets.from_preset(url).capacity == 0.3  # the cache now holds the new version
    [entry] = os.listdir(os.path.join(cache_root(), "presets"))  # nothing moved aside or staged is left
    assert set(os.listdir(os.path.join(cache_root(), "presets", entry))) == PRESET_FILES


# -- item 14: a routed preset on a dense checkpoint warns at load time ------------------


@pytest.fixture
def tiny_zoo(server, tmp_path, monkeypatch):
    np.savez(server["root"] / "tiny.npz", **to_npz_arrays(reference_params(), "vision_transformer"))
    sizes = f"image_size = 32\npatch_size = {P}\nhidden_dim = {D}\ndepth = {DEPTH}\nnum_heads = {H}\nmlp_dim = {M}\n"
    zoo = tmp_path / "zoo"
    zoo.mkdir()
    (zoo / "tiny.toml").write_text(f"""
[tiny_vit]
architecture = "vit"
variant = "B/16"
{sizes}default_tag = "synthetic"

[tiny_vit.tags.synthetic]
format = "vision_transformer"
url = "{server['url']}tiny.npz"
sha256 = "{sha256_of(server['root'] / 'tiny.npz')}"
config = {{ num_classes = {CLASSES}, use_class_token = true, pooling = "token" }}

[tiny_mone]
architecture = "mone_vit"
variant = "B/16"
{sizes}capacity = 0.5
tags_from = "tiny_vit"

[tiny_mod]
architecture = "mod_vit"
variant = "B/16"
{sizes}capacity = 0.5
tags_from = "tiny_vit"
""")
    monkeypatch.setenv(ZOO_PATH_ENV, str(zoo))
    registry._load_zoo.cache_clear()
    yield
    monkeypatch.delenv(ZOO_PATH_ENV)
    registry._load_zoo.cache_clear()


def test_routed_preset_on_a_dense_checkpoint_warns_and_trained_presets_do_not(tiny_zoo):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UntrainedWeightsWarning)
        presets.from_preset("tiny_vit")  # dense: nothing untrained
        presets.from_preset("vit_digits")  # shipped trained presets
        presets.from_preset("mone_vit_digits")
    for attempt in ("converted", "cached"):  # the first load and the converted cache warn alike
        with pytest.warns(UntrainedWeightsWarning) as caught:
            presets.from_preset("tiny_mone")
        [text] = [str(w.message) for w in caught if w.category is UntrainedWeightsWarning]
        assert "routers" in text and "smaller experts (widths 4, 8, 16 of 32)" in text, attempt
        assert "capacity=1.0 it equals the dense checkpoint" in text and "capacity 0.5" in text
        assert "augreg_mone_vit_b16_i1k" in text
    with pytest.warns(UntrainedWeightsWarning, match="the routers.*augreg_vit_b16_i1k architecture=mod_vit"):
        presets.from_preset("tiny_mod")
