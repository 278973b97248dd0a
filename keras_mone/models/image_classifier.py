"""Image classification task: a backbone, pooling and a linear head."""

import keras
from keras import ops

from keras_mone.layers.arguments import integer
from keras_mone.layers.config import ConfigMixin, register
from keras_mone.models.capacity_control import CapacityControlMixin
from keras_mone.models.loop_guard import LoopGuardMixin
from keras_mone.models.serving import ServingMixin
from keras_mone.models.weights_file import SafeLoadingMixin

POOLINGS = ("gap", "token")


@register
class ImageClassifier(LoopGuardMixin, SafeLoadingMixin, CapacityControlMixin, ConfigMixin, ServingMixin, keras.Model):
    """Logits from a ViT-family backbone.

    ``pooling="gap"`` averages all token features (the MoNE paper, Sec. 4.1);
    ``"token"`` reads the class token (the backbone needs
    ``use_class_token=True``). The head kernel starts at zero and its bias at
    ``head_bias_init`` (AugReg: -10 for ImageNet-21k, -6.9 for ImageNet-1k with
    sigmoid cross-entropy). Logits are float32 under any dtype policy.

    For MoNE backbones, ``set_capacity`` / ``capacity`` act on the backbone and
    ``predict`` / ``evaluate`` / ``fit`` follow the capacity set last.

    Args:
        backbone: a ``ViTBackbone`` or ``MoNEViTBackbone``.
        num_classes: number of output logits.
        pooling: "gap" or "token".
        head_bias_init: initial value of the head bias.
        head_dropout_rate: dropout before the head.
    """

    def __init__(
        self, backbone, num_classes=1000, pooling="gap", head_bias_init=0.0, head_dropout_rate=0.0, **kwargs
    ):
        super().__init__(**kwargs)
        if pooling not in POOLINGS:
            raise ValueError(f"`pooling` must be one of {POOLINGS}, got {pooling!r}.")
        if pooling == "token" and not backbone.use_class_token:
            raise ValueError('`pooling="token"` needs a backbone built with use_class_token=True.')
        num_classes = integer("num_classes", num_classes)
        self.backbone = backbone
        self.num_classes = num_classes
        self.pooling = pooling
        self.head_bias_init = head_bias_init
        self.head_dropout_rate = head_dropout_rate
        self.dropout = keras.layers.Dropout(head_dropout_rate)
        self.head = keras.layers.Dense(
            num_classes,
            kernel_initializer="zeros",
            bias_initializer=keras.initializers.Constant(head_bias_init),
            dtype=backbone.dtype_policy,
            name="head",
        )

    def build(self, input_shape=None):
        if not self.backbone.built:
            self.backbone.build((None, *self.backbone.input_shape_per_example))
        self.head.build((None, self.backbone.hidden_dim))
        self.built = True

    def check_inputs(self, inputs):
        """Raises a ``ValueError`` naming the argument if ``inputs`` do not fit the model."""
        self.backbone.check_inputs(inputs)

    def pool(self, tokens):
        """Pooled features ``(batch, hidden_dim)`` from backbone tokens."""
        if self.pooling == "token":
            return tokens[:, 0]
        return ops.mean(tokens, axis=1)

    def call(self, images, training=None):
        features = self.pool(self.backbone(images, training=training))
        features = self.dropout(features, training=training)
        return ops.cast(self.head(features), "float32")

    # -- capacity, delegated to a MoNE backbone -------------------------------
    @property
    def capacity(self):
        """Effective capacity of the backbone (1.0 for a dense backbone)."""
        return self.backbone.capacity

    @property
    def realised_capacity(self):
        """Effective capacity the backbone's whole-token counts give (1.0 for a dense backbone)."""
        return getattr(self.backbone, "realised_capacity", 1.0)

    def set_capacity(self, capacity):
        """Sets the backbone's effective capacity (MoNE backbones; dense ones accept only 1.0)."""
        self.backbone.set_capacity(capacity)

    def routing_key(self):
        return self.backbone.routing_key()

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["backbone"] = keras.saving.deserialize_keras_object(config["backbone"])
        return cls(**config)
