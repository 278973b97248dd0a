"""torch: blocks and LayerNorms run without Keras' ``Layer.__call__`` on eager torch (issue 40 item 3).

``Layer.__call__`` costs host time per call (argument flattening, call spec,
scopes) that an eager torch forward pays before its kernels run: about half the
host time of a forward (``bench/torch_host_time.py``). ``run_blocks`` asks each
block for ``ViTBlock.direct_call`` and the packed block runs its LayerNorms as
torch ops. These tests check that the results are the layer calls' bit for bit,
in float32 and mixed_bfloat16, forward and backward, and that every case the
direct call cannot take goes through ``Layer.__call__`` as before. Skipped on
jax and tensorflow.
"""

import importlib
import pathlib

import keras
import numpy as np
import pytest
from conftest import BACKEND, TINY, images, randomize_weights, to_numpy

from keras_mone.bench.torch_ops import layer_calls
from keras_mone.layers import ViTBlock, packed_block, torch_eager
from keras_mone.layers import block as block_module
from keras_mone.models import MoNEViTBackbone, ViTBackbone

pytestmark = pytest.mark.skipif(BACKEND != "torch", reason="torch's eager path")

if BACKEND == "torch":
    import torch


def _model(kind, dtype="float32", **kwargs):
    config = {**TINY, "dtype": dtype, **kwargs}
    model = MoNEViTBackbone(**config, capacity=0.3) if kind == "mone" else ViTBackbone(**config)
    model.build()
    randomize_weights(model, seed=3)
    return model


def _without_direct_calls(monkeypatch):
    monkeypatch.setattr(ViTBlock, "direct_call", lambda self, *args, **kwargs: None)


def _through_keras(monkeypatch):
    """No direct calls, and the packed block's LayerNorms, casts and GELU through Keras' own
    layer call and ops: the reference the direct paths must equal bit for bit."""
    _without_direct_calls(monkeypatch)
    monkeypatch.setattr(packed_block, "direct_layer_norm", lambda layer, x: layer(x))
    monkeypatch.setattr(packed_block, "direct_cast", keras.ops.cast)
    monkeypatch.setattr(block_module, "direct_cast", keras.ops.cast)
    monkeypatch.setattr(packed_block, "_gelu", lambda x, approximate, training, nested: keras.ops.gelu(x, approximate))


def _exactly_equal(a, b):
    a, b = to_numpy(a).astype("float32"), to_numpy(b).astype("float32")
    return a.shape == b.shape and np.array_equal(a, b)


@pytest.mark.parametrize("dtype", ["float32", "mixed_bfloat16"])
@pytest.mark.parametrize("kind", ["dense", "mone"])
def test_direct_block_calls_equal_layer_calls(kind, dtype, monkeypatch):
    """Forward outputs and gradients with and without ``direct_call`` and the packed block's
    torch LayerNorms, casts and GELU, bit for bit (MoNE's gates, float32 router
    probabilities, are cast to bf16 as ``Layer.__call__`` casts them)."""
    model = _model(kind, dtype)
    x = torch.as_tensor(images())

    def run():
        outputs = model(x, training=True)  # no dropout in TINY: the packed path trains too
        gradients = torch.autograd.grad(outputs.float().square().sum(), [v.value for v in model.trainable_weights],
                                        allow_unused=True)
        return outputs.detach(), [g for g in gradients if g is not None]

    with torch.inference_mode():
        direct_inference = model(x)
    direct, direct_gradients = run()
    _through_keras(monkeypatch)
    with torch.inference_mode():
        called_inference = model(x)
    called, called_gradients = run()
    assert str(direct.dtype) == str(called.dtype)
    assert _exactly_equal(direct_inference, called_inference)
    assert _exactly_equal(direct, called)
    assert len(direct_gradients) == len(called_gradients) > 0
    assert all(_exactly_equal(a, b) for a, b in zip(direct_gradients, called_gradients))


def test_direct_calls_are_taken_and_layer_calls_no_longer_grow_with_depth(monkeypatch):
    """A forward's Keras layer calls are the same at depth 2 and 4 (the blocks and their
    LayerNorms are no longer called through Keras); without direct calls they grow."""
    x = torch.as_tensor(images())

    def calls(kind, depth):
        model = _model(kind, depth=depth)
        model(x)
        return layer_calls(lambda: model(x))

    for kind in ("dense", "mone"):
        assert calls(kind, 2) == calls(kind, 4), kind
    taken = []
    original = ViTBlock.direct_call

    def counted(self, *args, **kwargs):
        outputs = original(self, *args, **kwargs)
        taken.append(outputs is not None)
        return outputs

    monkeypatch.setattr(ViTBlock, "direct_call", counted)
    model = _model("mone")
    model(x)
    assert taken == [True] * TINY["depth"]  # asked once per block, and taken
    _without_direct_calls(monkeypatch)
    assert calls("dense", 4) > calls("dense", 2)


