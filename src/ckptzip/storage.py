"""Storage behind a chain: any fsspec URL (plain path, file://, memory://, s3://, ...).

Every call is retried through transient faults (timeouts, throttling, 5xx, dropped connections)
under a bounded :class:`~ckptzip.retry.RetryPolicy`; a permanent fault is raised at once, typed
(``StorageFullError``, ``StorageReadOnlyError``) where it refines an ``OSError``. The API, also
meant for other writers of a store (a torch.distributed.checkpoint layer)::

    st = Storage(url, storage_options, retry=RetryPolicy())
    st.read(name) / st.exists(name) / st.list() / st.size(name) / st.delete(name)
    st.write_atomic(name, data)           # whole object or nothing; replaces
    st.create(name, data)                 # whole object or nothing; FileExistsError if the name is taken
                                          # (data: bytes, or a Payload of parts streamed into the write)
    data, version = st.read_versioned(name)            # (None, None) when absent
    version = st.write_if(name, data, version)        # compare-and-swap; WriteConflictError if it moved

``write_if`` is the commit of a writer: it succeeds only if ``name`` still holds what
``read_versioned`` returned (``version=None``: only if it does not exist). A conditional write that
landed but lost its answer, and so conflicts with itself when retried, is recognised (the stored
bytes are the ones written: documents of two writers always differ) and counts as a success.
``create`` never claims an existing object: a lost answer leaves an orphan, never a shared file. How each store does it (``Storage.conditional`` tells whether it is
atomic against other processes):

============  =====================================================  ==========
store          atomic write / exclusive create / compare-and-swap     conditional
============  =====================================================  ==========
local path     temp file + fsync + rename / + link / under a flock    yes
               of the folder; the folder is fsynced after each
s3 (s3fs)      one PUT / PUT If-None-Match: * / PUT If-Match: etag    yes
memory://      one call / under a process lock                        yes (one process)
other fsspec   one PUT / exists + PUT / read + compare + PUT          no: a race
               under a process lock                                   between processes
============  =====================================================  ==========

An interrupted write never becomes visible: local writes go to a temporary name first (``.tmp``,
an orphan ``gc`` removes) and an object store keeps nothing of a failed PUT (or of an aborted
multipart upload). A :class:`~ckptzip.payload.Payload` is written part by part (local: into the
temp file; S3: as the PUT's body, read from the parts), never joined, so a save holds its blobs
once; stores that take one buffer (memory://, other fsspec) get the joined bytes.
"""
from __future__ import annotations

import contextlib
import os
import threading
import uuid

import fsspec

from .errors import WriteConflictError
from .format import blake3_hex
from .payload import Payload, as_bytes
from .retry import CONFLICT_CODES, RetryPolicy, call, service_error

_S3_MAX_PUT = 5 * 2**30  # one PUT carries at most 5 GiB: larger objects go multipart, not conditional


def _version(data: bytes) -> str:
    """A version token of an object whose store has none (local, memory: write_if compares the
    content): its BLAKE3, 4x faster than SHA-256 here, and the index is read and rewritten whole
    on every save."""
    return blake3_hex(data)


