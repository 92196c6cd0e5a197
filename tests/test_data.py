"""The dataset loader: image folders and tensor files, order, batching, preprocessing, bad files."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from helpers import write_gray_images
from quantkit.config import InputSpec, PreprocessSection
from quantkit.data import open_dataset
from quantkit.errors import DataError

GRAY = PreprocessSection(color="gray")
GRAY_INPUT = [InputSpec(name="input", shape=["batch", 1, 8, 8])]


def test_flat_folder_is_sorted_unlabelled_and_scaled(tmp_path):
    paths = write_gray_images(tmp_path, 5)
    ds = open_dataset(tmp_path, GRAY_INPUT, preprocess=GRAY)
    samples = list(ds.samples())
    assert [s.source for s in samples] == [str(p) for p in paths]
    assert not ds.has_labels
    expected = np.asarray(Image.open(paths[2]), dtype=np.float32) / 255
    np.testing.assert_allclose(samples[2].inputs["input"][0], expected, rtol=1e-6)
    assert samples[2].inputs["input"].shape == (1, 8, 8)


def test_class_subfolders_give_labels_interleaved_round_robin(tmp_path):
    write_gray_images(tmp_path, 9, classes=3)
    ds = open_dataset(tmp_path, GRAY_INPUT, preprocess=GRAY, max_samples=6)
    assert ds.class_names == ["0", "1", "2"]
    assert [s.label for s in ds.samples()] == [0, 1, 2, 0, 1, 2]


def test_remainder_policies(tmp_path):
    write_gray_images(tmp_path, 10)
    ds = open_dataset(tmp_path, GRAY_INPUT, preprocess=GRAY)
    keep = [b.inputs["input"].shape[0] for b in ds.batches(4, "keep")]
    drop = [b.inputs["input"].shape[0] for b in ds.batches(4, "drop")]
    pad = list(ds.batches(4, "pad"))
    assert keep == [4, 4, 2] and drop == [4, 4]
    assert [b.inputs["input"].shape[0] for b in pad] == [4, 4, 4]
    assert pad[-1].size == 2
    np.testing.assert_array_equal(pad[-1].inputs["input"][3], pad[-1].inputs["input"][1])


def test_corrupt_image_is_an_error_naming_the_file_or_skipped_and_counted(tmp_path):
    write_gray_images(tmp_path, 4)
    bad = tmp_path / "0002.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    with pytest.raises(DataError, match=r"0002.png: cannot decode image"):
        list(open_dataset(tmp_path, GRAY_INPUT, preprocess=GRAY).samples())
    ds = open_dataset(tmp_path, GRAY_INPUT, preprocess=GRAY, on_bad_file="skip")
    assert len(list(ds.samples())) == 3
    assert [path for path, _ in ds.skipped] == [str(bad)]


def test_rgb_image_for_a_gray_model_is_a_channel_error(tmp_path):
    Image.new("RGB", (8, 8), (10, 20, 30)).save(tmp_path / "rgb.png")
    with pytest.raises(DataError, match=r"rgb.png: expected a 1-channel \(gray\) image, got mode RGB with 3"):
        list(open_dataset(tmp_path, GRAY_INPUT, preprocess=GRAY).samples())


def test_gray_image_for_an_rgb_model_is_converted(tmp_path):
    Image.new("L", (4, 4), 51).save(tmp_path / "g.png")
    spec = [InputSpec(name="x", shape=["batch", 3, 4, 4])]
    (sample,) = open_dataset(tmp_path, spec, preprocess=PreprocessSection()).samples()
    np.testing.assert_allclose(sample.inputs["x"], np.full((3, 4, 4), 0.2, np.float32), rtol=1e-6)


def test_image_of_the_wrong_size_is_an_error_naming_the_file(tmp_path):
    write_gray_images(tmp_path, 1, size=9)
    with pytest.raises(DataError, match=r"0000.png: sample shape \[1, 9, 9\] does not fit input 'input'"):
        list(open_dataset(tmp_path, GRAY_INPUT, preprocess=GRAY).samples())


def test_resize_crop_normalise_bgr_nhwc(tmp_path):
    array = np.zeros((20, 40, 3), np.uint8)
    array[..., 0] = 200  # red
    Image.fromarray(array).save(tmp_path / "red.png")
    pre = PreprocessSection(resize=10, center_crop=[10, 10], color="bgr", mean=[0.5, 0.5, 0.5],
                            std=[0.25, 0.25, 0.25], layout="nhwc")
    spec = [InputSpec(name="x", shape=["batch", 10, 10, 3])]
    (sample,) = open_dataset(tmp_path, spec, preprocess=pre).samples()
    x = sample.inputs["x"]
    assert x.shape == (10, 10, 3)
    np.testing.assert_allclose(x[..., 2], (200 / 255 - 0.5) / 0.25, rtol=1e-5)  # red is last in BGR
    np.testing.assert_allclose(x[..., 0], -2.0, rtol=1e-5)


def test_mixed_layout_and_empty_folders_are_refused(tmp_path):
    with pytest.raises(DataError, match="refusing to run on nothing"):
        open_dataset(tmp_path, GRAY_INPUT, preprocess=GRAY)
    write_gray_images(tmp_path, 2)
    write_gray_images(tmp_path / "cls", 2)
    with pytest.raises(DataError, match="has both image files and class subfolders"):
        open_dataset(tmp_path, GRAY_INPUT, preprocess=GRAY)
    with pytest.raises(DataError, match="data path does not exist"):
        open_dataset(tmp_path / "missing", GRAY_INPUT)


TEXT_INPUTS = [InputSpec(name="ids", shape=["batch", "seq"], dtype="int64"),
               InputSpec(name="mask", shape=["batch", "seq"], dtype="int64")]


def test_npz_multi_input_with_labels_streams_across_files(tmp_path):
    for k in range(2):
        np.savez(tmp_path / f"part{k}.npz", ids=np.full((3, 5), k, np.int32), mask=np.ones((3, 5), np.int64),
                 labels=np.arange(3) + 10 * k)
    ds = open_dataset(tmp_path, TEXT_INPUTS)
    batches = list(ds.batches(4))
    assert [b.size for b in batches] == [4, 2]
    assert batches[0].inputs["ids"].dtype == np.int64  # int32 widened to the input's dtype
    assert batches[0].labels.tolist() == [0, 1, 2, 10]
    assert batches[0].inputs["ids"][:, 0].tolist() == [0, 0, 0, 1]
    assert ds.planned_samples() == 6


def test_npz_errors_name_file_and_key(tmp_path):
    np.savez(tmp_path / "a.npz", ids=np.zeros((2, 5), np.int64))
    with pytest.raises(DataError, match=r"a.npz: missing key\(s\) \['mask'\]"):
        list(open_dataset(tmp_path, TEXT_INPUTS).samples())
    np.savez(tmp_path / "a.npz", ids=np.zeros((2, 5), np.float32), mask=np.zeros((2, 5), np.int64))
    with pytest.raises(DataError, match=r"a.npz: key 'ids' has dtype float32, input wants int64"):
        list(open_dataset(tmp_path, TEXT_INPUTS).samples())
    np.savez(tmp_path / "a.npz", ids=np.zeros((2, 5), np.int64), mask=np.zeros((3, 5), np.int64))
    with pytest.raises(DataError, match="disagree on the number of samples"):
        list(open_dataset(tmp_path, TEXT_INPUTS).samples())
    (tmp_path / "a.npz").write_bytes(b"garbage")
    with pytest.raises(DataError, match=r"a.npz: cannot read tensor file"):
        list(open_dataset(tmp_path, TEXT_INPUTS).samples())


def test_npy_single_input_and_shape_check(tmp_path):
    np.save(tmp_path / "x.npy", np.ones((3, 1, 8, 8), np.float32))
    batches = list(open_dataset(tmp_path, GRAY_INPUT).batches(2))
    assert [b.size for b in batches] == [2, 1]
    np.save(tmp_path / "x.npy", np.ones((3, 1, 7, 8), np.float32))
    with pytest.raises(DataError, match=r"x.npy\['input'\]: sample shape \[1, 7, 8\] does not fit"):
        list(open_dataset(tmp_path, GRAY_INPUT).samples())


def test_fingerprint_follows_content(tmp_path):
    paths = write_gray_images(tmp_path, 3)
    first = open_dataset(tmp_path, GRAY_INPUT, preprocess=GRAY).fingerprint()
    assert open_dataset(tmp_path, GRAY_INPUT, preprocess=GRAY).fingerprint() == first
    Image.new("L", (8, 8), 7).save(paths[1])
    assert open_dataset(tmp_path, GRAY_INPUT, preprocess=GRAY).fingerprint() != first


def test_shipped_datasets_load():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "calib_data"
    digits = open_dataset(root / "digits" / "eval", GRAY_INPUT, preprocess=GRAY)
    assert digits.class_names == [str(d) for d in range(10)]
    text = open_dataset(root / "text" / "calib.npz", TEXT_INPUTS[:0] + [
        InputSpec(name="input_ids", shape=["batch", "seq"], dtype="int64"),
        InputSpec(name="attention_mask", shape=["batch", "seq"], dtype="int64")])
    batch = next(text.batches(8))
    assert batch.inputs["input_ids"].shape == (8, 32)
