"""Tests of the analytic MAC counter (keras_mone.analysis.flops).

Small configurations are checked against counts written out by hand, the
dense ViTs against their published GMACs, and the MoNE counts against the
matrix products the model actually executes.
"""

import dataclasses
import importlib
import math

import keras
import pytest

from keras_mone.analysis import FlopCount, flop_ratio, flops, register_flop_counter
from keras_mone.models import ImageClassifier, MoNEViTBackbone, ViTBackbone, decode_variant

# Small ViT used throughout: 32x32x3 images, 8x8 patches -> 4x4 = 16 patches,
# D = 16, 2 heads, MLP 64. Nested experts (E = 4): widths 2, 4, 8, 16.
SMALL = dict(image_size=32, patch_size=8, hidden_dim=16, depth=2, num_heads=2, mlp_dim=64)

# Patch convolution: 16 patches * (8 * 8 * 3 = 192 inputs) * 16 outputs.
PATCH = 16 * 192 * 16  # 49,152
# One learned router over N = 16 tokens: 16 tokens * D 16 * E 4.
ROUTER = 16 * 16 * 4  # 1,024
# Dense block, N = 16 tokens at width 16:
#   qkv 16*16*48 = 12,288; attention 2*16*16*16 = 8,192;
#   attention_output 16*16*16 = 4,096; mlp 2*16*16*64 = 32,768.
DENSE_BLOCK = 12_288 + 8_192 + 4_096 + 32_768  # 57,344


def small_mone(**kwargs):
    return MoNEViTBackbone(**{**SMALL, **kwargs})


def test_dense_small_by_hand():
    count = flops(ViTBackbone(**SMALL))
    assert dict(count.breakdown) == {
        "patch_embedding": PATCH,
        "qkv": 2 * 12_288,
        "attention": 2 * 8_192,
        "attention_output": 2 * 4_096,
        "mlp": 2 * 32_768,
    }
    assert count.total == PATCH + 2 * DENSE_BLOCK == 163_840
    assert count.gmacs == pytest.approx(163_840e-9)


def test_dense_class_token_and_head_by_hand():
    backbone = ViTBackbone(**SMALL, use_class_token=True)
    model = ImageClassifier(backbone, num_classes=10, pooling="token")
    # N = 17 (16 patches + class token); the patch convolution is unchanged.
    #   qkv 17*16*48 = 13,056; attention 2*17*17*16 = 9,248;
    #   attention_output 17*16*16 = 4,352; mlp 2*17*16*64 = 34,816.
    block = 13_056 + 9_248 + 4_352 + 34_816  # 61,472
    head = 16 * 10
    assert flops(backbone).total == PATCH + 2 * block == 172_096
    count = flops(model)
    assert count.breakdown["head"] == head
    assert count.total == 172_096 + 160 == 172_256


def test_rectangular_input():
    backbone = ViTBackbone(**{**SMALL, "image_size": (32, 48)})
    # 4 x 6 = 24 patches -> N = 24.
    patch = 24 * 192 * 16
    block = 24 * 16 * 48 + 2 * 24 * 24 * 16 + 24 * 16 * 16 + 2 * 24 * 16 * 64
    assert flops(backbone).total == patch + 2 * block == 73_728 + 2 * 92_160


def routed_block(counts, widths=(2, 4, 8, 16), active=None):
    """One routed block from per-expert token counts (used only as a cross-check)."""
    token_width = sum(k * w for k, w in zip(counts, widths))
    active = sum(counts) if active is None else active
    return token_width * 48 + 2 * active * active * 16 + token_width * 16 + 2 * token_width * 64


