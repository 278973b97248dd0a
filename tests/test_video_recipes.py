"""Video recipes (ViViT / MoNE-ViViT): keys, bundled files, the video pipeline, init_from, tiny runs."""

import os

import keras
import numpy as np
import pytest
from conftest import randomize_weights

from keras_mone import recipes
from keras_mone.data import video_pipeline
from keras_mone.data.pipeline import AUGMENTATIONS
from keras_mone.models import ImageClassifier, MoNEViTBackbone, ViTBackbone
from keras_mone.models.weight_transfer import relative_weight_paths

tf = pytest.importorskip("tensorflow")

# 4 frames of 16x16, tubelet 2x8x8: 2 frame indices of 4 tokens (as tests/test_vivit.py).
SPATIAL = dict(patch_size=8, hidden_dim=32, depth=1, num_heads=4, mlp_dim=64)
TINY_VIDEO = dict(
    num_frames=4, image_size=16, digit_scale=1, model_args=dict(SPATIAL, temporal_depth=1),
    samples_per_digit=1, test_samples_per_digit=1, epochs=1, steps_per_epoch=4, batch_size=8,
    eval_batch_size=64, warmup_fraction=0.0, checkpoint_steps=0, init_from="",
)
VIDEO_RECIPES = [
    "vivit_fe_b16_k400", "mone_vivit_fe_b16_k400", "vivit_fe_b16_ssv2", "mone_vivit_fe_b16_ssv2",
    "moving_digits_vivit", "moving_digits_mone_vivit",
]


def repeat(batch):
    """The same batch without end (a generator for ``fit``)."""
    while True:
        yield batch


def tiny(tmp_path, **extra):
    return {**TINY_VIDEO, "output_dir": str(tmp_path), **extra}


def test_video_recipes_hold_the_reference_hyperparameters():
    assert set(VIDEO_RECIPES) <= set(recipes.list_recipes())
    k400, _ = recipes.resolve("mone_vivit_fe_b16_k400")
    assert (k400["optimizer"], k400["momentum"], k400["learning_rate"], k400["warmup_epochs"]) == ("sgd", 0.9, 0.05, 2.5)
    assert (k400["epochs"], k400["batch_size"], k400["grad_clip"], k400["scale_jitter"]) == (30, 64, 1.0, [0.9, 1.33])
    assert (k400["num_frames"], k400["frame_stride"], k400["image_size"], k400["num_classes"], k400["flip"]) == (32, 2, 224, 400, True)
    assert (k400["capacity"], k400["mode"], k400["variant"]) == (0.3, "isoflops", "B/16")
    ssv2, _ = recipes.resolve("vivit_fe_b16_ssv2")
    assert (ssv2["learning_rate"], ssv2["epochs"], ssv2["label_smoothing"], ssv2["drop_path_rate"]) == (0.4, 35, 0.3, 0.3)
    assert AUGMENTATIONS[ssv2["augmentation"]] == (0.3, 2, 20)
    assert (ssv2["image_size"], ssv2["num_classes"], ssv2["flip"], ssv2["architecture"]) == (256, 174, False, "vivit")
    digits, _ = recipes.resolve("moving_digits_mone_vivit")
    assert (digits["dataset"], digits["digits_target"], digits["optimizer"], digits["loss"]) == ("moving_digits", "digit_direction", "adamw", "softmax")
    assert (digits["num_frames"], digits["image_size"], digits["variant"], digits["flip"]) == (8, 32, "Digits/4", False)


