"""Preset handles: built-in names, local folders, ``https://`` URLs, ``hf://`` and ``kaggle://``.

Downloads go through ``keras.utils.get_file`` (progress bar) into a staging
folder beside the cache entry (``$KERAS_HOME/keras_mone/``); the entry (one
file, or a preset folder's three files) is published into the cache only
after every sha256 checked out, so a failed, partial or wrong download
leaves nothing behind (no file, no empty folder), and a cached entry is used
offline. An unpinned https handle keeps reading its cached copy;
``force_download=True`` fetches the server's current version.
"""

import contextlib
import hashlib
import os
import shutil
import tempfile
import urllib.parse

import keras

from keras_mone.presets.folder import (
    CONFIG_FILE,
    METADATA_FILE,
    WEIGHTS_FILE,
    check_folder,
    is_saved_preset,
    publish_folder,
    read_metadata,
)
from keras_mone.presets.weights import sha256_of

URL_SCHEMES = ("https://", "http://")
HUB_SCHEMES = {"hf://": ("huggingface_hub", "hf"), "kaggle://": ("kagglehub", "kaggle")}


def cache_root():
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    return os.path.join(home, "keras_mone")


def is_remote(handle):
    return isinstance(handle, str) and handle.startswith(URL_SCHEMES + tuple(HUB_SCHEMES))


def download(url, sha256=None, cache_subdir=None, force_download=False):
    """The local path of ``url``'s file, downloaded once into the cache.

    Args:
        url: an ``https://`` (or ``http://``) URL of a file.
        sha256: expected hex sha256; checked on download and on every cache hit
            (a cached file that differs is downloaded again).
        cache_subdir: folder under ``$KERAS_HOME/keras_mone`` (default:
            ``downloads/<hash of the URL>``).
        force_download: download again even if the file is cached.

    Raises:
        ValueError: the file's sha256 differs (the cache is left as it was).
        OSError: the transfer failed (the cache is left as it was).
    """
    name = os.path.basename(urllib.parse.urlparse(url).path) or "download"
    folder = os.path.join(cache_root(), cache_subdir or os.path.join("downloads", _key(url)))
    target = os.path.join(folder, name)
    if not force_download and os.path.isfile(target) and (sha256 is None or sha256_of(target) == sha256):
        return target
    with _staging(folder) as staging:
        fetched = _fetch(url, staging, sha256)
        os.makedirs(folder, exist_ok=True)
        os.replace(fetched, target)
    return target


def fetch_preset_folder(url, sha256=None, force_download=False):
    """A local copy of the preset folder at ``url`` (``config.json``, ``model.weights.h5``, ``metadata.json``).

    ``sha256`` pins ``metadata.json``, which pins the other two files. The
    three files are staged together and published as one folder only when
    every hash checks out; ``force_download`` fetches them again.
    """
    base = url.rstrip("/") + "/"
    folder = os.path.join(cache_root(), "presets", _key(base))
    if not force_download and _cached(folder, sha256):
        return folder
    with _staging(folder) as staging:
        _fetch(base + METADATA_FILE, staging, sha256)
        hashes = read_metadata(staging).get("sha256")
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            if not isinstance(hashes, dict) or name not in hashes:
                raise ValueError(f"{base + METADATA_FILE} records no sha256 for {name}; nothing was cached.")
            _fetch(base + name, staging, hashes[name])
        publish_folder(staging, folder, replacing=os.path.isdir(folder) and bool(os.listdir(folder)))
    return folder


def _cached(folder, sha256):
    if not is_saved_preset(folder):
        return False
    if sha256 is not None and sha256_of(os.path.join(folder, METADATA_FILE)) != sha256:
        return False
    try:
        check_folder(folder)
    except ValueError:
        return False  # damaged: downloaded again and replaced
    return True


def _fetch(url, staging, sha256):
    """Downloads ``url`` into ``staging`` and checks its sha256; returns its path."""
    name = os.path.basename(urllib.parse.urlparse(url).path) or "download"
    try:
        fetched = keras.utils.get_file(fname=name, origin=url, cache_dir=staging, cache_subdir=".", force_download=True)
    except Exception as error:
        raise OSError(
            f"Downloading {url} failed: {error}. Nothing was cached. (Files are cached after one successful "
            "download; from_preset(..., load_weights=False) builds a model without weights.)"
        ) from error
    actual = sha256_of(fetched)
    if sha256 is not None and actual != sha256:
        raise ValueError(
            f"Downloaded {url} has sha256 {actual}, expected {sha256}; nothing was cached "
            "(the server's file changed, or the transfer was corrupted)."
        )
    return fetched


@contextlib.contextmanager
def _staging(folder):
    """A temporary folder beside ``folder``, removed on exit with the parent folders it needed, if left empty."""
    parent = os.path.dirname(folder)
    created = []
    missing = parent
    while missing and not os.path.isdir(missing):
        created.append(missing)
        missing = os.path.dirname(missing)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".staging-", dir=parent)
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # written by this call only
        for path in created:  # innermost first; stops at the first non-empty one
            try:
                os.rmdir(path)
            except OSError:
                break


def _key(url):
    return hashlib.sha256(url.encode()).hexdigest()[:16]


def resolve_hub_handle(handle, force_download=False):
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
        extra_args = {"force_download": True} if force_download else {}
        if scheme == "hf://":
            return hub.snapshot_download(repo_id=path, **extra_args)
        return hub.model_download(path, **extra_args)
    raise ValueError(f"Unknown handle scheme in {handle!r}; use a preset name, a folder, https://, hf:// or kaggle://.")