class Storage:
    def __init__(self, url: str | os.PathLike, storage_options: dict | None = None, *,
                 retry: RetryPolicy | None = None):
        self.url = str(url)
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        self.root = self.root.rstrip("/") or "/"
        protocols = _protocols(self.fs)
        self.local = "file" in protocols
        self.retry = retry if retry is not None else RetryPolicy()
        if self.local:
            self._backend: _FsspecBackend = _LocalBackend(self.fs)
        elif "s3" in protocols and hasattr(self.fs, "call_s3"):
            self._backend = _S3Backend(self.fs)
        else:
            self._backend = _FsspecBackend(self.fs)
        self.conditional = self._backend.conditional or "memory" in protocols

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _call(self, what: str, name: str, fn, *args):
        return call(self.retry, what, self.path(name), fn, *args)

    # --- reads ------------------------------------------------------------------------------
    def exists(self, name: str) -> bool:
        return self._call("checking", name, self._backend.exists, self.path(name))

    def read(self, name: str) -> bytes:
        return self._call("reading", name, self._backend.read, self.path(name))

    def read_versioned(self, name: str) -> tuple[bytes | None, str | None]:
        """The object's bytes and a version token for :meth:`write_if`; (None, None) if absent."""
        return self._call("reading", name, self._backend.read_versioned, self.path(name))

    def list(self) -> list[str]:
        names = self._call("listing", "", self._backend.list, self.root)
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in names)

    def size(self, name: str) -> int:
        return int(self._call("sizing", name, self.fs.size, self.path(name)))

    # --- writes -----------------------------------------------------------------------------
    def makedirs(self) -> None:
        if self.local or "memory" in _protocols(self.fs):
            self._call("creating the folder", "", self.fs.makedirs, self.root, True)

    def write_atomic(self, name: str, data: bytes | Payload) -> None:
        self._call("writing", name, self._backend.write, self.path(name), data)

    def create(self, name: str, data: bytes | Payload) -> None:
        """Write a new object; FileExistsError if ``name`` exists.

        Also when an earlier try of this very call landed and only its answer was lost (this
        layer's retry or the store client's own): equal bytes can come from another writer too, so
        the caller picks another name and the first object is an orphan (``gc``), never shared.
        """
        self._call("writing", name, self._backend.create, self.path(name), data)

    def write_if(self, name: str, data: bytes, version: str | None) -> str:
        """Replace ``name`` only if it is still at ``version`` (None: only if absent); the new version.

        Raises WriteConflictError when another writer changed it since it was read. A try whose
        write landed but whose answer was lost is told by the stored bytes being ``data``, so
        documents of different writers must differ (the chain's carry the writer's owner record).
        """
        target = self.path(name)

        def attempt():
            try:
                return self._backend.write_if(target, data, version)
            except WriteConflictError:
                # an earlier try that landed and lost its answer (this layer's retry, or the store
                # client's own inside one try) conflicts with itself: the stored bytes tell
                cur, v = self._backend.read_versioned(target)
                if cur == data:
                    return v
                raise
        return self._call("committing", name, attempt)

    def delete(self, name: str) -> None:
        self._call("deleting", name, self._backend.delete, self.path(name))


class _FsspecBackend:
    """Any fsspec filesystem: a write is one call, conditional writes compare under a process lock."""

    conditional = False
    _locks: dict[str, threading.Lock] = {}
    _locks_guard = threading.Lock()

    def __init__(self, fs):
        self.fs = fs

    @contextlib.contextmanager
    def _exclusive(self, path: str):
        """One lock per folder of one filesystem class, in this process."""
        with self._locks_guard:
            lock = self._locks.setdefault(f"{id(type(self.fs))}:{path.rsplit('/', 1)[0]}", threading.Lock())
        with lock:
            yield

    def exists(self, path: str) -> bool:
        self.fs.invalidate_cache(path)  # another process may have written it since we listed
        return self.fs.exists(path)

    def read(self, path: str) -> bytes:
        return self.fs.cat_file(path)

    def read_versioned(self, path: str) -> tuple[bytes | None, str | None]:
        try:
            data = self.read(path)
        except (FileNotFoundError, NotADirectoryError):  # no such object (or no such folder)
            return None, None
        return data, _version(data)

    def list(self, root: str) -> list[str]:
        self.fs.invalidate_cache(root)
        try:
            return self.fs.ls(root, detail=False)
        except FileNotFoundError:
            return []

    def write(self, path: str, data: bytes | Payload) -> None:
        self.fs.pipe_file(path, as_bytes(data))

    def create(self, path: str, data: bytes | Payload) -> None:
        with self._exclusive(path):
            if self.exists(path):
                raise FileExistsError(f"{path} exists")
            self.write(path, data)

    def write_if(self, path: str, data: bytes, version: str | None) -> str:
        with self._exclusive(path):
            if self.read_versioned(path)[1] != version:
                raise WriteConflictError(f"{path} changed since it was read")
            self.write(path, data)
        return _version(data)

    def delete(self, path: str) -> None:
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            pass


