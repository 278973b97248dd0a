"""torch: MoNE's forward never waits on the host, and issues few ops (issue 40, item 3).

Eager torch on a GPU is fast only while the host runs ahead of the device:
one read of a tensor value on the host (``.item()``, ``int(t)``, ``if t:``, a
boolean mask, ``nonzero``: anything whose result shape depends on values)
makes the host wait for every queued kernel, and each op costs host time to
launch. Every aten op of a forward (and backward) pass is recorded with a
``TorchDispatchMode``; the recorder is checked on code that does synchronise
first, so a silent recorder cannot pass the tests. Skipped on jax and
tensorflow.
"""

import math

import keras
import numpy as np
import pytest
from conftest import BACKEND, NUM_TOKENS, TINY, assert_f32_close, images, randomize_weights, to_numpy

from keras_mone.analysis import flops
from keras_mone.bench.torch_ops import kernel_ops, layer_calls, record
from keras_mone.layers import block as block_module
from keras_mone.layers import packed_block
from keras_mone.models import MatViTBackbone, MoNEViTBackbone, ViTBackbone

pytestmark = pytest.mark.skipif(BACKEND != "torch", reason="torch's dispatcher records the ops")

if BACKEND == "torch":
    import torch


# Ops that read tensor values on the host, or whose output shape depends on them.
HOST_SYNC_OPS = {
    "_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "argwhere", "masked_select",
    "masked_scatter", "_unique", "_unique2", "unique_dim", "unique_consecutive", "repeat_interleave.Tensor",
}
def synchronisations(recorder):
    found = {name: n for name, n in recorder.counts.items() if name in HOST_SYNC_OPS}
    if recorder.boolean_indexing:
        found["boolean-mask indexing"] = recorder.boolean_indexing
    return found


def tiny_mone(**kwargs):
    model = MoNEViTBackbone(**{**TINY, "capacity": 0.3, **kwargs})
    model.build()
    randomize_weights(model, seed=1)
    return model


def test_the_recorder_sees_host_synchronisations():
    x = torch.arange(6.0)
    assert "_local_scalar_dense" in synchronisations(record(lambda: x.sum().item()))
    assert synchronisations(record(lambda: int(x.max())))
    assert synchronisations(record(lambda: bool(x[0] > 1)))
    assert synchronisations(record(lambda: x[x > 2]))
    assert "nonzero" in synchronisations(record(lambda: torch.nonzero(x)))
    assert synchronisations(record(lambda: torch.repeat_interleave(torch.tensor([1, 2]))))
    assert not synchronisations(record(lambda: torch.topk(x, 2)))


MODELS = {
    "learned": dict(),
    "class token to the full expert, late routers": dict(use_class_token=True, class_token_to_full_expert=True, router_positions=(1, 2), depth=3),
    "mod_greedy (dropped tokens)": dict(capacity=0.25, capacity_method="mod_greedy"),
    "random router": dict(router_type="random", router_seed=3),
    "capacity 1": dict(capacity=1.0),
}


@pytest.mark.parametrize("fused", [False, True], ids=["CPU form", "GPU form"])
@pytest.mark.parametrize("name", list(MODELS))
def test_mone_forward_and_backward_never_read_values_on_the_host(name, fused, monkeypatch):
    """In both forms of the packed blocks (``fuse_groups``). The random
    router's one read is Keras': its torch RNG seeds a ``torch.Generator``
    with the ``SeedGenerator`` state read on the host, one read per draw
    (every Keras random op on torch does, dropout included)."""
    monkeypatch.setattr(packed_block, "fuse_groups", lambda x: fused)
    expected = {"_local_scalar_dense": 1} if MODELS[name].get("router_type") == "random" else {}
    model = tiny_mone(**MODELS[name])
    x = torch.as_tensor(images())
    model(x)  # first call: builds, fills caches

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor was read on the host during the forward pass")

    # host reads the dispatcher does not see: numpy views and lists of CPU tensors
    monkeypatch.setattr(torch.Tensor, "numpy", refuse)
    monkeypatch.setattr(torch.Tensor, "tolist", refuse)
    monkeypatch.setattr(keras.ops, "convert_to_numpy", refuse)
    with torch.no_grad():
        assert synchronisations(record(lambda: model(x))) == expected
    assert synchronisations(record(lambda: model(x, training=True).square().mean().backward())) == expected


