"""Every Python and shell block of README.md and docs/*.md runs as written, on the current backend.

A block is a fenced ```python or ```bash block (indented ones inside list
items included); unlabelled fences are text (file trees) and are not run. A
block right after ``<!-- readme-test: skip (reason) -->`` is not run: it is
reported as a pytest skip with its reason, and a marker without a reason, or
a block in another language, fails. Every other block runs in a fresh
namespace (blocks are self-contained) with a temporary working directory:
python blocks with ``exec``; shell blocks line by line, each line a
``keras-mone`` command run in-process through ``keras_mone.cli.main`` (a
leading ``KERAS_BACKEND=...`` is dropped: the block runs on the backend under
test, which is the README's point that switching it changes nothing else).

What the test changes so every block takes seconds on a CPU:
- ``keras-mone train cluttered_digits_*`` commands and ``recipes.load`` get
  the tiny settings below for every key the block does not set itself;
  ``keras-mone train augreg_*`` on ``data_dir=ROOT`` trains one step on a
  200-image folder the test writes at ``ROOT``.
- Weight downloads (``keras_mone.presets.tags.download``) return a synthetic
  checkpoint in the AugReg ``.npz`` layout (random values, every key and shape
  of the requested size); ``$KERAS_HOME`` is a temporary folder; the same file
  is in the working directory under its published name.
"""

import contextlib
import io
import os
import pathlib
import re
import shlex
import urllib.parse

import keras
import numpy as np
import pytest

from keras_mone.cli.main import main
from keras_mone.models import decode_variant
from keras_mone.presets import get_preset
from test_full_scale_recipes import TINY_ARGS, _image_folder

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
FIRST_FIVE = "mone_vit_digits_adaptive"
SKIP = re.compile(r"<!--\s*readme-test:\s*skip\s*(\((?P<reason>.*)\))?\s*-->\s*$", re.S)
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)[ \t]*\n(?P<code>.*?)^(?P=indent)```[ \t]*$", re.S | re.M)
TINY_DIGITS = dict(
    image_size=16, digit_scale=1, clutter=1, samples_per_digit=1, test_samples_per_digit=1, epochs=1,
    steps_per_epoch=2, position_step=8, model_args=dict(patch_size=8, hidden_dim=32, depth=1, num_heads=4, mlp_dim=64),
)
TINY_DATA_ONLY = ("samples_per_digit", "test_samples_per_digit", "epochs", "steps_per_epoch")
TINY_FOLDER = [
    "image_size=32", *TINY_ARGS, "batch_size=4", "steps_per_epoch=1", "epochs=1", "warmup_steps=0",
    "shuffle_buffer=16", "checkpoint_steps=0", "augmentation=none",
]


def blocks(path):
    """``(line, language, code, skip reason or None)`` of every fenced block in ``path``."""
    text = path.read_text()
    found = []
    for match in FENCE.finditer(text):
        before = text[:match.start()].rstrip().rsplit("\n", 1)[-1].strip()
        marker = SKIP.match(before)
        reason = (marker.group("reason") or "").strip() if marker else None
        indent = len(match.group("indent"))
        code = "\n".join(line[indent:] for line in match.group("code").splitlines())
        found.append((text[:match.start()].count("\n") + 1, match.group("lang"), code, reason))
    return found


ALL = [(path, *block) for path in DOCS for block in blocks(path)]
CODE = [b for b in ALL if b[2]]  # labelled fences


def _id(block):
    return f"{block[0].relative_to(ROOT)}:{block[1]}"


def test_every_block_runs_or_says_why_not():
    assert len(CODE) >= 15, [_id(b) for b in CODE]
    for block in CODE:
        path, line, lang, code, reason = block
        assert lang in ("python", "bash"), f"{_id(block)}: ```{lang} blocks are not run; use python or bash"
        assert reason is None or len(reason) > 10, f"{_id(block)}: a skip marker needs a reason"
    skipped = [b for b in CODE if b[4] is not None]
    assert len(skipped) <= 4, [_id(b) for b in skipped]  # prefer running: a new skip is a decision


def test_readme_test_command_is_what_ci_runs():
    command = next(b[2].strip() for b in blocks(README) if "run_all_backends" in b[2])
    assert command.splitlines()[-1] in (ROOT / ".ci" / "run").read_text().splitlines()


def test_first_five_minutes_is_short_and_near_the_top():
    text = README.read_text()
    section = text.split("## First five minutes", 1)[1].split("\n## ", 1)[0]
    code = next(b[2] for b in blocks(README) if b[2] in section)
    assert len(code.strip().splitlines()) < 15
    assert text.index("## First five minutes") < text.index("## The two commands") < text.index("## Paths by task")


def test_docs_links_resolve():
    for path in DOCS:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", path.read_text()):
            assert (path.parent / target).exists(), f"{path.name} links to missing {target}"


