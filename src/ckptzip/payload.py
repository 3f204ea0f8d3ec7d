"""An object's bytes as the parts it is written from (a container's header, then each blob).

Storage streams the parts into the write (a temp file, an S3 PUT body), so a save never holds
a second, joined copy of its blobs. Call order::

    p = Payload([header, blob_a, blob_b])   # no copy: memoryviews of the parts
    len(p)                                  # the object's size
    with p.reader() as f: ...               # a seekable file over the parts (an S3 PUT body)
    bytes(p)                                # the joined object, for stores that take one buffer
"""
from __future__ import annotations

import bisect
import io
from collections.abc import Sequence


class Payload:
    """An object's bytes as a list of parts (memoryviews: nothing is copied until ``bytes()``).

    ``len()`` is the object's size, ``reader()`` a seekable file over it (an S3 PUT body),
    ``bytes()`` the joined object (stores that take one buffer).
    """

    def __init__(self, parts: Sequence[bytes | bytearray | memoryview]):
        self.parts = [memoryview(p).cast("B") for p in parts]
        self.nbytes = sum(p.nbytes for p in self.parts)

    def __len__(self) -> int:
        return self.nbytes

    def __bytes__(self) -> bytes:
        return b"".join(self.parts)

    def reader(self) -> io.BufferedReader:
        return io.BufferedReader(_PartsReader(self.parts), buffer_size=1 << 20)


class _PartsReader(io.RawIOBase):
    """A read-only, seekable raw file over a list of buffers (no copy beyond what is read)."""

    def __init__(self, parts: list[memoryview]):
        self._parts, self._pos = parts, 0
        self._starts = [0]
        for p in parts:
            self._starts.append(self._starts[-1] + p.nbytes)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._starts[-1]}[whence]
        if base + offset < 0:
            raise ValueError("negative seek position")
        self._pos = base + offset
        return self._pos

    def readinto(self, buf) -> int:
        out = memoryview(buf).cast("B")
        done = 0
        i = bisect.bisect_right(self._starts, self._pos) - 1
        while done < out.nbytes and i < len(self._parts):
            part = self._parts[i][self._pos - self._starts[i]:]
            n = min(part.nbytes, out.nbytes - done)
            out[done:done + n] = part[:n]
            done += n
            self._pos += n
            i += 1
        return done


def as_bytes(data: bytes | Payload) -> bytes:
    """The object in one buffer (joined only when it is a Payload)."""
    return bytes(data) if isinstance(data, Payload) else data
