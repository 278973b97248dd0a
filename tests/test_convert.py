"""Third-party ViT checkpoints (AugReg / big_vision .npz, timm, keras-hub) into keras_mone models.

Nothing here reaches the internet: each test writes a synthetic checkpoint in
the source format (exact key names and shapes, random values) from one set
of reference parameters, with its own inverse mapping, and compares the
converted model with ``numpy_reference.vit_forward`` on those parameters in
float64. Tolerance 1e-4: a two-block float32 ViT on O(1) activations carries
~1e-6 of round-off, a wrong transpose or head order gives O(1).
"""

import json
import struct

import keras
import numpy as np
import pytest

import numpy_reference as ref
from conftest import images, to_numpy
from keras_mone import convert, models

D, H, M, P, DEPTH, CLASSES = 32, 4, 64, 8, 2, 7
TOLERANCE = 1e-4


def reference_params(seed=0, grid=4):
    """Random parameters in keras_mone's path naming, class token included."""
    rng = np.random.default_rng(seed)

    def r(*shape, scale=0.2):
        return rng.normal(0, scale, shape)

    params = {
        "patch_embedding/projection/kernel": r(P, P, 3, D, scale=0.05),
        "patch_embedding/projection/bias": r(D),
        "patch_embedding/class_token": r(1, 1, D),
        "patch_embedding/position_embedding": r(1, grid * grid + 1, D),
        "norm/gamma": 1 + r(D), "norm/beta": r(D),
        "head/kernel": r(D, CLASSES), "head/bias": r(CLASSES),
    }
    for i in range(DEPTH):
        params.update({
            f"block_{i}/norm1/gamma": 1 + r(D), f"block_{i}/norm1/beta": r(D),
            f"block_{i}/attention/qkv/kernel": r(D, 3 * D), f"block_{i}/attention/qkv/bias": r(3 * D),
            f"block_{i}/attention/out/kernel": r(D, D), f"block_{i}/attention/out/bias": r(D),
            f"block_{i}/norm2/gamma": 1 + r(D), f"block_{i}/norm2/beta": r(D),
            f"block_{i}/mlp/fc1/kernel": r(D, M), f"block_{i}/mlp/fc1/bias": r(M),
            f"block_{i}/mlp/fc2/kernel": r(M, D), f"block_{i}/mlp/fc2/bias": r(D),
        })
    return {k: v.astype("float32") for k, v in params.items()}


