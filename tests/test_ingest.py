"""Ingest: torch.save files and Trainer folders -> normalised states -> the same files again; bad input."""
from __future__ import annotations

import collections
import json
import pickle
import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from ckptzip import ingest
from ckptzip.errors import ConfigError, CorruptCheckpointError, FormatVersionError, UnsafeInputError
from ckptzip.ingest import torchfile
from ckptzip.state import flatten_state, unflatten_state
from helpers import assert_same


@dataclass
class CustomArgs:  # stands in for transformers.TrainingArguments in training_args.bin
    lr: float = 1e-3


def roundtrip(state: dict):
    """What a restore hands back: the state through flatten/unflatten (the chain's exact path)."""
    flat = flatten_state(state)
    return unflatten_state(flat.skeleton, {k: v.clone() for k, v in flat.tensors.items()})


@pytest.fixture(scope="module")
def trained(digits_snapshots):
    model, opt, snaps, _ = digits_snapshots
    return model, snaps[-1]


def make_trainer_folder(root, model_sd, opt_sd, step, *, shards=False, name=None):
    d = root / (name or f"checkpoint-{step}")
    d.mkdir(parents=True)
    if shards:
        keys = list(model_sd)
        half = len(keys) // 2
        parts = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
        for fname, ks in parts.items():
            save_file({k: model_sd[k].contiguous() for k in ks}, str(d / fname), metadata={"format": "pt"})
        (d / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {k: f for f, ks in parts.items() for k in ks}}))
    else:
        save_file({k: v.contiguous() for k, v in model_sd.items()}, str(d / "model.safetensors"),
                  metadata={"format": "pt"})
    torch.save(opt_sd, d / "optimizer.pt")
    torch.save({"base_lrs": [1e-3], "last_epoch": step, "_step_count": step + 1}, d / "scheduler.pt")
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()},
               d / "rng_state.pth")
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": [
        {"loss": 2.0 - i / 10, "step": i} for i in range(step)]}, indent=2))
    (d / "training_args.bin").write_bytes(pickle.dumps(CustomArgs()))
    (d / "config.json").write_text('{"hidden": 128}\n')
    (d / "sub").mkdir()
    (d / "sub" / "notes.txt").write_bytes(b"x" * 3000)
    (d / "empty_dir").mkdir()
    return d


# --- torch.save files -------------------------------------------------------------------------

@pytest.mark.parametrize("shape", ["plain", "bare", "lightning", "nested_extra", "ordered"])
def test_torch_file_roundtrip_keeps_structure(tmp_path, trained, shape):
    model, snap = trained
    sd = model.state_dict()  # an OrderedDict with _metadata
    if shape == "plain":
        obj = {"model": snap.model, "optimizer": snap.optimizer, "step": snap.step, "note": "x"}
    elif shape == "bare":
        obj = sd
    elif shape == "lightning":
        obj = {"state_dict": snap.model, "optimizer_states": [snap.optimizer], "global_step": snap.step,
               "loops": {"fit": {"epoch": 3}}, "rng": np.random.get_state()}
    elif shape == "nested_extra":
        obj = {"module": snap.model, "optim": snap.optimizer, "ema": {"decay": 0.99, "w": torch.ones(3)},
               "iteration": torch.tensor(snap.step)}
    else:
        obj = collections.OrderedDict(model_state_dict=sd, optimizer_state_dict=snap.optimizer, epoch=1)
    path = tmp_path / "ck_7.pt"
    torch.save(obj, path)
    (src,) = ingest.find_sources([path])
    state = ingest.load_source(src)
    lay = state[ingest.LAYOUT_KEY]
    assert isinstance(state["model"], dict) and len(state["model"]) == len(snap.model)
    if shape != "bare":
        assert "optimizer" in state and state["optimizer"]["param_groups"] == snap.optimizer["param_groups"]
    flat = flatten_state(state)
    roles = {r.role for r in flat.records.values()}
    assert "weight" in roles and (shape == "bare" or {"exp_avg", "exp_avg_sq"} <= roles)
    back = ingest.rebuild(roundtrip(state))
    assert_same(back, torch.load(path, weights_only=False), strict_types=True)
    if shape in ("bare", "ordered"):
        m = back if shape == "bare" else back["model_state_dict"]
        assert dict(m._metadata) == {k: dict(v) for k, v in sd._metadata.items()}
    expected_step = {"plain": snap.step, "lightning": snap.step, "nested_extra": snap.step, "bare": 7, "ordered": 7}
    assert src.step == expected_step[shape]
    assert lay["format"] == src.layout == ingest.TORCH_LAYOUT


