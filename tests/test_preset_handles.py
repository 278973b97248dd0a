"""Preset folders, https handles and weights tags (issue 14), with a local HTTP server.

Nothing reaches the internet: a standard-library server on 127.0.0.1 serves
a preset folder and a synthetic AugReg ``.npz`` from a temporary folder; a
second route cuts its response half-way.
"""

import functools
import http.server
import os
import threading

import numpy as np
import pytest

from conftest import images, to_numpy
from keras_mone import models, presets
from keras_mone.presets import registry
from keras_mone.presets.handles import cache_root, download
from keras_mone.presets.weights import ZOO_PATH_ENV, sha256_of
from test_convert import CLASSES, D, DEPTH, H, M, P, reference_params, to_npz_arrays


def tiny_classifier(capacity=0.5, num_classes=CLASSES):
    backbone = models.MoNEViTBackbone(image_size=32, patch_size=P, hidden_dim=D, depth=DEPTH, num_heads=H,
                                      mlp_dim=M, use_class_token=True, capacity=capacity)
    model = models.ImageClassifier(backbone, num_classes=num_classes, pooling="token")
    model.build()
    return model


class _Handler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        if self.path.startswith("/broken/"):  # promises the whole file, sends half, hangs up
            data = open(os.path.join(self.directory, self.path[len("/broken/"):]), "rb").read()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.connection.close()
            return
        super().do_GET()


@pytest.fixture
def server(tmp_path, monkeypatch):
    root = tmp_path / "served"
    root.mkdir()
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras_home"))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Handler, directory=str(root)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield dict(root=root, url=f"http://127.0.0.1:{httpd.server_address[1]}/")
    httpd.shutdown()


def cached_files():
    found = []
    for folder, _, files in os.walk(cache_root()):
        found += [os.path.join(folder, f) for f in files]
    return found


def test_save_to_preset_then_from_preset_gives_identical_outputs(tmp_path):
    model = tiny_classifier()
    metadata = presets.save_to_preset(model, tmp_path / "mine", accuracy={"digits": 0.5})
    assert set(metadata["sha256"]) == {"config.json", "model.weights.h5"}
    assert metadata["parameter_count"] == model.count_params()
    loaded = presets.from_preset(str(tmp_path / "mine"))
    np.testing.assert_array_equal(to_numpy(loaded(images())), to_numpy(model(images())))
    at_03 = presets.from_preset(str(tmp_path / "mine"), capacity=0.3)
    assert at_03.capacity == 0.3


def test_a_folder_whose_config_and_weights_disagree(tmp_path):
    presets.save_to_preset(tiny_classifier(), tmp_path / "mine")
    with pytest.raises(ValueError, match="First mismatch: 'head/vars/.' \\(.*7,?\\) in the file, '.*head/.*' \\(.*3,?\\) in the model"):
        presets.from_preset(str(tmp_path / "mine"), num_classes=3)
    weights = tmp_path / "mine" / "model.weights.h5"
    weights.write_bytes(weights.read_bytes()[:-10])
    with pytest.raises(ValueError, match="model.weights.h5.*sha256"):
        presets.from_preset(str(tmp_path / "mine"))
    with pytest.raises(ValueError, match="neither a preset name"):
        presets.from_preset(str(tmp_path / "nowhere"))


def test_https_preset_folder_download_hash_and_cache(server):
    model = tiny_classifier()
    presets.save_to_preset(model, server["root"] / "mine")
    url = server["url"] + "mine/"
    pinned = sha256_of(server["root"] / "mine" / "metadata.json")
    loaded = presets.from_preset(url, sha256=pinned)
    np.testing.assert_array_equal(to_numpy(loaded(images())), to_numpy(model(images())))
    files = cached_files()
    assert len(files) == 3
    # offline: the server is gone for this handle, the cache answers
    for name in os.listdir(server["root"] / "mine"):
        os.remove(server["root"] / "mine" / name)
    np.testing.assert_array_equal(to_numpy(presets.from_preset(url, sha256=pinned)(images())), to_numpy(model(images())))
    assert cached_files() == files


def test_wrong_sha256_truncated_and_failing_downloads_leave_no_file(server):
    data = b"x" * 50_000
    (server["root"] / "blob.bin").write_bytes(data)
    with pytest.raises(ValueError, match="expected 0{64}"):
        download(server["url"] + "blob.bin", sha256="0" * 64)
    assert cached_files() == []
    with pytest.raises(OSError, match="Downloading .* failed"):
        download(server["url"] + "broken/blob.bin")
    assert cached_files() == []
    with pytest.raises(OSError, match="failed"):
        download(server["url"] + "missing.bin")
    assert cached_files() == []
    good = download(server["url"] + "blob.bin", sha256=sha256_of(server["root"] / "blob.bin"))
    assert open(good, "rb").read() == data


def test_weights_tag_downloads_converts_and_caches(server, tmp_path, monkeypatch):
    params = reference_params()
    np.savez(server["root"] / "tiny.npz", **to_npz_arrays(params, "vision_transformer"))
    zoo = tmp_path / "zoo"
    zoo.mkdir()
    (zoo / "tiny.toml").write_text(f"""
[tiny_vit]
architecture = "vit"
variant = "Ti/16"
image_size = 32
patch_size = {P}
hidden_dim = {D}
depth = {DEPTH}
num_heads = {H}
mlp_dim = {M}
default_tag = "synthetic"

[tiny_vit.tags.synthetic]
format = "vision_transformer"
url = "{server['url']}tiny.npz"
sha256 = "{sha256_of(server['root'] / 'tiny.npz')}"
config = {{ num_classes = {CLASSES}, use_class_token = true, pooling = "token" }}
top1 = 12.5

[tiny_mone]
architecture = "mone_vit"
variant = "Ti/16"
image_size = 32
patch_size = {P}
hidden_dim = {D}
depth = {DEPTH}
num_heads = {H}
mlp_dim = {M}
capacity = 1.0
tags_from = "tiny_vit"
""")
    monkeypatch.setenv(ZOO_PATH_ENV, str(zoo))
    registry._load_zoo.cache_clear()
    try:
        dense = presets.from_preset("tiny_vit")  # the default tag
        assert presets.weights_tags("tiny_mone") == {"synthetic": server["url"] + "tiny.npz"}
        mone = presets.from_preset("tiny_mone", weights="synthetic")
        np.testing.assert_allclose(to_numpy(mone(images())), to_numpy(dense(images())), atol=1e-5)
        converted = [f for f in cached_files() if f.endswith("metadata.json")]
        assert len(converted) == 2
        os.remove(server["root"] / "tiny.npz")  # offline now: the converted folders answer
        again = presets.from_preset("tiny_vit")
        np.testing.assert_array_equal(to_numpy(again(images())), to_numpy(dense(images())))
    finally:
        monkeypatch.delenv(ZOO_PATH_ENV)
        registry._load_zoo.cache_clear()


def test_hub_handles_name_their_extra():
    for handle, extra in (("hf://owner/repo", "keras-mone[hf]"), ("kaggle://keras/vit/keras/x", "keras-mone[kaggle]")):
        try:
            __import__("huggingface_hub" if handle.startswith("hf") else "kagglehub")
            continue  # installed: the handle would go to the hub
        except ImportError:
            pass
        with pytest.raises(ImportError, match=extra.replace("[", "\\[").replace("]", "\\]")):
            presets.from_preset(handle)
