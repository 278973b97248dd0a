"""Backend-agnostic Keras layers of keras_mone (``keras.ops`` only, static shapes)."""

from keras_mone.layers.acm import ACMMLP
from keras_mone.layers.acm_gate import ACMGate
from keras_mone.layers.acm_linear import ACMLinear
from keras_mone.layers.attention import MoNEAttention
from keras_mone.layers.block import MoNEBlock, ViTBlock  # noqa: F401  (MoNEBlock: deprecated alias, not in __all__)
from keras_mone.layers.gates import HalfOpenUnitInterval
from keras_mone.layers.mixer import MixerBlock, MlpBlock, SparseMixerBlock
from keras_mone.layers.mlp import NestedMLP
from keras_mone.layers.nested_dense import NestedDense
from keras_mone.layers.patch_embedding import PatchEmbedding
from keras_mone.layers.re_represent import ReRepresent1, ReRepresent2
from keras_mone.layers.regularization import DropPath
from keras_mone.layers.router import ExpertPreferredRouting, RandomRouter, Router
from keras_mone.layers.sequence_encoder import SequenceEncoder
from keras_mone.layers.sparse_moe import SparseMoE
from keras_mone.layers.tubelet_embedding import TubeletEmbedding, inflate_patch_kernel

__all__ = [
    "ACMGate",
    "ACMLinear",
    "ACMMLP",
    "DropPath",
    "ExpertPreferredRouting",
    "HalfOpenUnitInterval",
    "MixerBlock",
    "MlpBlock",
    "MoNEAttention",
    "NestedDense",
    "NestedMLP",
    "PatchEmbedding",
    "RandomRouter",
    "ReRepresent1",
    "ReRepresent2",
    "Router",
    "SequenceEncoder",
    "SparseMixerBlock",
    "SparseMoE",
    "TubeletEmbedding",
    "ViTBlock",
    "inflate_patch_kernel",
]
