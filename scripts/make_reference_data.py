#!/usr/bin/env python
"""Regenerate the committed reference data under ``calib_data/`` (deterministic).

Owned outputs (deleted and rewritten on every run):

* ``calib_data/digits/{calib,eval}/<digit>/<index:04d>.png`` - 8x8 grayscale PNGs
  from scikit-learn's digits (index = sample index in ``load_digits()``).
* ``calib_data/photos/{calib,eval}/NNNN.jpg`` - 256x256 RGB crops of the sample
  photographs bundled in scikit-image's wheel.
* ``calib_data/text/{calib,eval}.npz`` - random token ids + attention masks.
* ``calib_data/README.md``.

Nothing is downloaded: the digits ship inside scikit-learn and the photos are
read from the installed ``skimage/data`` folder with PIL (no pooch fetch).
Running the script twice gives byte-identical files (for the same Pillow /
libjpeg / zlib build).

Usage: python scripts/make_reference_data.py [--out calib_data]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from quantkit.zoo.digits import digits_split  # noqa: E402

# ---------------------------------------------------------------- digits
DIGITS_CALIB_COUNT = 256
DIGITS_CALIB_SEED = 0

# ---------------------------------------------------------------- photos
PHOTO_SIZE = 256
PHOTO_CALIB_COUNT = 256
PHOTO_EVAL_COUNT = 64
PHOTO_CALIB_SEED = 0
PHOTO_EVAL_SEED = 1
PHOTO_MIN_SCALE = 0.35
PHOTO_JPEG_QUALITY = 85

# (file in skimage/data, skimage.data function, source, licence as stated in
#  the skimage.data docstring). Crop NNNN.jpg is taken from
#  PHOTO_SOURCES[NNNN % len(PHOTO_SOURCES)].
PHOTO_SOURCES: list[tuple[str, str, str, str]] = [
    ("astronaut.png", "astronaut", "NASA Great Images database (Eileen Collins)",
     "public domain (\"No known copyright restrictions, released into the public domain\")"),
    ("chelsea.png", "chelsea", "Stefan van der Walt (Chelsea the cat)",
     "CC0 (\"No copyright restrictions. CC0 by the photographer\")"),
    ("coffee.png", "coffee", "Rachel Michetti, courtesy of Pikolo Espresso Bar",
     "CC0 (\"No copyright restrictions. CC0 by the photographer\")"),
    ("hubble_deep_field.jpg", "hubble_deep_field", "HubbleSite / NASA (Hubble eXtreme Deep Field)",
     "public domain (NASA; \"may be freely used in the public domain\")"),
    ("ihc.png", "immunohistochemistry", "Center for Microscopy And Molecular Imaging (CMMI)",
     "\"No known copyright restrictions\""),
    ("retina.jpg", "retina", "Wikimedia Commons, Mikael Haggstrom (fundus photograph)",
     "CC0 1.0 Universal Public Domain Dedication"),
    ("camera.png", "camera", "Lav Varshney (cameraman replacement, grayscale)",
     "CC0 (\"No copyright restrictions. CC0 by the photographer\")"),
    ("coins.png", "coins", "Brooklyn Museum Collection (Greek coins from Pompeii, grayscale)",
     "\"No known copyright restrictions\""),
    ("brick.png", "brick", "CC0Textures, Bricks25 (grayscale)", "CC0"),
    ("grass.png", "grass", "DeviantArt, linolafett \"Grass 01\" (grayscale)", "CC0"),
    ("gravel.png", "gravel", "CC0Textures, Gravel04 (grayscale)", "CC0"),
]

# Bundled images deliberately left out: their skimage.data docstrings state
# no licence, so redistribution rights are unclear.
EXCLUDED_PHOTOS: list[tuple[str, str]] = [
    ("rocket.jpg", "skimage says public domain, but the Flickr page shows CC BY-NC 2.0 (scikit-image#5095)"),
    ("moon.png", "no source or licence stated"),
    ("page.png", "no source or licence stated"),
    ("color.png", "colorwheel(): no source or licence stated"),
    ("motorcycle_left.png", "Middlebury 2014 stereo benchmark; no licence stated"),
    ("motorcycle_right.png", "Middlebury 2014 stereo benchmark; no licence stated"),
]

# ---------------------------------------------------------------- text
TEXT_SEQ_LEN = 32
TEXT_MIN_LEN = 8
TEXT_VOCAB = 1000
TEXT_CALIB_COUNT = 256
TEXT_EVAL_COUNT = 64
TEXT_CALIB_SEED = 0
TEXT_EVAL_SEED = 1


def _skimage_data_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("skimage")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("scikit-image is required (its wheel bundles the sample photos)")
    return Path(next(iter(spec.submodule_search_locations))) / "data"


# ====================================================================== digits
def write_digits(out: Path) -> dict[str, int]:
    split = digits_split()
    rng = np.random.default_rng(DIGITS_CALIB_SEED)
    classes = np.unique(split.y_train)
    per_class = np.full(len(classes), DIGITS_CALIB_COUNT // len(classes))
    per_class[: DIGITS_CALIB_COUNT % len(classes)] += 1  # 26 x 6 + 25 x 4 = 256
    chosen: list[int] = []
    for c, n in zip(classes, per_class):
        members = np.flatnonzero(split.y_train == c)
        chosen.extend(np.sort(rng.choice(members, size=int(n), replace=False)).tolist())

    def save(sub: str, pixels: np.ndarray, label: int, index: int) -> None:
        path = out / "digits" / sub / str(int(label)) / f"{int(index):04d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.ascontiguousarray(pixels, dtype=np.uint8)).save(path, format="PNG")

    for i in chosen:
        save("calib", split.x_train[i], split.y_train[i], split.idx_train[i])
    for px, y, idx in zip(split.x_eval, split.y_eval, split.idx_eval):
        save("eval", px, y, idx)
    return {"calib": len(chosen), "eval": len(split.y_eval), "train_pool": len(split.y_train)}


# ====================================================================== photos
def _load_sources() -> list[Image.Image]:
    data_dir = _skimage_data_dir()
    images = []
    for fname, *_ in PHOTO_SOURCES:
        with Image.open(data_dir / fname) as im:
            images.append(im.convert("RGB"))  # grayscale -> 3 identical channels
    return images


def _random_crop(im: Image.Image, rng: np.random.Generator) -> Image.Image:
    w, h = im.size
    side = int(round(rng.uniform(PHOTO_MIN_SCALE, 1.0) * min(w, h)))
    side = max(1, min(side, w, h))
    x0 = int(rng.integers(0, w - side + 1))
    y0 = int(rng.integers(0, h - side + 1))
    flip = bool(rng.random() < 0.5)
    crop = im.crop((x0, y0, x0 + side, y0 + side))
    if flip:
        crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return crop.resize((PHOTO_SIZE, PHOTO_SIZE), Image.Resampling.BICUBIC)


def write_photos(out: Path) -> dict[str, int]:
    sources = _load_sources()
    counts = {}
    for sub, count, seed in (
        ("calib", PHOTO_CALIB_COUNT, PHOTO_CALIB_SEED),
        ("eval", PHOTO_EVAL_COUNT, PHOTO_EVAL_SEED),
    ):
        rng = np.random.default_rng(seed)
        folder = out / "photos" / sub
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(count):
            crop = _random_crop(sources[i % len(sources)], rng)
            crop.save(folder / f"{i:04d}.jpg", format="JPEG", quality=PHOTO_JPEG_QUALITY)
        counts[sub] = count
    return counts


# ====================================================================== text
def make_text(count: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(TEXT_MIN_LEN, TEXT_SEQ_LEN + 1, size=count)
    ids = rng.integers(1, TEXT_VOCAB, size=(count, TEXT_SEQ_LEN), dtype=np.int64)
    mask = (np.arange(TEXT_SEQ_LEN)[None, :] < lengths[:, None]).astype(np.int64)
    ids = ids * mask  # padding (after the sequence) is id 0
    return {"input_ids": ids.astype(np.int64), "attention_mask": mask}


def write_text(out: Path) -> dict[str, int]:
    folder = out / "text"
    folder.mkdir(parents=True, exist_ok=True)
    counts = {}
    for sub, count, seed in (
        ("calib", TEXT_CALIB_COUNT, TEXT_CALIB_SEED),
        ("eval", TEXT_EVAL_COUNT, TEXT_EVAL_SEED),
    ):
        arrays = make_text(count, seed)
        # np.savez* writes zip members with a fixed 1980-01-01 timestamp -> reproducible
        np.savez_compressed(folder / f"{sub}.npz", **arrays)
        counts[sub] = count
    return counts


# ====================================================================== README
def readme_text(digits: dict[str, int]) -> str:
    n_src = len(PHOTO_SOURCES)
    src_rows = "\n".join(
        f"| {i} | `{fname}` (`skimage.data.{func}()`) | {source} | {lic} |"
        for i, (fname, func, source, lic) in enumerate(PHOTO_SOURCES)
    )
    excl_rows = "\n".join(f"- `{f}`: {why}" for f, why in EXCLUDED_PHOTOS)
    return f"""# calib_data