def test_step_sources_and_order(tmp_path, trained):
    _, snap = trained
    t = {"w": torch.zeros(2)}
    torch.save({"model": t, "step": 300}, tmp_path / "a.pt")         # entry wins over the name
    torch.save({"model": t}, tmp_path / "run_step20.pt")              # last number in the name
    torch.save({"model": t}, tmp_path / "final.pt")                   # argument order
    srcs = ingest.find_sources([tmp_path / "a.pt", tmp_path / "run_step20.pt", tmp_path / "final.pt"])
    assert [(s.path.name, s.step, s.step_from) for s in srcs] == [
        ("final.pt", 2, "order"), ("run_step20.pt", 20, "name"), ("a.pt", 300, "entry:step")]
    torch.save({"model": t, "global_step": 20}, tmp_path / "dup.pt")
    with pytest.raises(ConfigError, match="both have step 20"):
        ingest.find_sources([tmp_path / "run_step20.pt", tmp_path / "dup.pt"])


def test_bad_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        ingest.find_sources([tmp_path / "missing.pt"])
    torch.save({"a": torch.ones(2), "args": CustomArgs()}, tmp_path / "custom.pt")
    with pytest.raises(UnsafeInputError, match="needs arbitrary code to load"):
        ingest.find_sources([tmp_path / "custom.pt"])
    (tmp_path / "text.pt").write_text("hello\n")
    with pytest.raises(CorruptCheckpointError, match="not a checkpoint"):
        ingest.find_sources([tmp_path / "text.pt"])
    torch.save({"lr": 0.1}, tmp_path / "notensor.pt")
    with pytest.raises(CorruptCheckpointError, match="no tensors"):
        ingest.find_sources([tmp_path / "notensor.pt"])
    torch.save([torch.ones(1)], tmp_path / "list.pt")
    with pytest.raises(CorruptCheckpointError, match="expected a dict"):
        ingest.find_sources([tmp_path / "list.pt"])
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(CorruptCheckpointError, match="not a checkpoint"):
        ingest.find_sources([tmp_path / "emptydir"])


# --- Trainer folders -------------------------------------------------------------------------

@pytest.mark.parametrize("shards", [False, True])
def test_trainer_folder_roundtrip_byte_identical(tmp_path, trained, shards):
    _, snap = trained
    src_dir = make_trainer_folder(tmp_path / "run", snap.model, snap.optimizer, 30, shards=shards)
    (src,) = ingest.find_sources([tmp_path / "run"])  # a folder of checkpoint-* folders
    assert (src.path, src.layout, src.step, src.step_from) == (src_dir, ingest.TRAINER_LAYOUT, 30, "entry:global_step")
    state = ingest.load_source(src)
    files = state["extra"]["files"]
    assert isinstance(files["config.json"], bytes)                      # small: inline bytes
    assert isinstance(files["trainer_state.json"], torch.Tensor)        # large: a uint8 record
    assert "optimizer.pt" not in files and not any(f.endswith(".safetensors") for f in files)

    out = tmp_path / "restored"
    assert ingest.write_restored(roundtrip(state), out) == "folder"
    names = sorted(p.relative_to(src_dir).as_posix() for p in src_dir.rglob("*"))
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == names
    for rel in names:
        if (src_dir / rel).is_file():
            assert (out / rel).read_bytes() == (src_dir / rel).read_bytes(), rel
    assert not list(tmp_path.glob(".*.tmp"))

    flat = flatten_state(state)
    assert {r.role for r in flat.records.values()} >= {"weight", "exp_avg", "exp_avg_sq"}
    st = ingest.write_restored(roundtrip(state), tmp_path / "w.safetensors")
    assert st == "safetensors"
    from safetensors.torch import load_file
    w = load_file(str(tmp_path / "w.safetensors"))
    assert set(w) == set(snap.model) and all(torch.equal(w[k], snap.model[k]) for k in w)


def test_trainer_step_from_state_not_name(tmp_path, trained):
    _, snap = trained
    make_trainer_folder(tmp_path, snap.model, snap.optimizer, 7, name="ckpt-a")
    (src,) = ingest.find_sources([tmp_path / "ckpt-a"])
    assert src.step == 7 and src.layout == ingest.TRAINER_LAYOUT


# --- outputs -------------------------------------------------------------------------------

def test_check_output(tmp_path):
    (tmp_path / "f.pt").write_bytes(b"x")
    with pytest.raises(FileExistsError, match="--force"):
        ingest.check_output(tmp_path / "f.pt")
    assert ingest.check_output(tmp_path / "f.pt", force=True) == tmp_path / "f.pt"
    with pytest.raises(NotADirectoryError, match="is a file"):
        ingest.check_output(tmp_path / "f.pt" / "x.pt")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ingest.check_output(tmp_path / "nope" / "x.pt")
    assert [ingest.output_kind(p) for p in ("a.pt", "b.safetensors", "c", "d.ckpt")] == [
        "pt", "safetensors", "folder", "pt"]


