"""Finding, validating and ordering the checkpoints to ingest, and loading each one.

    sources = find_sources(paths)   # each path's layout detected and checked; ordered by step
    state = load_source(src)        # the normalised state, ready for CheckpointChain.save

A source's step comes from the checkpoint itself (an entry such as ``global_step``), else the last
number in its name, else its position among the arguments.
"""
from __future__ import annotations

import os
import pathlib
import re
from dataclasses import dataclass
from typing import Sequence

from ..errors import ConfigError, CorruptCheckpointError
from .layout import LAYOUTS, SourceLayout
from .lightning import LIGHTNING_LAYOUT
from .torchfile import TORCH_LAYOUT
from .trainer import TRAINER_LAYOUT

# the order layouts are tried in: the most specific first, a plain file last
DETECT_ORDER = (TRAINER_LAYOUT, LIGHTNING_LAYOUT, TORCH_LAYOUT)


@dataclass(frozen=True)
class Source:
    """One checkpoint to ingest, validated, with the step it will be stored under."""

    path: pathlib.Path
    layout: str        # its layout's descriptor: "torch-file/1" | "hf-trainer/1"
    step: int
    step_from: str     # where the step came from: "entry:<key>" | "name" | "order"


def find_sources(paths: Sequence[str | os.PathLike]) -> list[Source]:
    """Validate every path (loading each, without keeping tensors) and return them in step order.

    A folder that is not itself a checkpoint but holds ``checkpoint-*`` Trainer folders stands for
    all of them. Raises FileNotFoundError / UnsafeInputError / CorruptCheckpointError / ConfigError
    naming the path and the fix; nothing is written.
    """
    trainer = LAYOUTS[TRAINER_LAYOUT]
    found: list[tuple[pathlib.Path, SourceLayout]] = []
    for p in paths:
        path = pathlib.Path(p)
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such file or folder; check the path")
        layout = _detect(path)
        if layout is not None:
            found.append((path, layout))
            continue
        subs = sorted((d for d in path.glob("checkpoint-*") if trainer.detect(d)),
                      key=lambda d: _name_number(d.name) or 0)
        if not subs:
            raise CorruptCheckpointError(
                f"{path}: not a checkpoint (a folder without model.safetensors, pytorch_model.bin or "
                "checkpoint-* folders); pass torch.save files or Trainer checkpoint-N folders")
        found += [(d, trainer) for d in subs]

    sources: list[Source] = []
    for order, (path, layout) in enumerate(found):
        step, how = layout.check(path)
        if step is None:
            n = _name_number(path.name if path.is_dir() else path.stem)
            step, how = (n, "name") if n is not None else (order, "order")
        sources.append(Source(path, layout.descriptor, step, how))

    sources.sort(key=lambda s: s.step)
    for a, b in zip(sources, sources[1:]):
        if a.step == b.step:
            raise ConfigError(f"{a.path} and {b.path} both have step {a.step}; pass each step once")
    return sources


def load_source(src: Source) -> dict:
    """The normalised training state of ``src`` (with its ``__layout__``), for CheckpointChain.save."""
    return LAYOUTS[src.layout].load(src.path, src.step)


def _detect(path: pathlib.Path) -> SourceLayout | None:
    return next((LAYOUTS[d] for d in DETECT_ORDER if LAYOUTS[d].detect(path)), None)


def _name_number(name: str) -> int | None:
    nums = re.findall(r"\d+", name)
    return int(nums[-1]) if nums else None