def test_mone_greedy_leftover_to_smallest_by_hand():
    backbone = small_mone(capacity=0.5, capacity_method="greedy")
    # Greedy: c_4 = (0.5 - 1/8) / (1 - 1/8) = 3/7, c_1 = 4/7.
    # k_4 = floor(16 * 3/7 = 6.86) = 6; floor(16 * 4/7 = 9.14) = 9, and the one
    # token left by integer packing goes to the smallest expert: k_1 = 10.
    assert backbone.expert_token_counts() == ((10, 0, 0, 6), 0)
    # Token-widths: 10*2 + 6*16 = 116.
    #   qkv 116*48 = 5,568; attention 2*16*16*16 = 8,192 (all tokens, full D);
    #   attention_output 116*16 = 1,856; mlp 2*116*64 = 14,848.
    block = 5_568 + 8_192 + 1_856 + 14_848  # 30,464
    count = flops(backbone)
    assert dict(count.breakdown) == {
        "patch_embedding": PATCH,
        "qkv": 2 * 5_568,
        "attention": 2 * 8_192,
        "attention_output": 2 * 1_856,
        "mlp": 2 * 14_848,
        "router": ROUTER,
    }
    assert count.total == PATCH + 2 * block + ROUTER == 111_104
    assert block == routed_block((10, 0, 0, 6))


def test_mone_eq3_capacity_with_leftover_by_hand():
    backbone = small_mone(capacity=0.3)
    # Eq. 3 at e_c = 0.3 gives c = (0.4135, 0.3214, 0.1942, 0.0709);
    # c * 16 = (6.62, 5.14, 3.11, 1.13): k_2..k_4 = 5, 3, 1, and the smallest
    # expert takes the rest, 16 - 9 = 7 (its floor 6 plus one leftover).
    assert backbone.expert_token_counts() == ((7, 5, 3, 1), 0), "EPR token counts changed"
    # Token-widths: 7*2 + 5*4 + 3*8 + 1*16 = 74.
    #   qkv 74*48 = 3,552; attention 8,192; attention_output 74*16 = 1,184;
    #   mlp 2*74*64 = 9,472.
    block = 3_552 + 8_192 + 1_184 + 9_472  # 22,400
    assert flops(backbone).total == PATCH + 2 * block + ROUTER == 94_976


@pytest.mark.parametrize(
    "capacity, counts, expected",
    [
        # Every token at the full expert: the dense count plus the router.
        (1.0, (0, 0, 0, 16), 163_840 + 1_024),
        # Every token at width 2: token-widths 32 -> 1,536 + 8,192 + 512 + 4,096.
        (0.125, (16, 0, 0, 0), PATCH + 2 * 14_336 + ROUTER),
    ],
)
def test_mone_capacity_extremes_by_hand(capacity, counts, expected):
    backbone = small_mone(capacity=capacity)
    assert backbone.expert_token_counts() == (counts, 0)
    assert flops(backbone).total == expected


@pytest.mark.parametrize("capacity", [0.125, 0.2, 0.3, 0.5, 0.75, 0.9, 1.0])
def test_mone_matches_formula(capacity):
    backbone = small_mone(capacity=capacity)
    counts, dropped = backbone.expert_token_counts()
    assert dropped == 0
    assert flops(backbone).total == PATCH + 2 * routed_block(counts) + ROUTER


def test_mone_monotone_in_capacity():
    backbone = small_mone(image_size=224, patch_size=16)
    totals = []
    for capacity in (0.125, 0.2, 0.3, 0.5, 0.75, 1.0):
        backbone.set_capacity(capacity)
        totals.append(flops(backbone).total)
    assert totals == sorted(totals) and len(set(totals)) == len(totals)


def test_multi_router_late_router_by_hand():
    kwargs = dict(depth=4, capacity=0.5, capacity_method="greedy", router_positions=(1, 3))
    backbone = small_mone(**kwargs)
    # Block 0 precedes the first router: all 16 tokens at full width (57,344).
    # Blocks 1-3 are routed with counts (10, 0, 0, 6): 30,464 each (see above).
    # Two learned routers, each scoring all 16 tokens: 2 * 1,024.
    expected = PATCH + 57_344 + 3 * 30_464 + 2 * 1_024
    count = flops(backbone)
    assert count.total == expected == 199_936
    assert count.breakdown["router"] == 2_048
    # A random router has no weights and costs no MACs.
    assert flops(small_mone(router_type="random", **kwargs)).total == expected - 2_048


