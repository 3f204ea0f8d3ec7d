"""ckptzip.dcp with real processes: FSDP2 on a tiny GPT with AdamW, gloo on 127.0.0.1 (CPU).

One 4-rank training run saves the same states three ways (lossless, dynaquant with a collective
config search, plain DCP); the tests then reshard 4 -> 2 (two new rank processes) and 4 -> 1 (this
process, no process group), compare bit for bit with plain DCP's load, check the sharded DynaQuant
statistics against a single process's, corrupt and delete shard files, and SIGKILL a rank mid-save.
Rank processes run tests/dcp_worker.py.
"""
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from ckptzip.dcp import CompressedWriter, tools
from ckptzip.dcp.layout import Root
from ckptzip.errors import CorruptCheckpointError
from ckptzip.format import decode_container
from helpers import assert_same, record_part

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

WORKER = pathlib.Path(__file__).with_name("dcp_worker.py")
SRC = pathlib.Path(__file__).parents[1] / "src"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(scenario: str, world: int, args: dict, timeout_s: int = 300) -> list[dict]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    procs = [subprocess.Popen([sys.executable, str(WORKER), scenario, str(r), str(world), str(port), json.dumps(args)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(world)]
    errs = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=timeout_s)
            errs.append(err.decode()[-3000:])
    finally:
        for p in procs:
            p.kill()
            p.wait()
    out = pathlib.Path(args["out"])
    results = []
    for r, p in enumerate(procs):
        f = out / f"{scenario}-r{r}.json"
        assert f.exists(), f"rank {r} exited {p.returncode} without a result:\n{errs[r]}"
        results.append(json.loads(f.read_text()))
    return results


def plain_full(path) -> dict:
    """Plain DCP's own single-process load of a checkpoint folder (the oracle)."""
    state: dict = {}
    _load_state_dict(state, storage_reader=FileSystemReader(str(path)), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    return state


@pytest.fixture(scope="module")
def saved4(tmp_path_factory):
    """A 4-rank FSDP2 run saving steps 2 and 3 (lossless, dynaquant, plain DCP)."""
    d = tmp_path_factory.mktemp("dcp4")
    args = {"lossless": str(d / "lossless"), "dynaquant": str(d / "dq"), "plain": str(d / "plain"),
            "out": str(d), "steps": 3, "save_at": [2, 3], "step": 3}
    res = run_ranks("save", 4, args)
    assert len({r["val_loss"] for r in res}) == 1  # FSDP: every rank evaluates the same model
    return d, args


def test_reshard_4_to_2_and_1_lossless_bit_exact(saved4):
    d, args = saved4
    res = run_ranks("load", 2, args)  # a fresh FSDP2 model + AdamW at world 2
    for r in res:
        assert r["keys_equal"] and r["differ"] == [] and r["n_tensors"] > 100, r
        assert r["loop"] == {"epoch": 1, "tag": "tiny-gpt"}  # non-tensor state (DCP bytes items)
    for step in (2, 3):  # world 1, no process group: the delta (3) and its keyframe (2)
        assert_same(tools.load_full(args["lossless"], step), plain_full(f"{args['plain']}/{step}"))
    root = Root(args["lossless"])
    ranks = {f["rank"]: f for f in root.read_metadata(3)["ranks"]}
    assert list(ranks) == [0, 1, 2, 3, -1] and ranks[-1]["file"] == "shared.ckz"  # replicated items: one file
    assert [(ranks[r]["keyframe"], ranks[r]["parent"]) for r in range(4)] == [(False, 2)] * 4
    assert root.read_commit(3).needs == (2, 3) and tools.verify(args["lossless"]) == []


def _quantized_records(url, step, world):
    """({quantized record: [(prune threshold, codebook bytes) per shard]}, {record: smallest shard numel},
    the method config)."""
    out: dict = {}
    numel: dict = {}
    for r in range(world):
        c = decode_container(Root(url).step_store(step).read(f"rank-{r:05d}.ckz"))
        for name, rec in c.manifest["records"].items():
            numel[name] = min(numel.get(name, 1 << 62), int(torch.Size(rec["shape"]).numel()))
            if rec["pipeline"][0].startswith("dynaquant"):
                out.setdefault(name, []).append((rec["meta"].get("prune_threshold"), record_part(c, name, "codebook")))
    return out, numel, c.manifest["config"]


def test_dynaquant_shards_share_single_process_thresholds_and_codebooks(saved4, tmp_path):
    d, args = saved4
    full = plain_full(f"{args['plain']}/3")
    full["model"]["head.weight"] = full["model"]["wte.weight"]  # tied, as in the live model
    sharded, shard_numel, config = _quantized_records(args["dynaquant"], 3, 4)
    import torch.distributed.checkpoint as dcp

    one = tmp_path / "one"
    dcp.save(full, storage_writer=CompressedWriter(one, step=3, method="dynaquant", config=config))
    single, _, _ = _quantized_records(one, 3, 1)
    shared = set(sharded) & set(single)
    assert len(shared) >= 9  # the weights (moments are grid records: a fixed grid, no thresholds to share)
    for name in shared:  # every shard: the whole tensor's prune threshold and codebook
        assert {s for s in sharded[name]} == {single[name][0]}, name
    # tensors a single process quantizes but 4 ranks keep exact: shards below min_numel (documented)
    min_numel = config["quantizer"]["min_numel"]
    for name in set(single) - set(sharded):
        assert shard_numel[name] < min_numel, name
    summary = Root(args["dynaquant"]).read_metadata(3)["ranks"][0]["summary"]
    assert summary["search"] in ("exhaustive", "neighbourhood", "fallback") and summary["ranks"] == 4
    assert summary["degradation"] <= 0.01
    got = tools.load_full(args["dynaquant"])
    for k, v in tools.flat_tensors(plain_full(f"{args['plain']}/3")):
        if k.startswith("model.blocks") and k.endswith("weight") and v.dim() == 2:
            assert float((got_t := dict(tools.flat_tensors(got))[k]).sub(v).norm() / v.norm()) < 0.5, k
            assert got_t.dtype == v.dtype


def test_corrupt_or_missing_shard_is_named(saved4, tmp_path):
    _, args = saved4
    root = tmp_path / "copy"
    shutil.copytree(args["lossless"], root)
    target = root / "step-000000000003" / "rank-00002.ckz"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="step-000000000003/rank-00002.ckz.*checksum"):
        tools.load_full(root)
    problems = tools.verify(root)
    assert any("rank-00002.ckz" in str(p) for p in problems), problems
    assert any(p.record is not None and "damaged" in str(p) for p in problems), problems  # down to a tensor
    shutil.copytree(args["lossless"], root, dirs_exist_ok=True)
    (root / "step-000000000002" / "rank-00001.ckz").unlink()  # the parent of step 3's delta on rank 1
    with pytest.raises(CorruptCheckpointError, match="step-000000000002/rank-00001.ckz.*missing"):
        tools.load_full(root, 3)


def test_sigkill_of_one_rank_mid_save_leaves_previous_step(tmp_path):
    args = {"root": str(tmp_path / "root"), "plain": str(tmp_path / "plain"), "out": str(tmp_path)}
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    procs = [subprocess.Popen([sys.executable, str(WORKER), "kill", str(r), "2", str(port), json.dumps(args)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(2)]
    try:
        errs = [p.communicate(timeout=180)[1].decode()[-3000:] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert procs[1].returncode == -9
    res = json.loads((tmp_path / "kill-r0.json").read_text())
    assert res["save2"].startswith("raised"), (res, errs[0])
    root = Root(args["root"])
    assert root.committed_steps() == [1] and root.step_folders() == [1, 2]  # rank files of 2, no commit
    assert_same(tools.load_full(args["root"]), plain_full(f"{args['plain']}/1"))
    # the next save commits and removes the crashed one
    import torch.distributed.checkpoint as dcp

    dcp.save(plain_full(f"{args['plain']}/1"), storage_writer=CompressedWriter(args["root"], step=3))
    assert root.committed_steps() == [1, 3] and root.step_folders() == [1, 3]


def test_sketches_merge_exactly_across_ranks_with_different_keys(tmp_path):
    res = run_ranks("sketches", 2, {"out": str(tmp_path)})
    assert all(r["keys"] == ["both", "only0", "only1"] and r["exact"] for r in res), res
