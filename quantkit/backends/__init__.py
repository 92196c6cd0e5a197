"""Backends: each builds an INT8 artifact and opens runners for it (see base.py)."""
