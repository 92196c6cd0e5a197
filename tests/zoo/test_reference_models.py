"""Reference models (quantkit.zoo) and the data shipped in calib_data/."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
Image = pytest.importorskip("PIL.Image")

from quantkit.zoo.digits import build_digits_cnn, pixels_to_input  # noqa: E402
from quantkit.zoo.transformer import build_tiny_encoder  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "calib_data"
WEIGHTS = REPO / "models" / "digits_cnn.pt"

DIGITS_CALIB = 256
DIGITS_EVAL = 540  # 30% of the 1797 load_digits() samples
PHOTOS = {"calib": 256, "eval": 64}
TEXT = {"calib": 256, "eval": 64}
SEQ = 32


def _digit_pngs(sub: str) -> list[Path]:
    return sorted((DATA / "digits" / sub).glob("*/*.png"))


def _load_digit_pngs(sub: str) -> tuple[np.ndarray, np.ndarray]:
    files = _digit_pngs(sub)
    pixels = np.stack([np.asarray(Image.open(f)) for f in files])
    labels = np.array([int(f.parent.name) for f in files], dtype=np.int64)
    return pixels, labels


@pytest.fixture(scope="module")
def digits_model():
    model = build_digits_cnn()
    model.load_state_dict(torch.load(WEIGHTS, weights_only=True))
    return model


# ---------------------------------------------------------------- DigitsCNN
def test_zoo_package_does_not_import_torch():
    code = "import sys, quantkit.zoo; sys.exit('torch' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env).returncode == 0


def test_digits_weights_small():
    assert WEIGHTS.stat().st_size < 1_000_000


def test_digits_cnn_shape_and_eval_mode():
    model = build_digits_cnn()
    assert not model.training
    with torch.no_grad():
        out = model(torch.rand(3, 1, 8, 8))
    assert out.shape == (3, 10) and out.dtype == torch.float32


def test_digits_cnn_heldout_accuracy_on_shipped_pngs(digits_model):
    pixels, labels = _load_digit_pngs("eval")
    assert len(labels) == DIGITS_EVAL
    x = torch.from_numpy(pixels_to_input(pixels))
    with torch.no_grad():
        pred = digits_model(x).argmax(dim=1).numpy()
    acc = float((pred == labels).mean())
    assert acc >= 0.95, acc


# ---------------------------------------------------------------- encoder
def _text_batch(b: int = 3, t: int = 16):
    g = torch.Generator().manual_seed(123)
    ids = torch.randint(1, 1000, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.int64)
    mask[0, 10:] = 0
    mask[1, 5:] = 0
    ids = ids * mask
    return ids, mask


def test_tiny_encoder_shape_and_seed():
    model = build_tiny_encoder()
    assert not model.training
    ids, mask = _text_batch()
    with torch.no_grad():
        out = model(ids, mask)
        again = build_tiny_encoder(seed=0)(ids, mask)
        other = build_tiny_encoder(seed=1)(ids, mask)
    assert out.shape == (3, 4) and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, again, rtol=0, atol=0)
    assert not torch.allclose(out, other)


def test_tiny_encoder_variable_lengths():
    model = build_tiny_encoder()
    with torch.no_grad():
        for t in (1, 8, 64):
            ids = torch.randint(1, 1000, (2, t))
            assert model(ids, torch.ones_like(ids)).shape == (2, 4)


def test_tiny_encoder_ignores_ids_at_masked_positions():
    model = build_tiny_encoder()
    ids, mask = _text_batch()
    changed = ids.clone()
    changed[mask == 0] = torch.randint(1, 1000, (int((mask == 0).sum()),))
    with torch.no_grad():
        ref = model(ids, mask)
        out = model(changed, mask)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)


def test_tiny_encoder_sees_unmasked_ids():
    model = build_tiny_encoder()
    ids, mask = _text_batch()
    changed = ids.clone()
    changed[0, 3] = 500 if ids[0, 3] != 500 else 501
    with torch.no_grad():
        ref = model(ids, mask)
        out = model(changed, mask)
    assert (out[0] - ref[0]).abs().max() > 1e-4
    torch.testing.assert_close(out[1:], ref[1:], rtol=0, atol=1e-6)  # other rows unaffected


def test_tiny_encoder_mask_matters():
    model = build_tiny_encoder()
    ids, mask = _text_batch()
    shorter = mask.clone()
    shorter[2, 12:] = 0
    with torch.no_grad():
        assert (model(ids, shorter)[2] - model(ids, mask)[2]).abs().max() > 1e-4


# ---------------------------------------------------------------- shipped data
@pytest.mark.parametrize("sub,count", [("calib", DIGITS_CALIB), ("eval", DIGITS_EVAL)])
def test_shipped_digits(sub, count):
    files = _digit_pngs(sub)
    assert len(files) == count
    assert sorted({f.parent.name for f in files}) == [str(d) for d in range(10)]
    per_class = np.bincount([int(f.parent.name) for f in files], minlength=10)
    if sub == "calib":
        assert per_class.min() >= 25 and per_class.max() <= 26
    for f in files[:: max(1, count // 40)]:
        im = Image.open(f)
        assert (im.format, im.mode, im.size) == ("PNG", "L", (8, 8))
        assert len(f.stem) == 4 and f.stem.isdigit()


def test_shipped_digits_calib_and_eval_disjoint():
    calib = {f.stem for f in _digit_pngs("calib")}
    evals = {f.stem for f in _digit_pngs("eval")}
    assert len(calib) == DIGITS_CALIB and len(evals) == DIGITS_EVAL
    assert not calib & evals


def test_shipped_digits_match_split():
    pytest.importorskip("sklearn")
    from quantkit.zoo.digits import digits_split

    split = digits_split()
    pixels, labels = _load_digit_pngs("eval")
    order = np.argsort(split.idx_eval)
    stems = sorted(_digit_pngs("eval"), key=lambda f: int(f.stem))
    idx = np.array([int(f.stem) for f in stems])
    np.testing.assert_array_equal(idx, split.idx_eval[order])
    np.testing.assert_array_equal(
        np.stack([np.asarray(Image.open(f)) for f in stems]), split.x_eval[order]
    )
    np.testing.assert_array_equal([int(f.parent.name) for f in stems], split.y_eval[order])
    assert {int(f.stem) for f in _digit_pngs("calib")} <= set(split.idx_train.tolist())


@pytest.mark.parametrize("sub", ["calib", "eval"])
def test_shipped_photos(sub):
    files = sorted((DATA / "photos" / sub).glob("*.jpg"))
    assert [f.name for f in files] == [f"{i:04d}.jpg" for i in range(PHOTOS[sub])]
    for f in files[::8]:
        im = Image.open(f)
        assert (im.format, im.mode, im.size) == ("JPEG", "RGB", (256, 256))


def test_shipped_photos_calib_eval_differ():
    a = np.asarray(Image.open(DATA / "photos" / "calib" / "0000.jpg"))
    b = np.asarray(Image.open(DATA / "photos" / "eval" / "0000.jpg"))
    assert not np.array_equal(a, b)


@pytest.mark.parametrize("sub", ["calib", "eval"])
def test_shipped_text(sub):
    with np.load(DATA / "text" / f"{sub}.npz") as z:
        assert sorted(z.files) == ["attention_mask", "input_ids"]
        ids, mask = z["input_ids"], z["attention_mask"]
    n = TEXT[sub]
    assert ids.shape == mask.shape == (n, SEQ)
    assert ids.dtype == mask.dtype == np.int64
    assert set(np.unique(mask).tolist()) <= {0, 1}
    lengths = mask.sum(axis=1)
    assert lengths.min() >= 8 and lengths.max() <= SEQ
    # padding strictly after the tokens
    np.testing.assert_array_equal(mask, (np.arange(SEQ)[None, :] < lengths[:, None]).astype(np.int64))
    assert (ids[mask == 1] >= 1).all() and (ids[mask == 1] <= 999).all()
    assert (ids[mask == 0] == 0).all()


def test_shipped_text_runs_through_encoder():
    model = build_tiny_encoder()
    with np.load(DATA / "text" / "eval.npz") as z:
        ids, mask = torch.from_numpy(z["input_ids"]), torch.from_numpy(z["attention_mask"])
    with torch.no_grad():
        out = model(ids, mask)
    assert out.shape == (TEXT["eval"], 4) and torch.isfinite(out).all()


def test_calib_data_readme_exists():
    text = (DATA / "README.md").read_text(encoding="utf-8")
    for word in ("CC BY 4.0", "CC0", "make_reference_data.py"):
        assert word in text