def test_video_keys_are_validated(tmp_path):
    bad = {
        r"'num_frames' \(7\) must be a multiple of key 'tubelet_size' \(2\)": dict(num_frames=7),
        r"'optimizer' must be one of \['adamw', 'sgd'\]": dict(optimizer="adam"),
        r"init_from.*'nope.keras' does not exist": dict(init_from="nope.keras"),
        r"init_from.*'preset:vit_b16' names no preset with weights": dict(init_from="preset:vit_b16"),
        r"\['num_frames'\] as top-level": dict(model_args={"num_frames": 4}),
        r"'dataset' must be one of \['video_folder', 'moving_digits'\]": dict(dataset="cluttered_digits"),
        r"'label_smoothing' needs loss='softmax'": dict(loss="sigmoid", label_smoothing=0.1),
        r"'scale_jitter' must be \[low, high\]": dict(scale_jitter=[1.3, 0.9]),
        r"'preprocessing' must be one of \['scale_jitter', 'plain'\] for video": dict(preprocessing="inception"),
        r"'digits_target' must be one of": dict(digits_target="colour"),
    }
    for message, overrides in bad.items():
        with pytest.raises(recipes.RecipeError, match=message):
            recipes.resolve("moving_digits_vivit", **overrides)
    with pytest.raises(recipes.RecipeError, match=r"'dataset' must be one of \['tfds'"):
        recipes.resolve("cluttered_digits_vit", dataset="moving_digits")
    assert recipes.resolve("cluttered_digits_vit", init_from="x.keras")[0]["init_from"] == "x.keras"  # image models too
    # A missing image model stops load() before anything is built or written.
    run = tmp_path / "run"
    with pytest.raises(recipes.RecipeError, match="does not exist"):
        recipes.load("mone_vivit_fe_b16_k400", init_from=str(tmp_path / "missing.keras"), output_dir=str(run))
    assert not run.exists()


def _frame_folder(root, lengths=(10, 4), size=(20, 24)):
    """Clips whose frame i is the constant value 10 * i (readable after any resize or crop)."""
    for split in ("train", "val"):
        for label in ("push", "pull"):
            for clip, length in enumerate(lengths):
                folder = os.path.join(root, split, label, f"clip{clip}")
                os.makedirs(folder)
                for i in range(length):
                    frame = np.full((*size, 3), 10 * i, np.uint8)
                    tf.io.write_file(os.path.join(folder, f"{i:05d}.png"), tf.io.encode_png(frame))


def _frame_numbers(clips):
    """Frame index of every frame of ``(B, T, H, W, 3)`` clips in [-1, 1]."""
    return np.round((np.asarray(clips).mean(axis=(2, 3, 4)) + 1.0) * 127.5 / 10).astype(int)


def test_video_folder_pipeline_samples_frames_at_the_stride(tmp_path):
    _frame_folder(str(tmp_path))
    source = video_pipeline.video_folder_source(str(tmp_path), "val")
    assert (source.num_examples, source.num_classes) == (4, 2)
    evaluate = video_pipeline.eval_dataset(source, 3, 16, 4, 2, frame_stride=2)
    clips, labels = next(iter(evaluate))
    assert clips.shape == (4, 3, 16, 16, 3) and labels.shape == (4, 2)
    assert -1.0 <= clips.numpy().min() and clips.numpy().max() <= 1.0
    # Centred span of 5 frames: 10-frame clips give 2, 4, 6; 4-frame clips loop: 0, 2, 0.
    np.testing.assert_array_equal(_frame_numbers(clips), [[2, 4, 6], [0, 2, 0]] * 2)
    again, _ = next(iter(evaluate))
    np.testing.assert_array_equal(again.numpy(), clips.numpy())
    train = video_pipeline.train_dataset(source, 3, 16, 4, 2, frame_stride=3, shuffle_buffer=4, seed=1)
    starts = []
    for clips, _ in train.take(3):
        assert clips.shape == (4, 3, 16, 16, 3) and -1.0 <= clips.numpy().min() and clips.numpy().max() <= 1.0
        for frames in _frame_numbers(clips).tolist():
            # 10-frame clips: a random start in 0..3, then stride 3; 4-frame clips loop: 0, 3, 2.
            assert frames == [0, 3, 2] or (frames[0] in range(4) and frames == [frames[0] + 3 * i for i in range(3)]), frames
            starts.append(frames[0]) if frames != [0, 3, 2] else None
    assert len(set(starts)) > 1

