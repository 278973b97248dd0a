"""Day one for a Keras user (issue 29): the data a preset was scored on, an image
converter, ``from_preset`` class methods, model cards, the routing plot."""

import keras
import numpy as np
import pytest

from keras_mone import analysis, flops
from keras_mone.cli.main import main
from keras_mone.data import ImageConverter, load_cluttered_digits, preprocess
from keras_mone.models import ImageClassifier, MoNEViTBackbone, VideoClassifier, ViTBackbone
from keras_mone.methods.mixer.backbone import MixerBackbone
from keras_mone.presets import evaluation_data, from_preset, get_preset, save_to_preset, shipped_presets

# vit_digits' predicted class of the first 256 evaluation images (jax; every
# top-1 margin is > 0.05, so every backend agrees). 251 of them are correct.
VIT_DIGITS_FIRST_256 = (
    "9713599324222974071997774075733706180833944719727755145635569788152245188226627081166666577145256001597350407609"
    "4734729844661935345748583226881300161800309380422026137891402058717124355006891989104456354538076312900440528049"
    "87098926426940488307556994590312"
)


@pytest.fixture(scope="module")
def scored():
    return evaluation_data("vit_digits")


def test_evaluation_data_is_model_ready(scored):
    x, y = scored
    assert x.shape == (5026, 32, 32, 3) and x.dtype == np.float32
    assert x.min() == -1.0 and x.max() == 1.0
    assert y.shape == (5026,) and set(np.unique(y)) == set(range(10))


def test_evaluation_data_is_what_vit_digits_was_scored_on(scored):
    """Per example against a stored computation. Rules out: images left in
    [0, 1] (30% accuracy) or rendered with the loader's defaults (chance)."""
    x, y = scored
    predicted = np.argmax(from_preset("vit_digits").predict(x[:256], verbose=0), axis=-1)
    assert "".join(map(str, predicted)) == VIT_DIGITS_FIRST_256
    assert np.sum(predicted == y[:256]) == 251


@pytest.mark.large
def test_evaluation_data_reproduces_the_manifest_accuracy(scored):
    x, y = scored
    predicted = np.argmax(from_preset("vit_digits").predict(x, batch_size=512, verbose=0), axis=-1)
    expected = get_preset("vit_digits")["weights"]["eval"]["accuracy"]["1.0"]
    assert np.mean(predicted == y) == pytest.approx(expected, abs=1e-3)


def test_evaluation_data_of_a_preset_without_shipped_weights_is_refused():
    with pytest.raises(ValueError, match="ships no trained weights.*vit_digits"):
        evaluation_data("vit_b16")


# -- ImageConverter -----------------------------------------------------------


def test_image_converter_maps_uint8_and_unit_images_to_minus_one_one():
    """Rules out: a converter that divides by 256, or leaves [0, 1]."""
    raw = np.array([[0, 51, 255]], dtype="uint8")
    np.testing.assert_allclose(keras.ops.convert_to_numpy(ImageConverter()(raw)), [[-1.0, -0.6, 1.0]], atol=1e-6)
    np.testing.assert_allclose(preprocess(raw), [[-1.0, -0.6, 1.0]], atol=1e-6)
    unit = ImageConverter(value_range=(0, 1))
    np.testing.assert_allclose(keras.ops.convert_to_numpy(unit(np.array([0.0, 0.25, 1.0]))), [-1.0, -0.5, 1.0])


def test_image_converter_gives_the_evaluation_data(scored):
    split = get_preset("vit_digits")["weights"]["eval"]["test_split"]
    images, _ = load_cluttered_digits(**split)
    converter = ImageConverter.for_preset("vit_digits", value_range=(0, 1))
    np.testing.assert_allclose(keras.ops.convert_to_numpy(converter(images[:16])), scored[0][:16], atol=1e-6)
    np.testing.assert_allclose(preprocess(images[:16], value_range=(0, 1)), scored[0][:16], atol=1e-6)


def test_image_converter_round_trips_through_keras_file(tmp_path):
    model = keras.Sequential([keras.Input((4, 4, 3), dtype="uint8"), ImageConverter(value_range=(0, 255))])
    raw = np.arange(48, dtype="uint8").reshape(1, 4, 4, 3) * 5
    model.save(tmp_path / "converter.keras")
    loaded = keras.saving.load_model(tmp_path / "converter.keras")
    assert loaded.layers[-1].get_config()["value_range"] == [0.0, 255.0]
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(loaded(raw)), keras.ops.convert_to_numpy(model(raw)), atol=1e-6
    )


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"value_range": (255, 0)}, "value_range"),
        ({"value_range": (0,)}, "value_range"),
        ({"value_range": "0-255"}, "value_range"),
        ({"value_range": (0, float("nan"))}, "value_range"),
        ({"target_range": (1, 1)}, "target_range"),
    ],
)
def test_image_converter_bad_ranges_are_named(kwargs, argument):
    with pytest.raises(ValueError, match=f"`{argument}` must be a pair"):
        ImageConverter(**kwargs)


