"""Checking a chain: every committed file against its index entry, then (deep) every step decoded.

``CheckpointChain.verify()`` returns a list of :class:`Problem` (empty: all good); ``str(problem)``
is the one line the CLI prints, ``problem.fix`` what to do about it. Order of the checks:

    1. per entry: parent present, file present, file checksum = index checksum, container
       readable and holding the step the index says; for a file failing its checksum, each
       record whose blob fails its own checksum (so the damage is named down to a tensor)
    2. deep, only when 1 found nothing: replay every step through its method
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from .errors import CkptzipError
from .format import blob_matches, decode_container
from .index import file_matches

if TYPE_CHECKING:
    from .chain import CheckpointChain, Entry

FIX_FILE = "restore the file from a backup, or truncate the chain before this step"
FIX_INDEX = "restore index.json from a backup"


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a chain, located as precisely as known."""

    what: str                  # the sentence, without the location
    step: int | None = None    # the step it concerns (None: the chain as a whole)
    file: str | None = None    # the object's full storage path
    record: str | None = None  # the tensor record whose bytes are damaged
    fix: str = ""              # what to do about it

    def __str__(self) -> str:
        where = self.file if self.file is not None else f"step {self.step}"
        return f"{where}: {self.what}"


def verify_chain(chain: "CheckpointChain", entries: list["Entry"], *, deep: bool,
                 progress: Callable[[int, int, int], None] | None = None) -> list[Problem]:
    problems: list[Problem] = []
    steps = {e.step for e in entries}
    for e in entries:
        problems += _check_file(chain, e, steps)
    if deep and not problems:
        for i, e in enumerate(entries):
            if progress is not None:
                progress(e.step, i, len(entries))
            try:
                chain._replay(e.step, entries)
            except CkptzipError as err:
                problems.append(Problem(str(err), step=e.step, fix=FIX_FILE))
            except Exception as err:  # a decoder crash on valid checksums is still a problem to report
                problems.append(Problem(f"decode failed: {err.__class__.__name__}: {err}", step=e.step, fix=FIX_FILE))
    return problems


def _check_file(chain: "CheckpointChain", e: "Entry", steps: set[int]) -> list[Problem]:
    where = chain.storage.path(e.file)
    out = []
    if not e.keyframe and e.parent not in steps:
        out.append(Problem(f"needs parent step {e.parent}, which is not in the chain", e.step, where,
                           fix="truncate the chain before this step"))
    try:
        data = chain.storage.read(e.file)
    except FileNotFoundError:
        return out + [Problem("committed checkpoint file is missing", e.step, where, fix=FIX_FILE)]
    damaged = not file_matches(e, data)
    if damaged:
        out.append(Problem("file does not match its index checksum", e.step, where, fix=FIX_FILE))
    try:
        c = decode_container(data, name=where)
        if c.manifest.get("step") != e.step:
            out.append(Problem(f"holds step {c.manifest.get('step')}, index says {e.step}", e.step, where,
                               fix=FIX_FILE))
    except CkptzipError as err:
        out.append(Problem(_strip(str(err), where), e.step, where, fix=FIX_FILE))
    if damaged:
        out += _damaged_records(data, e.step, where)
    return out


def _damaged_records(data: bytes, step: int, where: str) -> list[Problem]:
    """The records of a damaged file whose blobs fail their own checksums."""
    try:
        c = decode_container(data, name=where, verify_blobs=False)
    except (CkptzipError, OSError):
        return []  # the header itself is damaged: the file's problem line already says so
    records = c.manifest.get("records", {})
    owner = {k: n for n, r in records.items() for k in r.get("blobs", {}).values()}
    grouped: dict[str, list[str]] = {}  # a blob that records share (stages group/1, batch/1) -> those records
    for n, r in records.items():
        meta = r.get("meta") if isinstance(r.get("meta"), dict) else {}
        for g in (meta.get("group"), meta.get("batch")):
            if isinstance(g, list) and g and isinstance(g[0], str):
                grouped.setdefault(g[0], []).append(n)
    out = []
    for k, blob in c.blobs.items():
        if not blob_matches(c.manifest["blobs"][k], blob, c.checksum):
            names = [owner[k]] if k in owner else grouped.get(k, [])
            what = f"shared blob {k!r}" if not names else f"record {names[0]!r}" + (
                f" and {len(names) - 1} more record(s) sharing blob {k!r}" if len(names) > 1 else "")
            out.append(Problem(f"{what} {'are' if len(names) > 1 else 'is'} damaged (blob {k} fails its checksum)",
                               step, where, record=names[0] if names else None, fix=FIX_FILE))
    return out


def _strip(msg: str, where: str) -> str:
    """A container error's message without its leading location (the Problem carries it)."""
    return msg[len(where) + 2:] if msg.startswith(where + ": ") else msg