def _per_block_and_rest(make, x):
    """Kernel ops of one block (difference of depth 3 and depth 2) and of everything else."""
    counts = {}
    for depth in (2, 3):
        model = make(depth)
        model(x)
        with torch.no_grad():
            counts[depth] = kernel_ops(record(lambda: model(x)))
    block = counts[3] - counts[2]
    return block, counts[2] - 2 * block


def test_mone_op_count_stays_near_the_dense_count(monkeypatch):
    """A regression guard on ops per forward, not a timing; counted in the form
    a GPU runs (``fuse_groups``), where each op is a kernel launch.

    A MoNE block with G token groups runs each group's four projections as
    its own GEMM (bias inside); the zero padding of the two out-projections is
    per group too: at most 6 ops more than a dense block per extra group,
    plus up to 10 for packing the groups (concatenations, the gate).
    Measured: dense 12 ops per block, MoNE at G = 4 31, router and EPR 58
    (9 per expert, 3 gathers, the inverse permutation); MoNE 38 before the
    out-projections wrote into one buffer and groups stayed views between
    blocks; 16 and 48 before each bias went into its GEMM (``addmm``), 18,
    79 and 182 before issue 40.
    """
    monkeypatch.setattr(packed_block, "fuse_groups", lambda x: True)
    x = torch.as_tensor(images())
    mone = tiny_mone()
    groups = sum(1 for k in mone.expert_token_counts()[0] if k)
    assert groups == 4
    mone_block, mone_rest = _per_block_and_rest(lambda depth: tiny_mone(depth=depth), x)
    dense_block, dense_rest = _per_block_and_rest(lambda depth: ViTBackbone(**{**TINY, "depth": depth}), x)
    assert mone_block <= dense_block + 6 * (groups - 1) + 10, (mone_block, dense_block)
    routing = mone_rest - dense_rest
    assert routing <= 12 * groups + 20, routing


def test_mone_forward_calls_few_layers():
    """No block calls a Keras layer on eager torch (``ViTBlock.direct_call``, its LayerNorms
    as torch ops): the backbone, its embedding and final norm are the calls left (a
    dense block called 13 layers before issue 40, a MoNE block 4 per group and more; the
    packed block 3)."""
    x = torch.as_tensor(images())
    calls = {}
    dense = ViTBackbone(**TINY)
    dense.build()
    for name, model in {"dense": dense, "mone": tiny_mone()}.items():
        model(x)
        calls[name] = layer_calls(lambda: model(x))
    assert calls["dense"] <= 4, calls  # the backbone, its embedding (2), its norm; none per block
    assert calls["mone"] <= calls["dense"] + 2, calls  # + the router and its dense layer


def test_packed_matmuls_are_the_counted_flops():
    """The matmuls and attention the packed blocks execute are exactly the MACs
    ``keras_mone.flops`` counts: no group runs at a width it does not need."""
    model = tiny_mone(use_class_token=True, router_positions=(1,), depth=3)
    x = torch.as_tensor(images())
    model(x)
    with torch.no_grad():
        recorder = record(lambda: model(x))
    count = flops(model).breakdown
    batch = x.shape[0]
    macs = {"mm": 0, "attention": 0}
    for name, shapes in recorder.products:
        if name in ("mm", "addmm"):  # addmm(bias, x, kernel): a projection with its bias in the GEMM
            (rows, inner), (_, cols) = shapes[:2] if name == "mm" else shapes[1:3]
            macs["mm"] += rows * inner * cols
        elif name.startswith("_scaled_dot_product"):
            b, heads, tokens, head_dim = shapes[0]
            macs["attention"] += 2 * b * heads * tokens * tokens * head_dim
    projections = count["qkv"] + count["attention_output"] + count["mlp"] + count["router"]
    assert macs["mm"] == batch * projections
    assert macs["attention"] == batch * count["attention"]


