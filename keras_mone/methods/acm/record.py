"""ACM's routing map: the learner count each block's gate chose per token, read from the forward
record for the routing analyses (``keras_mone.analysis.token_maps``, kind ``"learners"``)."""

import numpy as np
from keras import ops

from keras_mone.analysis.token_maps import register_record_kind


@register_record_kind("learners", "acm_choices", "ACM learners run per token (mean over blocks when no block is chosen)")
def learner_decision(record, decision):
    """Block ``decision``'s (default: mean over blocks) learners per token, the gate's expected
    count, its probabilities over ``0..N`` and the argmax count's share ``k / N``."""
    depth = len(record["blocks"])
    blocks = range(depth) if decision is None else [decision]
    if decision is not None and not 0 <= decision < depth:
        raise ValueError(f"`decision` must be a block index in [0, {depth}), got {decision!r}.")
    counts = np.mean([ops.convert_to_numpy(record["blocks"][b]["assignment"]) for b in blocks], axis=0)
    per_block = np.stack([ops.convert_to_numpy(record["acm_probs"][b]).astype("float32") for b in blocks])
    learners = per_block.shape[-1] - 1
    probs = per_block.mean(axis=0)
    expected = probs @ np.arange(learners + 1, dtype="float32")  # the gate's expected learner count
    return counts, expected, probs, per_block.argmax(-1).mean(axis=0) / learners