def test_mod_greedy_dropped_tokens_by_hand():
    backbone = small_mone(capacity=0.25, capacity_method="mod_greedy")
    # MoD greedy: c = (0, 0, 0, 0.25): 4 tokens at full width, 12 dropped.
    assert backbone.expert_token_counts() == ((0, 0, 0, 4), 12)
    # Dropped tokens skip the block entirely, also as keys / values:
    #   qkv 4*16*48 = 3,072; attention 2*4*4*16 = 512;
    #   attention_output 4*16*16 = 1,024; mlp 2*4*16*64 = 8,192.
    block = 3_072 + 512 + 1_024 + 8_192  # 12,800
    # The router still scores all 16 tokens.
    assert flops(backbone).total == PATCH + 2 * block + ROUTER == 75_776


def test_mone_class_token_classifier_by_hand():
    backbone = small_mone(capacity=0.5, capacity_method="greedy", use_class_token=True)
    model = ImageClassifier(backbone, num_classes=10, pooling="token")
    # N = 17: k_4 = floor(17 * 3/7 = 7.29) = 7, the smallest expert takes 10.
    assert backbone.expert_token_counts() == ((10, 0, 0, 7), 0)
    # Token-widths 10*2 + 7*16 = 132:
    #   qkv 132*48 = 6,336; attention 2*17*17*16 = 9,248;
    #   attention_output 132*16 = 2,112; mlp 2*132*64 = 16,896.
    block = 6_336 + 9_248 + 2_112 + 16_896  # 34,592
    router = 17 * 16 * 4  # 1,088
    head = 16 * 10
    assert flops(model).total == PATCH + 2 * block + router + head == 119_584


def test_classifier_follows_capacity():
    model = ImageClassifier(small_mone(capacity=1.0), num_classes=10)
    full = flops(model).total
    model.set_capacity(0.5)
    half = flops(model).total
    assert half < full
    assert half == flops(model.backbone).total + 160


PUBLISHED_GMACS = {"Ti/16": 1.26, "S/16": 4.61, "B/16": 17.58, "L/16": 61.6}


@pytest.mark.parametrize("variant", sorted(PUBLISHED_GMACS))
def test_published_dense_vit_gmacs(variant):
    backbone = ViTBackbone(**decode_variant(variant), image_size=224, use_class_token=True)
    model = ImageClassifier(backbone, num_classes=1000, pooling="token")
    count = flops(model)
    assert backbone.num_tokens == 197
    assert count.gmacs == pytest.approx(PUBLISHED_GMACS[variant], rel=0.01)
    # Counting reads the configuration only: nothing is built.
    assert not model.built and not backbone.built and not model.weights


def test_mone_b16_against_dense():
    dense = ImageClassifier(ViTBackbone(**decode_variant("B/16")), num_classes=1000)
    mone = ImageClassifier(MoNEViTBackbone(**decode_variant("B/16"), capacity=1.0), num_classes=1000)
    # At e_c = 1 MoNE is the dense ViT plus one router (196 * 768 * 4 MACs).
    assert flops(mone).total - flops(dense).total == 196 * 768 * 4
    mone.set_capacity(0.5)
    ratio = flop_ratio(dense, mone)
    # Attention scores stay at full width, so e_c = 0.5 saves a bit less than 2x.
    assert 1.8 < ratio < 2.0


