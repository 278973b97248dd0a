"""The one parser of ``key=value`` overrides (``keras-mone train``, ``quickstart``, ``bench``).

Values are read as TOML values (numbers, booleans, lists, quoted strings,
inline tables); anything else is kept as a string, so ``dataset=image_folder``
needs no quotes.
"""

import tomllib


def parse_value(text):
    """``"3"`` -> 3, ``"[1, 2]"`` -> [1, 2], ``"true"`` -> True, ``"abc"`` -> "abc"."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_assignment(text, what="override"):
    """``"key=value"`` -> ``(key, value)``; a ``ValueError`` naming ``what`` otherwise."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"{what} {text!r} must look like key=value.")
    return key, parse_value(raw.strip())