def _generic(monkeypatch):
    monkeypatch.setattr(block_module, "packable", lambda *args, **kwargs: False)


PACKED_CASES = {
    **MODELS,
    "dense ViT": None,
    "MatViT (one nested width per block)": "matvit",
}


def _case_model(name):
    if MODELS.get(name) is not None:
        return tiny_mone(**MODELS[name])
    if PACKED_CASES[name] == "matvit":
        model = MatViTBackbone(**TINY, layer_width_fractions=[0.25, 0.5])
    else:
        model = ViTBackbone(**TINY)
    model.build()
    randomize_weights(model, seed=1)
    return model


@pytest.mark.parametrize("fused", [False, True], ids=["CPU form", "GPU form"])
@pytest.mark.parametrize("name", list(PACKED_CASES))
def test_packed_blocks_equal_the_generic_path(name, fused, monkeypatch):
    """Outputs and gradients of the packed blocks against the per-group generic
    path (same ops per token, float32 rounding at most), in both forms
    (``fuse_groups``). The packed run goes first under ``torch.inference_mode``,
    so constants it caches must still serve a backward pass."""
    monkeypatch.setattr(packed_block, "fuse_groups", lambda x: fused)
    model = _case_model(name)
    x = torch.as_tensor(images())
    # the random router's seed state, restored before each call: every call draws the same numbers
    seeds = [(v, to_numpy(v)) for v in model.non_trainable_variables]

    def call(**kwargs):
        for variable, value in seeds:
            variable.assign(value)
        return model(x, **kwargs)

    with torch.inference_mode():
        packed_inference = to_numpy(call())

    def forward_and_gradients():
        outputs = call(training=True)
        loss = (outputs * torch.linspace(-1.0, 1.0, outputs.shape[-1])).square().mean()
        variables = [v.value for v in model.trainable_variables]
        grads = torch.autograd.grad(loss, variables, allow_unused=True)
        return to_numpy(outputs), [None if g is None else g.numpy() for g in grads]

    packed, packed_grads = forward_and_gradients()
    with monkeypatch.context() as patch:
        _generic(patch)
        expected, expected_grads = forward_and_gradients()
    assert_f32_close(packed_inference, expected)
    assert_f32_close(packed, expected)
    for variable, got, want in zip(model.trainable_variables, packed_grads, expected_grads):
        assert (got is None) == (want is None), variable.path
        if got is not None:
            np.testing.assert_allclose(got, want, atol=1e-5 * max(1.0, float(np.abs(want).max())), err_msg=variable.path)


@pytest.mark.parametrize("fused", [False, True], ids=["CPU form", "GPU form"])
def test_packed_blocks_equal_the_generic_path_in_mixed_precision(fused, monkeypatch):
    monkeypatch.setattr(packed_block, "fuse_groups", lambda x: fused)
    model = MoNEViTBackbone(**TINY, capacity=0.3, dtype="mixed_bfloat16")
    model.build()
    randomize_weights(model, seed=1)
    x = torch.as_tensor(images())
    with torch.no_grad():
        packed = model(x)
        _generic(monkeypatch)
        expected = model(x)
    assert packed.dtype == expected.dtype == torch.bfloat16
    scale = float(expected.float().abs().max())
    assert math.isfinite(scale) and scale > 0
    np.testing.assert_allclose(packed.float().numpy(), expected.float().numpy(), atol=2e-2 * scale)


