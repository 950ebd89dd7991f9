"""Errors raised by the runner. Every message says what happened and what to do."""

from __future__ import annotations


class RunnerError(Exception):
    """Root of every error the runner raises on purpose."""


class StoreError(RunnerError):
    """The checkpoint store could not be reached, read or written."""


class BadURIError(StoreError):
    """A checkpoint URI that names no supported store."""


class CheckpointError(RunnerError):
    """A checkpoint is missing, torn or corrupt."""


class NoCheckpointError(CheckpointError):
    """There is no committed checkpoint to restore from."""


class WireError(RunnerError):
    """A telemetry event or batch does not follow the wire format."""