class _LocalBackend(_FsspecBackend):
    """A local (or NFS-mounted) folder: rename and link give atomicity, a folder flock the CAS."""

    conditional = True

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def read(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def write(self, path: str, data: bytes | Payload) -> None:
        tmp = self._temp(path, data)
        try:
            os.replace(tmp, path)
        except BaseException:
            _unlink(tmp)
            raise
        _fsync_dir(os.path.dirname(path))

    def create(self, path: str, data: bytes | Payload) -> None:
        tmp = self._temp(path, data)
        try:
            os.link(tmp, path)  # never replaces: FileExistsError if the name is taken
        finally:
            _unlink(tmp)
        _fsync_dir(os.path.dirname(path))

    def write_if(self, path: str, data: bytes, version: str | None) -> str:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            _flock(fd)  # readers do not lock: they see the old or the new file, renamed whole
            if self.read_versioned(path)[1] != version:
                raise WriteConflictError(f"{path} changed since it was read")
            self.write(path, data)
        finally:
            os.close(fd)  # drops the lock
        return _version(data)

    @staticmethod
    def _temp(path: str, data: bytes | Payload) -> str:
        folder, name = os.path.split(path)
        os.makedirs(folder, exist_ok=True)
        tmp = f"{folder}/.{name}.{uuid.uuid4().hex}.tmp"
        try:
            with open(tmp, "wb") as f:
                for part in data.parts if isinstance(data, Payload) else (data,):
                    f.write(part)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            _unlink(tmp)
            raise
        return tmp


class _S3Backend(_FsspecBackend):
    """s3fs: PUT If-None-Match / If-Match make exclusive create and compare-and-swap atomic."""

    conditional = True

    def read(self, path: str) -> bytes:
        data, _ = self.read_versioned(path)
        if data is None:
            raise FileNotFoundError(path)
        return data

    def read_versioned(self, path: str) -> tuple[bytes | None, str | None]:
        from fsspec.asyn import sync

        bucket, key, _ = self.fs.split_path(path)

        async def get():  # body and ETag from one response: a HEAD then a GET could straddle a write
            resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
            try:
                return await resp["Body"].read(), resp["ETag"]
            finally:
                resp["Body"].close()
        try:
            return sync(self.fs.loop, get)
        except FileNotFoundError:
            return None, None

    def _put(self, path: str, data: bytes | Payload, **cond) -> str:
        bucket, key, _ = self.fs.split_path(path)
        body = data.reader() if isinstance(data, Payload) else data  # a fresh reader per try
        try:
            out = self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=body, **cond)
        except Exception as e:
            if isinstance(e, FileExistsError) or service_error(e)[0] in CONFLICT_CODES:
                raise WriteConflictError(f"{path} changed since it was read") from None
            raise
        finally:
            self.fs.invalidate_cache(path)
        return out["ETag"]

    def create(self, path: str, data: bytes | Payload) -> None:
        if len(data) > _S3_MAX_PUT:
            with self._exclusive(path):  # multipart upload: exists + upload (see the table)
                if self.exists(path):
                    raise FileExistsError(f"{path} exists")
                return self._multipart(path, data)
        try:
            self._put(path, data, IfNoneMatch="*")
        except WriteConflictError:
            raise FileExistsError(f"{path} exists") from None

    def write_if(self, path: str, data: bytes, version: str | None) -> str:
        return self._put(path, data, **({"IfNoneMatch": "*"} if version is None else {"IfMatch": version}))

    def _multipart(self, path: str, data: bytes | Payload) -> None:
        """A multipart upload fed part by part; aborted on any failure (the object never appears)."""
        f = self.fs.open(path, "wb")
        try:
            for part in data.parts if isinstance(data, Payload) else (memoryview(data),):
                f.write(part)
        except BaseException:
            try:
                f.discard()  # aborts the upload: S3 keeps nothing visible
            finally:
                f.closed = True  # a discarded file must not complete its upload when collected
            raise
        f.close()  # completes the upload: the object appears whole


def _flock(fd: int) -> None:
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: no folder lock, the compare is still made
        return
    fcntl.flock(fd, fcntl.LOCK_EX)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _protocols(fs) -> tuple[str, ...]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