def test_the_blocks_after_a_router_cast_and_join_its_gates_once(monkeypatch):
    """mixed_bfloat16 MoNE (one router, four blocks): the first block casts the router's gates
    to bf16 and joins them into token-major rows (``TokenGroups.gate_forms``), the three after it
    read them; the outputs are bit for bit those of a cast and a join in every block. Not while
    autograd records the gates."""
    model = _model("mone", "mixed_bfloat16", depth=4)
    x = torch.as_tensor(images())
    model(x)
    casts, joins = [], []
    cast, join = block_module.direct_cast, packed_block.token_major
    monkeypatch.setattr(block_module, "direct_cast", lambda t, dtype: casts.append(1) or cast(t, dtype))
    monkeypatch.setattr(packed_block, "token_major", lambda parts: joins.append(parts[0].dim()) or join(parts))
    with torch.no_grad():
        shared = model(x)
    gated, shared_joins = len(casts), joins.count(2)
    assert gated > 0 and shared_joins == 1 and joins.count(3) == 4  # gates once; every block's groups
    casts.clear()
    model(x, training=True)  # autograd records the gates: each block casts its own (gradients summed in float32)
    assert len(casts) == 4 * gated
    rebuilt = lambda forms, key, make, source: make()  # noqa: E731 - a cast and a join in every block
    monkeypatch.setattr(block_module, "shared_gate_form", rebuilt)
    monkeypatch.setattr(packed_block, "shared_gate_form", rebuilt)
    casts.clear(), joins.clear()
    with torch.no_grad():
        per_block = model(x)
    assert len(casts) == 4 * gated and joins.count(2) == 4
    assert _exactly_equal(shared, per_block)


def test_a_shared_gate_form_is_made_once_per_source():
    """``packed_block.shared_gate_form``: made once for the same gates (the same object), made
    again for other gates under the same key, and made every time without a dict."""
    made = []
    forms, gates, others = {}, [object()], [object()]

    def make():
        made.append(1)
        return len(made)

    assert [packed_block.shared_gate_form(forms, "k", make, g) for g in (gates, gates, others, others)] == [1, 1, 2, 2]
    assert packed_block.shared_gate_form(None, "k", make, gates) == 3


def test_an_inference_forward_no_longer_holds_every_block_input(monkeypatch):
    """Peak bytes an inference forward allocates (Python's cycle collector held off, as in
    ``bench/torch_op_count.py``): the same at depth 2 and 6. Through ``Layer.__call__``
    each block's inputs stayed alive to the end of the forward (the reference cycle of
    the pytree flattening of its arguments), one more token tensor per block."""
    from keras_mone.bench.memory import torch_peak_bytes

    x = torch.as_tensor(images(batch=8))

    def peak(kind, depth):
        model = _model(kind, depth=depth, mlp_dim=256)
        with torch.no_grad():
            model(x)
            return torch_peak_bytes(lambda: model(x))

    for kind in ("dense", "mone"):
        assert peak(kind, 2) == peak(kind, 6), kind
    _without_direct_calls(monkeypatch)
    assert peak("dense", 6) > peak("dense", 2)


