"""ViViT factorised encoder (Arnab et al. 2021, Model 3), and the video form of any image backbone."""

from keras import ops

from keras_mone.layers.config import config_argument_names, register
from keras_mone.layers.sequence_encoder import SequenceEncoder
from keras_mone.layers.tubelet_embedding import (
    TubeletEmbedding,
    validate_frame_geometry,
)
from keras_mone.models.vit_backbone import ViTBackbone


@register
class ViViTBackbone(ViTBackbone):
    """ViViT-FE: a spatial ViT per frame index, then a temporal transformer.

    ``backbone(videos)`` maps ``(batch, T, H, W, C)`` clips to
    ``(batch, T/t [+1], hidden_dim)`` temporal tokens (the temporal class
    token first when ``use_class_token``):

    1. tubelet embedding (``TubeletEmbedding``, ``t x p x p`` 3D conv) gives
       ``T/t`` frame indices of ``N`` tokens;
    2. the spatial transformer (this class's ViT blocks and norm, shared by
       all frame indices) encodes each frame index independently with its own
       class token; a frame index's output is its class token (or the mean of
       its tokens when ``use_class_token=False``);
    3. the temporal transformer (``SequenceEncoder``) runs over the ``T/t``
       frame outputs with its own class token.

    The spatial part has exactly the layout of ``ViTBackbone`` (block and
    norm weights at the same paths), so image weights load into it
    (``keras_mone.models.vivit_from_image_backbone``).

    Args (beyond ``ViTBackbone``'s; ``image_size`` is the frame size):
        num_frames: ``T``, frames per clip, a multiple of ``tubelet_size``.
        tubelet_size: ``t``, frames per tubelet.
        temporal_depth: blocks of the temporal transformer (4 for FE-B).
        temporal_num_heads, temporal_mlp_dim: its heads and MLP width
            (default: those of the spatial transformer).
        use_class_token: spatial and temporal class tokens (ViViT's default);
            ``False`` averages tokens instead (GAP).
    """

    default_name = "vivit_backbone"

    def __init__(
        self,
        num_frames=32,
        tubelet_size=2,
        temporal_depth=4,
        temporal_num_heads=None,
        temporal_mlp_dim=None,
        use_class_token=True,
        **kwargs,
    ):
        validate_frame_geometry(num_frames, tubelet_size)
        # Read by _make_embedding, which ViTBackbone.__init__ calls.
        self._clip_geometry = (num_frames, tubelet_size)
        super().__init__(use_class_token=use_class_token, **kwargs)
        self.num_frames = num_frames
        self.tubelet_size = tubelet_size
        self.temporal_depth = temporal_depth
        self.temporal_num_heads = temporal_num_heads
        self.temporal_mlp_dim = temporal_mlp_dim
        self.temporal_encoder = SequenceEncoder(
            self.patch_embedding.num_frame_indices,
            self.hidden_dim,
            temporal_depth,
            temporal_num_heads or self.num_heads,
            temporal_mlp_dim or self.mlp_dim,
            use_class_token=use_class_token,
            dropout_rate=self.dropout_rate,
            drop_path_rate=self.drop_path_rate,
            layer_norm_epsilon=self.layer_norm_epsilon,
            gelu_approximate=self.gelu_approximate,
            dtype=self.dtype_policy,
            name="temporal_encoder",
        )

    def _make_embedding(self, image_size, patch_size, hidden_dim, num_channels, use_class_token):
        num_frames, tubelet_size = self._clip_geometry
        return TubeletEmbedding(
            num_frames, image_size, patch_size, hidden_dim, tubelet_size=tubelet_size,
            num_channels=num_channels, use_class_token=use_class_token,
            dtype=self.dtype_policy, name="tubelet_embedding",
        )

    @property
    def input_shape_per_example(self):
        return (self.num_frames, *self.image_size, self.num_channels)

    @property
    def num_frame_indices(self):
        """``T / t``: frame indices per clip, each encoded by the spatial transformer."""
        return self.patch_embedding.num_frame_indices

    @property
    def num_output_tokens(self):
        """Temporal tokens per clip, class token included."""
        return self.temporal_encoder.num_tokens

    def _build_extra(self, token_shape):
        super()._build_extra(token_shape)
        self.temporal_encoder.build((None, self.num_frame_indices, self.hidden_dim))

    def output_tokens(self, encoded, training=None):
        """Temporal tokens from the spatial encoder's tokens ``(batch * T/t, N [+1], D)``:
        each frame index's class token (or token mean) goes through the
        temporal transformer. Intermediates of ``call(...,
        return_intermediates=True)`` stay per frame index (for MoNE: router
        probabilities and expert indices of shape ``(batch * T/t, N [+1], ...)``,
        row ``b * T/t + f`` = frame index ``f`` of clip ``b``)."""
        frames = encoded[:, 0] if self.use_class_token else ops.mean(encoded, axis=1)
        frames = ops.reshape(frames, (-1, self.num_frame_indices, self.hidden_dim))
        return self.temporal_encoder(frames, training=training)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], self.num_output_tokens, self.hidden_dim)


def video_form(image_backbone):
    """The ViViT-FE form of any image backbone class of the ViT family.

    Video is one wrapper around the image encoder, whatever the method: the
    tubelet embedding, the image encoder run with each frame index as an
    example (its blocks, routing part and norm unchanged, so routing happens
    per frame index), and the temporal transformer (``ViViTBackbone``). The
    class is derived once per image class and registered for ``.keras``
    saving under the image class's name with ``ViT`` -> ``ViViT``
    (``MoNEViTBackbone`` -> ``MoNEViViTBackbone``); its weights sit at the
    same paths as the image backbone's, so image weights load into it
    (``vivit_from_image_backbone``). Arguments are those of
    ``ViViTBackbone`` and of the image backbone.
    """
    if issubclass(image_backbone, ViViTBackbone):
        return image_backbone
    if image_backbone is ViTBackbone:
        return ViViTBackbone
    if not issubclass(image_backbone, ViTBackbone):
        raise TypeError(f"`image_backbone` must be a ViTBackbone class, got {image_backbone!r}.")
    if image_backbone not in _VIDEO_FORMS:
        name = image_backbone.__name__
        name = name.replace("ViT", "ViViT", 1) if "ViT" in name else f"{name}Video"
        attributes = {
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f"``{image_backbone.__name__}`` as a ViViT-FE (``video_form``): routed per frame index.",
            "default_name": image_backbone.default_name.replace("vit", "vivit", 1),
        }
        _VIDEO_FORMS[image_backbone] = register(type(name, (ViViTBackbone, image_backbone), attributes))
    return _VIDEO_FORMS[image_backbone]


_VIDEO_FORMS = {}

def dense_counterpart(backbone):
    """The (unbuilt) dense ``ViTBackbone`` (``ViViTBackbone`` for video) of ``backbone``'s size:
    the reference of isoFLOPs epochs and of the FLOP counts of MLP variants (ACM)."""
    dense = ViViTBackbone if isinstance(backbone, ViViTBackbone) else ViTBackbone
    config = backbone.get_config()
    return dense(**{k: config[k] for k in config_argument_names(dense) if k in config})
