"""Image classification task: a backbone, pooling and a linear head."""

import keras
from keras import ops

from keras_mone.arguments import integer
from keras_mone.layers.config import ConfigMixin, register
from keras_mone.models.backbone import model_from_preset
from keras_mone.models.capacity_control import CapacityControlMixin
from keras_mone.models.loop_guard import LoopGuardMixin
from keras_mone.models.loss_terms import LossTermsMixin
from keras_mone.models.serving import ServingMixin
from keras_mone.models.weights_file import SafeLoadingMixin

POOLINGS = ("gap", "token")


@register
class ImageClassifier(
    LossTermsMixin, LoopGuardMixin, SafeLoadingMixin, CapacityControlMixin, ConfigMixin, ServingMixin, keras.Model
):
    """Logits from a backbone (any ``keras_mone.models.backbone.Backbone``).

    ``pooling="gap"`` averages all token features (the MoNE paper, Sec. 4.1);
    ``"token"`` reads the class token (the backbone needs
    ``use_class_token=True``). The head kernel starts at zero and its bias at
    ``head_bias_init`` (AugReg: -10 for ImageNet-21k, -6.9 for ImageNet-1k with
    sigmoid cross-entropy). Logits are float32 under any dtype policy.

    For MoNE backbones, ``set_capacity`` / ``capacity`` act on the backbone and
    ``predict`` / ``evaluate`` / ``fit`` follow the capacity set last.

    Args:
        backbone: any ``keras_mone.models.backbone.Backbone`` (the contract it relies on).
        num_classes: number of output logits.
        pooling: "gap" or "token".
        head_bias_init: initial value of the head bias.
        head_dropout_rate: dropout before the head.
        representation_size: width of a ``Dense`` + tanh "pre-logits" layer
            between pooling and head (the original ViT ImageNet-21k
            checkpoints); ``None``: none.
    """

    def __init__(
        self, backbone, num_classes=1000, pooling="gap", head_bias_init=0.0, head_dropout_rate=0.0,
        representation_size=None, **kwargs
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
        self.representation_size = None if representation_size is None else integer(
            "representation_size", representation_size
        )
        self.pre_logits = None if representation_size is None else keras.layers.Dense(
            self.representation_size, activation="tanh", dtype=backbone.dtype_policy, name="pre_logits"
        )
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
        features = self.backbone.hidden_dim
        if self.pre_logits is not None:
            self.pre_logits.build((None, features))
            features = self.representation_size
        self.head.build((None, features))
        self.built = True

    def check_inputs(self, inputs):
        """Raises a ``ValueError`` naming the argument if ``inputs`` do not fit the model."""
        self.backbone.check_inputs(inputs)

    def pool(self, tokens):
        """Pooled features ``(batch, hidden_dim)`` from backbone tokens."""
        if self.pooling == "token":
            return tokens[:, 0]
        return ops.mean(tokens, axis=1)

    def logits(self, tokens, training=None):
        """float32 logits from backbone tokens: pooling, pre-logits, dropout, head."""
        features = self.pool(tokens)
        if self.pre_logits is not None:
            features = self.pre_logits(features)
        features = self.dropout(features, training=training)
        return ops.cast(self.head(features), "float32")

    def call(self, images, training=None):
        record = {}
        if training and self.loss_terms:  # the method's loss terms read the forward pass's record
            tokens, record = self.backbone(images, training=training, return_intermediates=True)
        else:
            tokens = self.backbone(images, training=training)
        return self.with_record(self.logits(tokens, training=training), record, training)

    # -- capacity, delegated to a MoNE backbone -------------------------------
    @property
    def capacity(self):
        """Effective capacity of the backbone (1.0 for a dense backbone)."""
        return self.backbone.capacity

    @property
    def realised_capacity(self):
        """Effective capacity the backbone's whole-token counts give (1.0 for a dense backbone)."""
        return self.backbone.realised_capacity

    def set_capacity(self, capacity):
        """Sets the backbone's effective capacity (MoNE backbones; dense ones accept only 1.0)."""
        self.backbone.set_capacity(capacity)

    def routing_key(self):
        return self.backbone.routing_key()

    @classmethod
    def from_preset(cls, name, /, **kwargs):
        """The model of preset ``name``, as ``keras_mone.presets.from_preset(name, **kwargs)``.

        Raises a ``ValueError`` naming both classes if the preset builds
        another task class (``VideoClassifier.from_preset("vit_digits")``);
        ``ImageClassifier`` accepts its subclasses (video, MatViT presets).
        """
        return model_from_preset(cls, name, kwargs, "task")

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["backbone"] = keras.saving.deserialize_keras_object(config["backbone"])
        return cls(**config)
