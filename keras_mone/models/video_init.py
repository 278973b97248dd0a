"""Initialising a ViViT from an image ViT (ViViT Sec. 3.4), dense or MoNE."""

from keras import ops

from keras_mone.layers.config import config_argument_names
from keras_mone.layers.tubelet_embedding import inflate_patch_kernel
from keras_mone.models.vivit_backbone import video_form
from keras_mone.layers.token_sequence import layout_positions
from keras_mone.models.weight_transfer import relative_weight_paths

_IMAGE_EMBEDDING = "patch_embedding/"
_VIDEO_EMBEDDING = "tubelet_embedding/"


def vivit_from_image_backbone(
    image_backbone, num_frames=32, tubelet_size=2, inflation="central_frame", **overrides
):
    """A ViViT-FE that starts from ``image_backbone``'s weights.

    Builds the video form of the image backbone's class (``video_form``:
    ``MoNEViViTBackbone`` from a ``MoNEViTBackbone`` with the same experts,
    capacity and routers, ``ViViTBackbone`` from a ``ViTBackbone``, and so on
    for every method), with
    the image model's configuration plus ``num_frames`` / ``tubelet_size`` /
    ``overrides`` (e.g. ``temporal_depth``, ``image_size``,
    ``use_class_token``), then copies the weights with
    :func:`load_image_weights`.

    Returns:
        The built video backbone. Its temporal transformer keeps its fresh
        initialisation, as in ViViT.
    """
    video_cls = video_form(type(image_backbone))
    image_config = image_backbone.get_config()
    names = set(config_argument_names(video_cls)) | {"dtype"}
    config = {k: v for k, v in image_config.items() if k in names}
    config["use_class_token"] = True  # ViViT's default; an override may turn it off
    config.update(num_frames=num_frames, tubelet_size=tubelet_size, **overrides)
    video = video_cls(**config)
    video.build()
    load_image_weights(video, image_backbone, inflation=inflation)
    return video


def load_image_weights(video_backbone, image_backbone, inflation="central_frame"):
    """Copies an image ViT's weights into the spatial part of a ViViT-FE.

    * the 2D patch kernel is inflated to the tubelet kernel
      (``inflate_patch_kernel``, "central_frame" by default), its bias copied;
    * spatial position embeddings are reused, resized bilinearly when the frame
      grid differs from the image grid (e.g. 224 -> 256 for SSv2); the class
      token and its position are copied when both models have one;
    * every block, the final norm and (MoNE) the routers are copied by path.

    Both backbones must be built and share ``hidden_dim``, ``depth``,
    ``num_heads``, ``mlp_dim`` and ``patch_size``; otherwise a ``ValueError``
    names the mismatch and nothing is changed.

    Returns:
        Sorted paths of video weights that were not initialised from the
        image model (the temporal transformer, and anything else new).
    """
    for name in ("hidden_dim", "depth", "num_heads", "mlp_dim", "patch_size", "num_channels"):
        video_value, image_value = getattr(video_backbone, name), getattr(image_backbone, name)
        if video_value != image_value:
            raise ValueError(
                f"Cannot load '{image_backbone.name}' into '{video_backbone.name}': "
                f"`{name}` is {image_value} in the image model but {video_value} in the video model."
            )
    image, video = relative_weight_paths(image_backbone), relative_weight_paths(video_backbone)
    values = {}
    for path, variable in image.items():
        if path.startswith(_IMAGE_EMBEDDING):
            continue
        if path not in video or tuple(video[path].shape) != tuple(variable.shape):
            raise ValueError(
                f"Cannot load '{image_backbone.name}' into '{video_backbone.name}': image weight "
                f"{path!r} {tuple(variable.shape)} has no counterpart of that shape in the video model."
            )
        values[path] = ops.convert_to_numpy(variable)
    kernel = ops.convert_to_numpy(image[_IMAGE_EMBEDDING + "projection/kernel"])
    values[_VIDEO_EMBEDDING + "projection/kernel"] = inflate_patch_kernel(
        kernel, video_backbone.tubelet_size, inflation
    )
    values[_VIDEO_EMBEDDING + "projection/bias"] = ops.convert_to_numpy(
        image[_IMAGE_EMBEDDING + "projection/bias"]
    )
    video_cls = video_backbone.use_class_token
    image_cls = image_backbone.use_class_token
    if video_cls and image_cls:
        values[_VIDEO_EMBEDDING + "class_token"] = ops.convert_to_numpy(
            image[_IMAGE_EMBEDDING + "class_token"]
        )
    positions = ops.convert_to_numpy(image[_IMAGE_EMBEDDING + "position_embedding"])
    values[_VIDEO_EMBEDDING + "position_embedding"] = layout_positions(
        positions, image_cls, image_backbone.patch_embedding.grid_size,
        ops.convert_to_numpy(video[_VIDEO_EMBEDDING + "position_embedding"]), video_cls,
        video_backbone.patch_embedding.grid_size,
    )
    for path, value in values.items():
        video[path].assign(value)
    return sorted(set(video) - set(values))
