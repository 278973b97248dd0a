"""The learned class token and position embeddings shared by every token sequence.

``PatchEmbedding`` (images), ``TubeletEmbedding`` (video frames) and
``SequenceEncoder`` (ViViT's temporal transformer) all put an optional learned
class token in front of their tokens and add learned position embeddings;
this module is the one place that does it.
"""

import keras
import numpy as np
from keras import ops


def add_sequence_weights(layer, num_tokens, hidden_dim, use_class_token, use_position_embedding=True):
    """Creates ``layer.class_token`` (``(1, 1, D)``, zeros, or ``None``) and
    ``layer.position_embedding`` (``(1, num_tokens, D)``, N(0, 0.02), or ``None``
    without ``use_position_embedding``: MLP-Mixer has none); call from ``build``.

    ``num_tokens`` counts the class token when there is one.
    """
    layer.class_token = None
    if use_class_token:
        layer.class_token = layer.add_weight(
            name="class_token", shape=(1, 1, hidden_dim), initializer="zeros"
        )
    layer.position_embedding = None
    if not use_position_embedding:
        return
    layer.position_embedding = layer.add_weight(
        name="position_embedding",
        shape=(1, num_tokens, hidden_dim),
        initializer=keras.initializers.RandomNormal(stddev=0.02),
    )


def prepend_class_token_and_add_positions(tokens, class_token, position_embedding):
    """``concat([class_token], tokens) + position_embedding`` for ``(batch, N, D)`` tokens
    (either may be ``None``)."""
    if class_token is not None:
        cls = ops.broadcast_to(
            ops.cast(class_token, tokens.dtype), (ops.shape(tokens)[0], 1, tokens.shape[-1])
        )
        tokens = ops.concatenate([cls, tokens], axis=1)
    if position_embedding is None:
        return tokens
    return tokens + ops.cast(position_embedding, tokens.dtype)


def layout_positions(source_positions, source_cls, source_grid, target_positions, target_cls, target_grid):
    """Position embeddings ``(1, [1 +] h*w, D)`` of one grid laid out for another.

    The grid part is resized bilinearly when the grids differ (AugReg / ViViT
    practice when the image size changes); the class position is the
    source's when both have a class token, the target's own when only the
    target has one, and dropped when the target has none.
    """
    grid = source_positions[:, int(source_cls):]
    if tuple(source_grid) != tuple(target_grid):
        grid = grid.reshape(1, *source_grid, -1)
        grid = ops.convert_to_numpy(
            ops.image.resize(grid, target_grid, interpolation="bilinear", antialias=False)
        ).reshape(1, target_grid[0] * target_grid[1], -1)
    if not target_cls:
        return grid
    cls = source_positions[:, :1] if source_cls else target_positions[:, :1]
    return np.concatenate([cls, grid], axis=1).astype(target_positions.dtype)
