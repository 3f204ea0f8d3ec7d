"""Source layout lightning/1: Lightning's checkpoint dict <-> normalised state, pointer files, bad pointers."""
from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest
import torch

from ckptzip import ingest
from ckptzip.errors import ConfigError, CorruptCheckpointError, FormatVersionError
from ckptzip.ingest import lightning as layout
from ckptzip.state import flatten_state, unflatten_state
from helpers import assert_same

DATA = pathlib.Path(__file__).parent / "data"


def fixtures():
    spec = importlib.util.spec_from_file_location("make_ingest_v1", DATA / "make_ingest_v1.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def roundtrip(state: dict):
    flat = flatten_state(state)
    return unflatten_state(flat.skeleton, {k: v.clone() for k, v in flat.tensors.items()})


@pytest.mark.parametrize("n_optimizers", [1, 2])
def test_checkpoint_dict_roundtrip(tmp_path, n_optimizers):
    name, ckpt = fixtures().lightning_checkpoints(n_optimizers)[1]
    state = layout.normalise(ckpt, name)
    lay = state[ingest.LAYOUT_KEY]
    assert lay["format"] == ingest.LIGHTNING_LAYOUT and lay["name"] == name
    assert state["model"] is ckpt["state_dict"] and "pytorch-lightning_version" in state["extra"]
    roles = {r.role for r in flatten_state(state).records.values()}
    if n_optimizers == 1:
        assert state["optimizer"] is ckpt["optimizer_states"][0] and {"weight", "exp_avg", "exp_avg_sq"} <= roles
    else:  # several optimizers: no single one to give roles to; all kept in extra
        assert "optimizer" not in state and len(state["extra"]["optimizer_states"]) == 2
    back = layout.to_checkpoint(roundtrip(state), "x")
    assert_same(back, ckpt, strict_types=True)  # the OrderedDict state_dict and its _metadata too
    assert dict(back["state_dict"]._metadata) == dict(ckpt["state_dict"]._metadata)
    assert ingest.write_restored(roundtrip(state), tmp_path / "x.ckpt") == "pt"  # a file plain Lightning loads
    assert_same(torch.load(tmp_path / "x.ckpt", weights_only=True), ckpt, strict_types=True)


def test_pointer_files(tmp_path):
    p = tmp_path / "epoch=0-step=10.ckpt"
    layout.write_pointer(p, "ckptzip-chain", 10)
    assert json.loads(p.read_text()) == {"ckptzip": 1, "chain": "ckptzip-chain", "step": 10}
    assert layout.read_pointer(p) == layout.Pointer("ckptzip-chain", 10) and not list(tmp_path.glob("*.tmp"))
    assert ingest.LAYOUTS[ingest.LIGHTNING_LAYOUT].detect(p)
    with pytest.raises(ConfigError, match=r"is a ckptzip pointer to step 10 .*`ckptzip restore "):
        ingest.find_sources([p])  # compressing a pointer would store 40 bytes of JSON as a checkpoint
    assert p.read_text() == '{"ckptzip": 1, "chain": "ckptzip-chain", "step": 10}'


@pytest.mark.parametrize("content,err,words", [
    ('{"ckptzip": 2, "chain": "c", "step": 1}', FormatVersionError, "upgrade ckptzip"),
    ('{"ckptzip": 1, "chain": "c", "step": "ten"}', CorruptCheckpointError, "damaged ckptzip pointer"),
    ('{"ckptzip": 1, "chain": "../elsewhere", "step": 1}', CorruptCheckpointError, "damaged ckptzip pointer"),
    ('{"ckptzip": 1, "chain": "c"', CorruptCheckpointError, "not a ckptzip pointer"),
    (b"PK\x03\x04 a torch.save zip", CorruptCheckpointError, "not a ckptzip pointer"),
])
def test_bad_pointers(tmp_path, content, err, words):
    p = tmp_path / "x.ckpt"
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(err, match=words) as e:
        layout.read_pointer(p)
    assert str(p) in str(e.value) and "\n" not in str(e.value)


def test_state_not_from_lightning_is_refused():
    state = ingest.torchfile.normalise({"model": {"w": torch.ones(2)}}, "x.pt")
    with pytest.raises(CorruptCheckpointError, match="not saved by CompressedCheckpointIO"):
        layout.to_checkpoint(state, "p.ckpt")
    with pytest.raises(CorruptCheckpointError, match="not saved by CompressedCheckpointIO"):
        layout.to_checkpoint({"model": {"w": torch.ones(2)}}, "p.ckpt")
