"""Image processors of vision-language checkpoints: pixels equal to transformers' PIL backend's
(tests/fixtures/image_processors/, written by its make_pixels.py) for every setting and image,
from every kind of input; every setting zoo cannot honour refused by name before any image is
processed; the settings written back load to the same processor."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from helpers import ROOT
from PIL import Image
from zoo.data.image_processors import load_image_processor

from zoo.plugin import ZooError

FIXTURE = ROOT / "tests" / "fixtures" / "image_processors"
IMAGES = ["rgb-17x31", "rgba-40x23", "l-64x64", "p-100x30", "rgb-53x37", "l-1x1"]
SETTINGS = sorted(p.parent.name for p in FIXTURE.glob("*/preprocessor_config.json"))
REFERENCE = dict(np.load(FIXTURE / "pixels.npz"))
PATHS = [FIXTURE / "images" / f"{name}.png" for name in IMAGES]


def config(setting: str) -> dict:
    return json.loads((FIXTURE / setting / "preprocessor_config.json").read_text())


def channels_first(pixels: np.ndarray) -> np.ndarray:
    """zoo's SigLIP and Gemma pixels are channels last, transformers' first; Qwen's rows are
    laid out alike."""
    return np.moveaxis(pixels, -1, 1) if pixels.ndim == 4 else pixels


def test_the_fixture_holds_every_setting():
    assert len(SETTINGS) == 12
    assert {key.split(".")[0] for key in REFERENCE} == {*SETTINGS, "arrays"}


@pytest.mark.parametrize("setting", SETTINGS)
def test_pixels_equal_transformers(setting):
    out = load_image_processor(FIXTURE / setting)(PATHS)
    np.testing.assert_array_equal(
        channels_first(out.pixel_values), REFERENCE[f"{setting}.pixel_values"]
    )
    assert out.pixel_values.dtype == np.float32
    for field, key in (("grid_thw", "image_grid_thw"), ("num_crops", "num_crops")):
        expected = REFERENCE.get(f"{setting}.{key}")
        made = getattr(out, field)
        assert (made is None) == (expected is None)
        if expected is not None:
            np.testing.assert_array_equal(made, expected)


def test_the_fixture_pans_scans_and_resizes_each_image_differently():
    """The settings' images are not all alike: crops and grids vary, so the equalities above
    hold for several shapes."""
    assert REFERENCE["gemma3-pan-and-scan.num_crops"].tolist() == [2, 2, 0, 3, 2, 0]
    grids = REFERENCE["qwen2-vl.image_grid_thw"].tolist()
    assert len({tuple(grid) for grid in grids}) == 4


def as_kind(path, kind: str):
    if kind == "path":
        return path
    if kind == "str":
        return str(path)
    if kind == "bytes":
        return path.read_bytes()
    image = Image.open(path)
    if kind == "pil":
        return image
    return np.asarray(image.convert("RGBA") if image.mode == "P" else image)


@pytest.mark.parametrize("kind", ["path", "str", "bytes", "pil", "array"])
def test_every_kind_of_input_gives_the_same_pixels(kind):
    """Grey arrays go in as height x width (transformers takes them with a channel axis)."""
    out = load_image_processor(FIXTURE / "siglip")([as_kind(path, kind) for path in PATHS])
    pixels = channels_first(out.pixel_values)
    np.testing.assert_array_equal(pixels, REFERENCE["siglip.pixel_values"])
    if kind == "array":
        np.testing.assert_array_equal(pixels, REFERENCE["arrays.pixel_values"])


@pytest.mark.parametrize("setting", ["gemma3-pan-and-scan", "qwen2-vl"])
def test_one_image_at_a_time_gives_the_batch(setting):
    processor = load_image_processor(FIXTURE / setting)
    batch = processor(PATHS)
    singles = [processor(path) for path in PATHS]
    rows = np.concatenate([single.pixel_values for single in singles])
    np.testing.assert_array_equal(rows, batch.pixel_values)
    counts = [s.num_crops if s.grid_thw is None else s.grid_thw for s in singles]
    expected = batch.num_crops if batch.grid_thw is None else batch.grid_thw
    np.testing.assert_array_equal(np.concatenate(counts), expected)


@pytest.mark.parametrize("suffix", ["Pil", "Fast"])
def test_the_backend_suffix_names_the_same_processor(suffix):
    settings = config("gemma3-pan-and-scan")
    settings["image_processor_type"] += suffix
    out = load_image_processor(settings)(PATHS)
    np.testing.assert_array_equal(
        channels_first(out.pixel_values), REFERENCE["gemma3-pan-and-scan.pixel_values"]
    )


@pytest.mark.parametrize("setting", SETTINGS)
def test_settings_load_again_to_the_same_processor(setting):
    processor = load_image_processor(FIXTURE / setting)
    written = json.loads(json.dumps(processor.settings()))
    again = load_image_processor(written)
    assert again.settings() == written
    assert list(written)[: len(config(setting))] == list(config(setting))
    np.testing.assert_array_equal(again(PATHS[:2]).pixel_values, processor(PATHS[:2]).pixel_values)


def test_the_processor_file_of_transformers_processors_is_read_where_there_is_no_other(tmp_path):
    """`ProcessorMixin.save_pretrained` nests the image processor's settings in one file."""
    with pytest.raises(ZooError, match="has no preprocessor_config.json"):
        load_image_processor(tmp_path)
    nested = {"image_processor": config("qwen2-vl"), "processor_class": "Qwen2_5_VLProcessor"}
    (tmp_path / "processor_config.json").write_text(json.dumps(nested))
    out = load_image_processor(tmp_path)(PATHS)
    np.testing.assert_array_equal(out.pixel_values, REFERENCE["qwen2-vl.pixel_values"])


