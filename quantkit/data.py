"""Datasets for calibration and benchmarking: image folders and .npz/.npy tensors.

One loader serves every stage. It streams: only the current batch (and, for
tensor files, the current file) is in memory. Order is deterministic:

* image folders: files sorted by path; with class subfolders (labels) the
  classes are interleaved round-robin, so ``max_samples`` takes a balanced subset;
* tensor files: ``*.npz``/``*.npy`` sorted by name, samples in file order.

Remainder policy for the last, short batch: ``keep`` (a smaller batch), ``drop``
(discard it) or ``pad`` (repeat its last sample; ``Batch.size`` counts only the
real samples, so accuracy ignores the padding).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from quantkit.artifacts import sha256_bytes, sha256_file, canonical_json
from quantkit.config import FLOAT_DTYPES, InputSpec, PreprocessSection
from quantkit.errors import DataError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".ppm", ".pgm", ".tif", ".tiff")
TENSOR_SUFFIXES = (".npz", ".npy")
LABELS_KEY = "labels"


@dataclass
class Sample:
    inputs: dict[str, np.ndarray]
    label: int | None
    source: str


@dataclass
class Batch:
    """A batch ready to feed: one array per input, batch axis first."""

    index: int
    inputs: dict[str, np.ndarray]
    labels: np.ndarray | None
    sources: list[str]
    size: int  # real samples; the rest (if any) is padding


@dataclass
class Dataset:
    """A deterministic, streaming sequence of samples.

    Build one with :func:`open_dataset`; iterate batches with :meth:`batches`.
    """

    root: Path
    format: str
    files: list[Path]
    inputs: list[InputSpec]
    preprocess: PreprocessSection | None
    labels: list[int | None]
    class_names: list[str] | None
    max_samples: int | None
    on_bad_file: str
    skipped: list[tuple[str, str]] = field(default_factory=list)

    @property
    def has_labels(self) -> bool:
        return self.class_names is not None or any(label is not None for label in self.labels)

    def planned_samples(self) -> int | None:
        """How many samples iteration will yield (None when unknown without reading)."""
        if self.format == "images":
            return min(len(self.files), self.max_samples or len(self.files))
        return self.max_samples if self.max_samples is not None and self._count_tensor_samples() >= self.max_samples \
            else self._count_tensor_samples()

    def fingerprint(self) -> str:
        """Hash of every file's name and content plus the preprocessing: changes make artifacts stale."""
        digest_parts = [canonical_json({
            "format": self.format,
            "preprocess": self.preprocess.model_dump() if self.preprocess else None,
            "max_samples": self.max_samples,
            "inputs": [spec.model_dump() for spec in self.inputs],
        })]
        for path in self.files:
            digest_parts.append(f"{path.relative_to(self.root) if path != self.root else path.name}={sha256_file(path)}")
        return sha256_bytes("\n".join(digest_parts).encode("utf-8"))[:32]

    def samples(self) -> Iterator[Sample]:
        """Yield samples in the documented order, up to ``max_samples``."""
        produced = self._image_samples() if self.format == "images" else self._tensor_samples()
        return itertools.islice(produced, self.max_samples)

    def batches(self, batch_size: int, remainder: str = "keep") -> Iterator[Batch]:
        """Group samples into batches (see the module doc for ``remainder``)."""
        chunk: list[Sample] = []
        index = 0
        for sample in self.samples():
            chunk.append(sample)
            if len(chunk) == batch_size:
                yield self._stack(index, chunk, batch_size)
                index += 1
                chunk = []
        if chunk and remainder != "drop":
            yield self._stack(index, chunk, batch_size if remainder == "pad" else len(chunk))

    # ----------------------------------------------------------------- images

    def _image_samples(self) -> Iterator[Sample]:
        spec = self.inputs[0]
        for path, label in zip(self.files, self.labels):
            try:
                array = load_image(path, self.preprocess, spec)
            except DataError as exc:
                if self.on_bad_file == "skip":
                    self.skipped.append((str(path), exc.message))
                    continue
                raise
            yield Sample({spec.name: array}, label, str(path))

    # ----------------------------------------------------------------- tensors

    def _tensor_samples(self) -> Iterator[Sample]:
        for path in self.files:
            try:
                arrays = self._load_tensor_file(path)
            except DataError as exc:
                if self.on_bad_file == "skip":
                    self.skipped.append((str(path), exc.message))
                    continue
                raise
            labels = arrays.pop(LABELS_KEY, None)
            count = len(next(iter(arrays.values())))
            for row in range(count):
                label = int(labels[row]) if labels is not None else None
                yield Sample({name: arrays[name][row] for name in arrays}, label, f"{path}[{row}]")

    def _load_tensor_file(self, path: Path) -> dict[str, np.ndarray]:
        try:
            if path.suffix == ".npy":
                if len(self.inputs) != 1:
                    raise DataError(f"{path}: a .npy file feeds one input, but the model has "
                                    f"{len(self.inputs)}; use .npz with keys {[s.name for s in self.inputs]}")
                raw = {self.inputs[0].name: np.load(path, mmap_mode="r", allow_pickle=False)}
            else:
                with np.load(path, allow_pickle=False) as npz:
                    raw = {key: npz[key] for key in npz.files}
        except DataError:
            raise
        except Exception as exc:  # noqa: BLE001 - numpy raises many types for a corrupt file
            raise DataError(f"{path}: cannot read tensor file ({type(exc).__name__}: {exc})") from None
        return _check_tensor_arrays(path, raw, self.inputs)

    def _count_tensor_samples(self) -> int:
        total = 0
        for path in self.files:
            try:
                if path.suffix == ".npy":
                    total += np.load(path, mmap_mode="r", allow_pickle=False).shape[0]
                else:
                    with np.load(path, allow_pickle=False) as npz:
                        total += npz[self.inputs[0].name].shape[0]
            except Exception:  # noqa: BLE001 - counting is best effort; iteration reports the error
                continue
        return total

    def _stack(self, index: int, chunk: list[Sample], target: int) -> Batch:
        real = len(chunk)
        padded = chunk + [chunk[-1]] * (target - real)
        inputs = {}
        for spec in self.inputs:
            try:
                inputs[spec.name] = np.stack([s.inputs[spec.name] for s in padded])
            except ValueError:
                shapes = sorted({tuple(s.inputs[spec.name].shape) for s in chunk})
                raise DataError(
                    f"batch {index}: samples of input {spec.name!r} have different shapes {shapes} "
                    f"(from {chunk[0].source} .. {chunk[-1].source}); use batch_size 1 or equal shapes"
                ) from None
        labels = None
        if all(s.label is not None for s in chunk):
            labels = np.array([s.label for s in padded], dtype=np.int64)
        return Batch(index, inputs, labels, [s.source for s in chunk], real)


