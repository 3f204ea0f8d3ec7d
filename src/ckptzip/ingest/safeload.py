"""Reading a torch.save file without running code from it: ``torch.load(weights_only=True)``.

Only tensors, containers, numbers, strings and numpy arrays of plain numbers are rebuilt; a file
that needs any other class is refused with UnsafeInputError, anything unreadable or damaged with
CorruptCheckpointError, each naming the file and the fix. ``verify_archive`` checks the CRC-32s
that torch.load skips (validation only: ``find_sources`` calls it once per file).
"""
from __future__ import annotations

import pathlib
import pickle
import zipfile

import numpy as np
import torch

from ..errors import CorruptCheckpointError, UnsafeInputError


def _numpy_safe_globals() -> list:
    """numpy arrays of plain numbers rebuild without running code; allow them (RNG states use them)."""
    core = getattr(np, "_core", None) or np.core
    out = [core.multiarray._reconstruct, np.ndarray, np.dtype]
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:  # plain numeric dtype classes only (no object, string or void arrays)
        out += [getattr(dtypes, n) for n in dir(dtypes) if n.endswith("DType")
                and not n.startswith(("Object", "Str", "Bytes", "Void", "DateTime", "TimeDelta"))]
    return out


def torch_load(path: pathlib.Path, *, mmap: bool = True):
    """torch.load(weights_only=True) with our errors; mmap when the file allows (cheap validation)."""
    try:
        with torch.serialization.safe_globals(_numpy_safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        if "Unsupported global" in str(e) or "GLOBAL" in str(e):
            raise UnsafeInputError(f"{path} needs arbitrary code to load (a pickle with custom classes); "
                                   "re-save it with plain tensors and dicts") from None
        raise not_torch(path) from None
    except RuntimeError as e:
        if mmap and "mmap can only be used" in str(e):
            return torch_load(path, mmap=False)  # an old (pre-zipfile) torch.save file
        raise not_torch(path) from None
    except (EOFError, KeyError, ValueError, IndexError, TypeError, zipfile.BadZipFile, UnicodeDecodeError,
            IsADirectoryError):
        raise not_torch(path) from None
    except OSError as e:
        if e.filename is not None:  # the OS refused the path itself (missing, no permission): say so
            raise
        raise not_torch(path) from None  # torch's archive reader on a truncated or damaged file


def verify_archive(path: pathlib.Path) -> None:
    """Check the CRC-32 of every member of a (zip-format) torch.save file: torch.load does not.

    One read of the file; catches a flipped byte in tensor data that would otherwise be ingested.
    """
    if not zipfile.is_zipfile(path):
        return  # a legacy (pre-1.6) torch.save file has no checksums
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, EOFError, ValueError, NotImplementedError):
        raise not_torch(path) from None
    if bad is not None:
        raise CorruptCheckpointError(f"{path}: entry {bad} fails its CRC check (the file is damaged); "
                                     "restore it from a backup or re-save it")


def not_torch(path) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path}: not a checkpoint (not a readable torch.save file: another format, "
                                  "or truncated or damaged); pass files written by torch.save or checkpoint-N folders")
