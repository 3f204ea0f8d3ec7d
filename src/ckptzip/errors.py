"""Typed errors. Each subclasses the builtin it refines, so callers can catch either."""
from __future__ import annotations

import contextlib


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


class UnsupportedStateError(CkptzipError, TypeError, ValueError):
    """A training state ckptzip cannot store as given: a value with no pickle-free form or a dtype it
    does not carry (the TypeError json.dumps raises for the same fault), two keys naming one record,
    optimizer state a method cannot read (ValueErrors). The message names the value and the fix.
    """


class NonFiniteError(CkptzipError, ValueError):
    """A tensor holds inf or NaN where a lossy codec needs finite values."""


class ConfigError(CkptzipError, ValueError):
    """A configuration value out of its valid range."""


class BaseMismatchError(CkptzipError, ValueError):
    """A checkpoint coded against base weights (basestate.py) restored without them, or with others."""


class StepOrderError(CkptzipError, ValueError):
    """A save's step is not after the chain's latest step (save increasing steps, or start a new chain)."""


class AgentError(CkptzipError, RuntimeError):
    """The asynchronous checkpoint agent failed; carries the agent's traceback.

    ``step`` is the save it concerns, ``exc_type`` and ``errno`` describe the agent's exception
    (``errno`` is None unless it was an OSError), ``agent_traceback`` is its formatted traceback.
    """

    def __init__(self, message: str, *, step: int | None = None, exc_type: str | None = None,
                 errno: int | None = None, agent_traceback: str = ""):
        super().__init__(message)
        self.step, self.exc_type, self.errno, self.agent_traceback = step, exc_type, errno, agent_traceback


class StateMismatchError(CkptzipError, RuntimeError):
    """A checkpoint does not fit the model or optimizer it is restored into (names, shapes, dtypes).

    A RuntimeError, as ``load_state_dict`` raises for the same fault; raised before anything loads.
    """


class ChainBusyError(CkptzipError, BlockingIOError):
    """Another writer owns the chain, or took it over from this one: one writer per chain at a time.

    A BlockingIOError, as a lock held by someone else is: the message names the owner and how to
    take the chain over (``takeover=True``) when that owner is gone.
    """


class WriteConflictError(CkptzipError, FileExistsError):
    """A conditional write lost: the object exists, or changed since it was read (storage.py)."""


class StorageError(CkptzipError, OSError):
    """A storage call failed for good (after retries, where the error was transient).

    ``errno`` keeps the operating system's code (ENOSPC, EROFS, ...) where there was one; the
    message is one line naming the object, what failed and what to do.
    """

    def __init__(self, message: str, *, errno: int | None = None):
        super().__init__(message)
        self.errno = errno  # set after __init__: OSError's two-argument form would prefix "[Errno N]"

    def __reduce__(self):
        return _rebuild_storage_error, (type(self), str(self), self.errno)


class StorageFullError(StorageError):
    """No space left on the device (ENOSPC) or over quota (EDQUOT)."""


class StorageReadOnlyError(StorageError, PermissionError):
    """The location cannot be written: a read-only file system (EROFS) or no permission."""


class StorageUnavailableError(StorageError):
    """Transient errors (timeouts, throttling, 5xx, dropped connections) outlasted the retry budget."""


@contextlib.contextmanager
def malformed(what: str):
    """Metadata read from a file inside the block: a KeyError, TypeError, ValueError, AttributeError
    or IndexError (a missing key, a wrong type) becomes ``CorruptCheckpointError("<what> is
    malformed (...)")``; a CorruptCheckpointError or FormatVersionError raised inside passes unchanged."""
    try:
        yield
    except (CorruptCheckpointError, FormatVersionError):
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise CorruptCheckpointError(f"{what} is malformed ({e!r})") from None


def _rebuild_storage_error(cls, message, errno):
    return cls(message, errno=errno)
