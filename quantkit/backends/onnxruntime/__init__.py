"""ONNX Runtime on CPU: the embedded default backend."""