def test_settings_write_the_defaults_a_null_stands_for():
    written = load_image_processor(FIXTURE / "gemma3").settings()
    assert written["do_convert_rgb"] is True
    assert written["do_pan_and_scan"] is False
    assert written["pan_and_scan_min_crop_size"] == 256
    assert written["image_seq_length"] == 256
    qwen = load_image_processor(FIXTURE / "qwen2-vl").settings()
    assert qwen["size"] == {"shortest_edge": 784, "longest_edge": 6272}
    assert qwen["resample"] == 3


def test_a_square_size_given_as_one_number():
    """SigLIP reads one number as a shortest edge unless default_to_square says otherwise."""
    settings = {**config("siglip"), "size": 32, "default_to_square": True}
    out = load_image_processor(settings)(PATHS)
    np.testing.assert_array_equal(
        channels_first(out.pixel_values), REFERENCE["siglip.pixel_values"]
    )
    with pytest.raises(ZooError, match=r"setting size=32 \(SiglipImageProcessor"):
        load_image_processor({**settings, "default_to_square": False})


@pytest.mark.parametrize(
    ("setting", "change", "match"),
    [
        (
            "siglip",
            {"image_processor_type": "CLIPImageProcessor"},
            '"CLIPImageProcessor" is not one',
        ),
        ("siglip", {"image_processor_type": None}, "image_processor_type=null is not one"),
        ("siglip", {"do_magic": True}, "do_magic=true .* not a setting of SiglipImageProcessor"),
        ("siglip", {"do_center_crop": True}, "do_center_crop=true .* may be false or null"),
        ("gemma3", {"do_pad": True}, "do_pad=true"),
        ("siglip", {"resample": 7}, r"resample=7 .* 3 \(bicubic\)"),
        ("siglip", {"size": {"shortest_edge": 224}}, 'size={"shortest_edge": 224}'),
        ("siglip", {"image_mean": [0.5, 0.5]}, r"image_mean=\[0.5, 0.5\] .* a list of 3"),
        ("siglip", {"image_std": 0}, "image_std=0 .* image_std's positive"),
        ("siglip", {"do_resize": "yes"}, 'do_resize="yes" .* true, false or null'),
        ("siglip", {"rescale_factor": -1}, "rescale_factor=-1 .* positive"),
        ("gemma3", {"pan_and_scan_min_crop_size": 0}, "pan_and_scan_min_crop_size=0 .* >= 1"),
        ("qwen2-vl", {"min_pixels": 9000}, "least pixels \\(9000\\) exceed its most \\(6272\\)"),
        ("qwen2-vl", {"size": 448}, "size=448 .*shortest_edge"),
        ("qwen2-vl", {"patch_size": 0}, "patch_size=0"),
        ("qwen2-vl", {"do_pan_and_scan": True}, "do_pan_and_scan=true .* Qwen2VLImageProcessor"),
    ],
)
def test_a_setting_that_cannot_be_honoured_is_refused_by_name(setting, change, match):
    with pytest.raises(ZooError, match=match):
        load_image_processor({**config(setting), **change})


@pytest.mark.parametrize(
    ("setting", "change", "image", "match"),
    [
        ("siglip", {}, np.zeros((4, 4, 3), np.float32), "array of float32: give uint8"),
        ("siglip", {}, np.zeros((4, 4, 2), np.uint8), r"shape \(4, 4, 2\)"),
        ("siglip", {}, 7, "Image 0 is of type int"),
        ("siglip", {}, b"not an image", r"Image 0 \(its bytes\) cannot be decoded"),
        ("siglip", {"do_convert_rgb": False}, PATHS[2], "mode L .* do_convert_rgb=false"),
        ("siglip", {"do_resize": False}, PATHS[:2], "do_resize=false .* these differ"),
        (
            "qwen2-vl",
            {},
            np.zeros((1, 250, 3), np.uint8),
            "1 x 250 pixels: .* at most 200 times the short one",
        ),
        ("qwen2-vl", {"do_resize": False}, PATHS[0], "multiples of patch_size x merge_size = 28"),
        ("siglip", {}, [], "no images"),
    ],
)
def test_an_image_that_cannot_be_processed_is_refused(setting, change, image, match):
    processor = load_image_processor({**config(setting), **change})
    with pytest.raises(ZooError, match=match):
        processor(image)


def test_bytes_and_paths_are_turned_upright_by_their_exif_orientation(tmp_path):
    pixels = np.asarray(Image.open(PATHS[0]))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated: the stored image is shown turned 90 degrees clockwise
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG", exif=exif)
    processor = load_image_processor(FIXTURE / "siglip")
    upright = processor(np.ascontiguousarray(np.rot90(pixels, -1)))
    np.testing.assert_array_equal(processor(buffer.getvalue()).pixel_values, upright.pixel_values)
