"""The contract every backend follows: open a runner on an artifact; the runner infers and times.

A :class:`Runner` is activated once (load the model, allocate buffers), then
``infer`` is called any number of times with a ``{input name: array}`` feed and
returns ``{output name: array}``; :meth:`Runner.last_inference_time` says how
long the last ``infer`` took, so timing is part of the contract rather than
something each caller measures differently. ``deactivate`` frees everything.
Runners are context managers::

    with backend.open_runner(path, threads=4) as runner:
        outputs = runner.infer({"input": batch})
        seconds = runner.last_inference_time()

A :class:`Backend` is the small table entry the bench stage looks up by name;
building artifacts is a separate concern (``quantkit.build``). Heavy imports
(onnxruntime, tensorrt, pycuda) happen in a backend's own module, never here.
"""

from __future__ import annotations

import abc
import importlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Protocol, runtime_checkable

import numpy as np

from quantkit.errors import ModelError, NotAvailableError


class RunnerStateError(ModelError):
    """A runner was used outside activate()/deactivate() (a bug in the caller)."""


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape and dtype of one model input.

    ``shape`` holds ints for fixed axes and a string (the axis name) or None for dynamic ones.
    """

    name: str
    shape: tuple[int | str | None, ...]
    dtype: np.dtype

    def fixed_dims(self) -> dict[int, int]:
        return {axis: dim for axis, dim in enumerate(self.shape) if isinstance(dim, int)}


class Runner(abc.ABC):
    """Base class of all runners: subclasses implement the ``*_impl`` methods.

    Args:
        name: a label for messages (the artifact's file name by default in subclasses).
    """

    def __init__(self, name: str):
        self.name = name
        self.is_active = False
        self._inference_time: float | None = None
        self._reported_time: float | None = None

    # ------------------------------------------------------------------ lifecycle

    def activate(self) -> None:
        """Load the model and allocate what inference needs.

        Raises:
            RunnerStateError: when already active (activation is not reference-counted).
        """
        if self.is_active:
            raise RunnerStateError(f"{self.name}: runner is already active")
        self._activate_impl()
        self.is_active = True
        self._inference_time = None

    def deactivate(self) -> None:
        """Free the model and buffers; a no-op when not active, so cleanup paths may always call it."""
        if not self.is_active:
            return
        try:
            self._deactivate_impl()
        finally:
            self.is_active = False
            self._inference_time = None

    def __enter__(self) -> "Runner":
        self.activate()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.deactivate()

    # ------------------------------------------------------------------ metadata

    @property
    def input_specs(self) -> list[TensorSpec]:
        """The model's inputs (valid while active)."""
        self._require_active("input_specs")
        return self._input_specs_impl()

    @property
    def output_names(self) -> list[str]:
        """The model's output names, in the order ``infer`` returns them (valid while active)."""
        self._require_active("output_names")
        return self._output_names_impl()

    @property
    def providers(self) -> list[str]:
        """What actually executes the model (execution providers, device); informational."""
        return []

    # ------------------------------------------------------------------ inference

    def infer(self, feed: Mapping[str, np.ndarray], check_inputs: bool = True) -> dict[str, np.ndarray]:
        """Run the model once.

        Args:
            feed: one array per input, batch axis first.
            check_inputs: check names, dtypes, ranks and fixed dimensions first (cheap,
                and not part of the measured time).

        Returns:
            Output name -> array. Callers that keep outputs across calls must not
            assume the runner hands out fresh buffers.

        Raises:
            RunnerStateError: when the runner is not active.
            ModelError: when the feed does not fit the model, or the backend fails.
        """
        self._require_active("infer()")
        if check_inputs:
            check_feed(feed, self._input_specs_impl(), self.name)
        self._reported_time = None
        start = time.perf_counter()
        outputs = self._infer_impl(feed)
        wall = time.perf_counter() - start
        # a backend that can time more precisely (e.g. CUDA events) reports it; otherwise wall time
        self._inference_time = self._reported_time if self._reported_time is not None else wall
        return outputs

    def last_inference_time(self) -> float | None:
        """Seconds the last ``infer`` took, or None when nothing ran since activation."""
        self._require_active("last_inference_time()")
        return self._inference_time

    def _report_inference_time(self, seconds: float) -> None:
        """For ``_infer_impl``: the backend's own measurement of this call."""
        self._reported_time = seconds

    def _require_active(self, what: str) -> None:
        if not self.is_active:
            raise RunnerStateError(f"{self.name}: {what} needs an active runner; call activate() "
                                   "or use the runner as a context manager")

    # ------------------------------------------------------------------ to implement

    @abc.abstractmethod
    def _activate_impl(self) -> None: ...

    @abc.abstractmethod
    def _infer_impl(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    @abc.abstractmethod
    def _deactivate_impl(self) -> None: ...

    @abc.abstractmethod
    def _input_specs_impl(self) -> list[TensorSpec]: ...

    @abc.abstractmethod
    def _output_names_impl(self) -> list[str]: ...


def check_feed(feed: Mapping[str, np.ndarray], specs: list[TensorSpec], where: str) -> None:
    """Check that ``feed`` names every input exactly once with the right dtype, rank and fixed dims.

    Raises:
        ModelError: naming the first mismatch.
    """
    names = [spec.name for spec in specs]
    missing = [name for name in names if name not in feed]
    extra = sorted(set(feed) - set(names))
    if missing or extra:
        raise ModelError(f"{where}: feed does not fit the model inputs {names}: "
                         f"missing {missing}, unexpected {extra}")
    for spec in specs:
        array = feed[spec.name]
        if array.dtype != spec.dtype:
            raise ModelError(f"{where}: input {spec.name!r} is {array.dtype}, the model wants {spec.dtype}")
        if array.ndim != len(spec.shape):
            raise ModelError(f"{where}: input {spec.name!r} has rank {array.ndim} {list(array.shape)}, "
                             f"the model wants rank {len(spec.shape)} {list(spec.shape)}")
        for axis, dim in spec.fixed_dims().items():
            if array.shape[axis] != dim:
                raise ModelError(f"{where}: input {spec.name!r} has {array.shape[axis]} at axis {axis}, "
                                 f"the model fixes it to {dim} (shape {list(spec.shape)})")


@runtime_checkable
class Backend(Protocol):
    """What the bench stage needs from a backend: availability and a runner per artifact."""

    name: str

    def is_available(self) -> tuple[bool, str]:
        """(True, "") or (False, why not: the missing package or device)."""
        ...

    def open_runner(self, artifact_path: Path, **options: Any) -> Runner:
        """An inactive runner for ``artifact_path`` (options such as ``threads``)."""
        ...


# name -> "module:attribute" of a Backend instance; imported only when asked for.
BACKENDS: dict[str, str] = {
    "onnxruntime": "quantkit.backends.onnxruntime.runner:BACKEND",
    "tensorrt": "quantkit.backends.tensorrt.runner:BACKEND",
}


def get_backend(name: str) -> Backend:
    """The registered backend ``name``, checked to be usable here.

    Raises:
        NotAvailableError: unknown name, backend not shipped yet, or not usable on this machine.
    """
    if name not in BACKENDS:
        raise NotAvailableError(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}")
    module_name, _, attribute = BACKENDS[name].partition(":")
    try:
        backend = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise NotAvailableError(f"backend {name!r} is not available in this installation ({exc})") from None
    available, reason = backend.is_available()
    if not available:
        raise NotAvailableError(f"backend {name!r} is not available: {reason}")
    return backend
