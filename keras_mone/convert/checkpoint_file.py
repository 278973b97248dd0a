"""Reading a checkpoint file of a named format, for every converter (ViT, Mixer)."""

import os

from keras_mone.convert.big_vision import read_npz
from keras_mone.convert.timm import read_pth, read_safetensors


def read_checkpoint_file(source, format, npz_formats, from_npz, from_torch, hint=""):
    """``from_npz(arrays)`` of an ``.npz`` checkpoint (``format`` in ``npz_formats``) or
    ``from_torch(arrays)`` of a timm ``.safetensors`` / ``.pth`` one.

    ``source`` must be the path of an existing file (``hint`` ends the type
    error); every ``ValueError`` about the content names the file and format.
    """
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(
            f"format {format!r} takes the path of a checkpoint file as `source`, got "
            f"{type(source).__name__}{hint}."
        )
    path = os.fspath(source)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Checkpoint {path!r} does not exist.")
    if format in npz_formats:
        arrays, convert = read_npz(path), from_npz
    elif path.endswith(".safetensors"):
        arrays, convert = read_safetensors(path), from_torch
    elif path.endswith((".pth", ".pt", ".bin")):
        arrays, convert = read_pth(path), from_torch
    else:
        raise ValueError(f"timm checkpoints are .safetensors or .pth files, got {path!r}.")
    try:
        return convert(arrays)
    except ValueError as error:  # name the file in every message about its content
        raise ValueError(f"{format} checkpoint {path!r}: {error}") from error
