"""Shared-memory staging of training states: the slots an async save copies into.

A chain (one URL, one rank) owns a few POSIX shared-memory objects whose names are derived from
a hash of the chain's URL, so a restarted trainer (or the agent of a crashed one) finds them::

    ckz-<key>-r<rank>-ctl      4 KiB control block: owner pids, takeover request, slot count
    ckz-<key>-r<rank>-s<i>     slot i: one staged checkpoint (i < redundancy R)

Slot layout (little-endian)::

    [0, 4096)        header: magic, version, seq, step, meta/data offsets and sizes, checksum;
                     at byte 512 the 8-byte complete marker, at 516.. the agent's commit state
                     and the trainer's discard flag
    [4096, ...)      meta: JSON (url, rank, step, skeleton, records with offsets, encode context)
    [data_off, ...)  data: every tensor's bytes, each 64-byte aligned (data_off 4 KiB aligned)

A writer clears the complete marker first, copies meta and tensors, and writes the marker
``COMPLETE`` last, so a trainer killed mid-copy leaves a *torn* slot that every reader skips.

The checksum is the wrapping 64-bit sum of the data region's words plus the CRC-32 of the meta:
not cryptographic, but it catches zeroed and bit-flipped data at memory bandwidth (a CRC over the
data costs about twice the copy itself). It is computed by the trainer inside the save
(``checksum_by="trainer"``) or, by default, by the agent before it encodes the slot, which keeps it
off the time training waits (about a third of it). A reader uses a slot whose marker is present
and whose checksum, once set (the ``summed`` field), matches; the orphaned agent of a crashed
trainer sums what it finds before anyone restores from it.

The control block carries two POSIX record locks: byte 0 is held by the live trainer's engine,
byte 1 by the live agent. The kernel drops them when a process dies, which is how a restarted
trainer tells a live writer (refuse) from an orphaned agent (ask it to hand over). Record locks
are per process and every close of *any* descriptor of the file drops them, so each process keeps
exactly one descriptor of the control block open.

Linux first: names live in /dev/shm (``shm_open``); macOS works without the leak listing.
"""
from __future__ import annotations

import ctypes
import fcntl
import glob
import hashlib
import json
import math
import mmap
import os
import struct
import time
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from ..state import FlatState, TensorRecord
from ..tensorbytes import dtype_name, torch_dtype

try:  # CPython's own binding of shm_open / shm_unlink (what multiprocessing.shared_memory uses)
    import _posixshmem
except ImportError:  # pragma: no cover - Windows
    _posixshmem = None

SHM_DIR = "/dev/shm"
PREFIX = "ckz-"
HEADER_BYTES = 4096
ALIGN = 64
MAGIC = b"CKZSLOT1"
VERSION = 1
COMPLETE = b"COMPLETE"
_HDR = struct.Struct("<8sIIqqQQQQQ")   # magic, version, summed, seq, step, meta_off, meta_len, data_off,
#                                        data_len, checksum
_SUMMED_OFF, _CHECKSUM_OFF = 12, 64    # the agent fills these in when the trainer left them to it
_MARK_OFF = 512                        # 8 bytes: COMPLETE, written last
_STATE_OFF = 520                       # u32 written by the agent: STAGED / COMMITTED / FAILED
_DISCARD_OFF = 524                     # u32 written by the trainer: 1 = rolled back, never restore
STAGED, COMMITTED, FAILED = 0, 1, 2
STATE_NAMES = {STAGED: "staged", COMMITTED: "committed", FAILED: "failed"}

_CTL = struct.Struct("<8sIIqqqq")      # magic, version, n_slots (@12), trainer_pid (@16), agent_pid (@24),
#                                        takeover_pid (@32), reserved
CTL_MAGIC = b"CKZCTRL1"
CTL_BYTES = 4096
TRAINER_BYTE, AGENT_BYTE = 0, 1


# --- names -----------------------------------------------------------------------------------

def chain_key(url: str, storage_options: dict | None = None) -> str:
    """16 hex digits naming a chain location: the same URL gives the same key in every process."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(str(url), **(storage_options or {}))
    proto = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if proto in ("file", "local"):
        root = os.path.realpath(root)
    return hashlib.sha256(f"{proto}://{root}".encode()).hexdigest()[:16]


def ctl_name(key: str, rank: int) -> str:
    return f"{PREFIX}{key}-r{rank}-ctl"


def slot_name(key: str, rank: int, i: int) -> str:
    return f"{PREFIX}{key}-r{rank}-s{i}"


def list_segments(key: str | None = None) -> list[str]:
    """Names of ckptzip segments present in /dev/shm (all of them, or one chain's). Linux only."""
    pattern = f"{PREFIX}{key}-*" if key else f"{PREFIX}*"
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(SHM_DIR, pattern)))


