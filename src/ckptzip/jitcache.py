"""numba's kernels compiled in a child process; this process loads them from numba's disk cache.

numba compiles a kernel at its first call and keeps the machine code on disk (``cache=True``):
a dynaquant save and restore compile for ~50 s on a cold cache, and a later process loads the same
code in ~1.6 s. A process that compiled its kernels itself also keeps LLVM's state (~0.5 GB) and
saves 1.04-1.11x slower for the rest of its life than one that loaded them (paired against each other,
docs/BENCHMARKS.md "Kernels compiled in a child process"). So a chain's first save or restore
waits for a child, ``python -m ckptzip.jitcache METHOD``, that saves and restores a small training
state with the method (compiling what the cache lacks), and then loads every kernel from the
cache. CheckpointChain starts the child when it is made, so a run trains beside the compile; a
stamp file in numba's cache folder, named by a hash of this package's sources (their sizes and
times: ~2 ms a process), numba, Python and the CPU, says the child already ran.

    prepare("dynaquant")     # start the child in the background (nothing if stamped or started)
    ready("dynaquant")       # wait for it (starting it if needed); then the kernels load
    compile_kernels(["dynaquant", "lossless"])   # both, blocking (the demo, ``ckptzip jit``)

The child's failure or timeout is never the save's: a warning, and the kernels compile here as
before. ``CKPTZIP_JIT=inprocess`` skips the child (numba-less hosts and ``NUMBA_DISABLE_JIT=1``
skip it too). Children of several processes (ranks, an engine's agent) take a lock in the cache
folder: one compiles, the others then load. A child then deletes the cache files of this package's
kernels whose line moved (an edit, an upgrade in place), which numba would keep forever and never
read again; a process still running the old sources compiles those kernels itself.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import subprocess
import sys
import tempfile
import threading

__all__ = ["prepare", "ready", "compile_kernels", "enabled", "cache_dir", "stamp_path", "ENV", "TIMEOUT_S"]

ENV = "CKPTZIP_JIT"          # "child" (default) or "inprocess"
TIMEOUT_S = 1800.0           # a cold compile takes ~50 s on 2 cores; a loaded host several times that
_STAMP = "ckptzip-jit-"
_LOCK = "ckptzip-jit.lock"
_log = logging.getLogger(__name__)
_guard = threading.Lock()
_children: dict[str, tuple | None] = {}  # method -> (its child, its stderr file); None: nothing to wait for


def _method(name: str) -> str:
    return name.split("/", 1)[0]  # a descriptor ("dynaquant/2") names its method before the slash


def enabled() -> bool:
    """Whether a chain's kernels compile in a child: numba installed, jitting, not ``CKPTZIP_JIT=inprocess``."""
    from .codec.huffman import HAVE_NUMBA

    return HAVE_NUMBA and os.environ.get(ENV, "child") != "inprocess" and os.environ.get("NUMBA_DISABLE_JIT") != "1"


def cache_dir() -> str:
    """numba's cache folder for this package (NUMBA_CACHE_DIR's, if set): the stamps and the lock live there."""
    from .codec.rans import _encode_kernel

    return _encode_kernel.stats.cache_path


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:  # model and flags: numba compiles for the host's features
            return "".join(line for line in f if line.startswith(("model name", "flags")))[:4096]
    except OSError:
        return platform.processor()


def stamp_path(method: str) -> str:
    """The stamp that says ``method``'s kernels are in numba's cache for these sources."""
    import numba

    root = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256(f"{numba.__version__}|{sys.version}|{platform.machine()}|{_cpu()}".encode())
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                st = os.stat(os.path.join(folder, name))
                h.update(f"{os.path.relpath(os.path.join(folder, name), root)}:{st.st_size}:{st.st_mtime_ns}|".encode())
    return os.path.join(cache_dir(), f"{_STAMP}{_method(method)}-{h.hexdigest()[:16]}")


