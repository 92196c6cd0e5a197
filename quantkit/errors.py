"""The one exception family of quantkit and the exit codes it maps to.

Every failure a user can cause or meet is raised as a :class:`QuantkitError`
subclass; the CLI turns it into a one-line message and an exit code in exactly
one place (:func:`quantkit.cli.main`). Anything else is a bug and is reported as
an internal error.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_GATE_FAILED = 3
EXIT_INTERRUPTED = 130


class QuantkitError(Exception):
    """Base class: a failure with a message meant for the user."""

    exit_code = EXIT_RUNTIME

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} ({self.hint})"


class UsageError(QuantkitError):
    """A command-line option or combination of options is wrong."""

    exit_code = EXIT_USAGE


class ConfigError(UsageError):
    """The YAML config (or a CLI override of it) is invalid."""


class DataError(QuantkitError):
    """A dataset file is missing, unreadable or does not fit the model."""


class ModelError(QuantkitError):
    """A model cannot be loaded, exported or run."""


class ParityError(ModelError):
    """The exported ONNX model disagrees with the PyTorch model."""


class StaleArtifactError(QuantkitError):
    """An artifact was produced from inputs that have changed since."""


class MissingArtifactError(QuantkitError):
    """A stage needs an artifact that an earlier stage has not produced."""


class NotAvailableError(QuantkitError):
    """A feature is not available in this build or environment."""


class GateFailedError(QuantkitError):
    """A benchmark gate failed; distinct exit code for CI."""

    exit_code = EXIT_GATE_FAILED
