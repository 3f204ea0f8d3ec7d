"""ckptzip.dcp in one process (DCP without a process group): layout, commit, deltas, keyframes,
retention, restart, async_save, fsspec roots (memory://, S3 via moto), non-tensor items, tools."""
import json
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from ckptzip.dcp import CompressedReader, CompressedWriter, forget, tools
from ckptzip.dcp.layout import Root
from ckptzip.chain import KeyframePolicy, RetentionPolicy
from ckptzip.errors import (CkptzipError, CorruptCheckpointError, IncompleteCheckpointError, StepNotFoundError,
                            UnsafeInputError)
from helpers import assert_same
from test_storage_s3 import s3_endpoint  # noqa: F401 - the moto S3 server fixture

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")



@pytest.fixture(autouse=True)
def _one_thread_and_fresh_references():
    torch.set_num_threads(1)  # conftest restores it
    yield
    forget()


class Trainer:
    """A real (tiny) Adam run on scikit-learn digits; ``state()`` is what a DCP user saves."""

    def __init__(self, hidden: int = 64, seed: int = 0):
        from ckptzip.demo.workloads import DigitsMLP, digits_data

        torch.manual_seed(seed)
        self.x, self.y, _, _ = digits_data(seed)
        self.model = DigitsMLP(hidden)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.n = 0

    def steps(self, k: int = 3) -> "Trainer":
        for _ in range(k):
            idx = torch.arange(self.n * 64, self.n * 64 + 64) % len(self.x)
            nn.functional.cross_entropy(self.model(self.x[idx]), self.y[idx]).backward()
            self.opt.step()
            self.opt.zero_grad()
            self.n += 1
        return self

    def state(self) -> dict:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict(),
                "loop": {"step": self.n, "tag": "digits", "history": [1.5, 0.25]}}


def fresh_like(state: dict) -> dict:
    """A load target with the same keys and shapes (different values), as a resumed job builds."""
    t = Trainer(seed=1).steps(1)
    s = t.state()
    s["loop"] = {"step": -1, "tag": "", "history": []}
    return s


def load(url, step=None, **kw) -> dict:
    target = fresh_like({})
    dcp.load(target, storage_reader=CompressedReader(url, step, **kw))
    return target


def test_roundtrip_deltas_and_non_tensor_state(tmp_path):
    t = Trainer()
    saved = {}
    for step in (10, 20, 30):
        s = t.steps().state()
        dcp.save(s, storage_writer=CompressedWriter(tmp_path, step=step))
        saved[step] = _clone(s)
    root = Root(tmp_path)
    assert root.committed_steps() == [10, 20, 30]
    ranks = root.read_metadata(30)["ranks"]
    assert [(f["keyframe"], f["parent"], f["chain"]) for f in ranks] == [(False, 20, [10, 20, 30])]
    for step in (10, 20, 30):
        assert_same(load(tmp_path, step), saved[step])
    assert_same(load(tmp_path), saved[30])
    assert_same(tools.load_full(tmp_path, 20), consolidated(saved[20], tmp_path / "plain"))


