"""Where the router sends the tokens that matter (does the router learn?)."""

import numpy as np

from keras_mone.models.record_call import forward_with_record


def expert_share_of_tokens(model, images, token_mask, router=0, batch_size=256):
    """Fraction of the ``token_mask`` tokens that each expert receives, smallest expert first.

    With tokens that hold the object (e.g. ``patch_coverage(masks, p) > 0`` of
    the cluttered digits), a learned router sends far more of them to the full
    expert than its capacity share ``c_E``, which is what a random router
    would give (MoNE Fig. 1, 8).

    Args:
        model: a MoNE classifier or backbone (``return_intermediates=True``).
        images: model inputs.
        token_mask: bool ``(batch, patch tokens)`` in token order; a class
            token, if any, is not counted.
        router: which router's assignment to read (index into
            ``router_positions``).

    Returns:
        float array ``(num_experts,)`` summing to 1 (dropped tokens excluded).
    """
    backbone = getattr(model, "backbone", model)
    counts = np.zeros(backbone.num_experts)
    for start in range(0, len(images), batch_size):
        _, intermediates = forward_with_record(backbone, images[start : start + batch_size])
        expert = intermediates["expert_index"][router]
        expert = expert[:, expert.shape[1] - token_mask.shape[1] :]  # drop the class token
        chosen = expert[token_mask[start : start + batch_size]]
        counts += np.bincount(chosen[chosen >= 0], minlength=backbone.num_experts)
    return counts / max(counts.sum(), 1)
