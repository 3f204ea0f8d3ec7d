"""Chains that ckptzip v0.1 ingested (tests/data/ingest_v1, see make_ingest_v1.py) restore to the same files."""
from __future__ import annotations

import importlib.util
import pathlib
import shutil

import pytest
import torch
from safetensors.torch import load_file

from ckptzip import CheckpointChain, ingest
from helpers import assert_same

DATA = pathlib.Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def v1():
    spec = importlib.util.spec_from_file_location("make_ingest_v1", DATA / "make_ingest_v1.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def chains(tmp_path):
    shutil.copytree(DATA / "ingest_v1", tmp_path / "v1")  # a restore must not touch the golden files
    return tmp_path / "v1"


def test_torch_file_chain(chains, tmp_path, v1):
    chain = CheckpointChain(chains / "torch-file")
    assert chain.verify() == []
    for step, (name, obj) in zip(v1.STEPS, v1.torch_file_sources()):
        state = chain.load(step)
        assert state[ingest.LAYOUT_KEY]["format"] == "torch-file/1" and state[ingest.LAYOUT_KEY]["name"] == name
        out = tmp_path / name
        assert ingest.write_restored(state, out) == "pt"
        assert_same(torch.load(out, weights_only=True), obj, strict_types=True)


def test_hf_trainer_chain(chains, tmp_path, v1):
    chain = CheckpointChain(chains / "hf-trainer")
    assert chain.verify() == []
    for k, (step, (name, files, model, opt)) in enumerate(zip(v1.STEPS, v1.trainer_sources())):
        out = tmp_path / name
        assert ingest.write_restored(chain.load(step), out) == "folder"
        weights = (["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"] if k == 1
                   else ["model.safetensors"])
        assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == sorted(
            [*files, *weights, "optimizer.pt", "sub"])
        for rel, data in files.items():
            assert (out / rel).read_bytes() == data, rel  # kept byte for byte
        got = {}
        for w in weights:
            got.update(load_file(str(out / w)))
        assert_same(dict(sorted(got.items())), dict(sorted(model.items())))
        assert_same(torch.load(out / "optimizer.pt", weights_only=True), opt)


@pytest.mark.parametrize("folder,n_optimizers,steps", [("lightning", 1, (10, 20)), ("lightning-2opt", 2, (10,))])
def test_lightning_v01_chain(chains, tmp_path, v1, folder, n_optimizers, steps):
    pytest.importorskip("lightning.pytorch")
    from ckptzip.integrations.lightning import CompressedCheckpointIO

    io = CompressedCheckpointIO()
    expected = dict(v1.lightning_checkpoints(n_optimizers))
    for name in sorted(p.name for p in (chains / folder).glob("*.ckpt")):
        ckpt = io.load_checkpoint(chains / folder / name)
        assert ckpt["global_step"] in steps
        # v0.1 kept neither the top-level key order nor the state_dict's OrderedDict type
        want = dict(sorted(expected[name].items()), state_dict=dict(expected[name]["state_dict"]))
        assert_same(dict(sorted(ckpt.items())), want)
        state = CheckpointChain(chains / folder / "ckptzip-chain").load(ckpt["global_step"])
        ingest.write_restored(state, tmp_path / name)  # `ckptzip restore` of a v0.1 Lightning chain
        assert_same(dict(sorted(torch.load(tmp_path / name, weights_only=True).items())), want)
