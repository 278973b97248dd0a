"""Preset handles: built-in names, local folders, ``https://`` URLs, ``hf://`` and ``kaggle://``.

Downloads go through ``keras.utils.get_file`` (progress bar) into a staging
folder; a file is moved into the cache (``$KERAS_HOME/keras_mone/``) only
after its sha256 checked out, so a failed, partial or wrong download never
leaves a file in the cache, and a cached file is used offline.
"""

import hashlib
import os
import shutil
import tempfile
import urllib.parse

import keras

from keras_mone.presets.folder import CONFIG_FILE, METADATA_FILE, WEIGHTS_FILE, read_metadata
from keras_mone.presets.weights import sha256_of

URL_SCHEMES = ("https://", "http://")
HUB_SCHEMES = {"hf://": ("huggingface_hub", "hf"), "kaggle://": ("kagglehub", "kaggle")}


def cache_root():
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    return os.path.join(home, "keras_mone")


def is_remote(handle):
    return isinstance(handle, str) and handle.startswith(URL_SCHEMES + tuple(HUB_SCHEMES))


def download(url, sha256=None, cache_subdir=None):
    """The local path of ``url``'s file, downloaded once into the cache.

    Args:
        url: an ``https://`` (or ``http://``) URL of a file.
        sha256: expected hex sha256; checked on download and on every cache hit.
        cache_subdir: folder under ``$KERAS_HOME/keras_mone`` (default:
            ``downloads/<hash of the URL>``).

    Raises:
        ValueError: the file's sha256 differs (the cache is left without it).
        OSError / Exception from the transfer, with the cache left as it was.
    """
    name = os.path.basename(urllib.parse.urlparse(url).path) or "download"
    folder = os.path.join(cache_root(), cache_subdir or os.path.join("downloads", _key(url)))
    target = os.path.join(folder, name)
    if os.path.isfile(target):
        if sha256 is None or sha256_of(target) == sha256:
            return target
        os.remove(target)  # a cached file that no longer matches the pinned hash
    os.makedirs(folder, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".download-", dir=folder)
    try:
        try:
            fetched = keras.utils.get_file(
                fname=name, origin=url, cache_dir=staging, cache_subdir=".", force_download=True
            )
        except Exception as error:
            raise OSError(
                f"Downloading {url} failed: {error}. (Files are cached after one successful download; "
                "from_preset(..., load_weights=False) builds a model without weights.)"
            ) from error
        actual = sha256_of(fetched)
        if sha256 is not None and actual != sha256:
            raise ValueError(
                f"Downloaded {url} has sha256 {actual}, expected {sha256}; it was not kept "
                "(the server's file changed, or the transfer was corrupted)."
            )
        os.replace(fetched, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def fetch_preset_folder(url, sha256=None):
    """A local copy of the preset folder at ``url`` (``config.json``, ``model.weights.h5``, ``metadata.json``).

    ``sha256`` pins ``metadata.json``, which pins the other two files.
    """
    base = url.rstrip("/") + "/"
    subdir = os.path.join("presets", _key(base))
    metadata = download(base + METADATA_FILE, sha256=sha256, cache_subdir=subdir)
    folder = os.path.dirname(metadata)
    hashes = read_metadata(folder).get("sha256", {})
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if name not in hashes:
            raise ValueError(f"{base + METADATA_FILE} records no sha256 for {name}.")
        download(base + name, sha256=hashes[name], cache_subdir=subdir)
    return folder


def _key(url):
    return hashlib.sha256(url.encode()).hexdigest()[:16]


def resolve_hub_handle(handle):
    """A local folder for an ``hf://owner/repo`` or ``kaggle://owner/model/framework/variation[/version]`` handle."""
    for scheme, (module, extra) in HUB_SCHEMES.items():
        if not handle.startswith(scheme):
            continue
        try:
            hub = __import__(module)
        except ImportError as error:
            raise ImportError(
                f"{scheme} handles need {module}: pip install \"keras-mone[{extra}]\"."
            ) from error
        path = handle[len(scheme):]
        if scheme == "hf://":
            return hub.snapshot_download(repo_id=path)
        return hub.model_download(path)
    raise ValueError(f"Unknown handle scheme in {handle!r}; use a preset name, a folder, https://, hf:// or kaggle://.")
