"""Artifacts on disk: atomic writes, content hashes, manifests and staleness.

Every artifact is written to a temporary file in its final directory and renamed
into place, so an interrupted run never leaves a half-written model, cache or
engine. Each stage writes a JSON manifest naming what produced its outputs
(a fingerprint of its inputs plus tool versions); a later stage or ``quantkit run``
compares fingerprints to decide whether an artifact is still valid.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from quantkit.errors import MissingArtifactError, StaleArtifactError

MANIFEST_SCHEMA = 1


@contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """Yield a temporary path next to ``final``; rename it into place on success.

    On any exception (including KeyboardInterrupt) the temporary file is removed
    and ``final`` is left untouched.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb+") as handle:  # make the bytes durable before the rename
            os.fsync(handle.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(final: Path, data: bytes) -> None:
    """Write ``data`` to ``final`` atomically."""
    with atomic_path(final) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(final: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``final`` atomically."""
    atomic_write_bytes(final, text.encode("utf-8"))


def atomic_write_json(final: Path, payload: Any) -> None:
    """Write ``payload`` as stable, pretty JSON (sorted keys) atomically."""
    atomic_write_text(final, canonical_json(payload, indent=2) + "\n")


def canonical_json(payload: Any, indent: int | None = None) -> str:
    """JSON with sorted keys, so equal payloads give equal bytes and hashes."""
    return json.dumps(payload, sort_keys=True, indent=indent, ensure_ascii=False, default=str)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file's content, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sha256_files(paths: Iterable[Path], root: Path | None = None) -> str:
    """One hash over several files: their relative names and contents, in order."""
    digest = hashlib.sha256()
    for path in paths:
        name = str(Path(path).relative_to(root)) if root else str(path)
        digest.update(name.encode("utf-8") + b"\0")
        digest.update(sha256_file(Path(path)).encode("ascii"))
    return digest.hexdigest()


def fingerprint_hash(fingerprint: Mapping[str, Any]) -> str:
    """Short stable hash of a fingerprint mapping."""
    return sha256_bytes(canonical_json(fingerprint).encode("utf-8"))[:16]


def library_versions(*extra: str) -> dict[str, str]:
    """Versions of the libraries that shape an artifact (only those importable)."""
    from quantkit import __version__

    versions = {"quantkit": __version__, "python": platform.python_version()}
    for name in ("numpy", "onnx", "onnxruntime", *extra):
        try:
            module = __import__(name)
            versions[name] = getattr(module, "__version__", "unknown")
        except ImportError:
            continue
    return versions


@dataclass(frozen=True)
class Manifest:
    """What produced a stage's outputs.

    Attributes:
        stage: the stage name (``export``, ``calibrate`` ...).
        fingerprint: everything the outputs depend on (config subset, input hashes).
        outputs: file name (relative to the model's artifact dir) -> SHA-256.
        versions: tool and library versions (informational: not part of freshness).
        details: stage-specific results (parity figures, op histogram ...).
    """

    stage: str
    fingerprint: Mapping[str, Any]
    outputs: Mapping[str, str]
    versions: Mapping[str, str]
    details: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": MANIFEST_SCHEMA,
            "stage": self.stage,
            "fingerprint": dict(self.fingerprint),
            "fingerprint_hash": fingerprint_hash(self.fingerprint),
            "outputs": dict(self.outputs),
            "versions": dict(self.versions),
            "details": dict(self.details),
        }

    @classmethod
    def read(cls, path: Path) -> "Manifest":
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
            return cls(
                stage=raw["stage"],
                fingerprint=raw["fingerprint"],
                outputs=raw["outputs"],
                versions=raw.get("versions", {}),
                details=raw.get("details", {}),
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise StaleArtifactError(f"{path}: not a readable quantkit manifest ({exc})") from None


class ModelWorkspace:
    """The artifact directory of one model: ``<workdir>/<model name>/``."""

    def __init__(self, workdir: Path, model_name: str):
        self.root = Path(workdir) / model_name

    def path(self, name: str) -> Path:
        return self.root / name

    @property
    def onnx_model(self) -> Path:
        return self.root / "model.onnx"

    @property
    def export_manifest(self) -> Path:
        return self.root / "export.json"

    def write_manifest(self, manifest_name: str, manifest: Manifest) -> None:
        atomic_write_json(self.root / manifest_name, manifest.to_json())

    def staleness(self, manifest_name: str, fingerprint: Mapping[str, Any]) -> str | None:
        """Why the outputs recorded in ``manifest_name`` are not valid, or None when fresh."""
        path = self.root / manifest_name
        if not path.exists():
            return f"{path} does not exist"
        try:
            manifest = Manifest.read(path)
        except StaleArtifactError as exc:
            return str(exc)
        changed = _changed_keys(manifest.fingerprint, fingerprint)
        if changed:
            return f"inputs changed since {manifest_name} was written: {', '.join(changed)}"
        for name, digest in manifest.outputs.items():
            output = self.root / name
            if not output.exists():
                return f"{output} is missing"
            if sha256_file(output) != digest:
                return f"{output} was modified after {manifest_name} was written"
        return None

    def require_fresh(self, manifest_name: str, fingerprint: Mapping[str, Any], what: str) -> Manifest:
        """Return the manifest if its outputs are fresh, else raise a clear error."""
        path = self.root / manifest_name
        if not path.exists():
            raise MissingArtifactError(f"{what} not found: {path} does not exist")
        reason = self.staleness(manifest_name, fingerprint)
        if reason:
            raise StaleArtifactError(f"{what} is stale: {reason}")
        return Manifest.read(path)


def _changed_keys(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two fingerprints."""
    changed = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        dotted = f"{prefix}{key}"
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            changed += _changed_keys(a, b, dotted + ".")
        elif canonical_json(a) != canonical_json(b):
            changed.append(dotted)
    return changed
