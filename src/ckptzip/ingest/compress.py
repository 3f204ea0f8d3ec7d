"""The job behind ``ckptzip compress``: check everything first, then ingest the sources in step order.

    job = plan(paths, out, method="lossless")   # every error before anything is written
    entries = run(job, on_source=show)          # one chain save per source; show(src) before each

``plan`` checks the method and its config, the quality options, the chain folder (new, empty, or
a chain whose latest step comes before the sources), every source (sources.find_sources) and, for
methods with a config search, loads the ``--eval`` spec: ``module:function`` or
``path/to/file.py:function`` returning ``(model, eval_fn)``, or ``pretrained:MODEL_FOLDER`` (a
Hugging Face encoder judged by search/pretrained.py's default check; ``pretrained-KIND:...`` for
another of its checks). ``run`` then loads each source's
weights into that model before its save, so the search judges quality on the checkpoint being
compressed. Messages name the ``ckptzip compress`` options, since that is who they are for.
"""
from __future__ import annotations

import importlib
import importlib.util
import math
import os
import pathlib
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..basestate import BaseWeights
from ..chain import INDEX, CheckpointChain, Entry, KeyframePolicy
from ..errors import ConfigError, IncompleteCheckpointError
from ..format import CHECKSUMS, DEFAULT_CHECKSUM
from ..methods.base import EncodeContext, Method, get_method
from .sources import Source, find_sources, load_source


@dataclass(frozen=True)
class CompressJob:
    out: str
    method: Method
    sources: tuple[Source, ...]
    keyframe_every: int = 10
    model: torch.nn.Module | None = None   # the --eval model, each source's weights loaded before its save
    eval_fn: Callable | None = None
    threshold: float | None = None         # None: the method's default budget
    higher_is_better: bool = False
    checksum: str = DEFAULT_CHECKSUM       # each blob's checksum in the files written (format.CHECKSUMS)
    base: BaseWeights | None = None        # --base: keyframes coded as residuals against these weights


def plan(paths: Sequence[str | os.PathLike], out: str, method: str = "lossless", config: dict | None = None, *,
         keyframe_every: int = 10, eval_spec: str | None = None, threshold: float | None = None,
         higher_is_better: bool = False, checksum: str = DEFAULT_CHECKSUM,
         base: str | os.PathLike | None = None) -> CompressJob:
    """Validate the whole job; raises a one-line error naming the thing and the fix, writes nothing."""
    m = get_method(method, config)
    if (threshold is not None or higher_is_better) and eval_spec is None:
        raise ConfigError("--threshold and --higher-is-better need --eval module:function returning "
                          "(model, eval_fn)")
    if threshold is not None and not (math.isfinite(threshold) and threshold > 0):
        raise ConfigError(f"--threshold must be a positive relative budget such as 0.01, got {threshold}")
    if checksum not in CHECKSUMS:
        raise ConfigError(f"--checksum must be one of {', '.join(CHECKSUMS)}, got {checksum!r}")
    entries = check_target(out)
    sources = find_sources(paths)
    if not sources:
        raise ConfigError("no checkpoints to compress; pass torch.save files or Trainer checkpoint-N folders")
    if entries and sources[0].step <= entries[-1].step:
        raise ConfigError(f"{sources[0].path} has step {sources[0].step}, not after the chain's latest step "
                          f"{entries[-1].step}; pass later checkpoints or choose a new --out")
    weights = None if base is None else BaseWeights.from_file(base)
    model = eval_fn = None
    if eval_spec is not None:
        model, eval_fn = load_eval(eval_spec)
    return CompressJob(out, m, tuple(sources), keyframe_every, model, eval_fn, threshold, higher_is_better, checksum,
                       weights)


def run(job: CompressJob, *, on_source: Callable[[Source], None] | None = None) -> list[Entry]:
    """Save every source of ``job`` into its chain, in step order; returns the new index entries."""
    saved = []
    with CheckpointChain(job.out, job.method, keyframe=KeyframePolicy(every=job.keyframe_every),
                         checksum=job.checksum, base=job.base) as chain:
        for s in job.sources:
            if on_source is not None:
                on_source(s)
            state = load_source(s)
            if job.model is not None:
                load_weights(job.model, state, s.path)
            ctx = EncodeContext(step=s.step, model=job.model, eval_fn=job.eval_fn,
                                higher_is_better=job.higher_is_better,
                                **({"threshold": job.threshold} if job.threshold is not None else {}))
            saved.append(chain.save(state, s.step, model=job.model, ctx=ctx))
    return saved


