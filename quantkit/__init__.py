"""quantkit: take a trained model to a fast, accurate INT8 deployment from one YAML config."""

__version__ = "0.1.0"
