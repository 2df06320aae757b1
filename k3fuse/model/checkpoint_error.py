"""How a checkpoint's problems are reported: `CheckpointError`, one line naming the file, the tensor and what was
expected, and `shown`, which quotes anything read from a file so that a name holding newlines, escape sequences
or a megabyte of text still prints as one short line."""
from __future__ import annotations

from ..usage_error import UsageError

#: characters of a file-supplied string kept in a message
SHOWN_CHARS = 120


class CheckpointError(UsageError, ValueError):
    """The checkpoint is not one this model can load: the message names the file (shard, config.json, the index),
    the tensor or field, what it holds and what was expected. A UsageError, so the CLI prints it as one line."""


def shown(value: object) -> str:
    """`value` (a name or field read from a file) quoted with Python's escapes, cut to SHOWN_CHARS."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}...({len(text)} chars)"


__all__ = ["CheckpointError", "shown"]
