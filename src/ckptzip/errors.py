"""Typed errors. Each subclasses the builtin it refines, so callers can catch either."""
from __future__ import annotations


class CkptzipError(Exception):
    """Base of every error ckptzip raises on purpose."""


class CorruptCheckpointError(CkptzipError, ValueError):
    """A file or record fails its checksum, is truncated, or is not a ckptzip container."""


class StepNotFoundError(CkptzipError, FileNotFoundError):
    """The requested step is not committed in the chain."""


class IncompleteCheckpointError(CkptzipError, FileNotFoundError):
    """No committed index at the location (an empty chain, or a save that never committed)."""


class UnknownMethodError(CkptzipError, KeyError):
    """A descriptor or method name that no registered method handles."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it a plain sentence
        return str(self.args[0]) if self.args else ""


class FormatVersionError(CkptzipError, ValueError):
    """The file was written by a newer format version than this reader knows."""


class UnknownStageError(FormatVersionError):
    """A record's pipeline names a stage descriptor (or a version of it) this reader does not know."""


class UnsafeInputError(CkptzipError, ValueError):
    """Input that would need arbitrary code to load (a pickle with custom classes)."""


class NonFiniteError(CkptzipError, ValueError):
    """A tensor holds inf or NaN where a lossy codec needs finite values."""


class ConfigError(CkptzipError, ValueError):
    """A configuration value out of its valid range."""


class AgentError(CkptzipError, RuntimeError):
    """The asynchronous checkpoint agent failed; carries the agent's traceback."""
