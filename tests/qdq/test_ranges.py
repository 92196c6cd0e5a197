import json

import pytest

from quantkit.errors import MissingArtifactError, StaleArtifactError
from quantkit.qdq import TensorRange, load_ranges, widen_overclipped


def test_cpu_bounds_clip_to_amax_and_hold_zero():
    assert TensorRange(amax=2.0, min=-5.0, max=3.0).cpu_bounds() == (-2.0, 2.0)
    assert TensorRange(amax=10.0, min=0.5, max=3.0).cpu_bounds() == (0.0, 3.0)  # zero always representable
    assert TensorRange(amax=1.0, min=-3.0, max=-0.5).cpu_bounds() == (-1.0, 0.0)


def test_trt_bounds_are_symmetric():
    assert TensorRange(amax=1.5, min=-0.2, max=3.0).trt_bounds() == (-1.5, 1.5)


def test_load_ranges_reads_calib_json(tmp_path):
    path = tmp_path / "calib.json"
    path.write_text(json.dumps({"tensors": {"a": {"amax": 1.0, "scale": 1 / 127, "min": -0.5, "max": 1.0,
                                                  "method": "minmax", "params": {}, "clipped_fraction": 0.0}},
                                "stage": "calibrate"}))
    assert load_ranges(path) == {"a": TensorRange(1.0, -0.5, 1.0, 0.0)}


def test_overclipped_ranges_fall_back_to_observed_min_max():
    gate = TensorRange(amax=0.09, min=0.09, max=0.85, clipped_fraction=1.0)  # entropy on an SE gate
    ok = TensorRange(amax=5.0, min=0.0, max=16.0, clipped_fraction=0.001)
    ranges, widened = widen_overclipped({"gate": gate, "relu": ok})
    assert widened == {"gate": gate}
    assert ranges["gate"].cpu_bounds() == (0.0, 0.85) and ranges["relu"] is ok


def test_load_ranges_missing_file(tmp_path):
    with pytest.raises(MissingArtifactError, match="calibrate"):
        load_ranges(tmp_path / "calib.json")


@pytest.mark.parametrize("payload", ["not json", json.dumps({"ranges": {}}),
                                     json.dumps({"tensors": {"a": {"amax": -1, "min": 0, "max": 1}}}),
                                     json.dumps({"tensors": {"a": {"amax": "nan", "min": 0, "max": 1}}})])
def test_load_ranges_rejects_garbage(tmp_path, payload):
    path = tmp_path / "calib.json"
    path.write_text(payload)
    with pytest.raises(StaleArtifactError):
        load_ranges(path)