def detect_format(path: Path, declared: str = "auto") -> str:
    """``images`` or ``numpy``: as declared, or from the files found."""
    if declared != "auto":
        return declared
    candidates = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    suffixes = {p.suffix.lower() for p in candidates}
    if suffixes & set(TENSOR_SUFFIXES):
        return "numpy"
    if suffixes & set(IMAGE_SUFFIXES):
        return "images"
    raise DataError(
        f"{path}: no data found (expected image files {', '.join(IMAGE_SUFFIXES)} or .npz/.npy tensors); "
        "refusing to run on nothing"
    )


def open_dataset(
    path: str | Path,
    inputs: Sequence[InputSpec],
    *,
    fmt: str = "auto",
    preprocess: PreprocessSection | None = None,
    max_samples: int | None = None,
    on_bad_file: str = "error",
) -> Dataset:
    """List a dataset's files and check its layout; no file is decoded yet.

    Args:
        path: a directory (or one .npz/.npy file).
        inputs: the model's inputs the data must fit.
        fmt: ``auto`` (detect), ``images`` or ``numpy``.
        preprocess: image preprocessing (defaults apply when None).
        max_samples: stop after this many samples (all when None).
        on_bad_file: ``error`` stops at a bad file; ``skip`` counts it in ``Dataset.skipped``.

    Raises:
        DataError: missing/empty directory, mixed layouts, no data.
    """
    root = Path(path)
    if not root.exists():
        raise DataError(f"{root}: data path does not exist")
    kind = detect_format(root, fmt)
    if kind == "images":
        files, labels, classes = _list_images(root)
        preprocess = preprocess or PreprocessSection()
    else:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.suffix.lower() in TENSOR_SUFFIXES)
        labels, classes = [None] * len(files), None
        if not files:
            raise DataError(f"{root}: no .npz/.npy files found; refusing to run on nothing")
    return Dataset(root, kind, files, list(inputs), preprocess, labels, classes, max_samples, on_bad_file)