def consolidated(state: dict, folder) -> dict:
    """What plain DCP's own single-process consolidation gives for ``state`` (optimizer indices
    come back as strings, as DCP flattens them)."""
    dcp.save(state, checkpoint_id=folder)
    out: dict = {}
    _load_state_dict(out, storage_reader=dcp.FileSystemReader(folder), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    return out


def _clone(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj


def test_keyframes_retention_and_live_references(tmp_path):
    t = Trainer()
    kw = {"keyframe": KeyframePolicy(every=3), "retention": RetentionPolicy(keep_last=1)}
    for step in range(1, 6):
        dcp.save(t.steps(1).state(), storage_writer=CompressedWriter(tmp_path, step=step, **kw))
    root = Root(tmp_path)
    # 1 kf, 2, 3 deltas; 4 kf, 5 delta: keep_last=1 keeps 5 and the keyframe it needs
    assert root.committed_steps() == [4, 5] and root.step_folders() == [4, 5]
    assert root.read_commit(5).needs == (4, 5)
    assert_same(load(tmp_path), _clone(t.state()))


def test_restart_replays_own_files_and_layout_change_starts_keyframe(tmp_path):
    t = Trainer()
    dcp.save(t.steps().state(), storage_writer=CompressedWriter(tmp_path, step=1))
    dcp.save(t.steps().state(), storage_writer=CompressedWriter(tmp_path, step=2))
    forget()  # a restarted process: the reference is rebuilt from the rank's files
    dcp.save(t.steps().state(), storage_writer=CompressedWriter(tmp_path, step=3))
    assert Root(tmp_path).read_metadata(3)["ranks"][0]["parent"] == 2
    bigger = Trainer(hidden=32).steps().state()  # other shapes: the old reference does not apply
    dcp.save(bigger, storage_writer=CompressedWriter(tmp_path, step=4))
    assert Root(tmp_path).read_metadata(4)["ranks"][0]["keyframe"] is True
    assert_same(tools.load_full(tmp_path, 4), consolidated(bigger, tmp_path / "plain"))


def test_async_save_and_memory_root():
    url = f"memory://ckptzip-dcp-{uuid.uuid4().hex}"
    t = Trainer()
    for step in (1, 2):
        s = t.steps().state()
        expect = _clone(s)
        fut = dcp.async_save(s, storage_writer=CompressedWriter(url, step=step))
        (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
        assert_same(load(url), expect)
    assert Root(url).read_metadata(2)["ranks"][0]["parent"] == 1


def test_bad_input_and_missing_steps(tmp_path):
    with pytest.raises(IncompleteCheckpointError, match="no committed DCP checkpoint"):
        tools.load_full(tmp_path)
    with pytest.raises(BaseException, match="no committed DCP checkpoint"):  # DCP wraps it, message kept
        load(tmp_path)
    t = Trainer()
    dcp.save(t.steps().state(), storage_writer=CompressedWriter(tmp_path, step=5))
    with pytest.raises(BaseException, match="step 5 is not after the latest committed step 5"):
        dcp.save(t.state(), storage_writer=CompressedWriter(tmp_path, step=5))
    with pytest.raises(StepNotFoundError, match="step 7 is not committed.*committed steps: \\[5\\]"):
        tools.load_full(tmp_path, 7)
    (tmp_path / "step-000000000005" / "metadata.json.zst").write_bytes(b"{}")
    with pytest.raises(CorruptCheckpointError, match="metadata.json.zst: does not match"):
        tools.load_full(tmp_path)
    assert any("metadata.json.zst" in str(p) for p in tools.verify(tmp_path))


class Opaque:
    """A custom class in the state: DCP pickles it; loading it would run arbitrary code."""


def test_bytes_items_are_never_unpickled_by_tools(tmp_path):
    state = Trainer().steps().state()
    state["loop"]["obj"] = Opaque()
    dcp.save(state, storage_writer=CompressedWriter(tmp_path, step=1))
    with pytest.raises(UnsafeInputError, match="loop.obj.*not plain data"):
        tools.load_full(tmp_path)


def test_dynaquant_single_process_and_tools(tmp_path):
    t = Trainer(hidden=128)
    for step in (1, 2):
        dcp.save(t.steps(5).state(), storage_writer=CompressedWriter(tmp_path, step=step, method="dynaquant"))
    rows = tools.list_steps(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["raw_bytes"] / rows[1]["nbytes"] > 4
    got = tools.load_full(tmp_path)
    w, w_hat = t.model.state_dict()["fc2.weight"], got["model"]["fc2.weight"]
    assert float((w - w_hat).norm() / w.norm()) < 0.15
    assert got["loop"] == t.state()["loop"]
    info = tools.inspect_step(tmp_path)
    assert info["step"] == 2 and info["tensors"]["model.fc2.weight"]["size"] == [128, 128]
    assert tools.verify(tmp_path) == []
    out = tmp_path / "full.safetensors"
    assert tools.restore_file(tmp_path, str(out))["tensors"] == len(info["tensors"])
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(out))["model.fc2.weight"], w_hat)


def test_config_search_on_the_live_model_single_process(tmp_path):
    """The writer's collective config search (dcp/search.py) with no process group: a real
    validation-loss eval_fn, knobs chosen per save and the search state carried to the next."""
    t = Trainer(hidden=128)
    xv, yv = t.x[-200:], t.y[-200:]

    def val_loss(m):
        with torch.no_grad():
            return float(nn.functional.cross_entropy(m(xv), yv))

    for step in (1, 2):
        dcp.save(t.steps(5).state(), storage_writer=CompressedWriter(tmp_path, step=step, method="dynaquant",
                                                                   model=t.model, eval_fn=val_loss,
                                                                   threshold=0.02))
    rows = tools.list_steps(tmp_path)
    summaries = [r["summary"] for r in rows]
    assert summaries[0]["search"] == "exhaustive" and summaries[1]["search"] in ("neighbourhood", "fallback")
    assert all(s["evals"] >= 1 for s in summaries)
    restored = Trainer(hidden=128).model
    restored.load_state_dict(tools.load_full(tmp_path)["model"])
    assert val_loss(restored) <= val_loss(t.model) * 1.02 + 1e-6


def test_s3_root_through_moto(s3_endpoint):
    from test_storage_s3 import BUCKET

    url = f"s3://{BUCKET}/dcp-{uuid.uuid4().hex}"
    opts = {"client_kwargs": {"endpoint_url": s3_endpoint}, "skip_instance_cache": True}
    t = Trainer()
    for step in (1, 2):
        s = t.steps().state()
        expect = _clone(s)
        dcp.save(s, storage_writer=CompressedWriter(url, step=step, storage_options=opts,
                                                    retention=RetentionPolicy(keep_last=1),
                                                    keyframe=KeyframePolicy(every=1)))
    assert Root(url, opts).committed_steps() == [2] and Root(url, opts).step_folders() == [2]
    assert_same(load(url, storage_options=opts), expect)
    assert tools.verify(url, storage_options=opts) == []


def test_cli_on_a_dcp_root(tmp_path):
    from typer.testing import CliRunner

    from ckptzip.cli import app

    def cli(*args):
        return CliRunner().invoke(app, [str(a) for a in args])

    t = Trainer()
    for step in (1, 2):
        dcp.save(t.steps().state(), storage_writer=CompressedWriter(tmp_path / "root", step=step))
    root = tmp_path / "root"
    r = cli("ls", root)
    assert r.exit_code == 0 and "2 steps" in r.stdout, r.output
    assert [row["step"] for row in json.loads(cli("ls", root, "--json").stdout)] == [1, 2]
    r = cli("inspect", root, "--step", 1)
    assert r.exit_code == 0 and "rank-00000.ckz" in r.stdout and "keyframe" in r.stdout, r.output
    assert cli("verify", root).stdout.startswith("OK: 2 steps verified")
    r = cli("restore", root, "--out", tmp_path / "full.pt")
    assert r.exit_code == 0 and "restored step 2" in r.stdout, r.output
    assert_same(torch.load(tmp_path / "full.pt", weights_only=True), tools.load_full(root))
    r = cli("restore", root, "--out", tmp_path / "full.npz")
    assert r.exit_code == 2 and "write a .pt" in r.output
    (root / "step-000000000002" / "rank-00000.ckz").write_bytes(b"garbage")
    r = cli("verify", root)
    assert r.exit_code == 1 and "step-000000000002/rank-00000.ckz" in r.stdout and "FAILED" in r.stdout, r.output


@pytest.mark.parametrize("kw, msg", [({"step": -1}, "CompressedWriter step must be an int >= 0"),
                                     ({"step": 1.5}, "CompressedWriter step must be an int"),
                                     ({"step": 1, "threshold": -0.1}, "CompressedWriter threshold"),
                                     ({"step": 1, "eval_fn": 3}, "eval_fn must be a callable"),
                                     ({"step": 1, "method": "nope"}, "unknown method 'nope'")])
def test_writer_refuses_bad_arguments(tmp_path, kw, msg):
    with pytest.raises(CkptzipError, match=msg):
        CompressedWriter(tmp_path, **kw)
    assert not any(tmp_path.iterdir())  # nothing written
