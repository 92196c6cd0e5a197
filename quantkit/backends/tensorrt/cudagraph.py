"""CUDA graphs through cuda-python's runtime bindings (pycuda has no stream capture).

A graph records one ``execute_async_v3`` on a stream and replays it with a single launch,
which removes most of the per-inference CPU enqueue cost for small models (what trtexec's
``--useCudaGraph`` does). Capture can fail - some TensorRT engines enqueue work that cannot
be captured - so callers treat :class:`GraphCaptureError` as "run without graphs".
"""

from __future__ import annotations

from typing import Any, Callable


class GraphCaptureError(RuntimeError):
    """Stream capture or graph instantiation failed; fall back to plain enqueue."""


def load_cudart() -> Any | None:
    """cuda-python's runtime module (``cuda.bindings.runtime``, or ``cuda.cudart`` before 12.6), or None."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart
        except ImportError:
            return None
    return cudart


def _check(cudart: Any, error: Any, what: str) -> None:
    if error != cudart.cudaError_t.cudaSuccess:
        raise GraphCaptureError(f"{what} failed: {error}")


class CudaGraph:
    """An instantiated graph of one enqueue on one stream."""

    def __init__(self, cudart: Any, graph_exec: Any):
        self._cudart = cudart
        self._graph_exec = graph_exec

    @classmethod
    def capture(cls, cudart: Any, stream_handle: int, enqueue: Callable[[], bool]) -> "CudaGraph":
        """Capture ``enqueue()`` (which must only enqueue work on ``stream_handle``) into a graph.

        Thread-local capture mode, as trtexec uses: other threads' CUDA calls are not affected.
        The stream always leaves capture mode, also when the enqueue fails or raises.

        Raises:
            GraphCaptureError: anything went wrong; nothing is left captured or allocated.
        """
        mode = cudart.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal
        error, = cudart.cudaStreamBeginCapture(stream_handle, mode)
        _check(cudart, error, "cudaStreamBeginCapture")
        enqueued = False
        try:
            enqueued = bool(enqueue())
        finally:
            error, graph = cudart.cudaStreamEndCapture(stream_handle)
        if error != cudart.cudaError_t.cudaSuccess or not enqueued:
            if graph is not None and error == cudart.cudaError_t.cudaSuccess:
                cudart.cudaGraphDestroy(graph)
            raise GraphCaptureError(f"stream capture failed (enqueue {'ok' if enqueued else 'failed'}, {error})")
        try:
            error, graph_exec = cudart.cudaGraphInstantiate(graph, 0)
        finally:
            cudart.cudaGraphDestroy(graph)
        _check(cudart, error, "cudaGraphInstantiate")
        return cls(cudart, graph_exec)

    def launch(self, stream_handle: int) -> None:
        """Replay the graph on the stream it was captured on.

        Raises:
            GraphCaptureError: the launch failed.
        """
        error, = self._cudart.cudaGraphLaunch(self._graph_exec, stream_handle)
        _check(self._cudart, error, "cudaGraphLaunch")

    def destroy(self) -> None:
        if self._graph_exec is not None:
            self._cudart.cudaGraphExecDestroy(self._graph_exec)
            self._graph_exec = None
