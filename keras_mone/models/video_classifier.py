"""Video classification task: a ViViT backbone, pooling over time and a linear head."""

from keras_mone.layers.config import register
from keras_mone.models.image_classifier import ImageClassifier


@register
class VideoClassifier(ImageClassifier):
    """Logits from a ``ViViTBackbone`` / ``MoNEViViTBackbone``: ``model(videos)``.

    Videos are ``(batch, T, H, W, C)``. ``pooling="token"`` reads the temporal
    class token (ViViT's default), ``"gap"`` averages the temporal tokens.
    Head initialisation, dropout and the capacity API (``set_capacity``,
    ``capacity``) are those of ``ImageClassifier``.
    """

    def __init__(self, backbone, num_classes=400, pooling="token", **kwargs):
        super().__init__(backbone, num_classes=num_classes, pooling=pooling, **kwargs)