def test_what_the_direct_call_cannot_take_goes_through_the_layer_call():
    """``direct_call`` answers ``None`` (and ``run_blocks`` calls the layer) for an unbuilt
    block, symbolic inputs, inputs not in the block's dtype (``Layer.__call__`` casts them),
    gates on a block without a gate (the call raises), rematerialisation, an activity
    regularizer, ``autocast`` off, a subclass's own ``call``, and requests it does not serve."""
    dim = TINY["hidden_dim"]
    x = torch.as_tensor(np.random.default_rng(0).standard_normal((2, 5, dim)).astype("float32"))
    block = ViTBlock(dim, TINY["num_heads"], TINY["mlp_dim"])
    assert block.direct_call([x], [dim]) is None  # not built
    block.build((None, None, dim))
    assert _exactly_equal(block.direct_call(x, None), block(x))
    assert block.direct_call([keras.KerasTensor((2, 5, dim))], [dim]) is None
    gates = [torch.ones((2, 5))]
    assert block.direct_call([x], [dim], gates=gates) is None
    with pytest.raises(ValueError, match="without a gate"):
        block([x], widths=[dim], gates=gates)
    half = ViTBlock(dim, TINY["num_heads"], TINY["mlp_dim"], dtype="mixed_bfloat16")
    half.build((None, None, dim))
    assert half.direct_call([x], [dim]) is None  # float32 into a bf16 block: the layer call casts
    assert str(half(x).dtype) == "torch.bfloat16"
    assert block.direct_call([x[:, :0]], [dim]) is None  # an empty group: the generic path
    with keras.RematScope(mode="full"):
        remat = ViTBlock(dim, TINY["num_heads"], TINY["mlp_dim"])
    remat.build((None, None, dim))
    assert remat.direct_call([x], [dim]) is None

    regularized = ViTBlock(dim, TINY["num_heads"], TINY["mlp_dim"], activity_regularizer="l2")
    regularized.build((None, None, dim))
    assert regularized.direct_call([x], [dim]) is None
    regularized(x)
    assert len(regularized.losses) == 1
    block.autocast = False
    assert block.direct_call([x], [dim]) is None  # ``Layer.__call__``'s casting rules then differ
    block.autocast = True

    class Scaled(ViTBlock):
        def call(self, inputs, **kwargs):
            return super().call(inputs, **kwargs) * 2.0

    scaled = Scaled(dim, TINY["num_heads"], TINY["mlp_dim"])
    scaled.build((None, None, dim))
    assert scaled.direct_call([x], [dim]) is None


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_layer_norms_without_the_layer_call_are_bit_exact(policy):
    layer = keras.layers.LayerNormalization(epsilon=1e-3, dtype=policy)  # not the blocks' 1e-6
    layer.build((None, 5, 24))
    randomize_weights(layer, seed=4)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.as_tensor(np.random.default_rng(1).standard_normal((3, 5, 24)).astype("float32")).to(dtype)
        expected, got = layer(x), torch_eager.direct_layer_norm(layer, x)
        assert got.dtype == expected.dtype and torch.equal(got, expected)
    other_axis = keras.layers.LayerNormalization(axis=(1, 2), dtype=policy)  # through its own call
    other_axis.build((None, 5, 24))
    assert torch.equal(torch_eager.direct_layer_norm(other_axis, x), other_axis(x))


def test_the_host_time_bench_reports_dense_mone_and_the_plain_torch_floor(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
    importlib.import_module("torch_host_time").main(["--variant", "Ti/16", "--image-size", "32", "--repeats", "3"])
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in out.splitlines() if line.startswith("| ")}
    assert set(rows) == {"model", "dense", "mone e_c=0.3", "plain PyTorch ViT (same shape)"}
    assert rows["dense"][2].strip() == "1.00x"
    assert all(float(rows[name][0]) > 0 for name in rows if name != "model")


def test_torch_module_hooks_still_fire():
    """Only ``torch.nn.Module.__call__`` runs hooks: with a hook on a block, on one of its
    LayerNorms, on a part (its qkv projection), or a global one, that layer is called as a
    layer again."""
    model = _model("mone")
    x = torch.as_tensor(images())
    seen = []
    blocks = [layer for layer in model._flatten_layers() if isinstance(layer, ViTBlock)]
    block = blocks[0]
    handle = block.register_forward_hook(lambda module, args, output: seen.append("block"))
    model(x)
    handle.remove()
    handle = block.norm1.register_forward_hook(lambda module, args, output: seen.append("norm1"))
    model(x)
    handle.remove()
    handle = block.attention.qkv.register_forward_hook(lambda module, args, output: seen.append("qkv"))
    model(x)  # a hook on a part: that block takes the generic path, which calls its parts
    handle.remove()
    qkv_calls = seen.count("qkv")
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, output: seen.append("global") if isinstance(module, ViTBlock) else None
    )
    model(x)
    handle.remove()
    assert qkv_calls >= 1
    assert seen == ["block", "norm1"] + ["qkv"] * qkv_calls + ["global"] * len(blocks)
    seen.clear()
    model(x)
    assert not seen


def test_stateless_calls_read_the_given_weights():
    """``stateless_call`` (Keras' functional form, used by its trainers) with other weights
    equals the model holding those weights: the packed block reads variables as Keras does."""
    model = _model("mone")
    x = torch.as_tensor(images())
    other = [v.value * 1.5 for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    stateless, _ = model.stateless_call(other, non_trainable, x)
    for variable, value in zip(model.trainable_variables, other):
        variable.assign(value)
    assert _exactly_equal(stateless, model(x))
