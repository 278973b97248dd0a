"""Sparse-MLP's classifier: an ``ImageClassifier`` that trains with the MoE load-balancing loss."""

from keras_mone.layers.config import register
from keras_mone.models.image_classifier import ImageClassifier
from keras_mone.models.loss_terms import LossTerm


def moe_aux_loss(record, y_true, logits):
    """The sparse blocks' summed load-balancing loss (already weighted by ``aux_loss_weight``, Eq. 11)."""
    return record["aux_loss"]


MOE_AUX_LOSS = LossTerm("moe_aux_loss", moe_aux_loss, weight=1.0)


@register
class SparseMLPClassifier(ImageClassifier):
    """``ImageClassifier`` on a ``SparseMLPBackbone``.

    ``fit`` adds the backbone's load-balancing loss to the task loss
    (``0.01 * (CV^2(importance) + CV^2(load)) / 2`` per MoE layer, Lou et al.
    2021 Eq. 11, through the method-owned loss-term hook,
    ``keras_mone.models.loss_terms``) and logs it as ``moe_aux_loss``;
    ``set_loss_terms(())`` trains without it. Evaluation and inference
    return logits, as every classifier.
    """

    def default_loss_terms(self):
        return (MOE_AUX_LOSS,)