def test_moving_digits_recipe_fits_and_lowers_the_loss(tmp_path):
    setup = recipes.load("moving_digits_vivit", resume=False, **tiny(tmp_path, eval_split="", learning_rate=3e-3))
    assert setup.model.backbone.num_frames == 4 and type(setup.model).__name__ == "VideoClassifier"
    batch = next(setup.train_data)  # fresh renderings: a MovingDigitsStream
    assert tuple(batch[0].shape) == (8, 4, 16, 16, 3) and tuple(batch[1].shape) == (8, 40)
    one_batch = repeat(batch)
    before = setup.model.evaluate(*batch, verbose=0, return_dict=True)["loss"]
    setup.model.fit(one_batch, steps_per_epoch=10, epochs=1, verbose=0, shuffle=False)
    after = setup.model.evaluate(*batch, verbose=0, return_dict=True)["loss"]
    assert np.isfinite(after) and after < before - 0.05, (before, after)
    assert int(keras.ops.convert_to_numpy(setup.optimizer.iterations)) == 10


def test_k400_recipe_runs_on_a_tiny_frame_folder_with_init_from(tmp_path):
    data = str(tmp_path / "data")
    _frame_folder(data)
    # MoNE-ViViT starts from a MoNE-ViT image model (same experts and routers).
    image = ImageClassifier(MoNEViTBackbone(image_size=16, capacity=0.3, **SPATIAL), num_classes=3)
    image.build()
    randomize_weights(image, seed=3)
    path = str(tmp_path / "image.keras")
    image.save(path)
    image = keras.saving.load_model(path)  # weight paths relative to the backbone
    setup = recipes.load(
        "mone_vivit_fe_b16_k400", resume=False, data_dir=data,
        **tiny(tmp_path / "run", num_frames=4, frame_stride=2, steps_per_epoch=2, batch_size=4, shuffle_buffer=8,
               warmup_epochs=0.5, epochs=4, init_from=path),
    )
    assert type(setup.optimizer).__name__ == "SGD" and setup.epochs > 4  # isoFLOPs at e_c 0.3
    video, image_weights = relative_weight_paths(setup.model.backbone), relative_weight_paths(image.backbone)
    copied = [p for p in image_weights if not p.startswith("patch_embedding/")]
    assert copied and all(p in video for p in copied)
    for p in copied:
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(video[p]), keras.ops.convert_to_numpy(image_weights[p]))
    clips, labels = next(iter(setup.train_data))
    assert clips.shape == (4, 4, 16, 16, 3) and labels.shape == (4, 400)  # the recipe fixes 400 classes
    history = setup.model.fit(setup.train_data, steps_per_epoch=2, epochs=1, verbose=0, shuffle=False)
    assert np.isfinite(history.history["loss"][-1])
    assert int(keras.ops.convert_to_numpy(setup.optimizer.iterations)) == 2
    # A MoNE-ViT's routers have no place in a dense ViViT, nor a narrower ViT's blocks:
    # a RecipeError, before any training.
    with pytest.raises(recipes.RecipeError, match=r"init_from.*mone_vit_backbone.*no counterpart"):
        recipes.load("vivit_fe_b16_k400", resume=False, data_dir=data, **tiny(tmp_path / "run2", init_from=path))
    narrow = ImageClassifier(ViTBackbone(image_size=16, **{**SPATIAL, "hidden_dim": 16}), num_classes=3)
    narrow.build()
    narrow.save(str(tmp_path / "narrow.keras"))
    with pytest.raises(recipes.RecipeError, match=r"init_from.*hidden_dim"):
        recipes.load(
            "vivit_fe_b16_k400", resume=False, data_dir=data, **tiny(tmp_path / "run3", init_from=str(tmp_path / "narrow.keras"))
        )


def test_moving_digits_recipes_start_from_the_shipped_image_presets(tmp_path):
    """init_from = "preset:<name>": the spatial transformer holds the image preset's weights."""
    from keras_mone import presets

    for recipe, preset in (("moving_digits_vivit", "vit_digits"), ("moving_digits_mone_vivit", "mone_vit_digits")):
        setup = recipes.load(recipe, resume=False, output_dir=str(tmp_path / recipe), eval_split="", steps_per_epoch=1)
        assert setup.recipe["init_from"] == f"preset:{preset}"
        image = relative_weight_paths(presets.from_preset(preset).backbone)
        video = relative_weight_paths(setup.model.backbone)
        blocks = [p for p in image if not p.startswith("patch_embedding/")]  # blocks, norm, routers
        assert blocks and all(p in video for p in blocks)
        for p in blocks:
            np.testing.assert_array_equal(keras.ops.convert_to_numpy(video[p]), keras.ops.convert_to_numpy(image[p]))