@pytest.mark.parametrize("fused", [False, True], ids=["CPU form", "GPU form"])
def test_mone_inference_holds_no_more_memory_than_dense(fused, monkeypatch):
    """Peak bytes of the tensors an inference forward allocates (torch.profiler's
    memory events): MoNE at e_c 0.3 at most dense's plus its routing state, in
    both packed forms, with a wide MLP so that its hidden activations dominate.
    The routing state: the tokens gathered in expert order (a copy of the
    embedded tokens, alive into the second block), the gathered router
    probabilities (one per token and expert) and the token order. Stacking the
    groups' products for one GELU held the products and their copy at once:
    1.4x dense's peak here, 1.05x at ViT-B/16, batch 8 (issue 40: 739 against
    664 MiB on an H200, batch 64)."""
    from keras_mone.bench.memory import torch_peak_bytes

    monkeypatch.setattr(packed_block, "fuse_groups", lambda x: fused)
    geometry = {**TINY, "mlp_dim": 1024}
    x = torch.as_tensor(images(batch=8))
    peaks = {}
    for name, model in {"dense": ViTBackbone(**geometry), "mone": MoNEViTBackbone(**geometry, capacity=0.3)}.items():
        model.build()
        with torch.no_grad():
            model(x)
            peaks[name] = torch_peak_bytes(lambda: model(x))
    rows = x.shape[0] * NUM_TOKENS
    experts = len(model.expert_widths)
    assert peaks["dense"] >= 2 * rows * geometry["mlp_dim"] * 4  # the recorder sees the MLP's hidden activations
    routing_state = rows * (geometry["hidden_dim"] + experts) * 4 + rows * 4
    assert peaks["mone"] <= peaks["dense"] + routing_state, peaks


def test_the_op_count_bench_reports_counts_and_peaks_of_the_gpu_form(monkeypatch, capsys):
    """``bench/torch_op_count.py --gpu-form``: kernel ops, layer calls, compiled graphs
    and peak forward MiB of dense and MoNE, counted in the packed blocks' GPU form."""
    import importlib
    import pathlib

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
    monkeypatch.setattr(packed_block, "fuse_groups", packed_block.fuse_groups)  # the script replaces it
    importlib.import_module("torch_op_count").main(
        ["--variant", "Ti/16", "--image-size", "32", "--batch-size", "2", "--gpu-form"]
    )
    out = capsys.readouterr().out
    assert "batch 2, float32, the packed blocks' GPU form" in out
    rows = {
        line.split("|")[1].strip(): [float(cell) for cell in line.split("|")[2:-1]]
        for line in out.splitlines() if line.startswith(("| dense", "| mone"))
    }
    (ops, calls, graphs, peak), (mone_ops, mone_calls, mone_graphs, mone_peak) = rows["dense"], rows["mone e_c=0.3"]
    assert graphs == mone_graphs == 1 and calls <= mone_calls <= calls + 2
    assert 0 < ops < mone_ops and 0 < peak and 0 < mone_peak


@pytest.mark.parametrize("fused", [False, True], ids=["CPU form", "GPU form"])
def test_packed_blocks_under_autocast_and_torch_func(fused, monkeypatch):
    """The inference buffers (``out=``) and the reuse of a tensor the groups view
    (data pointers) stand aside where they cannot work: under ``torch.autocast``
    (which casts no ``out=`` call's inputs: bf16 attention outputs met a float32
    kernel) and under ``torch.func`` transforms (wrapper tensors have no storage).
    Both raised before; now they equal the generic path."""
    monkeypatch.setattr(packed_block, "fuse_groups", lambda x: fused)
    model = tiny_mone()
    x = torch.as_tensor(images())

    def run():
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = model(x)
        gradient = torch.func.grad(lambda t: model(t).square().mean())(x)
        return autocast.float().numpy(), gradient.detach().numpy()

    packed = run()
    _generic(monkeypatch)
    expected = run()
    np.testing.assert_allclose(packed[0], expected[0], atol=2e-2 * float(np.abs(expected[0]).max()))
    assert_f32_close(packed[1], expected[1])