Small, redistributable data sets shipped with quantkit for calibration,
accuracy checks, tests and benchmarks. **Generated - do not edit by hand.**
Regenerate with (from the repository root):

    python scripts/make_reference_data.py

The script deletes and rewrites `digits/`, `photos/`, `text/` and this README,
and is deterministic (byte-identical output for the same Pillow/libjpeg/zlib).
Nothing is downloaded: the digits ship inside scikit-learn and the photos are
read from the images bundled in scikit-image's wheel.

## digits/ - scikit-learn 8x8 handwritten digits

- `digits/calib/<digit>/<index>.png`: {digits['calib']} images from the **train** split,
  class-balanced (26 each for digits 0-5, 25 each for 6-9), chosen with
  `numpy.random.default_rng({DIGITS_CALIB_SEED})`.
- `digits/eval/<digit>/<index>.png`: the whole **held-out** split ({digits['eval']} images).
- Split: `sklearn.model_selection.train_test_split(stratify=y, test_size=0.3,
  random_state=0)` over `load_digits()` ({digits['train_pool']} train / {digits['eval']} held-out),
  implemented once in `quantkit.zoo.digits.digits_split()` and shared with
  `scripts/train_digits.py` (which trains `models/digits_cnn.pt`).
- `<index>` is the 4-digit sample index in `load_digits()`; the folder name is the label.
- Format: 8x8 grayscale (`L`) PNG, pixel = `round(v * 255 / 16)` for the original
  0..16 value `v` (numpy round-half-to-even). Model input for `DigitsCNN` is
  `png_value / 255` as float32 `[N, 1, 8, 8]`.