def test_flop_count_object():
    count = flops(small_mone(capacity=0.5))
    assert isinstance(count.total, int)
    assert list(count.breakdown)[:2] == ["patch_embedding", "qkv"]
    with pytest.raises(TypeError):
        count.breakdown["qkv"] = 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        count.label = "x"
    text = str(count)
    assert "router" in text and "total" in text and f"{count.total:,}" in text
    summed = FlopCount({"qkv": 1}) + FlopCount({"qkv": 2, "head": 3})
    assert dict(summed.breakdown) == {"qkv": 3, "head": 3} and summed.total == 6
    assert hash(summed) == hash(FlopCount({"qkv": 3, "head": 3}))
    with pytest.raises(ValueError):
        FlopCount({"qkv": -1})


def test_unknown_model_and_registry(monkeypatch):
    module = importlib.import_module("keras_mone.analysis.flops")
    monkeypatch.setattr(module, "_COUNTERS", dict(module._COUNTERS))

    class Custom:
        pass

    class SubCustom(Custom):
        pass

    with pytest.raises(TypeError, match="No FLOP counter for Custom"):
        flops(Custom())

    @register_flop_counter(Custom)
    def _count(model):
        return FlopCount({"mlp": 7}, label="custom")

    # Sub-classes use the counter of their closest registered ancestor.
    assert flops(SubCustom()).total == 7


# -- cross-check against the matrix products the model executes ----------------------
class _SymbolicCall(keras.Operation):
    """Runs ``fn`` on KerasTensors: Keras traces it for shapes (``Operation``'s
    default ``compute_output_spec``), ignoring any ``compute_output_shape``."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def call(self, inputs):
        return self.fn(inputs)


def _traced_block_macs(monkeypatch, model, batch=2):
    """MACs per example of every ``keras.ops.matmul`` and attention in ``model.call``.

    The call is traced symbolically (shapes only), which is all the count needs
    and much faster than running it eagerly.
    """
    from keras_mone.layers import attention as attention_module

    measured = {"matmul": 0, "attention": 0}
    matmul = keras.ops.matmul
    attention = attention_module.multi_head_attention

    def counting_matmul(x1, x2):
        a, b = tuple(x1.shape), tuple(x2.shape)
        measured["matmul"] += math.prod(a[:-1]) * a[-1] * b[-1]
        return matmul(x1, x2)

    def counting_attention(qkv, return_received_attention=False):
        # Counted here as a whole (QK^T and the weighted sum); the matmuls it
        # runs inside must not count as projections.
        parts = qkv if isinstance(qkv, (list, tuple)) else [qkv]  # MoNE's token groups come as parts
        _, _, _, heads, head_dim = parts[0].shape
        tokens = sum(part.shape[1] for part in parts)
        measured["attention"] += 2 * batch * tokens * tokens * heads * head_dim
        with monkeypatch.context() as inner:
            inner.setattr(keras.ops, "matmul", matmul)
            return attention(qkv, return_received_attention)

    with monkeypatch.context() as patch:
        patch.setattr(keras.ops, "matmul", counting_matmul)
        patch.setattr(attention_module, "multi_head_attention", counting_attention)
        images = keras.KerasTensor((batch, *model.input_shape_per_example))
        _SymbolicCall(model.call)(images)
    return {name: value // batch for name, value in measured.items()}


def test_counts_match_executed_matmuls(monkeypatch):
    # Late and repeated routers, a class token, four widths with a leftover
    # token, and (mod_greedy) dropped tokens.
    late = dict(depth=3, router_positions=(1, 2), use_class_token=True)
    cases = [
        (small_mone(capacity=0.3, **late), (0.3, 0.75)),
        (small_mone(capacity=0.25, capacity_method="mod_greedy", **late), (0.25, 0.6)),
    ]
    for backbone, capacities in cases:
        backbone.build()
        for capacity in capacities:
            backbone.set_capacity(capacity)
            measured = _traced_block_macs(monkeypatch, backbone)
            count = flops(backbone).breakdown
            assert measured["attention"] == count["attention"], capacity
            assert measured["matmul"] == count["qkv"] + count["attention_output"] + count["mlp"]
