"""The MLP-Mixer's ``write_checkpoint`` layout (``keras_mone.convert.writer``): the inverse of
``checkpoints.load_mixer_state``, registered for ``MixerBackbone`` and its sub-classes."""

from keras_mone.convert.loaders import register_checkpoint_writer
from keras_mone.methods.mixer.backbone import MixerBackbone
from keras_mone.methods.mixer.checkpoints import BLOCK_PARTS, FORMATS, check_mixer_model


@register_checkpoint_writer(MixerBackbone, FORMATS, check_mixer_model, name="MLP-Mixer")
def mixer_arrays(weights, backbone, format):
    """``{key: array}`` of a Mixer checkpoint: flax ``.npz`` names and (in, out) kernels, or timm's."""
    take, flax, depth = weights.take, format == "vision_transformer", backbone.depth
    kernel, bias = take("patch_embedding/projection/kernel"), take("patch_embedding/projection/bias")
    arrays = {"stem/kernel": kernel, "stem/bias": bias} if flax else \
        {"stem.proj.weight": kernel.transpose(3, 2, 0, 1), "stem.proj.bias": bias}
    for i in range(depth):
        for part, (flax_name, timm_name) in BLOCK_PARTS.items():
            norm = part.startswith("layer_norm")
            first = take(f"block_{i}/{part}/{'gamma' if norm else 'kernel'}")
            second = take(f"block_{i}/{part}/{'beta' if norm else 'bias'}")
            if flax:
                arrays[f"MixerBlock_{i}/{flax_name}/{'scale' if norm else 'kernel'}"] = first
                arrays[f"MixerBlock_{i}/{flax_name}/bias"] = second
            else:
                arrays[f"blocks.{i}.{timm_name}.weight"] = first if norm else first.T
                arrays[f"blocks.{i}.{timm_name}.bias"] = second
    gamma, beta = take("norm/gamma"), take("norm/beta")
    arrays.update({"pre_head_layer_norm/scale": gamma, "pre_head_layer_norm/bias": beta} if flax else
                  {"norm.weight": gamma, "norm.bias": beta})
    if "head/kernel" in weights:
        kernel, bias = take("head/kernel", in_backbone=False), take("head/bias", in_backbone=False)
        arrays.update({"head/kernel": kernel, "head/bias": bias} if flax else
                      {"head.weight": kernel.T, "head.bias": bias})
    return arrays