def test_folder_output_needs_trainer_layout(tmp_path):
    state = torchfile.normalise({"model": {"w": torch.ones(2)}}, "x.pt")
    with pytest.raises(ConfigError, match="not ingested from a Trainer folder"):
        ingest.write_restored(state, tmp_path / "outdir")
    with pytest.raises(ConfigError, match="no model state dict"):
        ingest.model_weights({"optimizer": {"state": {}, "param_groups": []}})


# --- bad input: one line naming the file and the fix, the source untouched -----------------------

def _snapshot(root):
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _fails(paths, err, words, root):
    before = _snapshot(root)
    with pytest.raises(err) as e:
        ingest.find_sources(paths)
    msg = str(e.value)
    assert "\n" not in msg and words in msg and any(p.name in msg for p in paths), msg
    assert _snapshot(root) == before  # nothing written, nothing changed


def test_corrupt_truncated_and_foreign_files(tmp_path, trained):
    _, snap = trained
    good = tmp_path / "good_5.pt"
    torch.save({"model": snap.model, "optimizer": snap.optimizer}, good)
    data = good.read_bytes()
    tensor_at = data.index(snap.model["fc1.weight"].numpy().tobytes()[:64])
    bad = {"trunc_1.pt": data[: len(data) // 2], "tail_1.pt": data[:-30], "empty_1.pt": b"",
           "npy_1.pt": b"\x93NUMPY\x01\x00" + b"x" * 100,
           "flip_1.pt": data[:tensor_at] + bytes([data[tensor_at] ^ 1]) + data[tensor_at + 1:]}
    for name, b in bad.items():
        (tmp_path / name).write_bytes(b)
        words = "fails its CRC" if name.startswith("flip") else "not a checkpoint"
        _fails([tmp_path / name], CorruptCheckpointError, words, tmp_path)
    _fails([good, tmp_path / "trunc_1.pt"], CorruptCheckpointError, "truncated", tmp_path)  # one bad of two


def test_damaged_trainer_folders(tmp_path, trained):
    _, snap = trained
    d = make_trainer_folder(tmp_path, snap.model, snap.optimizer, 30, shards=True)
    shard = d / "model-00002-of-00002.safetensors"
    full = shard.read_bytes()
    shard.write_bytes(full[:100])
    _fails([d], CorruptCheckpointError, "not a readable safetensors file", tmp_path)
    shard.write_bytes(full)
    save_file({k: snap.model[k].contiguous() for k in list(snap.model)[:1]}, str(d / "model-00001-of-00002.safetensors"))
    save_file({k: snap.model[k].contiguous() for k in snap.model}, str(shard))
    _fails([d], CorruptCheckpointError, "is in two weight files", tmp_path)
    save_file({k: snap.model[k].contiguous() for k in list(snap.model)[1:]}, str(shard))
    (d / "trainer_state.json").write_text('{"global_step": 3')
    _fails([d], CorruptCheckpointError, "not valid JSON", tmp_path)
    (d / "trainer_state.json").write_text('{"global_step": 30}')
    torch.save({"state": {}, "param_groups": [], "args": CustomArgs()}, d / "optimizer.pt")
    _fails([d], UnsafeInputError, "needs arbitrary code to load", tmp_path)


def test_unknown_layout_version_and_failed_write_keep_outputs(tmp_path):
    state = torchfile.normalise({"model": {"w": torch.ones(2)}, "step": 1}, "x.pt")
    state[ingest.LAYOUT_KEY]["format"] = "torch-file/9"  # written by a newer ckptzip
    with pytest.raises(FormatVersionError, match="torch-file/9.*upgrade ckptzip"):
        ingest.write_restored(state, tmp_path / "x.pt")
    assert list(tmp_path.iterdir()) == []
    out = tmp_path / "w.safetensors"
    out.write_bytes(b"previous")
    with pytest.raises(ConfigError, match="not a tensor"):  # fails inside the write: out must survive
        ingest.write_restored({"model": {"w": torch.ones(2), "n": 3}}, out, force=True)
    assert out.read_bytes() == b"previous" and sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]


def test_compress_job_checks_before_writing(tmp_path):
    from ckptzip.ingest.compress import plan

    with pytest.raises(ConfigError, match="no checkpoints to compress"):
        plan([], str(tmp_path / "chain"))
    with pytest.raises(ConfigError, match="need --eval"):
        plan([], str(tmp_path / "chain"), threshold=0.01)
    assert list(tmp_path.iterdir()) == []