# -- running the blocks --------------------------------------------------------
def synthetic_augreg(path, url):
    """An AugReg ``.npz`` with the keys and shapes ``url``'s file has (random values)."""
    name = os.path.basename(urllib.parse.urlparse(url).path)
    size, patch = re.match(r"(Ti|S|B|L)_(\d+)-", name).groups()
    spec = decode_variant(f"{size}/{patch}")
    d, h, m, p = spec["hidden_dim"], spec["num_heads"], spec["mlp_dim"], spec["patch_size"]
    tokens = (int(re.search(r"res_(\d+)", name).group(1)) // p) ** 2 + 1
    classes = 1000 if "imagenet2012" in name else 21843
    rng = np.random.default_rng(0)
    r = lambda *shape: rng.normal(0, 0.02, shape).astype("float32")  # noqa: E731
    arrays = {"embedding/kernel": r(p, p, 3, d), "embedding/bias": r(d), "cls": r(1, 1, d),
              "Transformer/posembed_input/pos_embedding": r(1, tokens, d),
              "Transformer/encoder_norm/scale": 1 + r(d), "Transformer/encoder_norm/bias": r(d),
              "head/kernel": r(d, classes), "head/bias": r(classes)}
    for i in range(spec["depth"]):
        block = f"Transformer/encoderblock_{i}"
        for norm in ("LayerNorm_0", "LayerNorm_2"):
            arrays.update({f"{block}/{norm}/scale": 1 + r(d), f"{block}/{norm}/bias": r(d)})
        attention = f"{block}/MultiHeadDotProductAttention_1"
        for proj in ("query", "key", "value"):
            arrays.update({f"{attention}/{proj}/kernel": r(d, h, d // h), f"{attention}/{proj}/bias": r(h, d // h)})
        arrays.update({f"{attention}/out/kernel": r(h, d // h, d), f"{attention}/out/bias": r(d),
                       f"{block}/MlpBlock_3/Dense_0/kernel": r(d, m), f"{block}/MlpBlock_3/Dense_0/bias": r(m),
                       f"{block}/MlpBlock_3/Dense_1/kernel": r(m, d), f"{block}/MlpBlock_3/Dense_1/bias": r(d)})
    np.savez(path, **arrays)
    return str(path)


def tiny_command(argv):
    """``keras-mone train`` arguments with the tiny settings for the keys ``argv`` leaves unset."""
    if argv[:1] != ["train"] or len(argv) < 2 or argv[1].startswith("-"):
        return argv
    given = {arg.split("=", 1)[0] for arg in argv[2:]}
    if argv[1].startswith("cluttered_digits"):
        extra = [f"{k}={v}" for k, v in TINY_DIGITS.items() if k != "model_args"]
        extra += [f"model_args.{k}={v}" for k, v in TINY_DIGITS["model_args"].items()]
    elif argv[1].startswith("augreg_") and "data_dir=ROOT" in argv:
        _image_folder(pathlib.Path("ROOT"))
        extra = TINY_FOLDER
    else:
        raise AssertionError(f"no tiny form for `keras-mone {' '.join(argv)}`: mark the block with a reason")
    return argv + [arg for arg in extra if arg.split("=", 1)[0] not in given]


def run_shell(code):
    for line in code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            words = words[1:]  # KERAS_BACKEND=...: the backend under test runs it
        if not words:
            continue
        assert words[0] == "keras-mone", f"only keras-mone commands run here: {line!r}"
        try:
            code = main(tiny_command(words[1:]))
        except SystemExit as stop:  # --help
            code = stop.code
        assert code in (0, None), f"`{line}` exited {code}"


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras_home"))
    checkpoints = tmp_path / "downloads"
    checkpoints.mkdir()

    def download(url, sha256=None, cache_subdir=None, force_download=False):
        return synthetic_augreg(checkpoints / os.path.basename(url), url)

    monkeypatch.setattr("keras_mone.presets.tags.download", download)
    for name in set(re.findall(r'"((?:Ti|S|B|L)_\d+-[^"]*\.npz)"', "\n".join(b[3] for b in CODE))):
        synthetic_augreg(tmp_path / name, name)  # a block opens a downloaded file by its name
    from keras_mone import recipes

    load = recipes.load
    def tiny_load(name, **kw):
        # a block that starts from a preset keeps its geometry (the preset's weights must fit)
        from_preset = str(kw.get("init_from", "")).startswith("preset:")
        tiny = {k: v for k, v in TINY_DIGITS.items() if not from_preset or k in TINY_DATA_ONLY}
        return load(name, **{**tiny, **kw})

    monkeypatch.setattr(recipes, "load", tiny_load)
    return tmp_path


@pytest.mark.parametrize("block", CODE, ids=_id)
def test_block_runs(block, sandbox):
    path, line, lang, code, reason = block
    if reason is not None:
        pytest.skip(f"{_id(block)}: {reason}")
    keras.utils.set_random_seed(0)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        if lang == "python":
            exec(compile(code, f"{path}:{line}", "exec"), {"__name__": "readme"})
        else:
            run_shell(code)
    if path == README and f'from_preset("{FIRST_FIVE}")' in code:
        check_first_five_minutes(code, out.getvalue(), sandbox)


def check_first_five_minutes(code, printed, folder):
    """Rules out data that is not the scored split (the loader's defaults, or [0, 1]
    images), a budget change that does nothing, and comments that disagree with the manifest."""
    found = dict(re.findall(r"e_c ([\d.]+): ([\d.]+)%", printed))
    expected = get_preset(FIRST_FIVE)["weights"]["eval"]["accuracy"]
    assert set(found) == {"0.5", "0.3"}, printed
    for capacity, accuracy in found.items():
        assert float(accuracy) == pytest.approx(100 * expected[capacity], abs=0.1)
        assert f"{100 * expected[capacity]:.2f}%" in code  # the comment states it
    assert (folder / "routing.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