def test_image_converter_for_an_unknown_preset_is_refused():
    with pytest.raises(ValueError, match="Unknown preset 'nope'"):
        ImageConverter.for_preset("nope")


# -- from_preset class methods ------------------------------------------------


def test_class_from_preset_gives_the_preset_with_its_weights():
    """Rules out: weights not loaded, or overrides dropped."""
    model = ImageClassifier.from_preset("vit_digits")
    reference = from_preset("vit_digits")
    assert type(model) is ImageClassifier
    for mine, theirs in zip(model.weights, reference.weights):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(mine), keras.ops.convert_to_numpy(theirs))
    backbone = MoNEViTBackbone.from_preset("mone_vit_digits", capacity=0.3)
    assert type(backbone) is MoNEViTBackbone and backbone.capacity == 0.3
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(ViTBackbone.from_preset("vit_digits").weights[0]),
        keras.ops.convert_to_numpy(reference.backbone.weights[0]),
    )


@pytest.mark.parametrize(
    "cls, name, preset_class",
    [
        (VideoClassifier, "vit_digits", "ImageClassifier"),
        (MoNEViTBackbone, "vit_digits", "ViTBackbone"),
        (ViTBackbone, "mixer_digits", "MixerBackbone"),
        (MixerBackbone, "vivit_fe_digits", "ViViTBackbone"),
    ],
)
def test_class_from_preset_of_another_class_names_both(cls, name, preset_class):
    with pytest.raises(ValueError, match=f"builds class {preset_class}, not {cls.__name__}"):
        cls.from_preset(name, load_weights=False)


def test_class_from_preset_checks_a_preset_folder(tmp_path):
    save_to_preset(from_preset("vit_digits", load_weights=False), tmp_path / "folder")
    assert type(ImageClassifier.from_preset(str(tmp_path / "folder"))) is ImageClassifier
    with pytest.raises(ValueError, match="builds class ImageClassifier, not VideoClassifier"):
        VideoClassifier.from_preset(str(tmp_path / "folder"))


# -- keras-mone presets show ----------------------------------------------------


def test_presets_show_prints_the_model_card(capsys):
    """Rules out: accuracies or GMACs of another capacity, a fixed-capacity
    preset said to serve every budget."""
    assert main(["presets", "show", "mone_vit_digits"]) == 0
    card = capsys.readouterr().out
    model = from_preset("mone_vit_digits", load_weights=False)
    entry = get_preset("mone_vit_digits")["weights"]
    for capacity, accuracy in entry["eval"]["accuracy"].items():
        model.set_capacity(float(capacity))
        assert f"{float(capacity):<14g} {flops(model).gmacs:.4g}   {100 * accuracy:.2f}%" in card
    assert entry["command"] in card and f"{model.count_params():,}" in card
    assert "trained at e_c 0.5 only" in card and "For every budget: mone_vit_digits_adaptive" in card
    assert main(["presets", "show", "mone_vit_digits_adaptive"]) == 0
    assert "one model serves every budget" in capsys.readouterr().out
    assert main(["presets", "show", "vit_digits"]) == 0
    assert "one budget: no routing" in capsys.readouterr().out


@pytest.mark.parametrize("name", shipped_presets())
def test_presets_show_gives_every_recorded_accuracy(name, capsys):
    """Every shipped preset, whatever its setting (capacity, width, ACM's execution)."""
    assert main(["presets", "show", name]) == 0
    card = capsys.readouterr().out
    for accuracy in get_preset(name)["weights"]["eval"]["accuracy"].values():
        assert f"{100 * accuracy:.2f}%" in card


def test_presets_show_unknown_name_is_an_error(capsys):
    assert main(["presets", "show", "nope"]) == 2
    assert "Unknown preset 'nope'" in capsys.readouterr().err


# -- routing plot ---------------------------------------------------------------


