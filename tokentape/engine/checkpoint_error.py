"""The error of a checkpoint folder that cannot be loaded (defined with the other shared
exceptions in tokentape/errors.py, without torch, so that the frontend's tokenizer loading,
which runs without the model, raises it too)."""

from __future__ import annotations

from tokentape.errors import CheckpointError

__all__ = ["CheckpointError"]
