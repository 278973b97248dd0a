"""Writing checkpoint files: ``.npz``, ``.safetensors`` and torch state dicts, published atomically."""

import json
import os
import shutil
import struct
import tempfile

import numpy as np

TORCH_SUFFIXES = (".pth", ".pt", ".bin")


def write_arrays(path, overwrite, arrays):
    """Writes ``{key: array}`` to ``path`` as ``.npz``, torch (``TORCH_SUFFIXES``) or ``.safetensors``
    (by its suffix), through ``publish``."""
    publish(path, overwrite, lambda target: _file_writer(path)(target, arrays))


def _file_writer(path):
    if path.endswith(".npz"):
        return _write_npz
    return _write_torch if path.endswith(TORCH_SUFFIXES) else _write_safetensors


def _write_npz(target, arrays):
    with open(target, "wb") as file:
        np.savez(file, **arrays)


_SAFETENSORS_CODES = {"float32": "F32", "float16": "F16", "float64": "F64", "bfloat16": "BF16"}


def _write_safetensors(target, arrays):
    """A ``.safetensors`` file: 8-byte header length, JSON header (padded to 8 bytes), raw little-endian data."""
    header, chunks, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, array in arrays.items():
        array = np.ascontiguousarray(array)
        code = _SAFETENSORS_CODES.get(array.dtype.name)
        if code is None:
            raise ValueError(f"weight {name!r} has dtype {array.dtype.name}, not a float type safetensors holds here.")
        data = (array.view("<u2") if code == "BF16" else array.astype(array.dtype.newbyteorder("<"))).tobytes()
        header[name] = {"dtype": code, "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(target, "wb") as file:
        file.write(struct.pack("<Q", len(text)) + text)
        for chunk in chunks:
            file.write(chunk)


def _write_torch(target, arrays):
    """A torch state dict (``torch.save``); dtypes numpy lacks go as float32 (exact)."""
    import torch

    native = ("float16", "float32", "float64")
    torch.save({name: torch.from_numpy(np.array(a if a.dtype.name in native else a.astype("float32")))
                for name, a in arrays.items()}, target)


def publish(path, overwrite, write):
    """Runs ``write(target)`` in a staging folder beside ``path``, then renames the result into place.

    An existing ``path`` is replaced only with ``overwrite`` (a folder: moved aside, restored if the
    rename fails); the staging folder is removed in any case, so a failed write leaves nothing behind.
    """
    folder = os.path.dirname(os.path.abspath(path))
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.", suffix=".partial", dir=folder)
    target, previous = os.path.join(staging, "new"), os.path.join(staging, "previous")
    try:
        write(target)
        if os.path.lexists(path) and not overwrite:  # appeared while writing
            raise FileExistsError(f"{path!r} exists; pass overwrite=True to replace it.")
        if os.path.isdir(path):  # a folder is not replaced in one step: move it aside, back on failure
            os.replace(path, previous)
            try:
                os.replace(target, path)
            except OSError:
                os.replace(previous, path)
                raise
        else:
            os.replace(target, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
