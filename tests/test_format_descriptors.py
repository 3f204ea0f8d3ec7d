"""docs/FORMAT.md's "Record pipelines by method" table matches what every method writes.

DOCUMENTED is a copy of that table (pattern notation: ``x?`` optional, ``{a|b}/1`` one of). The
tests check that the copy equals the table in the doc, that every available method is in it, and
that two real saves per method (a tiny digits run) write only documented pipelines, delta-only
descriptors only in delta files, and the blob parts FORMAT.md specifies. Edit the doc and this
dict together.
"""
from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
import torch

import ckptzip
from ckptzip import CheckpointChain
from ckptzip.codec import stages as S
from ckptzip.format import decode_container

DOC = Path(__file__).resolve().parents[1] / "docs" / "FORMAT.md"

_EXACT_V01 = ["exact/1, bytegroup/1", "exact/1, raw/1"]
_EXACT = _EXACT_V01[:1] + ["exact/1, bytegroup/2"] + _EXACT_V01[1:]  # /2: a tensor of segments (FORMAT.md 5)
_EXACT_Q = _EXACT + ["exact/1, group/1, bytegroup/1"]  # the quantizing methods group small exact records (M.1)
_EXACT_DELTAS = _EXACT_Q + ["exact/1, same/1"]  # the quantizing template's delta files (M.1)
_EXCP_CODES = ["excp-codes/2, {ans|huffman}/1", "excp-codes/2, bitpack/1, {xz|zstd-frame}/1"]
_B = ", batch/1?"  # a small quantized record's data in the shared blob (M.2)
_GRID = ["moment-grid/1, cyclic-delta/1?, tuple/1?, {ans|rans}/1" + _B,  # M.10
         "moment-direction/1, tuple/1?, {ans|rans}/1" + _B, "moment-direction/1"]
_GRID_KEYFRAMES = ["moment-grid/1, tuple/1?, {ans|rans}/1" + _B, "moment-direction/1, tuple/1?, {ans|rans}/1" + _B,
                   "moment-direction/1"]
DOCUMENTED: dict[str, list[str]] = {
    "lossless": [p + v for p in ("lossless/1, ", "lossless/1, xor/1, ", "lossless/1, xor/1?, group/1, ")
                 for v in ("bytegroup/1", "bytegroup/2")],  # /2: a blob with sparse planes
    "dynaquant": _EXACT_DELTAS + [p + _B for p in (
        "dynaquant/1, rle/1?, {huffman|ans|rans|zstd-ints}/1",
        "dynaquant/1, cyclic-delta/1, rearrange/1?, rle/1?, {huffman|ans|rans|zstd-ints}/1",
        "dynaquant/1, residual/1, rle/1?, {huffman|ans|rans|zstd-ints}/1",
        "dynaquant/1, {residual|cyclic-delta}/1?, tuple/1, {ans|rans}/1")] + _GRID,
    "qd": _EXACT_DELTAS + [p + _B for p in ("qd/1, huffman/1", "qd/1, cyclic-delta/1, huffman/1",
                                            "qd/1, residual/1, huffman/1")] + _GRID,
    "cnr": _EXACT_Q + ["cnr/1, huffman/1" + _B] + _GRID_KEYFRAMES,
    "gobo": _EXACT_Q + ["gobo/1, huffman/1" + _B] + _GRID_KEYFRAMES,
    "bitsnap": _EXACT + ["bitsnap/1, bitmask/1", "bitsnap/1, bitmask/1, bytegroup/1", "bitsnap/1, bitmask/1, bytegroup/2",
                         "bitsnap/1, bitmask/1, zstd-frame/1", "bitsnap/1, cluster8/1",
                         "bitsnap/1, cluster8/1, zero-if/1"],
    "bitsnap-lossless": _EXACT + ["bitsnap/1, bitmask/1", "bitsnap/1, bitmask/1, bytegroup/1",
                                  "bitsnap/1, bitmask/1, bytegroup/2", "bitsnap/1, bitmask/1, zstd-frame/1"],
    "excp": ["exact/1, span/1", "excp-residual/1, excp-tensor/2, span/1", "joint/1", "excp-base/1"],
    "excp-fixed": _EXACT + ["exact/1, span/1"] + [f"{first}{tail}" for first in
                                                   ("excp-residual/1, excp-tensor/2", "kmeans-nonzero/1", "joint/1")
                                                   for tail in ["", *(", " + c for c in _EXCP_CODES)]],
}
# the same table for the files ckptzip 0.1 wrote (FORMAT.md "Pipelines of files written by ckptzip 0.1")
_V1_CODERS = "{ans|huffman|xz|zstd}/1"
DOCUMENTED_V01: dict[str, list[str]] = {
    **{m: [p.removesuffix(_B) for p in DOCUMENTED[m] if not p.startswith("moment-") and "residual/1" not in p
           and "same/1" not in p and ", group/1" not in p and "bytegroup/2" not in p]
       for m in ("qd", "cnr", "gobo")},
    "lossless": ["lossless/1, bytegroup/1", "lossless/1, xor/1, bytegroup/1"],
    "dynaquant": _EXACT_V01 + ["dynaquant/1, rle/1?, {huffman|ans|zstd}/1",
                               "dynaquant/1, cyclic-delta/1, rearrange/1?, rle/1?, {huffman|ans|zstd}/1"],
    "bitsnap": _EXACT_V01 + ["bitsnap/1, bitmask/1", "bitsnap/1, bitmask/1, bytegroup/1",
                             "bitsnap/1, bitmask/1, zstd/1", "bitsnap/1, cluster8/1", "bitsnap/1, cluster8/1, zero-if/1"],
    "bitsnap-lossless": _EXACT_V01 + ["bitsnap/1, bitmask/1", "bitsnap/1, bitmask/1, bytegroup/1",
                                      "bitsnap/1, bitmask/1, zstd/1"],
    "excp": ["raw/1, xz/1", "excp-residual/1, excp-tensor/1, xz/1", "excp-tensor/1, xz/1", "excp-base/1"],
    "excp-fixed": _EXACT_V01 + ["raw/1, {xz|zstd}/1", "excp-residual/1, excp-tensor/1",
                                f"excp-residual/1, excp-tensor/1, excp-codes/1, {_V1_CODERS}", "kmeans-nonzero/1",
                                f"kmeans-nonzero/1, excp-codes/1, {_V1_CODERS}", "excp-tensor/1",
                                f"excp-tensor/1, excp-codes/1, {_V1_CODERS}"],
}
GOLDEN_V01 = Path(__file__).resolve().parent / "data" / "golden_methods_v1"
# descriptors that need a parent: never in a keyframe file (the sentence above the table)
DELTA_ONLY = ["xor/1", "cyclic-delta/1", "rearrange/1", "residual/1", "bitmask/1", "excp-residual/1", "excp-base/1",
              "same/1"]
