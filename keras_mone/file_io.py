"""Files written and checked the same way everywhere: sha256 digests and atomic text writes."""

import hashlib
import os


def sha256_of(path):
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def atomic_write_text(path, text):
    """Writes ``text`` to ``path`` through ``<path>.partial`` and a rename: a crash
    leaves the old file (or none), never a truncated one."""
    temporary = f"{path}.partial"
    with open(temporary, "w") as f:
        f.write(text)
    os.replace(temporary, path)
