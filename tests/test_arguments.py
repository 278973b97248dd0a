"""Constructor arguments are checked before anything is built: types, ranges, relations."""

import numpy as np
import pytest

from keras_mone.models import ImageClassifier, MoNEViTBackbone, ViTBackbone

SMALL = dict(image_size=16, patch_size=8, hidden_dim=16, depth=2, num_heads=2, mlp_dim=32)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(image_size="88"), "image_size"),
        (dict(image_size=(16, "16")), "image_size"),
        (dict(image_size=True), "image_size"),
        (dict(patch_size=8.0), "patch_size"),
        (dict(depth=0), "depth"),
        (dict(depth="2"), "depth"),
        (dict(mlp_dim=0), "mlp_dim"),
        (dict(num_heads=0), "num_heads"),
        (dict(num_heads=3), "divisible by `num_heads`"),
        (dict(hidden_dim=16.0), "hidden_dim"),
        (dict(layer_norm_epsilon=-1.0), "layer_norm_epsilon"),
        (dict(layer_norm_epsilon=float("nan")), "layer_norm_epsilon"),
        (dict(dropout_rate=1.0), "dropout_rate"),
        (dict(drop_path_rate=-0.1), "drop_path_rate"),
    ],
)
def test_bad_backbone_arguments_name_the_argument(change, message):
    with pytest.raises(ValueError, match=message):
        ViTBackbone(**{**SMALL, **change})


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(capacity="0.5"), "capacity"),
        (dict(capacity=True), "capacity"),
        (dict(capacity=0.0), "capacity"),
        (dict(router_positions="0"), "router_positions"),
        (dict(router_positions=[0.0]), "router_positions"),
        (dict(router_positions=[5]), "router_positions"),
        (dict(num_experts=2.0), "num_experts"),
    ],
)
def test_bad_mone_arguments_name_the_argument(change, message):
    with pytest.raises(ValueError, match=message):
        MoNEViTBackbone(**{**SMALL, **change})


def test_numpy_integers_are_ints():
    backbone = ViTBackbone(**{**SMALL, "depth": np.int64(2), "image_size": np.int32(16)})
    model = ImageClassifier(backbone, num_classes=np.int64(10))
    assert model.num_classes == 10 and type(model.num_classes) is int and backbone.depth == 2
    assert model.get_config()["num_classes"] == 10


@pytest.mark.parametrize("num_classes", [0, "10", 2.0, True])
def test_bad_num_classes(num_classes):
    with pytest.raises(ValueError, match="num_classes"):
        ImageClassifier(ViTBackbone(**SMALL), num_classes=num_classes)