SHARED_BLOBS = {"excp": {"payload"}, "excp-fixed": {"payload", "codes"},  # FORMAT.md 1.2
                # section 6 and M.1: the digits state's small float32 records; M.2: its small quantized ones
                "lossless": {"group.4f"}, **{m: {"group.4f", "batch"} for m in ("dynaquant", "qd", "cnr", "gobo")}}
QUANTIZED = {"dynaquant/1", "qd/1", "cnr/1", "gobo/1"}                      # M.2 records


def expand(pattern: str) -> set[tuple[str, ...]]:
    """Every concrete pipeline a pattern stands for."""
    choices = []
    for tok in pattern.split(", "):
        optional = tok.endswith("?")
        tok = tok.removesuffix("?")
        alt = re.fullmatch(r"\{(.+)\}(/\d+)", tok)
        opts = [a + alt.group(2) for a in alt.group(1).split("|")] if alt else [tok]
        choices.append(opts + [None] if optional else opts)
    return {tuple(t for t in combo if t is not None) for combo in itertools.product(*choices)}


def doc_table(heading: str = "Record pipelines by method", column: int = 1) -> dict[str, list[str]]:
    """A table of FORMAT.md under ``### <heading>``: first column -> the backquoted items of ``column``."""
    text = DOC.read_text(encoding="utf-8")
    section = text.split(f"### {heading}", 1)[1].split("\n### ", 1)[0]
    out = {}
    for line in section.splitlines():
        cells = re.split(r"(?<!\\)\|", line)[1:-1]
        m = re.fullmatch(r" `([a-z0-9/-]+)` ", cells[0]) if len(cells) > column else None
        if m:
            out[m.group(1)] = [p.replace("\\|", "|") for p in re.findall(r"`((?:[^`\\]|\\.)+)`", cells[column])]
    return out


def expected_parts(record: dict) -> set[str]:
    """The blob parts FORMAT.md gives a record (M.1, M.2, M.6-M.7, bitsnap, excp)."""
    pipe, meta = record["pipeline"], record["meta"]
    if pipe[-1] == "span/1" or pipe[0] == "joint/1":
        return set()  # bytes in the shared payload
    if pipe[0] in ("exact/1", "lossless/1"):
        return set() if "group/1" in pipe else {"data"}  # a grouped record's words: in its group blob
    if pipe[-1] == "batch/1":
        return set()  # its packed data in the shared blob (M.2)
    if pipe[0] in QUANTIZED:  # packed since batch/1
        return {"data"} if "parts" in meta else {"codes", "codebook"} | {f"side.{k}" for k in meta["side"]}
    if pipe[0] in ("moment-grid/1", "moment-direction/1"):  # M.10: the M.2 parts packed in one blob
        return set() if meta.get("zero") else {"data"}
    if pipe[:2] == ["bitsnap/1", "cluster8/1"]:
        return {"labels", "values", "scale", "min"}
    if pipe[:2] == ["bitsnap/1", "bitmask/1"]:
        if meta["kind"] == "same":
            return set()
        if pipe[2:] in (["bytegroup/1"], ["bytegroup/2"]):
            return {"values", "mask"} if meta["kind"] == "bitmask" else {"values"}
        return {"payload"}
    return set()  # excp / excp-fixed records point into the shared blobs


