"""Image and video classifiers with MatViT joint training of all nested widths (MatFormer)."""

from keras import ops

from keras_mone.layers.config import register
from keras_mone.models.image_classifier import ImageClassifier


@register
class MatViTClassifier(ImageClassifier):
    """``ImageClassifier`` on a ``MatViTBackbone`` that trains its nested models jointly.

    With ``joint_training=True``, a training call (``model.fit``) returns the
    logits of every width in ``backbone.nested_fractions`` stacked on axis 1,
    ``(batch, num_widths, num_classes)``, smallest width first. Paired with
    ``keras_mone.training.SumOverWidths(loss)`` the training loss is the
    equal-weight sum of the per-width losses, as in MatFormer / MatViT; it is
    plain Keras, so ``fit`` works unchanged on every backend. Inference and
    evaluation (``training=False``) return ``(batch, num_classes)`` logits at the
    backbone's current width (``set_width``).

    Args (beyond ``ImageClassifier``'s):
        joint_training: stack the logits of all widths when training.
    """

    def __init__(self, backbone, joint_training=True, **kwargs):
        super().__init__(backbone, **kwargs)
        self.joint_training = joint_training

    def set_loss_terms(self, terms):
        """Joint training stacks the logits of every width and takes no method loss terms."""
        if tuple(terms) and self.joint_training:
            raise ValueError("MatViT joint training (joint_training=True) takes no method loss terms.")
        super().set_loss_terms(terms)

    def set_width(self, width_fraction=1.0, layer_width_fractions=None):
        """Sets the backbone's width (see ``MatViTBackbone.set_width``)."""
        self.backbone.set_width(width_fraction, layer_width_fractions)

    def call(self, images, training=None):
        if not (training and self.joint_training):
            return super().call(images, training=training)
        backbone = self.backbone
        tokens = backbone.patch_embedding(images, training=training)
        logits = []
        for fraction in backbone.nested_fractions:
            features = backbone.encode_at(tokens, backbone.layer_widths(fraction), training=training)
            logits.append(self.logits(backbone.output_tokens(features, training=training), training=training))
        return ops.stack(logits, axis=1)


@register
class MatViViTClassifier(MatViTClassifier):
    """``MatViTClassifier`` for videos: a ``MatViViTBackbone``, the temporal
    class token read out by default (``VideoClassifier``'s defaults), and the
    same joint training of the nested widths (stacked logits in ``fit``)."""

    def __init__(self, backbone, num_classes=400, pooling="token", joint_training=True, **kwargs):
        super().__init__(
            backbone, num_classes=num_classes, pooling=pooling, joint_training=joint_training, **kwargs
        )
