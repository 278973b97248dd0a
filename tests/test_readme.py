"""The README's "First five minutes" block runs as written, and prints what its comments say."""

import contextlib
import io
import pathlib
import re

import pytest

from keras_mone.presets import get_preset

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
PRESET = "mone_vit_digits_adaptive"


def first_five_minutes():
    """The Python block under the README's "First five minutes" heading."""
    text = README.read_text()
    section = text.split("## First five minutes", 1)[1]
    match = re.search(r"```python\n(.*?)```", section.split("\n## ", 1)[0], re.S)
    assert match, "README's 'First five minutes' section has no python block"
    return match.group(1)


def test_block_is_short_and_near_the_top():
    block = first_five_minutes()
    assert len(block.strip().splitlines()) < 15
    assert README.read_text().index("## First five minutes") < README.read_text().index("## The two commands")


def test_first_five_minutes_runs_and_prints_the_manifest_accuracy(tmp_path, monkeypatch):
    """Rules out: a block that fails, data that is not the scored split (the
    loader's defaults, or [0, 1] images), a budget change that does nothing,
    and comments that disagree with the manifest."""
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(first_five_minutes(), str(README), "exec"), {"__name__": "readme"})
    printed = dict(re.findall(r"e_c ([\d.]+): ([\d.]+)%", out.getvalue()))
    expected = get_preset(PRESET)["weights"]["eval"]["accuracy"]
    assert set(printed) == {"0.5", "0.3"}, out.getvalue()
    for capacity, accuracy in printed.items():
        assert float(accuracy) == pytest.approx(100 * expected[capacity], abs=0.1)
        assert f"{100 * expected[capacity]:.2f}%" in first_five_minutes()  # the comment states it
    assert (tmp_path / "routing.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