def _list_images(root: Path) -> tuple[list[Path], list[int | None], list[str] | None]:
    if root.is_file():
        return [root], [None], None
    top_files = sorted(p for p in root.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    class_dirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    class_dirs = [d for d in class_dirs if any(f.suffix.lower() in IMAGE_SUFFIXES for f in d.rglob("*"))]
    if top_files and class_dirs:
        raise DataError(
            f"{root}: has both image files and class subfolders ({class_dirs[0].name}/ ...); "
            "use a flat folder or one subfolder per class"
        )
    if top_files:
        return top_files, [None] * len(top_files), None
    if not class_dirs:
        raise DataError(f"{root}: no image files found; refusing to run on nothing")
    per_class = [sorted(f for f in d.rglob("*") if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES)
                 for d in class_dirs]
    files, labels = [], []
    # round-robin over classes so that the first N samples are balanced
    for row in itertools.zip_longest(*[[(f, i) for f in fs] for i, fs in enumerate(per_class)]):
        for item in row:
            if item is not None:
                files.append(item[0])
                labels.append(item[1])
    return files, labels, [d.name for d in class_dirs]


_RESAMPLE = {"nearest": 0, "bilinear": 2, "bicubic": 3}  # PIL.Image.Resampling values
_GRAY_MODES = ("1", "L", "P", "I", "I;16", "F", "LA")


def load_image(path: Path, pre: PreprocessSection, spec: InputSpec) -> np.ndarray:
    """Decode and preprocess one image into an array of the input's sample shape.

    Raises:
        DataError: naming the file, for unreadable images, wrong channel counts
        and sizes that do not fit the input.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as opened:
            opened.load()
            image = opened
    except (OSError, UnidentifiedImageError, ValueError, SyntaxError) as exc:
        raise DataError(f"{path}: cannot decode image ({exc})") from None
    image = _convert_mode(path, image, pre.color)
    image = _resize_and_crop(image, pre)
    array = np.asarray(image, dtype=np.float32)
    if array.ndim == 2:
        array = array[:, :, None]
    if pre.color == "bgr":
        array = array[:, :, ::-1]
    array = array * np.float32(pre.scale)
    if pre.mean is not None:
        array = array - np.asarray(pre.mean, dtype=np.float32)
    if pre.std is not None:
        array = array / np.asarray(pre.std, dtype=np.float32)
    if pre.layout == "nchw":
        array = array.transpose(2, 0, 1)
    _check_sample_shape(path, array.shape, spec)
    return np.ascontiguousarray(array, dtype=spec.dtype)


def _convert_mode(path: Path, image, color: str):
    if color == "gray":
        if image.mode not in _GRAY_MODES:
            raise DataError(f"{path}: expected a 1-channel (gray) image, got mode {image.mode} "
                            f"with {len(image.getbands())} channels")
        return image.convert("L") if image.mode not in ("L", "F") else image
    # colour models accept gray and RGBA/CMYK images converted to RGB: common in real datasets
    return image if image.mode == "RGB" else image.convert("RGB")


def _resize_and_crop(image, pre: PreprocessSection):
    if pre.resize is not None:
        if isinstance(pre.resize, int):
            width, height = image.size
            short = min(width, height)
            size = (round(width * pre.resize / short), round(height * pre.resize / short))
        else:
            size = (pre.resize[1], pre.resize[0])
        image = image.resize(size, resample=_RESAMPLE[pre.interpolation])
    if pre.center_crop is not None:
        crop_h, crop_w = (pre.center_crop, pre.center_crop) if isinstance(pre.center_crop, int) else pre.center_crop
        width, height = image.size
        if crop_w > width or crop_h > height:
            raise DataError(f"center_crop {crop_h}x{crop_w} is larger than the image ({height}x{width})")
        left, top = (width - crop_w) // 2, (height - crop_h) // 2
        image = image.crop((left, top, left + crop_w, top + crop_h))
    return image


def _check_sample_shape(source: object, shape: tuple[int, ...], spec: InputSpec) -> None:
    want = spec.sample_shape()
    if len(shape) != len(want) or any(isinstance(w, int) and w != s for w, s in zip(want, shape)):
        raise DataError(
            f"{source}: sample shape {list(shape)} does not fit input {spec.name!r} "
            f"(expected {['*' if isinstance(w, str) else w for w in want]} per sample)"
        )


def _check_tensor_arrays(path: Path, raw: dict[str, np.ndarray], inputs: Sequence[InputSpec]) -> dict[str, np.ndarray]:
    names = [spec.name for spec in inputs]
    missing = [name for name in names if name not in raw]
    if missing:
        raise DataError(f"{path}: missing key(s) {missing} for model input(s); file has {sorted(raw)}")
    arrays = {}
    counts = set()
    for spec in inputs:
        array = raw[spec.name]
        if array.ndim < 1:
            raise DataError(f"{path}: key {spec.name!r} is a scalar; expected samples along axis 0")
        _check_sample_shape(f"{path}[{spec.name!r}]", array.shape[1:], spec)
        target = np.dtype(spec.dtype)
        if not np.can_cast(array.dtype, target, casting="same_kind") or (
            spec.dtype not in FLOAT_DTYPES and array.dtype.kind == "f"
        ):
            raise DataError(f"{path}: key {spec.name!r} has dtype {array.dtype}, input wants {spec.dtype}")
        arrays[spec.name] = array.astype(target, copy=False)
        counts.add(array.shape[0])
    if LABELS_KEY in raw:
        labels = raw[LABELS_KEY]
        if labels.ndim != 1 or labels.dtype.kind not in "iu":
            raise DataError(f"{path}: key 'labels' must be a 1-D integer array, got {labels.dtype} {labels.shape}")
        arrays[LABELS_KEY] = labels
        counts.add(labels.shape[0])
    if len(counts) != 1:
        raise DataError(f"{path}: arrays disagree on the number of samples: {sorted(counts)}")
    return arrays
