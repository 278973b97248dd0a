"""MLP-Mixer (Tolstikhin et al.) and Sparse-MLP (Lou et al.): the all-MLP members of the zoo.

The family's folder: ``blocks`` (Mixer blocks, the sparse block),
``sparse_moe`` (the MoE layer), ``re_represent``, ``backbone``,
``classifier`` (Sparse-MLP's load-balancing loss), ``transfer`` (Sparse-MLP
from a Mixer), ``checkpoints`` and ``checkpoint_writer`` (the vision_transformer
and timm formats, registered with ``keras_mone.convert``), ``flops`` (its
FLOP counters) and ``method`` (its registry entries). Its public classes are
also in ``keras_mone.layers`` and ``keras_mone.models``.
"""

from keras_mone.exports import export
from keras_mone.methods.mixer import checkpoint_writer, flops  # noqa: F401  (register the writer, FLOP counters)
from keras_mone.methods.mixer.backbone import MIXER_SIZES, SPARSE_MLP_SIZES, MixerBackbone, SparseMLPBackbone
from keras_mone.methods.mixer.blocks import MixerBlock, MlpBlock, SparseMixerBlock
from keras_mone.methods.mixer.checkpoints import load_mixer_state, read_mixer_state
from keras_mone.methods.mixer.classifier import SparseMLPClassifier
from keras_mone.methods.mixer.method import MIXER, SPARSE_MLP
from keras_mone.methods.mixer.re_represent import ReRepresent1, ReRepresent2
from keras_mone.methods.mixer.sparse_moe import SparseMoE
from keras_mone.methods.mixer.transfer import sparse_mlp_from_mixer

for _layer in (MixerBlock, MlpBlock, SparseMixerBlock, ReRepresent1, ReRepresent2, SparseMoE):
    export("keras_mone.layers")(_layer)
for _model in (MixerBackbone, SparseMLPBackbone, SparseMLPClassifier, sparse_mlp_from_mixer):
    export("keras_mone.models")(_model)
export("keras_mone.models", name="MIXER_SIZES")(MIXER_SIZES)
export("keras_mone.models", name="SPARSE_MLP_SIZES")(SPARSE_MLP_SIZES)

__all__ = [
    "MIXER", "MIXER_SIZES", "MixerBackbone", "MixerBlock", "MlpBlock", "ReRepresent1", "ReRepresent2",
    "SPARSE_MLP", "SPARSE_MLP_SIZES", "SparseMLPBackbone", "SparseMLPClassifier", "SparseMixerBlock", "SparseMoE",
    "load_mixer_state", "read_mixer_state", "sparse_mlp_from_mixer",
]
