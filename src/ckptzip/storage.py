"""Storage behind a chain: any fsspec URL (plain path, file://, memory://, s3://, ...).

The one guarantee the chain needs is an atomic whole-object write: on local files we write a temp
file, fsync and ``os.replace`` it (then fsync the folder); on object stores a single PUT is already
all-or-nothing, so the object is written directly.
"""
from __future__ import annotations

import os
import uuid

import fsspec


class Storage:
    def __init__(self, url: str | os.PathLike, storage_options: dict | None = None):
        self.url = str(url)
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        self.root = self.root.rstrip("/") or "/"
        self.local = "file" in _protocols(self.fs)

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def exists(self, name: str) -> bool:
        return self.fs.exists(self.path(name))

    def read(self, name: str) -> bytes:
        with self.fs.open(self.path(name), "rb") as f:
            return f.read()

    def makedirs(self) -> None:
        if self.local or "memory" in _protocols(self.fs):
            self.fs.makedirs(self.root, exist_ok=True)

    def write_atomic(self, name: str, data: bytes) -> None:
        target = self.path(name)
        if not self.local:
            self.fs.pipe_file(target, data)
            return
        os.makedirs(self.root, exist_ok=True)
        tmp = f"{self.root}/.{name}.{uuid.uuid4().hex}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        _fsync_dir(self.root)

    def delete(self, name: str) -> None:
        try:
            self.fs.rm_file(self.path(name))
        except FileNotFoundError:
            pass

    def list(self) -> list[str]:
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in entries)

    def size(self, name: str) -> int:
        return int(self.fs.size(self.path(name)))


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
