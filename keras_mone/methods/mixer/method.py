"""MLP-Mixer (Tolstikhin et al.) and Sparse-MLP (Lou et al.): the all-MLP members of the zoo.

Neither routes at a capacity: each is scored at capacity 1.0 only, and its
size table is its own (``S/16``, ``B/16``, ... of the Mixer papers).
"""

from keras_mone.methods.registry import Architecture, Method, register_method
from keras_mone.models.image_classifier import ImageClassifier
from keras_mone.methods.mixer.backbone import (
    MixerBackbone,
    SparseMLPBackbone,
    decode_mixer_variant,
    decode_sparse_mlp_variant,
)
from keras_mone.methods.mixer.classifier import SparseMLPClassifier

#: The tiny sizes of the harness for the Mixer family (32x32 images, 16 tokens).
MIXER_TINY = dict(image_size=32, patch_size=8, hidden_dim=16, depth=1, token_mlp_dim=8, channel_mlp_dim=32)
SPARSE_MLP_TINY = dict(
    MIXER_TINY, sparse_depth=1, sparse_tokens=24, sparse_hidden_dim=8, token_num_experts=4,
    token_expert_dim=16, channel_num_experts=2, channel_expert_dim=16, seed=0,
)

MIXER = register_method(Method(
    "mixer",
    image=Architecture("mixer", MixerBackbone, ImageClassifier, video=False,
                       decode_variant=decode_mixer_variant, tiny=MIXER_TINY),
))
SPARSE_MLP = register_method(Method(
    "sparse_mlp",
    image=Architecture("sparse_mlp", SparseMLPBackbone, SparseMLPClassifier, video=False,
                       decode_variant=decode_sparse_mlp_variant, tiny=SPARSE_MLP_TINY),
))
