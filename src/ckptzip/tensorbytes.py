"""Exact tensor <-> bytes conversion for every dtype we store (no pickle, little-endian)."""
from __future__ import annotations

import math

import numpy as np
import torch

from .errors import CorruptCheckpointError, UnsupportedStateError

# torch dtype name -> (torch dtype, numpy dtype used to carry its bits)
DTYPES: dict[str, tuple[torch.dtype, np.dtype]] = {
    "float64": (torch.float64, np.dtype("<f8")),
    "float32": (torch.float32, np.dtype("<f4")),
    "float16": (torch.float16, np.dtype("<f2")),
    "bfloat16": (torch.bfloat16, np.dtype("<u2")),  # numpy has no bf16: carry the bits
    "int64": (torch.int64, np.dtype("<i8")),
    "int32": (torch.int32, np.dtype("<i4")),
    "int16": (torch.int16, np.dtype("<i2")),
    "int8": (torch.int8, np.dtype("i1")),
    "uint8": (torch.uint8, np.dtype("u1")),
    "bool": (torch.bool, np.dtype("?")),
}
# the integer dtypes quantization codes may come in: the codec kernels read them as they are
INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
# same-width integer type used to view float bits (XOR deltas, byte grouping)
BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16"})


_NAMES = {t: name for name, (t, _) in DTYPES.items()}
ITEMSIZE = {name: np_dtype.itemsize for name, (_, np_dtype) in DTYPES.items()}  # bytes an element, by dtype name


def dtype_name(dtype: torch.dtype) -> str:
    name = _NAMES.get(dtype)
    if name is None:
        raise UnsupportedStateError(f"tensor dtype {dtype} is not supported; convert it to one of {sorted(DTYPES)}")
    return name


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype that carries a torch dtype's bits (DTYPES)."""
    return DTYPES[dtype_name(dtype)][1]


def narrowest_int(hi: int) -> torch.dtype:
    """The narrowest of BITS_DTYPE's integer types (uint8, int16, int32, int64) holding every value in [0, hi]."""
    return next(d for top, d in _INT_TOPS if hi <= top)


_INT_TOPS = tuple((torch.iinfo(d).max, d) for d in BITS_DTYPE.values())  # torch.iinfo costs ~1 us a call


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a dtype name read from a file (CorruptCheckpointError if it is none we write)."""
    return _dtypes(name)[0]


def _dtypes(name: str) -> tuple[torch.dtype, np.dtype]:
    try:
        return DTYPES[name]
    except (KeyError, TypeError):  # TypeError: an unhashable value from a malformed manifest
        raise CorruptCheckpointError(f"unknown dtype name {name!r} (a corrupt file, or one written by a newer "
                                     f"ckptzip); this reader knows {sorted(DTYPES)}") from None


def host(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, on the CPU and contiguous (no call where it already is: a save visits every record)."""
    if t.requires_grad:
        t = t.detach()
    if not t.is_cpu:
        t = t.cpu()
    return t if t.is_contiguous() else t.contiguous()


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A detached, contiguous CPU copy of ``t`` that shares no memory with it (training mutates the
    original in place); a CPU tensor's ``clone()`` costs ~0.6x of ``.to("cpu", copy=True)``."""
    if t.requires_grad:
        t = t.detach()
    if t.is_cpu:
        return t.clone(memory_format=torch.contiguous_format)
    return t.to("cpu", memory_format=torch.contiguous_format)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two flat arrays hold the same bytes (NaN payloads and -0.0 included)."""
    if a.nbytes != b.nbytes:
        return False
    if a.nbytes < 1 << 16:  # small: bytes compare in ~0.1 us, np.array_equal's setup costs ~3 us
        return a.tobytes() == b.tobytes()
    return bool(np.array_equal(a.view(np.uint8), b.view(np.uint8)))


_PLAIN = frozenset(t for t, _ in DTYPES.values()) - {torch.bfloat16}  # numpy() carries their bits


def to_numpy_bits(t: torch.Tensor) -> np.ndarray:
    """Flat numpy array of a tensor's exact bits (bf16 carried as uint16). Moves to CPU if needed."""
    if t.dim() == 1 and t.dtype in _PLAIN and t.is_cpu and not t.requires_grad and t.is_contiguous():
        return t.numpy()  # the usual code stream: a view, without the checks below (~3 us a stream)
    a = _host_bits(t)
    return a if a.ndim == 1 else a.reshape(-1)  # numpy's reshape of a contiguous array: a view, ~4x cheaper


def _host_bits(t: torch.Tensor) -> np.ndarray:
    """A numpy array of ``t``'s exact bits in its own shape (bf16 carried as uint16), on the CPU."""
    t = host(t)
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


def tensor_to_bytes(t: torch.Tensor) -> bytes:
    """Raw little-endian bytes of a tensor (row-major)."""
    return _host_bits(t).tobytes()  # C order: no flat view needed


def tensor_from_bytes(buf: bytes | bytearray | memoryview, dtype: str, shape) -> torch.Tensor:
    """Inverse of tensor_to_bytes; returns a fresh, writable CPU tensor."""
    tdtype, npdtype = _dtypes(dtype)
    shape = tuple(int(s) for s in shape)
    n = math.prod(shape)  # numpy's prod costs ~5 us a call, and a restore makes one per record
    if len(buf) != n * npdtype.itemsize:
        raise CorruptCheckpointError(
            f"tensor data has {len(buf)} bytes, expected {n * npdtype.itemsize} for {dtype}{list(shape)}"
        )
    arr = np.frombuffer(buf, dtype=npdtype).copy()
    if tdtype == torch.bfloat16:
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16).reshape(shape)
    return torch.from_numpy(arr).reshape(shape)


def tensor_from_words(words: np.ndarray, dtype: str, shape) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` over ``words`` (a new, writable array of unsigned ints of the
    dtype's width, native order, which the tensor then owns): no copy, unlike tensor_from_bytes."""
    tdtype = _dtypes(dtype)[0]
    shape = tuple(int(s) for s in shape)
    if words.size != math.prod(shape) or words.itemsize != tdtype.itemsize:
        raise CorruptCheckpointError(f"tensor data has {words.size} words of {words.itemsize} bytes, expected "
                                     f"{math.prod(shape)} of {tdtype.itemsize} for {dtype}{list(shape)}")
    return torch.from_numpy(words).view(tdtype).reshape(shape)
