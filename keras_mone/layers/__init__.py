"""Backend-agnostic Keras layers of keras_mone (``keras.ops`` only, static shapes).

The shared layers live here; a method family's own layers (ACM's learners
and gates, the Mixer blocks, Sparse-MLP's MoE) live in its folder
(``keras_mone/methods/<family>/``) and are exported here (``keras_mone.exports``).
"""

from keras_mone.exports import exported_names

from keras_mone.layers.attention import MoNEAttention
from keras_mone.layers.block import MoNEBlock, ViTBlock  # noqa: F401  (MoNEBlock: deprecated alias, not in __all__)
from keras_mone.layers.gates import HalfOpenUnitInterval
from keras_mone.layers.mlp import NestedMLP
from keras_mone.layers.nested_dense import NestedDense
from keras_mone.layers.patch_embedding import PatchEmbedding
from keras_mone.layers.regularization import DropPath
from keras_mone.layers.router import ExpertPreferredRouting, RandomRouter, Router
from keras_mone.layers.sequence_encoder import SequenceEncoder
from keras_mone.layers.tubelet_embedding import TubeletEmbedding, inflate_patch_kernel

__getattr__, __dir__ = exported_names("keras_mone.layers", globals())

__all__ = [
    "DropPath",
    "ExpertPreferredRouting",
    "HalfOpenUnitInterval",
    "MoNEAttention",
    "NestedDense",
    "NestedMLP",
    "PatchEmbedding",
    "RandomRouter",
    "Router",
    "SequenceEncoder",
    "TubeletEmbedding",
    "ViTBlock",
    "inflate_patch_kernel",
]
