"""Method-owned loss terms: the training hook every task class shares.

A method adds terms to the task loss (ACM's budget, entropy and diversity
losses; Sparse-MLP's load-balancing loss) through ``LossTerm`` objects. A
task class with terms, in a training call, returns ``{"logits": ...,
"record": ...}`` instead of the logits: the record is the forward pass's
intermediates (``return_intermediates=True`` of the backbone, see
``keras_mone.models.block_loop.BlockRecord``; each method decides what its
blocks keep there). ``compute_loss`` adds ``sum weight * term(record, ...)``
to the compiled loss, and each term's value is a metric of its own name, so
``history.csv`` logs it. With no terms nothing changes: the training call
returns logits and the loss is the compiled one.
"""

import dataclasses
from typing import Callable

import keras
from keras import ops


@dataclasses.dataclass(frozen=True)
class LossTerm:
    """One named term of a method's training loss.

    Attributes:
        name: the metric name it is logged under (``history.csv`` column).
        fn: ``(record, y_true, logits) -> scalar``: the unweighted term.
        weight: its weight in the training loss (the logged value is unweighted).
    """

    name: str
    fn: Callable
    weight: float = 1.0


class LossTermsMixin:
    """Adds method-owned loss terms to a ``keras.Model`` task class.

    Sub-classes may override ``default_loss_terms()`` (terms the model always
    trains with); ``set_loss_terms`` replaces them (a recipe's training mode
    does), and must be called before ``compile``. Only training calls compute
    the terms; evaluation and inference are unchanged.
    """

    def default_loss_terms(self):
        return ()

    @property
    def loss_terms(self):
        terms = self.__dict__.get("_loss_terms_override")
        return self.default_loss_terms() if terms is None else terms

    def set_loss_terms(self, terms):
        """Trains with ``terms`` (a sequence of ``LossTerm``) instead of the defaults.

        Training state, like the compiled loss: not saved with the model (a
        loaded model trains with its class's ``default_loss_terms()``; a
        recipe sets its mode's terms again when it resumes)."""
        terms = tuple(terms)
        names = [term.name for term in terms]
        if len(set(names)) != len(names) or any(not isinstance(t, LossTerm) for t in terms):
            raise ValueError(f"`terms` must be LossTerm objects with distinct names, got {terms!r}.")
        self.__dict__["_loss_terms_override"] = terms
        self._term_trackers()  # create the metrics before compile() sees the model's metrics

    def _term_trackers(self):
        trackers = self.__dict__.setdefault("_loss_term_trackers", {})
        for term in self.loss_terms:
            if term.name not in trackers:
                tracker = keras.metrics.Mean(name=term.name)
                trackers[term.name] = tracker
        return [trackers[term.name] for term in self.loss_terms]

    def compile(self, *args, **kwargs):
        self._term_trackers()
        return super().compile(*args, **kwargs)

    @property
    def metrics(self):
        return list(super().metrics) + self._term_trackers()

    def with_record(self, logits, record, training):
        """What a training call returns: the logits, plus the record when terms need it."""
        if training and self.loss_terms:
            return {"logits": logits, "record": record}
        return logits

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        if not isinstance(y_pred, dict):
            return super().compute_loss(x, y, y_pred, sample_weight, training=training)
        logits, record = y_pred["logits"], y_pred["record"]
        loss = super().compute_loss(x, y, logits, sample_weight, training=training)
        for term, tracker in zip(self.loss_terms, self._term_trackers()):
            value = ops.cast(term.fn(record, y, logits), "float32")
            tracker.update_state(value)
            loss = loss + term.weight * value
        return loss

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        training = isinstance(y_pred, dict)
        results = super().compute_metrics(x, y, y_pred["logits"] if training else y_pred, sample_weight)
        if not training:  # terms are training quantities: no val_<term> column of zeros
            for name in self.__dict__.get("_loss_term_trackers", {}):
                results.pop(name, None)
        return results
