"""The error of a checkpoint folder that cannot be loaded. A module of its own, without torch,
so that the frontend's tokenizer loading (which runs without the model) raises it too."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded; the message names the file and the problem
    (and the tensor or key, where there is one)."""