def _open_fd(name: str, create: bool) -> int:
    flags = os.O_RDWR | (os.O_CREAT if create else 0)
    if _posixshmem is not None:
        return _posixshmem.shm_open("/" + name, flags, 0o600)
    raise OSError("POSIX shared memory is not available on this platform; use async_save=False")


def unlink(name: str) -> bool:
    """Remove a segment's name (mappings stay valid until unmapped). False if it did not exist."""
    try:
        _posixshmem.shm_unlink("/" + name)
        return True
    except FileNotFoundError:
        return False


def unlink_chain(key: str, rank: int, n_slots: int = 0) -> None:
    """Remove every segment of one chain and rank: its slots, then the control block."""
    names = {slot_name(key, rank, i) for i in range(n_slots)}
    names |= {n for n in list_segments(key) if n.startswith(f"{PREFIX}{key}-r{rank}-s")}
    for n in sorted(names):
        unlink(n)
    unlink(ctl_name(key, rank))


def shm_free_bytes() -> int | None:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


# --- segments --------------------------------------------------------------------------------

class Segment:
    """One shared-memory object mapped read-write into this process."""

    def __init__(self, name: str, *, size: int | None = None, create: bool = False, populate: bool = False):
        self.name = name
        fd = _open_fd(name, create)
        try:
            st = os.fstat(fd)
            if create and size is not None and st.st_size < size:
                os.ftruncate(fd, size)
                if populate and hasattr(os, "posix_fallocate"):
                    # allocate the pages in the kernel now: faulting them in during the first copy is
                    # about twice as slow, and that copy is what training waits for
                    os.posix_fallocate(fd, 0, size)
                st = os.fstat(fd)
            if st.st_size == 0:
                raise FileNotFoundError(f"shared memory segment {name} is empty")
            self.size = st.st_size
            self.inode = st.st_ino
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            self.mm = mmap.mmap(fd, self.size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._pinned = False

    def stale(self) -> bool:
        """True if the name now points at another object or size (recreated or grown elsewhere)."""
        try:
            st = os.stat(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            return True
        except OSError:
            return False
        return st.st_ino != self.inode or st.st_size != self.size

    def tensor(self, dtype: torch.dtype, shape, offset: int) -> torch.Tensor:
        """A tensor viewing the segment's bytes at ``offset`` (shares memory; no copy)."""
        shape = tuple(int(s) for s in shape)
        n = math.prod(shape)
        if n == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self.mm, dtype=dtype, count=n, offset=offset).view(shape)

    def words(self, offset: int, nbytes: int) -> np.ndarray:
        return np.frombuffer(self.mm, dtype=np.uint64, count=nbytes // 8, offset=offset)

    def pin_for_cuda(self) -> bool:
        """Page-lock the mapping so device-to-host copies DMA straight into it (CUDA only)."""
        if self._pinned:
            return True
        try:
            base = self.tensor(torch.uint8, (self.size,), 0)
            rc = torch.cuda.cudart().cudaHostRegister(base.data_ptr(), self.size, 0)
            self._pinned = int(rc) == 0 if not isinstance(rc, tuple) else int(rc[0]) == 0
            if self._pinned:
                self._pin_ptr = base.data_ptr()
        except Exception:  # pinning is an optimisation; pageable copies still work
            self._pinned = False
        return self._pinned

    def close(self) -> None:
        if self._pinned:
            try:
                torch.cuda.cudart().cudaHostUnregister(self._pin_ptr)
            except Exception:
                pass
            self._pinned = False
        try:
            self.mm.close()
        except BufferError:
            pass  # a tensor still views it: the mapping goes when that tensor is collected


# --- slot contents ---------------------------------------------------------------------------

@dataclass
class SlotInfo:
    """What a slot's header says. ``valid`` = complete marker present and magic/version known."""

    name: str
    valid: bool
    seq: int = -1
    step: int = -1
    state: int = STAGED
    discarded: bool = False
    meta_off: int = 0
    meta_len: int = 0
    data_off: int = 0
    data_len: int = 0
    checksum: int = 0
    summed: bool = False

    @property
    def usable(self) -> bool:
        """Complete and not rolled back (the checksum is checked separately: it reads everything)."""
        return self.valid and not self.discarded


@dataclass
class Layout:
    """Where each tensor of one staged checkpoint goes in a slot."""

    meta: bytes
    tensors: list  # [(tensor, offset from data_off, nbytes)]
    data_off: int
    data_len: int

    @property
    def total(self) -> int:
        return self.data_off + self.data_len


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def plan(flat: FlatState, *, step: int, seq: int, url: str, rank: int, ctx: dict | None = None,
         aux: dict[str, torch.Tensor] | None = None) -> Layout:
    """Lay out ``flat`` (plus ``aux`` tensors, e.g. gradients for the encoder) in one slot."""
    off = 0
    tensors, records, aux_meta = [], {}, {}
    for name, rec in flat.records.items():
        t = flat.tensors[name]
        nbytes = t.numel() * t.element_size()
        records[name] = {**rec.to_dict(), "offset": off, "nbytes": nbytes}
        tensors.append((t, off, nbytes))
        off = _align(off + nbytes, ALIGN)
    for name, t in (aux or {}).items():
        t = t.detach()
        nbytes = t.numel() * t.element_size()
        aux_meta[name] = {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "offset": off, "nbytes": nbytes}
        tensors.append((t, off, nbytes))
        off = _align(off + nbytes, ALIGN)
    meta = {"format": "ckptzip-slot", "version": VERSION, "url": url, "rank": rank, "step": step, "seq": seq,
            "skeleton": flat.skeleton, "extra": flat.extra, "records": records, "aux": aux_meta,
            "ctx": ctx or {}}
    raw = json.dumps(meta, separators=(",", ":")).encode()
    data_off = _align(HEADER_BYTES + len(raw), 4096)
    return Layout(raw, tensors, data_off, _align(max(off, 8), 8))


def copy_tensor(dst: torch.Tensor, src: torch.Tensor) -> None:
    """The blocking copy of one tensor into shared memory (tests wrap it to inject faults).

    A contiguous CPU tensor is one memmove: ``Tensor.copy_`` opens a parallel region per tensor,
    and with hundreds of tensors on a busy machine waking its thread pool costs more than the copy
    (0.35 s against 0.012 s for a 10M-parameter Adam state on 2 loaded cores).
    """
    if (src.device.type == "cpu" and src.is_contiguous() and src.dtype == dst.dtype and dst.is_contiguous()
            and not src.is_conj() and not src.is_neg()):
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())
    else:
        dst.copy_(src, non_blocking=src.is_cuda)


def write_slot(seg: Segment, layout: Layout, *, step: int, seq: int, checksum: bool = True,
               pin_cuda: bool = True) -> None:
    """Copy one checkpoint into ``seg``; the complete marker is written last. ``checksum=False``
    leaves the sum to the agent (``ensure_checksum``)."""
    if layout.total > seg.size:
        raise ValueError(f"slot {seg.name} holds {seg.size} bytes, the checkpoint needs {layout.total}")
    mm = seg.mm
    mm[_MARK_OFF:_MARK_OFF + 8] = b"\0" * 8
    struct.pack_into("<II", mm, _STATE_OFF, STAGED, 0)
    mm[HEADER_BYTES:HEADER_BYTES + len(layout.meta)] = layout.meta
    cuda = any(t.is_cuda for t, _, _ in layout.tensors)
    if cuda and pin_cuda:
        seg.pin_for_cuda()
    for t, off, nbytes in layout.tensors:
        if nbytes:
            copy_tensor(seg.tensor(t.dtype, t.shape, layout.data_off + off), t)
    if cuda:
        torch.cuda.synchronize()
    total = slot_checksum(seg, layout.data_off, layout.data_len, layout.meta) if checksum else 0
    _HDR.pack_into(mm, 0, MAGIC, VERSION, int(checksum), seq, step, HEADER_BYTES, len(layout.meta),
                   layout.data_off, layout.data_len, total)
    mm[_MARK_OFF:_MARK_OFF + 8] = COMPLETE


def slot_checksum(seg: Segment, data_off: int, data_len: int, meta: bytes) -> int:
    words = seg.words(data_off, data_len)
    try:
        s = int(np.add.reduce(words, dtype=np.uint64))
    finally:
        del words
    return (s + zlib.crc32(meta)) & 0xFFFFFFFFFFFFFFFF


def read_header(seg: Segment) -> SlotInfo:
    mm = seg.mm
    if seg.size < HEADER_BYTES:
        return SlotInfo(seg.name, False)
    magic, version, summed, seq, step, meta_off, meta_len, data_off, data_len, checksum = _HDR.unpack_from(mm, 0)
    complete = mm[_MARK_OFF:_MARK_OFF + 8] == COMPLETE
    state, discarded = struct.unpack_from("<II", mm, _STATE_OFF)
    ok = (complete and magic == MAGIC and version == VERSION and meta_off == HEADER_BYTES
          and meta_off + meta_len <= data_off and data_off + data_len <= seg.size)
    return SlotInfo(seg.name, ok, seq, step, state, bool(discarded), meta_off, meta_len, data_off, data_len, checksum,
                    bool(summed))


def read_meta(seg: Segment, info: SlotInfo) -> bytes:
    return bytes(seg.mm[info.meta_off:info.meta_off + info.meta_len])


def verify_slot(seg: Segment, info: SlotInfo) -> bool:
    """Complete, and (once summed) the data and meta still sum to the header's checksum."""
    if not info.valid:
        return False
    if not info.summed:
        return True  # staged moments ago and not yet summed by the agent: the marker is all there is
    return slot_checksum(seg, info.data_off, info.data_len, read_meta(seg, info)) == info.checksum


def ensure_checksum(seg: Segment, info: SlotInfo) -> bool:
    """Agent side: sum a slot the trainer left unsummed (True), or verify a summed one."""
    if not info.valid:
        return False
    if info.summed:
        return verify_slot(seg, info)
    total = slot_checksum(seg, info.data_off, info.data_len, read_meta(seg, info))
    struct.pack_into("<Q", seg.mm, _CHECKSUM_OFF, total)
    struct.pack_into("<I", seg.mm, _SUMMED_OFF, 1)  # after the sum itself
    return True


def set_state(seg: Segment, state: int) -> None:
    struct.pack_into("<I", seg.mm, _STATE_OFF, state)


def set_discarded(seg: Segment) -> None:
    struct.pack_into("<I", seg.mm, _DISCARD_OFF, 1)


def load_slot(seg: Segment, info: SlotInfo, *, clone: bool) -> tuple[FlatState, dict[str, torch.Tensor], dict]:
    """(flat state, aux tensors, meta) of a slot; views into the segment unless ``clone``."""
    meta = json.loads(read_meta(seg, info))
    tensors, records, aux = {}, {}, {}
    for name, r in meta["records"].items():
        rec = TensorRecord.from_dict(name, r)
        t = seg.tensor(torch_dtype(rec.dtype), rec.shape, info.data_off + r["offset"])
        tensors[name] = t.clone() if clone else t
        records[name] = rec
    for name, r in meta.get("aux", {}).items():
        t = seg.tensor(torch_dtype(r["dtype"]), r["shape"], info.data_off + r["offset"])
        aux[name] = t.clone() if clone else t
    return FlatState(tensors, records, meta["skeleton"], meta.get("extra", {})), aux, meta


# --- control block ---------------------------------------------------------------------------

class Control:
    """The chain's control block: who owns its slots. Keep one instance per process."""

    def __init__(self, key: str, rank: int):
        self.name = ctl_name(key, rank)
        self._open()

    def _open(self) -> None:
        self.fd = _open_fd(self.name, True)
        st = os.fstat(self.fd)
        if st.st_size < CTL_BYTES:
            os.ftruncate(self.fd, CTL_BYTES)
        self.inode = st.st_ino
        self.mm = mmap.mmap(self.fd, CTL_BYTES, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        magic = self.mm[:8]
        if magic != CTL_MAGIC:
            _CTL.pack_into(self.mm, 0, CTL_MAGIC, VERSION, 0, 0, 0, 0, 0)

    def reopen_if_unlinked(self) -> bool:
        """After a wait on another process: if our name was unlinked meanwhile, open the new one."""
        try:
            st = os.stat(os.path.join(SHM_DIR, self.name))
            same = st.st_ino == self.inode
        except FileNotFoundError:
            same = False
        except OSError:
            return False
        if not same:
            self.close()
            self._open()
        return not same

    def _get(self, fmt: str, off: int) -> int:
        return struct.unpack_from(fmt, self.mm, off)[0]

    def _put(self, fmt: str, off: int, value: int) -> None:
        struct.pack_into(fmt, self.mm, off, value)  # one field: the other process writes the others

    n_slots = property(lambda self: self._get("<I", 12), lambda self, v: self._put("<I", 12, v))
    trainer_pid = property(lambda self: self._get("<q", 16), lambda self, v: self._put("<q", 16, v))
    agent_pid = property(lambda self: self._get("<q", 24), lambda self, v: self._put("<q", 24, v))
    takeover_pid = property(lambda self: self._get("<q", 32), lambda self, v: self._put("<q", 32, v))

    def try_lock(self, byte: int) -> bool:
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, byte)
            return True
        except OSError:
            return False

    def unlock(self, byte: int) -> None:
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_UN, 1, byte)
        except OSError:
            pass

    def held_elsewhere(self, byte: int) -> bool:
        """True while another live process holds the lock on ``byte`` (we must not hold it)."""
        if self.try_lock(byte):
            self.unlock(byte)
            return False
        return True

    def lock_wait(self, byte: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.try_lock(byte):
                if self.reopen_if_unlinked():  # we locked a name someone just removed: retry on the new one
                    continue
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def close(self) -> None:
        try:
            self.mm.close()
        finally:
            os.close(self.fd)  # drops this process's record locks on the file