# -- writers: reference parameters -> each source format ----------------------
def _split_qkv(kernel, bias):
    """(D, 3D) / (3D,) -> per-projection (D, H, D/H) kernels and (H, D/H) biases."""
    kernels = [kernel[:, i * D:(i + 1) * D].reshape(D, H, D // H) for i in range(3)]
    biases = [bias[i * D:(i + 1) * D].reshape(H, D // H) for i in range(3)]
    return kernels, biases


def to_npz_arrays(params, layout, scanned=False):
    vt = layout == "vision_transformer"
    names = dict(ln1="LayerNorm_0", attention="MultiHeadDotProductAttention_1" if vt else "MultiHeadDotProductAttention_0",
                 ln2="LayerNorm_2" if vt else "LayerNorm_1", mlp="MlpBlock_3" if vt else "MlpBlock_0")
    positions = params["patch_embedding/position_embedding"]
    out = {"embedding/kernel": params["patch_embedding/projection/kernel"],
           "embedding/bias": params["patch_embedding/projection/bias"],
           "cls": params["patch_embedding/class_token"],
           "Transformer/encoder_norm/scale": params["norm/gamma"], "Transformer/encoder_norm/bias": params["norm/beta"],
           "head/kernel": params["head/kernel"], "head/bias": params["head/bias"]}
    if vt:
        out["Transformer/posembed_input/pos_embedding"] = positions
    else:  # big_vision: no class position (the class token is added after the positions)
        out["pos_embedding"] = positions[:, 1:]
    blocks = []
    for i in range(DEPTH):
        b = lambda k: params[f"block_{i}/{k}"]  # noqa: E731
        kernels, biases = _split_qkv(b("attention/qkv/kernel"), b("attention/qkv/bias"))
        block = {f"{names['ln1']}/scale": b("norm1/gamma"), f"{names['ln1']}/bias": b("norm1/beta"),
                 f"{names['ln2']}/scale": b("norm2/gamma"), f"{names['ln2']}/bias": b("norm2/beta"),
                 f"{names['attention']}/out/kernel": b("attention/out/kernel").reshape(H, D // H, D),
                 f"{names['attention']}/out/bias": b("attention/out/bias"),
                 f"{names['mlp']}/Dense_0/kernel": b("mlp/fc1/kernel"), f"{names['mlp']}/Dense_0/bias": b("mlp/fc1/bias"),
                 f"{names['mlp']}/Dense_1/kernel": b("mlp/fc2/kernel"), f"{names['mlp']}/Dense_1/bias": b("mlp/fc2/bias")}
        for name, kernel, bias in zip(("query", "key", "value"), kernels, biases):
            block[f"{names['attention']}/{name}/kernel"], block[f"{names['attention']}/{name}/bias"] = kernel, bias
        blocks.append(block)
    if scanned:
        out.update({f"Transformer/encoderblock/{k}": np.stack([blk[k] for blk in blocks]) for k in blocks[0]})
    else:
        out.update({f"Transformer/encoderblock_{i}/{k}": v for i, blk in enumerate(blocks) for k, v in blk.items()})
    return out if vt else {f"params/{k}": v for k, v in out.items()}


def to_timm_state(params, class_token=True):
    sd = {"patch_embed.proj.weight": params["patch_embedding/projection/kernel"].transpose(3, 2, 0, 1),
          "patch_embed.proj.bias": params["patch_embedding/projection/bias"],
          "pos_embed": params["patch_embedding/position_embedding"][:, 0 if class_token else 1:],
          "norm.weight": params["norm/gamma"], "norm.bias": params["norm/beta"],
          "head.weight": params["head/kernel"].T, "head.bias": params["head/bias"]}
    if class_token:
        sd["cls_token"] = params["patch_embedding/class_token"]
    for i in range(DEPTH):
        b = lambda k: params[f"block_{i}/{k}"]  # noqa: E731
        sd.update({f"blocks.{i}.norm1.weight": b("norm1/gamma"), f"blocks.{i}.norm1.bias": b("norm1/beta"),
                   f"blocks.{i}.attn.qkv.weight": b("attention/qkv/kernel").T, f"blocks.{i}.attn.qkv.bias": b("attention/qkv/bias"),
                   f"blocks.{i}.attn.proj.weight": b("attention/out/kernel").T, f"blocks.{i}.attn.proj.bias": b("attention/out/bias"),
                   f"blocks.{i}.norm2.weight": b("norm2/gamma"), f"blocks.{i}.norm2.bias": b("norm2/beta"),
                   f"blocks.{i}.mlp.fc1.weight": b("mlp/fc1/kernel").T, f"blocks.{i}.mlp.fc1.bias": b("mlp/fc1/bias"),
                   f"blocks.{i}.mlp.fc2.weight": b("mlp/fc2/kernel").T, f"blocks.{i}.mlp.fc2.bias": b("mlp/fc2/bias")})
    return sd


def write_safetensors(path, arrays):
    header, offset, chunks = {}, 0, []
    for name, array in arrays.items():
        data = np.ascontiguousarray(array, "<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        chunks.append(data)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(chunks))


# -- the models and the reference ---------------------------------------------
def classifier(image_size=32, use_class_token=True, num_classes=CLASSES, mone=False):
    config = dict(image_size=image_size, patch_size=P, hidden_dim=D, depth=DEPTH, num_heads=H, mlp_dim=M,
                  use_class_token=use_class_token)
    backbone = models.MoNEViTBackbone(**config, capacity=1.0) if mone else models.ViTBackbone(**config)
    model = models.ImageClassifier(backbone, num_classes=num_classes, pooling="token" if use_class_token else "gap")
    model.build()
    return model


def resize_grid(positions, old, new):
    """Bilinear resize with half-pixel centres (no antialiasing), in numpy."""
    def weights(n_in, n_out):
        x = np.clip((np.arange(n_out) + 0.5) * n_in / n_out - 0.5, 0, n_in - 1)
        low = np.floor(x).astype(int)
        high = np.minimum(low + 1, n_in - 1)
        w = np.zeros((n_out, n_in))
        w[np.arange(n_out), low] += 1 - (x - low)
        w[np.arange(n_out), high] += x - low
        return w
    grid = positions.reshape(old, old, -1)
    wy, wx = weights(old, new), weights(old, new)
    return np.einsum("yi,xj,ijd->yxd", wy, wx, grid).reshape(1, new * new, -1)


def expected_tokens(params, x, use_class_token=True, grid=4):
    params = dict(params)
    positions = params["patch_embedding/position_embedding"]
    cls_position, grid_positions = positions[:, :1], positions[:, 1:]
    if grid != 4:
        grid_positions = resize_grid(grid_positions[0], 4, grid)
    params["patch_embedding/position_embedding"] = (
        np.concatenate([cls_position, grid_positions], axis=1) if use_class_token else grid_positions)
    tokens, _ = ref.vit_forward(params, x, patch_size=P, depth=DEPTH, num_heads=H, use_class_token=use_class_token)
    return tokens


def backbone_tokens(model, x):
    return to_numpy(model.backbone(x))


SOURCES = {
    "vision_transformer": lambda p, tmp: _npz(tmp, to_npz_arrays(p, "vision_transformer")),
    "big_vision": lambda p, tmp: _npz(tmp, to_npz_arrays(p, "big_vision")),
    "big_vision_scanned": lambda p, tmp: _npz(tmp, to_npz_arrays(p, "big_vision", scanned=True)),
    "timm_safetensors": lambda p, tmp: _safetensors(tmp, to_timm_state(p)),
}
FORMAT = {"vision_transformer": "vision_transformer", "big_vision": "big_vision",
          "big_vision_scanned": "big_vision", "timm_safetensors": "timm"}


def _npz(tmp, arrays):
    path = tmp / "checkpoint.npz"
    np.savez(path, **arrays)
    return path


def _safetensors(tmp, arrays):
    path = tmp / "model.safetensors"
    write_safetensors(path, arrays)
    return path


@pytest.mark.parametrize("source", sorted(SOURCES))
@pytest.mark.parametrize("image_size", [32, 48])
def test_checkpoint_converts_to_the_reference_vit(source, image_size, tmp_path):
    params = reference_params()
    if FORMAT[source] == "big_vision":  # big_vision adds the class token after the positions
        params["patch_embedding/position_embedding"][:, 0] = 0.0
    path = SOURCES[source](params, tmp_path)
    model = classifier(image_size=image_size)
    report = convert.load_checkpoint(model, str(path), FORMAT[source])
    x = images(size=image_size)
    expected = expected_tokens(params, x, grid=image_size // P)
    assert np.max(np.abs(backbone_tokens(model, x) - expected)) <= TOLERANCE
    assert "head/kernel" in report["loaded"]
    np.testing.assert_allclose(to_numpy(model(x)), expected[:, 0] @ params["head/kernel"] + params["head/bias"], atol=TOLERANCE)


def test_gap_model_from_a_class_token_checkpoint(tmp_path):
    # Rules out dropping the class token silently (issue 29 item 5: `kept: {}`, no word).
    params = reference_params()
    model = classifier(use_class_token=False, num_classes=3)
    path = str(SOURCES["vision_transformer"](params, tmp_path))
    before = model.get_weights()
    with pytest.raises(ValueError, match=r"'cls'.*use_class_token=True, pooling=\"token\"(.|\n)*strict=False"):
        convert.load_checkpoint(model, path, "vision_transformer")
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    with pytest.warns(UserWarning, match="gelu_approximate=True"):
        report = convert.load_checkpoint(model, path, "vision_transformer", strict=False)
    x = images()
    assert np.max(np.abs(backbone_tokens(model, x) - expected_tokens(params, x, use_class_token=False))) <= TOLERANCE
    assert "head/kernel" in report["kept"]  # 7 classes in the checkpoint, 3 in the model
    assert set(report["unused"]) == {"cls", "head/kernel", "head/bias"}
    assert "num_classes=7" in report["unused"]["head/kernel"]


def test_timm_pth_and_a_model_without_class_token(tmp_path):
    torch = pytest.importorskip("torch")
    params = reference_params()
    path = tmp_path / "model.pth"
    torch.save({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in to_timm_state(params, class_token=False).items()}, path)
    model = classifier(use_class_token=False)
    convert.load_checkpoint(model, str(path), "timm")
    x = images()
    assert np.max(np.abs(backbone_tokens(model, x) - expected_tokens(params, x, use_class_token=False))) <= TOLERANCE


def test_mone_at_full_capacity_equals_the_dense_model(tmp_path):
    params = reference_params()
    path = SOURCES["timm_safetensors"](params, tmp_path)
    dense, mone = classifier(), classifier(mone=True)
    convert.load_checkpoint(dense, str(path), "timm")
    report = convert.load_checkpoint(mone, str(path), "timm")
    assert any("router" in k for k in report["kept"])  # routers stay freshly initialised
    x = images()
    np.testing.assert_allclose(to_numpy(mone(x)), to_numpy(dense(x)), atol=1e-5)


def test_video_model_starts_from_a_converted_image_model(tmp_path):
    params = reference_params()
    image = classifier(use_class_token=True)
    convert.load_checkpoint(image, str(SOURCES["vision_transformer"](params, tmp_path)), "vision_transformer")
    video = models.vivit_from_image_backbone(image.backbone, num_frames=2, tubelet_size=2, temporal_depth=1)
    np.testing.assert_array_equal(to_numpy(video.blocks[0].attention.qkv.kernel), params["block_0/attention/qkv/kernel"])


def test_keras_hub_backbone_matches_output_for_output():
    keras_hub = pytest.importorskip("keras_hub")
    hub = keras_hub.models.ViTBackbone(image_shape=(32, 32, 3), patch_size=P, num_layers=DEPTH, num_heads=H,
                                       hidden_dim=D, mlp_dim=M)
    rng = np.random.default_rng(3)
    for variable in hub.weights:
        variable.assign(rng.normal(0, 0.2, variable.shape).astype("float32"))
    model = classifier()
    convert.load_checkpoint(model, hub, "keras_hub")
    x = images()
    np.testing.assert_allclose(backbone_tokens(model, x), to_numpy(hub(x)), atol=TOLERANCE)


@pytest.mark.parametrize(
    "change, message",
    [(dict(depth=3), "has 2 blocks but the model has `depth`=3"), (dict(hidden_dim=64, num_heads=4), "nothing was loaded")],
)
def test_a_checkpoint_of_another_size_changes_nothing(change, message, tmp_path):
    path = SOURCES["timm_safetensors"](reference_params(), tmp_path)
    config = dict(image_size=32, patch_size=P, hidden_dim=D, depth=DEPTH, num_heads=H, mlp_dim=M, use_class_token=True)
    config.update(change)
    model = models.ImageClassifier(models.ViTBackbone(**config), num_classes=CLASSES, pooling="token")
    model.build()
    before = model.get_weights()
    with pytest.raises(ValueError, match=message):
        convert.load_checkpoint(model, str(path), "timm")
    for old, new in zip(before, model.get_weights()):
        np.testing.assert_array_equal(old, new)


def test_damaged_and_mislabelled_checkpoints(tmp_path):
    params = reference_params()
    npz = SOURCES["vision_transformer"](params, tmp_path)
    with pytest.raises(ValueError, match="not a 'big_vision' ViT checkpoint"):
        convert.load_checkpoint(classifier(), str(npz), "big_vision")
    npz.write_bytes(npz.read_bytes()[:1000])
    with pytest.raises(ValueError, match="not a readable .npz"):
        convert.load_checkpoint(classifier(), str(npz), "vision_transformer")
    st = SOURCES["timm_safetensors"](params, tmp_path)
    st.write_bytes(st.read_bytes()[:-100])
    with pytest.raises(ValueError, match="truncated"):
        convert.load_checkpoint(classifier(), str(st), "timm")
    with pytest.raises(ValueError, match="`format` must be one of"):
        convert.load_checkpoint(classifier(), str(st), "safetensors")
    with pytest.raises(FileNotFoundError):
        convert.load_checkpoint(classifier(), str(tmp_path / "missing.npz"), "vision_transformer")
    assert keras.backend.backend() in ("jax", "tensorflow", "torch")
