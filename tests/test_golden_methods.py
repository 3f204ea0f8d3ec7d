"""Golden chains of every method: files written by ckptzip 0.1 still decode to exactly what 0.1
decoded, and today's writer still writes the bytes docs/FORMAT.md describes.

tests/data/golden_methods_v1/ holds one small chain per method and variant (a keyframe and two
more saves of a real digits training state: Adam moments, a bf16 layer, a tied weight, exact
scalars) written by the 0.1 tree, plus every tensor 0.1's restore produced; golden_methods_v2/
holds the chains whose bytes today's writer changed (tests/data/make_golden_methods.py explains
both). Whatever the refactor, each restored tensor must be bit-identical and each restored
skeleton equal, and re-encoding the inputs must reproduce every container byte for byte.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from helpers import assert_same

from ckptzip import CheckpointChain

DATA = Path(__file__).resolve().parent / "data"
V1, V2 = DATA / "golden_methods_v1", DATA / "golden_methods_v2"
V2_ANS = DATA / "golden_methods_v2_ans"  # v2 chains as written before rans/1 replaced ans/1 (frozen)
V3 = DATA / "golden_methods_v3"  # v2 chains in format version 3, a safetensors tensor a blob (frozen)
V2_BLOBS = DATA / "golden_methods_v2_blobs"  # v2 chains before batch/1: a quantized record's own blobs (frozen)
INPUTS = json.loads((V1 / "inputs.json").read_text())
EXPECTED = {"v1": json.loads((V1 / "expected.json").read_text()), "v2": json.loads((V2 / "expected.json").read_text())}
_spec = importlib.util.spec_from_file_location("make_golden_methods", DATA / "make_golden_methods.py")
golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(golden)
REGENERATE = "if the format change is deliberate: python tests/data/make_golden_methods.py --current, and FORMAT.md"


@pytest.fixture(scope="module")
def values():
    return golden.all_values()


def test_every_method_has_a_golden_chain():
    import ckptzip

    assert {c["method"] for c in EXPECTED["v1"].values()} == set(ckptzip.available_methods())


def _restores_as_expected(folder: Path, name: str, exp: dict, values: dict) -> None:
    chain = CheckpointChain(folder / name)
    assert [str(s) for s in chain.steps()] == list(exp["steps"])
    for step, want in exp["steps"].items():
        r = chain.restore(int(step))
        assert r.manifest["method"].partition("/")[0] == exp["method"] and r.manifest["keyframe"] is want["keyframe"]
        skeleton = INPUTS[step]["skeleton"] if want["skeleton"] == "input" else want["skeleton"]
        assert r.flat.skeleton == skeleton, f"{name} step {step}: skeleton differs from the golden restore"
        assert sorted(r.flat.tensors) == sorted(want["tensors"]), f"{name} step {step}"
        for rec, key in want["tensors"].items():
            assert_same(values[key], r.flat.tensors[rec], f"{name} step {step} {rec}")


@pytest.mark.parametrize("name", sorted(EXPECTED["v1"]))
def test_v01_chain_decodes_as_v01_did(name, values):
    exp = EXPECTED["v1"][name]
    assert all(e.method == f"{exp['method']}/1" for e in CheckpointChain(V1 / name).entries())
    _restores_as_expected(V1, name, exp, values)


@pytest.mark.parametrize("name", sorted(EXPECTED["v2"]))
def test_current_chain_decodes_as_written(name, values):
    _restores_as_expected(V2, name, EXPECTED["v2"][name], values)


@pytest.mark.parametrize("name", sorted(p.name for p in V2_ANS.iterdir()))
def test_ans_coded_chain_decodes_as_its_rans_successor(name, values):
    """The same chains coded with ans/1 (grid moments included) restore what v2's rans/1 files do."""
    _restores_as_expected(V2_ANS, name, EXPECTED["v2"][name], values)


@pytest.mark.parametrize("name", sorted(p.name for p in V2_BLOBS.iterdir()))
def test_unbatched_chain_decodes_as_its_batched_successor(name, values):
    """Two v2 chains as written before batch/1 (each quantized record's parts in blobs of its own)
    restore what today's files of the same chains, whose small records share one blob, do."""
    old = [CheckpointChain(V2_BLOBS / name).manifest(s) for s in CheckpointChain(V2_BLOBS / name).steps()]
    new = [CheckpointChain(V2 / name).manifest(s) for s in CheckpointChain(V2 / name).steps()]
    assert not any("batch" in m["blobs"] for m in old) and all("batch" in m["blobs"] for m in new)
    _restores_as_expected(V2_BLOBS, name, EXPECTED["v2"][name], values)


@pytest.mark.parametrize("name", sorted(p.name for p in V3.iterdir()))
def test_format_3_chain_decodes_as_its_format_4_successor(name, values):
    """Four v2 chains as written before format version 4 put every blob in one safetensors tensor
    restore what today's files of the same chains do."""
    old, new = CheckpointChain(V3 / name), CheckpointChain(V2 / name)
    assert old.steps() == new.steps()
    assert {old.manifest(s)["format_version"] for s in old.steps()} == {3}
    assert {new.manifest(s)["format_version"] for s in new.steps()} == {4}
    _restores_as_expected(V3, name, EXPECTED["v2"][name], values)


@pytest.mark.parametrize("name", sorted(n for n, (_, _, search) in {**golden.CHAINS, **golden.CHAINS_CURRENT}.items()
                                        if not search))
def test_current_writer_reproduces_the_golden_bytes(name, tmp_path, values):
    """Re-encoding the golden inputs gives the golden containers, byte for byte (v2's where today's
    format differs from 0.1's, else 0.1's own files)."""
    pinned = json.loads((V2 / "versions.json").read_text())["zstd"]
    if golden.zstd_version() != pinned:
        pytest.skip(f"golden bytes were written with zstd {pinned}, this is {golden.zstd_version()}")
    golden.encode_chain(name, tmp_path / name, INPUTS, values)
    ref = V2 / name if (V2 / name).exists() else V1 / name
    files = sorted(ref.glob("*.ckz"))
    assert [f.name for f in files] == sorted(f.name for f in (tmp_path / name).glob("*.ckz"))
    for f in files:
        assert (tmp_path / name / f.name).read_bytes() == f.read_bytes(), f"{name}/{f.name} changed; {REGENERATE}"
