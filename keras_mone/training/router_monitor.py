"""Is the router learning? Per-epoch alpha and router entropy, into the epoch logs.

In Eq. 1 of the MoNE paper the router probability r reaches the loss only
through ``(alpha * r + 1) * FFN(...)``, so with alpha at its initial 0 the
router gets no gradient until alpha moves. ``RouterMonitor`` writes, at each
epoch end, every routed block's alpha and the router's mean entropy over a
fixed probe batch into the logs (``history.csv`` through ``CSVLogger``): an
untrained router keeps its entropy near ln(E) (1.386 nats for 4 experts).
"""

import keras
import numpy as np
from keras import ops

from keras_mone.models.record_call import forward_with_record


def router_statistics(backbone, probe_images):
    """``{"alpha_<block>": ..., "router_entropy_<block>": ...}`` of a MoNE backbone.

    Entropies are in nats, averaged over the probe's tokens; empty for
    backbones without learned routers.
    """
    stats = {}
    if getattr(backbone, "router_type", None) != "learned":
        return stats
    for index, block in enumerate(backbone.blocks):
        if getattr(block, "alpha", None) is not None:
            stats[f"alpha_{index}"] = float(ops.convert_to_numpy(block.alpha))
    _, intermediates = forward_with_record(backbone, probe_images)
    for position, probs in zip(backbone.router_positions, intermediates["router_probs"]):
        p = np.clip(probs.astype("float64"), 1e-12, 1.0)
        stats[f"router_entropy_{position}"] = float(np.mean(-np.sum(p * np.log(p), axis=-1)))
    return stats


class RouterMonitor(keras.callbacks.Callback):
    """Adds :func:`router_statistics` of the model's backbone to each epoch's logs.

    Place it before ``CSVLogger`` in the callback list so the columns reach
    ``history.csv``. Models without a learned router are left alone.

    Args:
        probe_images: a fixed batch of model inputs (e.g. 256 test images).
    """

    def __init__(self, probe_images):
        super().__init__()
        self.probe_images = probe_images

    def on_epoch_end(self, epoch, logs=None):
        backbone = getattr(self.model, "backbone", None)
        if logs is not None and backbone is not None:
            logs.update(router_statistics(backbone, self.probe_images))