@pytest.fixture(scope="module")
def snapshots():
    from ckptzip.demo.workloads import digits_run

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is faster on a shared box
    try:
        with torch.random.fork_rng(devices=[]):  # digits_run seeds the global RNG
            return digits_run(n_checkpoints=2, steps_between=5, hidden=64)[2]
    finally:
        torch.set_num_threads(threads)


def test_table_in_doc_matches_this_copy():
    assert doc_table() == DOCUMENTED
    text = " ".join(DOC.read_text(encoding="utf-8").split())
    assert ("appears only in delta files (a keyframe file never holds one): "
            + ", ".join(f"`{d}`" for d in DELTA_ONLY) + ".") in text


def test_every_available_method_is_documented():
    assert set(ckptzip.available_methods()) == set(DOCUMENTED) == set(DOCUMENTED_V01)


def test_v01_table_in_doc_matches_this_copy():
    assert doc_table("Pipelines of files written by ckptzip 0.1") == DOCUMENTED_V01


def test_registry_table_in_doc_matches_the_registry():
    """Every descriptor is defined once in codec/stages.py and listed in FORMAT.md, legacy ones as such."""
    doc = doc_table("Stage registry")
    assert set(doc) == set(S.STAGES)
    for d, stage in S.STAGES.items():
        assert doc[d] == [f"{m}" for m in stage.legacy_in], d  # "all" has no backquoted method
    written = {d for ps in DOCUMENTED.values() for p in ps for pipe in expand(p) for d in pipe}
    assert written == {d for d, s in S.STAGES.items() if not s.legacy_in}  # each current stage is written
    read_v01 = {d for ps in DOCUMENTED_V01.values() for p in ps for pipe in expand(p) for d in pipe}
    assert {d for d, s in S.STAGES.items() if s.legacy_in} <= read_v01


@pytest.mark.parametrize("method", sorted(DOCUMENTED_V01))
def test_v01_golden_files_match_the_v01_table(method):
    """The golden files ckptzip 0.1 wrote (tests/test_golden_methods.py) hold only 0.1's documented pipelines."""
    allowed = set().union(*(expand(p) for p in DOCUMENTED_V01[method]))
    seen = set()
    for chain in GOLDEN_V01.iterdir():
        for f in sorted(chain.glob("*.ckz")):
            m = decode_container(f.read_bytes(), name=str(f)).manifest
            if m["method"] != f"{method}/1":
                continue
            for name, r in m["records"].items():
                assert tuple(r["pipeline"]) in allowed, f"{f}: {name}: {r['pipeline']}"
                seen.add(tuple(r["pipeline"]))
    assert seen, f"no golden 0.1 file of {method}"


def test_expand():
    assert expand("a/1, b/1?, {x|y}/1") == {("a/1", "x/1"), ("a/1", "y/1"), ("a/1", "b/1", "x/1"),
                                             ("a/1", "b/1", "y/1")}


@pytest.mark.parametrize("method", ckptzip.available_methods())
def test_written_records_match_the_doc(method, snapshots, tmp_path):
    torch.set_num_threads(1)  # conftest restores the count
    allowed = set().union(*(expand(p) for p in DOCUMENTED[method]))
    makes_deltas = any(d in p for p in DOCUMENTED[method] for d in DELTA_ONLY)
    chain = CheckpointChain(tmp_path / method, method)
    for s in snapshots:
        chain.save({"model": s.model, "optimizer": s.optimizer}, s.step)
    entries = chain.entries()
    assert len(entries) == 2 and entries[0].keyframe
    assert entries[1].keyframe is not makes_deltas  # delta-capable methods write a delta at save 2
    for e in entries:
        m = decode_container(chain.storage.read(e.file), name=e.file).manifest
        assert m["keyframe"] is e.keyframe and (m["parent_step"] is None) is e.keyframe
        shared = {k for k in m["blobs"] if not k[0].isdigit()}
        assert shared == SHARED_BLOBS.get(method, set()), e.file
        seen = set()
        for name, r in m["records"].items():
            pipe = tuple(r["pipeline"])
            assert pipe in allowed, f"{method} {e.file} {name}: {list(pipe)} is not in docs/FORMAT.md"
            seen.update(pipe)
            assert set(r["blobs"]) == expected_parts(r), f"{method} {name}: blobs {sorted(r['blobs'])}"
            if pipe[0] in QUANTIZED:  # M.2: meta.delta mirrors the cyclic-delta stage
                assert isinstance(r["meta"]["n_levels"], int) and isinstance(r["meta"]["side"], dict)
                assert r["meta"]["delta"] is ("cyclic-delta/1" in pipe), name
        delta_only = seen & set(DELTA_ONLY)
        if e.keyframe:
            assert not delta_only, f"{method} keyframe {e.file} holds {sorted(delta_only)}"
        else:
            assert delta_only, f"{method} delta {e.file} holds no delta-only descriptor"
