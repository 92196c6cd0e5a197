"""Shared fixtures: tiny configs and datasets written to tmp_path."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from helpers import base_config, write_gray_images


@pytest.fixture
def gray_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "gray"
    write_gray_images(folder, 10)
    return folder


@pytest.fixture
def make_config(tmp_path: Path, gray_dir: Path):
    """Write a config (base + edits) and return its path. Edits: dotted key -> value, or None to delete."""

    def _make(edits: dict | None = None, text: str | None = None) -> Path:
        path = tmp_path / "config.yaml"
        if text is not None:
            path.write_text(text)
            return path
        cfg = copy.deepcopy(base_config(gray_dir))
        for dotted, value in (edits or {}).items():
            target = cfg
            keys = dotted.split(".")
            for key in keys[:-1]:
                target = target.setdefault(key, {})
            if value is None:
                target.pop(keys[-1], None)
            else:
                target[keys[-1]] = value
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return path

    return _make