def prepare(method: str) -> None:
    """Start ``method``'s child in the background unless its stamp is there (once per process)."""
    name = _method(method)
    with _guard:
        if name in _children:
            return
        from .methods.base import builtin

        # a registered method of the user's exists only in this process: its kernels compile here
        if not enabled() or not builtin(name) or os.path.exists(stamp_path(name)):
            _children[name] = None
            return
        pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [pkg_parent, os.environ.get("PYTHONPATH")])))
        try:
            # stderr into a file, not a pipe: a child nobody waits for (a chain that never saves) must
            # not block on a full pipe while it holds the lock; a thread reaps it when it ends
            err = tempfile.TemporaryFile()
            child = subprocess.Popen([sys.executable, "-m", "ckptzip.jitcache", name], env=env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
            _children[name] = child, err
            threading.Thread(target=child.wait, name=f"ckptzip-jit-{name}", daemon=True).start()
        except OSError as e:
            _children[name] = None
            _log.warning("ckptzip: could not start the kernel compile child (%s); compiling in this process", e)


def ready(method: str, timeout: float = TIMEOUT_S) -> None:
    """Wait for ``method``'s child (starting it if :func:`prepare` did not). On its failure or
    timeout, a warning: the kernels then compile in this process."""
    name = _method(method)
    prepare(name)
    with _guard:
        entry = _children.get(name)
    if entry is None:
        return
    child, log = entry
    late = False
    try:  # outside the guard: another method's chain may start its child meanwhile
        child.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        late = True
        child.kill()
        child.wait()
    with _guard:
        if _children.get(name) is not entry:  # another thread waited for the same child and reported
            return
        _children[name] = None
        err = f"no result within {timeout:.0f} s" if late else _tail(log)
        log.close()
        if child.returncode:
            _log.warning("ckptzip: the kernel compile child for %s failed (%s); compiling in this process "
                         "(set %s=inprocess to skip the child)", name, err or f"exit code {child.returncode}", ENV)


def _tail(f) -> str:
    """The last line of a child's stderr file."""
    f.seek(0)
    lines = f.read()[-4096:].decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else ""


def compile_kernels(methods) -> None:
    """:func:`prepare` every method, then :func:`ready` each (their children take turns on the lock)."""
    for m in methods:
        prepare(m)
    for m in methods:
        ready(m)


# --- the child -------------------------------------------------------------------------------
def _exercise(method: str) -> None:
    """Save a small training state's keyframe and three deltas with ``method`` (the deltas with the
    config search: the first exhaustive, the next two in the neighbourhood), restore every step from
    a fresh chain object, then resume as a restarted run does (a save after its restore): each
    kernel a save and a restore call, at the dtypes a float32 model with Adam gives them."""
    import fsspec
    import torch
    from torch import nn

    from .chain import CheckpointChain
    from .methods.base import EncodeContext

    torch.manual_seed(0)
    # small and large tensors: a stream's codes are packed to uint8 symbols past 2**17 (codec/tuples.py)
    model = nn.Sequential(nn.Embedding(256, 64), nn.Linear(64, 2048), nn.LayerNorm(2048), nn.GELU(),
                          nn.Linear(2048, 64), nn.Linear(64, 256, bias=False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (16, 32))

    def loss_of(m: nn.Module) -> torch.Tensor:
        return nn.functional.cross_entropy(m(x).flatten(0, 1), x.flatten())

    def score(m: nn.Module) -> float:
        with torch.no_grad():
            return float(loss_of(m))

    def state(step: int) -> dict:
        return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "rng": torch.get_rng_state()}

    root = f"ckptzip-jit-{os.getpid()}"
    url = f"memory://{root}/{method}"
    try:
        chain = CheckpointChain(url, method)
        for step in (1, 2, 3, 4):
            for _ in range(3):
                opt.zero_grad()
                loss_of(model).backward()
                opt.step()
            # sensitivity pruning reads gradients (api.SaveWindowRecorder's), and a state often
            # carries the RNG's bytes: both reach kernels at dtypes of their own
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
            ctx = EncodeContext(step=step, model=model, eval_fn=score, threshold=0.01,
                                gradients=grads if step > 2 else None) if step > 1 else None
            chain.save(state(step), step, model=model, optimizer=opt, ctx=ctx)
        for step in (1, 2, 3, 4):
            CheckpointChain(url).restore(step)
        resumed = CheckpointChain(url, method)  # a restart: restore the latest, then save against it
        model.load_state_dict(resumed.restore().state["model"])
        resumed.save(state(5), 5, model=model, optimizer=opt,
                     ctx=EncodeContext(step=5, model=model, eval_fn=score, threshold=0.01))
    finally:
        fsspec.filesystem("memory").rm(root, recursive=True)


def _child(methods: list[str]) -> None:
    import torch

    torch.set_num_threads(1)  # beside a training run: the compile is one thread anyway
    os.environ[ENV] = "inprocess"  # this process is the compile: no child of its own
    folder = cache_dir()
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, _LOCK), "a") as lock:
        try:
            import fcntl
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process's child compiling: wait, then load
        except ImportError:  # pragma: no cover - no flock (Windows): children may compile side by side
            pass
        for method in methods:
            stamp = stamp_path(method)
            if os.path.exists(stamp):
                continue
            _exercise(method)
            for old in os.listdir(folder):  # the stamps of sources that changed since
                if old.rsplit("-", 1)[0] == f"{_STAMP}{method}":  # not "bitsnap-lossless"'s for "bitsnap"
                    os.remove(os.path.join(folder, old))
            with open(stamp, "w") as f:
                f.write("compiled\n")
        try:
            stale = _stale_files(_live_kernels())
        except AttributeError:  # numba's cache objects changed shape: sweep nothing
            stale = []
        for path in stale:
            try:
                os.remove(path)
            except OSError:  # another child swept it first
                pass


def _live_kernels() -> dict[str, set[str]]:
    """numba cache folder -> the file stems (``module.qualname-line.pyXY``) of this package's
    cached kernels as these sources define them: every kernel the imported modules define at their
    import (a kernel made later, inside a call, would be swept as stale: this package makes none)."""
    import gc

    from numba.core.dispatcher import Dispatcher

    live: dict[str, set[str]] = {}
    for o in gc.get_objects():
        # the type, not isinstance: that reads __class__, which some objects answer with a warning
        if issubclass(type(o), Dispatcher) and o.py_func.__module__.startswith(f"{__package__}."):
            index = getattr(o._cache, "_cache_file", None)  # None: a kernel without cache=True
            if index is not None:
                live.setdefault(o._cache._cache_path, set()).add(index._index_name.removesuffix(".nbi"))
    return live


def _stale_files(live: dict[str, set[str]]) -> list[str]:
    """The index (.nbi) and code (.nbc) files in ``live``'s folders that belong to a module with a
    live kernel there but to none of its stems: a kernel whose line moved (an edit, an upgrade in
    place) leaves its old files, which numba never reads again (a development tree had gathered
    ~450 of them, 25 MB). Files of modules this process did not import stay."""
    stale = []
    for folder, stems in live.items():
        modules = {s.split(".", 1)[0] for s in stems}
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            stem = name.removesuffix(".nbi") if name.endswith(".nbi") else (
                name.rsplit(".", 2)[0] if name.endswith(".nbc") else None)  # stem.N.nbc
            if stem is not None and stem.split(".", 1)[0] in modules and stem not in stems:
                stale.append(os.path.join(folder, name))
    return stale


if __name__ == "__main__":
    _child(sys.argv[1:])
