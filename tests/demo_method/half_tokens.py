"""A toy method: only every ``token_stride``-th token runs the blocks, the rest pass by.

The whole family in one module, outside the library: a routing part, a
backbone that uses it, and one registry entry with a recipe key of its own.
Importing the module registers the method (``keras_mone.methods.families``).
"""

import keras
from keras import ops

from keras_mone.methods.registry import Architecture, Method, RecipeKey, register_method
from keras_mone.models.image_classifier import ImageClassifier
from keras_mone.models.video_classifier import VideoClassifier
from keras_mone.models.vit_backbone import ViTBackbone
from keras_mone.models.vivit_backbone import video_form
from keras_mone.routing import parts


class StridedTokens(parts.TokenRouting):
    """Tokens ``0, s, 2s, ...`` run every block at full width; the others pass by unchanged."""

    def __init__(self, depth, hidden_dim, stride):
        super().__init__(depth, hidden_dim)
        self.stride = stride

    def block_plan(self, num_tokens):
        return [[(len(range(0, num_tokens, self.stride)), self.hidden_dim)]] * self.depth

    def before_block(self, index, state, received, record):
        tokens = state.restored()
        batch, n = ops.shape(tokens)[0], tokens.shape[1]
        kept = [i for i in range(n) if i % self.stride == 0]
        other = [i for i in range(n) if i % self.stride]
        new = parts.TokenGroups()
        new.add_group(parts.gather_tokens(tokens, _rows(kept, batch)), self.hidden_dim, 0)
        if other:
            new.passed = parts.gather_tokens(tokens, _rows(other, batch))
        new.order = _rows(kept + other, batch)
        return new


def _rows(indices, batch):
    return ops.broadcast_to(ops.convert_to_tensor([indices], dtype="int32"), (batch, len(indices)))


@keras.saving.register_keras_serializable(package="demo_method")
class StridedViTBackbone(ViTBackbone):
    """A ViT whose blocks run only every ``token_stride``-th token."""

    def __init__(self, token_stride=2, **kwargs):
        if not isinstance(token_stride, int) or token_stride < 1:
            raise ValueError(f"`token_stride` must be an integer >= 1, got {token_stride!r}.")
        self.token_stride = token_stride
        super().__init__(**kwargs)

    def token_routing(self):
        return StridedTokens(self.depth, self.hidden_dim, self.token_stride)


TOKEN_STRIDE = RecipeKey(2, int, "demo: every token_stride-th token runs the blocks", low=1)

HALF_TOKENS = register_method(Method(
    "strided_tokens",
    image=Architecture("strided_vit", StridedViTBackbone, ImageClassifier, video=False),
    video=Architecture("strided_vivit", video_form(StridedViTBackbone), VideoClassifier, video=True),
    recipe_arguments=lambda recipe: dict(token_stride=recipe["token_stride"]),
    recipe_keys={"token_stride": TOKEN_STRIDE},
))