- Source / licence: UCI ML "Optical Recognition of Handwritten Digits" data set
  (E. Alpaydin, C. Kaynak), as bundled in scikit-learn; licensed
  **CC BY 4.0**
  (https://archive.ics.uci.edu/dataset/80/optical+recognition+of+handwritten+digits).

## photos/ - crops of scikit-image sample photographs

- `photos/calib/NNNN.jpg`: {PHOTO_CALIB_COUNT} crops, `numpy.random.default_rng({PHOTO_CALIB_SEED})`.
- `photos/eval/NNNN.jpg`: {PHOTO_EVAL_COUNT} crops, `numpy.random.default_rng({PHOTO_EVAL_SEED})`
  (different crops from the calib set).
- Each crop: square crop with side uniform in [{PHOTO_MIN_SCALE:.0%}, 100%] of the source's
  shorter side at a uniformly random position, horizontal flip with p = 0.5,
  resized to {PHOTO_SIZE}x{PHOTO_SIZE} with PIL BICUBIC, saved as RGB JPEG quality {PHOTO_JPEG_QUALITY}.
  Grayscale sources are converted to RGB (three equal channels).
- File `NNNN.jpg` is cropped from source number `NNNN % {n_src}` below.
- Sources: the images bundled in the scikit-image wheel (`skimage/data/`),
  with source and licence as stated in the corresponding `skimage.data`
  docstrings (scikit-image 0.26):

| # | file | source | licence |
|---|------|--------|---------|
{src_rows}

Bundled images deliberately **not** used (no licence stated, so redistribution
rights are unclear):

{excl_rows}

## text/ - synthetic token sequences

- `text/calib.npz` ({TEXT_CALIB_COUNT} samples, `numpy.random.default_rng({TEXT_CALIB_SEED})`) and
  `text/eval.npz` ({TEXT_EVAL_COUNT} samples, `numpy.random.default_rng({TEXT_EVAL_SEED})`).
- Keys: `input_ids` int64 `[N, {TEXT_SEQ_LEN}]` and `attention_mask` int64 `[N, {TEXT_SEQ_LEN}]`.
- Each sample has a uniformly random length L in {TEXT_MIN_LEN}..{TEXT_SEQ_LEN}: positions `< L` hold
  uniform random ids in 1..{TEXT_VOCAB - 1} with mask 1; positions `>= L` are padding
  (id 0, mask 0). Inputs for `quantkit.zoo.transformer` (vocab {TEXT_VOCAB}).
- Purely synthetic (random numbers): no third-party content.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "calib_data")
    args = parser.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    for owned in ("digits", "photos", "text"):
        shutil.rmtree(out / owned, ignore_errors=True)
    (out / "README.md").unlink(missing_ok=True)

    digits = write_digits(out)
    photos = write_photos(out)
    text = write_text(out)
    (out / "README.md").write_text(readme_text(digits), encoding="utf-8")
    print(f"digits: {digits}\nphotos: {photos}\ntext: {text}\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