def test_plot_routing_writes_a_png_of_the_routing_map(scored, tmp_path):
    """Rules out: a map of another router's or capacity's assignment (each
    image's map holds the static EPR counts of the capacity set)."""
    model = from_preset("mone_vit_digits", capacity=0.3)
    expert = analysis.routing_map(model, scored[0][:3])
    assert expert.shape == (3, 8, 8)
    counts = model.backbone.expert_token_counts()[0]
    for image in expert:
        assert tuple(np.bincount(image.ravel(), minlength=4)) == tuple(counts)
    figure = analysis.plot_routing(model, scored[0], tmp_path / "routing.png", num_images=3)
    assert (tmp_path / "routing.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(figure.axes) == 6


def test_plot_routing_needs_a_mone_model(scored, tmp_path):
    with pytest.raises(ValueError, match="`model` must be a MoNE image model"):
        analysis.plot_routing(from_preset("vit_digits", load_weights=False), scored[0][:2], tmp_path / "r.png")
    with pytest.raises(ValueError, match="`num_images` must be an int >= 1"):
        analysis.plot_routing(from_preset("mone_vit_digits"), scored[0], tmp_path / "r.png", num_images=0)
    assert not (tmp_path / "r.png").exists()


@pytest.fixture(scope="module")
def adaptive():
    return from_preset("mone_vit_digits_adaptive")


def _drawn(figure):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    return canvas.get_renderer()


def _inside(extent, box):
    return extent.x0 >= box.x0 and extent.y0 >= box.y0 and extent.x1 <= box.x1 and extent.y1 <= box.y1


def test_plot_routing_keeps_the_title_whole_for_one_image(adaptive, scored, tmp_path):
    """Issue 43: one image cut the title to "t (brightest: full exp"."""
    adaptive.set_capacity(0.5)
    figure = analysis.plot_routing(adaptive, scored[0][:1], tmp_path / "one.png")
    renderer = _drawn(figure)
    title = next(t for t in figure.findobj(lambda a: hasattr(a, "get_text")) if t.get_text() == figure.get_suptitle())
    assert " ".join(title.get_text().replace("\u00a0", " ").split()) == (
        "Nested expert of each token, router 0 (before block 0), at e_c = 0.5"
    )
    assert _inside(title.get_window_extent(renderer), figure.bbox)
    legend = figure.axes[1].get_legend()
    assert _inside(legend.get_window_extent(renderer), figure.bbox)
    assert figure.get_figwidth() >= 4.5 and len(figure.axes) == 2


def test_plot_routing_grid_is_the_models_expert_of_each_token(adaptive, scored):
    """Every drawn cell is the expert the model's router sends that token to
    (eager forward record, class token dropped, row-major patch grid)."""
    adaptive.set_capacity(0.3)
    x = scored[0][:3]
    figure = analysis.plot_routing(adaptive, x, num_images=3)
    _, record = adaptive.backbone(x, training=False, return_intermediates=True)
    expected = keras.ops.convert_to_numpy(record["expert_index"][0])[:, -64:].reshape(3, 8, 8)
    assert len(np.unique(expected)) == 4  # every expert is used: the comparison sees each value
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(figure.axes[3 + i].images[-1].get_array()), expected[i])
    np.testing.assert_array_equal(analysis.routing_grid(adaptive, x)["grid"], expected)


def test_plot_routing_legend_names_every_expert(adaptive, scored):
    adaptive.set_capacity(0.5)
    figure = analysis.plot_routing(adaptive, scored[0], num_images=2)
    legend = figure.axes[-1].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["D", "D/2", "D/4", "D/8"]
    assert "D: full" in legend.get_title().get_text()


def test_plot_routing_names_dropped_skipped_and_learner_tokens():
    """MoNE's dropped tokens (MoD Greedy allocation), MoD / A-MoD's skipped ones, ACM's learner counts."""
    from conftest import images
    from harness import build_classifier

    from keras_mone.analysis.capacity_methods import model_variant

    x = images(batch=2)
    dropping, _ = model_variant(build_classifier("mone_vit"), capacity_method="mod_greedy", capacity=0.25)
    expected = {"mone": ["D", "D/2", "D/4", "D/8", "dropped"], "mod_vit": ["run", "skipped"],
                "acm_vit": ["4/4 learners", "3/4 learners", "2/4 learners", "1/4 learners", "none (skipped)"]}
    models = {"mone": dropping, "mod_vit": build_classifier("mod_vit"), "acm_vit": build_classifier("acm_vit")}
    for name, model in models.items():
        figure = analysis.plot_routing(model, x)
        grid = np.stack([np.asarray(ax.images[-1].get_array()) for ax in figure.axes[2:]])
        assert [t.get_text() for t in figure.axes[-1].get_legend().get_texts()] == expected[name]
        np.testing.assert_array_equal(grid, analysis.routing_grid(model, x)["grid"])
        if name == "mone":  # MoD Greedy: a quarter of the tokens to the full expert, the rest dropped
            assert set(np.unique(grid).tolist()) == {-1, 3}


def test_plot_routing_refuses_a_bad_router(adaptive, scored, tmp_path):
    for router in (1, -1, True, 0.0, "0"):
        with pytest.raises(ValueError, match=r"`router` must be an int in \[0, 1\) \(the model's routers\)"):
            analysis.plot_routing(adaptive, scored[0][:2], tmp_path / "r.png", router=router)
    with pytest.raises(ValueError, match="`input_alpha` must be a number in"):
        analysis.plot_routing(adaptive, scored[0][:2], tmp_path / "r.png", input_alpha=1.0)
    assert not (tmp_path / "r.png").exists()


@pytest.mark.large
def test_preset_descriptions_give_the_gmacs_of_the_built_model():
    """The preset list's "N GMACs at 224" is keras_mone.flops of the preset as
    built. Rules out: the published class-token figures (17.58) on GAP builds (17.47)."""
    import re

    from keras_mone.presets import list_presets

    checked = 0
    for name in list_presets():
        match = re.search(r"([\d.]+) GMACs at 224", get_preset(name)["description"])
        if match:
            decimals = len(match.group(1).partition(".")[2])
            assert round(flops(from_preset(name, load_weights=False)).gmacs, decimals) == float(match.group(1)), name
            checked += 1
    assert checked >= 10
