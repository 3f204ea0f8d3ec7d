"""Files written by ckptzip 0.1 still decode, for every method, to exactly what 0.1 decoded.

tests/data/golden_methods_v1/ holds one small chain per method and variant (a keyframe and two
more saves of a real digits training state: Adam moments, a bf16 layer, a tied weight, exact
scalars) written by the 0.1 tree, plus every tensor 0.1's restore produced
(tests/data/make_golden_methods.py explains the layout; it is never regenerated). Whatever the
refactor, each restored tensor must be bit-identical and each restored skeleton equal.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import assert_same

from ckptzip import CheckpointChain

DATA = Path(__file__).resolve().parent / "data" / "golden_methods_v1"
EXPECTED = json.loads((DATA / "expected.json").read_text())
INPUTS = json.loads((DATA / "inputs.json").read_text())


@pytest.fixture(scope="module")
def values():
    from safetensors.torch import load_file

    return load_file(DATA / "values.safetensors")


def test_every_method_has_a_golden_chain():
    import ckptzip

    assert {c["method"] for c in EXPECTED.values()} == set(ckptzip.available_methods())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_v01_chain_decodes_as_v01_did(name, values):
    exp = EXPECTED[name]
    chain = CheckpointChain(DATA / name)
    assert [str(s) for s in chain.steps()] == list(exp["steps"])
    for step, want in exp["steps"].items():
        r = chain.restore(int(step))
        assert r.manifest["method"] == f"{exp['method']}/1" and r.manifest["keyframe"] is want["keyframe"]
        skeleton = INPUTS[step]["skeleton"] if want["skeleton"] == "input" else want["skeleton"]
        assert r.flat.skeleton == skeleton, f"{name} step {step}: skeleton differs from 0.1's restore"
        assert list(r.flat.tensors) == list(want["tensors"]), f"{name} step {step}"
        for rec, key in want["tensors"].items():
            assert_same(values[key], r.flat.tensors[rec], f"{name} step {step} {rec}")