def check_target(url: str) -> list[Entry]:
    """Where ``--out`` will write: a new/empty folder or an existing chain. Returns its entries."""
    chain = CheckpointChain(url)
    st = chain.storage
    if st.local:
        root = pathlib.Path(st.root)
        if root.exists() and not root.is_dir():
            raise NotADirectoryError(f"{url} is a file, not a chain folder; choose a folder for --out")
        if root.is_dir() and not (root / INDEX).exists() and any(root.iterdir()):
            raise IncompleteCheckpointError(f"{url} is a folder with other files and no index.json, not a chain; "
                                            "choose a new or empty folder for --out")
        probe = root
        while not probe.exists():
            probe = probe.parent
        if not probe.is_dir():
            raise NotADirectoryError(f"cannot create {url}: {probe} is a file; choose another --out")
        if not os.access(probe, os.W_OK | os.X_OK):
            raise PermissionError(f"cannot write {url}: no write permission on {probe}; choose a writable --out")
    return chain.entries(refresh=True) if st.exists(INDEX) else []


def load_eval(spec: str, what: str = "--eval") -> tuple[torch.nn.Module, Callable]:
    """(model, eval_fn) from ``module:function``, ``path/to/file.py:function`` or ``pretrained[-KIND]:FOLDER``."""
    kind, sep, folder = spec.partition(":")
    if sep and (kind == "pretrained" or kind.startswith("pretrained-")):
        from ..search import pretrained

        return pretrained.from_pretrained(folder, kind.removeprefix("pretrained").lstrip("-") or pretrained.DEFAULT_CHECK)
    mod_name, sep, fn_name = spec.rpartition(":")
    if not sep or not mod_name or not fn_name:
        raise ConfigError(f"{what} {spec!r} must be module:function or path/to/file.py:function")
    try:
        if mod_name.endswith(".py") or os.sep in mod_name or "/" in mod_name:
            path = pathlib.Path(mod_name)
            if not path.is_file():
                raise FileNotFoundError(f"{what} {spec}: no such file {path}; check the path")
            ispec = importlib.util.spec_from_file_location(path.stem, path)
            mod = importlib.util.module_from_spec(ispec)
            ispec.loader.exec_module(mod)
        else:
            # a console script does not put the working directory on sys.path; python -m would
            added = os.getcwd() not in sys.path and "" not in sys.path
            if added:
                sys.path.insert(0, os.getcwd())
            try:
                mod = importlib.import_module(mod_name)
            finally:
                if added:
                    sys.path.remove(os.getcwd())
    except ImportError as e:
        raise ConfigError(f"{what} {spec}: cannot import {mod_name} ({e}); put it on PYTHONPATH") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ConfigError(f"{what} {spec}: {mod_name} has no function {fn_name}; name a function that returns "
                          "(model, eval_fn)")
    res = fn()
    if not (isinstance(res, tuple) and len(res) == 2 and isinstance(res[0], torch.nn.Module) and callable(res[1])):
        raise ConfigError(f"{what} {spec}: {fn_name}() must return (model, eval_fn), got {type(res).__name__}")
    return res


def load_weights(model: torch.nn.Module, state: dict, where) -> None:
    """Load a source's model weights into the --eval model (extra model keys are an error, missing ones not)."""
    sd = state.get("model")
    if not isinstance(sd, dict):
        raise ConfigError(f"{where}: holds no model state dict to load into the --eval model; pass checkpoints "
                          "with model weights or drop --eval")
    try:
        _, unexpected = model.load_state_dict(sd, strict=False)
    except RuntimeError as e:
        raise ConfigError(f"{where}: weights do not fit the --eval model ({str(e).splitlines()[0]})") from None
    if unexpected:
        raise ConfigError(f"{where}: weights do not fit the --eval model (unexpected key {unexpected[0]!r}); "
                          "return the model these checkpoints were trained with")
