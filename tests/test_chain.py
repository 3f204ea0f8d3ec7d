"""CheckpointChain (chain.py) over real training runs: exact round trips on local, file:// and
memory:// storage, the keyframe policy, retention, restarts, verify() and orphan collection.
"""
import json
import pathlib
import shutil
import uuid

import fsspec
import pytest
import torch
from torch import nn

from ckptzip.chain import INDEX, CheckpointChain, KeyframePolicy, RetentionPolicy, checkpoint_file
from ckptzip.errors import CorruptCheckpointError, IncompleteCheckpointError, StepNotFoundError, StepOrderError
from ckptzip.format import encode_container, header_sha256, sha256
from ckptzip.methods.base import EncodeContext
from helpers import assert_same  # noqa: E402


@pytest.fixture(autouse=True)
def _one_torch_thread():
    # many tiny ops: intra-op threads only add contention on a shared CPU (conftest restores the count)
    torch.set_num_threads(1)


DATA = pathlib.Path(__file__).parent / "data"


def digits_states(snaps):
    return [(s.step, {"model": s.model, "optimizer": s.optimizer, "step": s.step, "epoch": i / 3,
                      "tag": None, "best": float("inf") if i == 0 else 1.0 / i}) for i, s in enumerate(snaps)]


@pytest.fixture
def memory_url():
    root = f"/ckptzip-test-{uuid.uuid4().hex}"
    yield f"memory://{root}"
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


@pytest.fixture(params=["path", "file", "memory"])
def url(request, tmp_path, memory_url):
    if request.param == "path":
        return str(tmp_path / "run")
    if request.param == "file":
        return (tmp_path / "run").as_uri()
    return memory_url


def stored_files(chain) -> set[str]:
    return set(chain.storage.list())


# --- round trips -------------------------------------------------------------------------------

def test_real_run_round_trips_exactly(url, digits_snapshots):
    _, _, snaps, _ = digits_snapshots
    states = digits_states(snaps)
    assert len(states) >= 10
    chain = CheckpointChain(url, "lossless", keyframe=KeyframePolicy(every=4))
    for step, state in states:
        e = chain.save(state, step=step)
        assert e.file == checkpoint_file(step) and e.nbytes == chain.storage.size(e.file)
        assert e.raw_bytes > e.nbytes  # compressed
    assert chain.steps() == [s for s, _ in states]
    assert [e.keyframe for e in chain.entries()] == [i % 4 == 0 for i in range(len(states))]
    assert stored_files(chain) == {INDEX} | {checkpoint_file(s) for s, _ in states}
    reader = CheckpointChain(url)  # a separate reader, as another process would open it
    for step, state in states:
        assert_same(state, reader.load(step))
    assert_same(states[-1][1], reader.load())
    assert reader.verify() == []
    r = reader.restore(states[3][0])
    assert r.step == states[3][0] and r.manifest["parent_step"] == states[2][0] and not r.manifest["keyframe"]
    assert r.flat.records["optimizer/state/0/exp_avg"].param == "fc1.weight"


def test_transformer_block_adamw_round_trip(tmp_path):
    torch.manual_seed(0)
    block = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    opt = torch.optim.AdamW(block.parameters(), lr=1e-3, weight_decay=0.1)
    x = torch.randn(4, 8, 32)
    chain = CheckpointChain(tmp_path / "tf", "lossless", keyframe=KeyframePolicy(every=3))
    saved = []
    for step in range(1, 6):
        for _ in range(2):
            loss = block(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        state = {"model": block.state_dict(), "optimizer": opt.state_dict(),
                 "half": {k: v.to(torch.bfloat16) for k, v in block.state_dict().items()}}
        chain.save(state, step=step * 2, model=block, optimizer=opt)
        saved.append((step * 2, {k: _clone(v) for k, v in state.items()}))
    for step, state in saved:
        back = chain.load(step)
        assert_same(state, back)
    b2 = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    b2.load_state_dict(back["model"])
    o2 = torch.optim.AdamW(b2.parameters())
    o2.load_state_dict(back["optimizer"])
    assert torch.equal(b2(x), block(x))
    rec = chain.restore().flat.records
    assert rec["optimizer/state/0/exp_avg"].param == "self_attn.in_proj_weight"


def _clone(obj):
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj


def test_golden_chain_v1_still_restores():
    spec = __import__("importlib.util").util.spec_from_file_location("make_golden", DATA / "make_golden.py")
    golden = __import__("importlib.util").util.module_from_spec(spec)
    spec.loader.exec_module(golden)
    chain = CheckpointChain(DATA / "golden_chain_v1")
    assert chain.verify() == []
    expected = golden.golden_chain_states()
    assert chain.steps() == [s for s, _ in expected]
    assert [e.keyframe for e in chain.entries()] == [True, False, False]
    for step, state in expected:
        assert_same(state, chain.load(step))


# --- keyframe policy ---------------------------------------------------------------------------

def _tiny_states(n: int, size: int = 2000, start: int = 1):
    """A cheap, real-looking sequence: weights drifting by small SGD-like steps."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(size, generator=g)
    out = []
    for i in range(n):
        w = w - 1e-3 * torch.randn(size, generator=g)
        out.append((start + i, {"model": {"w": w.clone()}, "step": start + i}))
    return out


def _replay_len(chain, step) -> int:
    return len(chain._path(step, chain.entries()))


@pytest.mark.parametrize("every", [1, 3, 4])
def test_keyframe_every(tmp_path, every):
    chain = CheckpointChain(tmp_path / "c", keyframe=KeyframePolicy(every=every))
    for step, state in _tiny_states(10):
        chain.save(state, step=step)
    entries = chain.entries()
    assert [e.keyframe for e in entries] == [i % every == 0 for i in range(10)]
    for i, e in enumerate(entries):
        assert e.parent == (None if e.keyframe else entries[i - 1].step)
        assert _replay_len(chain, e.step) == i % every + 1


@pytest.mark.parametrize("max_replay", [0, 1, 2, 5])
def test_keyframe_max_replay_bounds_restore_path(tmp_path, max_replay):
    chain = CheckpointChain(tmp_path / "c", keyframe=KeyframePolicy(every=100, max_replay=max_replay))
    states = _tiny_states(12)
    for step, state in states:
        chain.save(state, step=step)
    deltas = [_replay_len(chain, s) - 1 for s, _ in states]
    assert max(deltas) == max_replay  # bounded, and the bound is used
    assert [e.keyframe for e in chain.entries()] == [i % (max_replay + 1) == 0 for i in range(12)]
    for step, state in states[-3:]:
        assert_same(state, chain.load(step))


def test_keyframe_max_replay_bytes_ratio(tmp_path):
    ratio = 1.5
    chain = CheckpointChain(tmp_path / "c", keyframe=KeyframePolicy(every=100, max_replay_bytes_ratio=ratio))
    for step, state in _tiny_states(15):
        chain.save(state, step=step)
    entries = chain.entries()
    by_step = {e.step: e for e in entries}
    n_kf = sum(e.keyframe for e in entries)
    assert 1 < n_kf < len(entries)  # deltas are a sizeable fraction of a keyframe here: both occur
    for i, e in enumerate(entries):
        path = chain._path(e.step, entries)
        kf = by_step[path[0]]
        before = sum(by_step[s].nbytes for s in path[1:-1])  # deltas replayed before this one
        if not e.keyframe:
            assert before <= ratio * kf.nbytes
        elif i > 0:  # a later keyframe only when the previous deltas exceeded the ratio
            prev_path = chain._path(entries[i - 1].step, entries)
            prev_kf = by_step[prev_path[0]]
            assert sum(by_step[s].nbytes for s in prev_path[1:]) > ratio * prev_kf.nbytes


def test_force_keyframe_and_policy_validation(tmp_path):
    chain = CheckpointChain(tmp_path / "c", keyframe=KeyframePolicy(every=10))
    states = _tiny_states(3)
    chain.save(states[0][1], step=1)
    chain.save(states[1][1], step=2)
    e = chain.save(states[2][1], step=3, ctx=EncodeContext(step=3, force_keyframe=True))
    assert e.keyframe and e.parent is None
    assert_same(states[2][1], chain.load(3))
    for bad in (dict(every=0), dict(max_replay=-1)):
        with pytest.raises(ValueError, match="KeyframePolicy"):
            KeyframePolicy(**bad)
    for bad in (dict(keep_last=0), dict(keep_every=-2)):
        with pytest.raises(ValueError, match="RetentionPolicy"):
            RetentionPolicy(**bad)


# --- retention ---------------------------------------------------------------------------------

def _expected_kept(entries_all, keep_last, keep_every):
    """Independent reference: wanted steps plus every step on their replay paths."""
    by_step = {e.step: e for e in entries_all}
    wanted = {entries_all[-1].step}
    if keep_last:
        wanted |= {e.step for e in entries_all[-keep_last:]}
    if keep_every:
        wanted |= {e.step for e in entries_all if e.step % keep_every == 0}
    needed = set()
    for s in wanted:
        while True:
            needed.add(s)
            if by_step[s].keyframe:
                break
            s = by_step[s].parent
    return needed


@pytest.mark.parametrize("keep_last, keep_every, every", [(2, None, 3), (1, 4, 3), (None, 5, 2), (3, None, 1)])
def test_retention_keeps_what_kept_steps_need(tmp_path, keep_last, keep_every, every):
    chain = CheckpointChain(tmp_path / "c", keyframe=KeyframePolicy(every=every),
                            retention=RetentionPolicy(keep_last=keep_last, keep_every=keep_every))
    states = dict(_tiny_states(13, size=500))
    all_entries, ever_deleted = [], set()
    for step, state in states.items():
        before = {e.step for e in chain.entries(refresh=True)}
        all_entries.append(chain.save(state, step=step))
        kept = set(chain.steps())
        live = [e for e in all_entries if e.step in before | {step}]
        assert kept == _expected_kept(live, keep_last, keep_every) & (before | {step})
        # every kept step restores exactly; every dropped step's file is gone, no kept one is
        files = stored_files(chain)
        assert files == {INDEX} | {checkpoint_file(s) for s in kept}
        ever_deleted |= before - kept
        assert not {checkpoint_file(s) for s in ever_deleted} & files
    assert ever_deleted  # retention did delete something
    assert chain.verify() == []
    for s in chain.steps():
        assert_same(states[s], chain.load(s))
    with pytest.raises(StepNotFoundError):
        chain.load(min(ever_deleted))


# --- errors --------------------------------------------------------------------------------------

def test_save_holds_its_blobs_once(tmp_path):
    """The container is streamed into the file from its blobs, never joined into a second copy:
    the Python heap's peak during a save (the blobs are bytes; tensors live outside it) stays near
    the stored size, where a joined container needed twice that."""
    import tracemalloc

    torch.manual_seed(0)
    state = {"model": {f"w{i}": torch.randn(64, 1024) for i in range(24)}}  # 6 MB, mantissas incompressible
    CheckpointChain(tmp_path / "warm", "lossless").save({"w": torch.randn(512)}, 1)  # imports, kernels
    chain = CheckpointChain(tmp_path / "c", "lossless")
    tracemalloc.start()
    try:
        e = chain.save(state, 1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert e.nbytes > 4e6 and peak < 1.3 * e.nbytes, (peak, e.nbytes)
    assert_same(chain.load(1), state)


def test_steps_must_increase(tmp_path):
    chain = CheckpointChain(tmp_path / "c")
    states = _tiny_states(2)
    chain.save(states[0][1], step=5)
    for bad in (5, 4, -1):
        with pytest.raises(StepOrderError, match=f"step {bad} is not after the chain's latest step 5"):
            chain.save(states[1][1], step=bad)
    assert chain.steps() == [5] and stored_files(chain) == {INDEX, checkpoint_file(5)}


def test_step_not_found_and_empty_chain(tmp_path, memory_url):
    for url in (tmp_path / "empty", memory_url):
        empty = CheckpointChain(url)
        with pytest.raises(IncompleteCheckpointError, match="no committed checkpoint"):
            empty.load()
        with pytest.raises(FileNotFoundError):
            empty.restore(3)
        assert empty.steps() == [] and empty.verify() == [] and empty.orphans() == []
    chain = CheckpointChain(tmp_path / "c")
    for step, state in _tiny_states(3, start=10):
        chain.save(state, step=step)
    with pytest.raises(StepNotFoundError, match=r"step 7 is not in the chain .*10, 11, 12") as ei:
        chain.load(7)
    assert isinstance(ei.value, FileNotFoundError)


def test_restart_continues_with_deltas(tmp_path, digits_snapshots):
    _, _, snaps, _ = digits_snapshots
    states = digits_states(snaps)
    url = tmp_path / "run"
    first = CheckpointChain(url, keyframe=KeyframePolicy(every=100))
    for step, state in states[:4]:
        first.save(state, step=step)
    first.close()
    # a new process: nothing in memory, the reference is rebuilt from the chain
    second = CheckpointChain(url, keyframe=KeyframePolicy(every=100))
    e = second.save(states[4][1], step=states[4][0])
    assert not e.keyframe and e.parent == states[3][0]
    # a resumed run that loads first, then saves
    third = CheckpointChain(url, keyframe=KeyframePolicy(every=100))
    loaded = third.load()
    assert_same(states[4][1], loaded)
    # training mutates what it loaded in place (Adam keeps the state tensors it is given): the
    # chain's own reference for the next delta must not change with it
    for st in loaded["optimizer"]["state"].values():
        st["exp_avg"].mul_(2.0)
    for t in loaded["model"].values():
        t.add_(1.0)
    for step, state in states[5:]:
        e = third.save(state, step=step)
        assert not e.keyframe and e.parent == step - (states[1][0] - states[0][0])
    reader = CheckpointChain(url)
    assert [e.keyframe for e in reader.entries()] == [True] + [False] * (len(states) - 1)
    for step, state in states:
        assert_same(state, reader.load(step))
    assert reader.verify() == []


def test_truncate_rolls_back_and_deltas_continue(tmp_path, digits_snapshots):
    """Resume from an older step (after divergence): later checkpoints go, the next save is a delta
    against the kept step, and a crash between the index commit and the deletes leaves orphans only."""
    _, _, snaps, _ = digits_snapshots
    states = digits_states(snaps)
    chain = CheckpointChain(tmp_path / "c", keyframe=KeyframePolicy(every=100))
    for step, state in states[:6]:
        chain.save(state, step=step)
    keep_to = states[2][0]
    assert chain.truncate(keep_to) == [s for s, _ in states[3:6]]
    assert chain.steps() == [s for s, _ in states[:3]] and chain.orphans() == []
    assert stored_files(chain) == {INDEX} | {checkpoint_file(s) for s, _ in states[:3]}
    assert chain.truncate(keep_to) == []  # nothing later: a no-op
    # the writer forgot the reference of a dropped step: the next save replays the kept one
    e = chain.save(states[6][1], step=states[6][0])
    assert not e.keyframe and e.parent == keep_to
    reader = CheckpointChain(tmp_path / "c")
    for step, state in states[:3] + states[6:7]:
        assert_same(state, reader.load(step))
    assert reader.verify() == []


def test_restart_keeps_the_keyframe_cadence(tmp_path):
    states = _tiny_states(9)
    url = tmp_path / "c"
    for i, (step, state) in enumerate(states):  # a new chain object for every save
        CheckpointChain(url, keyframe=KeyframePolicy(every=3)).save(state, step=step)
    assert [e.keyframe for e in CheckpointChain(url).entries()] == [i % 3 == 0 for i in range(9)]


# --- verify, orphans, gc ---------------------------------------------------------------------------

@pytest.fixture
def small_chain(tmp_path):
    chain = CheckpointChain(tmp_path / "c", keyframe=KeyframePolicy(every=3))
    states = _tiny_states(5)
    for step, state in states:
        chain.save(state, step=step)
    assert chain.verify() == []
    return chain, dict(states), tmp_path / "c"


@pytest.mark.parametrize("where", ["header", "middle", "last"])
def test_verify_names_a_flipped_file(small_chain, where):
    """An entry pins its file by the header's digest, the header every blob's checksum: a byte
    flipped anywhere (manifest, a blob, the last byte) is found."""
    chain, states, root = small_chain
    target = root / checkpoint_file(2)
    data = bytearray(target.read_bytes())
    assert chain.entries()[1].header_sha256 and chain.entries()[1].sha256 is None
    data[{"header": 40, "middle": len(data) // 2, "last": len(data) - 1}[where]] ^= 0x20
    target.write_bytes(bytes(data))
    problems = chain.verify(deep=False)
    assert problems and all(checkpoint_file(2) in str(p) for p in problems)
    assert any(p.what == "file does not match its index checksum" and p.step == 2 for p in problems)
    assert chain.verify() == problems  # deep skips decoding when a file is already bad
    with pytest.raises(CorruptCheckpointError, match=checkpoint_file(2)):
        chain.load(3)  # its replay path runs through step 2
    assert_same(states[4], chain.load(4))  # a keyframe after the damage is unaffected


def test_verify_names_a_deleted_file(small_chain):
    chain, _, root = small_chain
    (root / checkpoint_file(4)).unlink()
    problems = chain.verify()
    assert [str(p) for p in problems] == [f"{chain.storage.path(checkpoint_file(4))}: committed checkpoint file is missing"]
    assert problems[0].step == 4 and problems[0].file == chain.storage.path(checkpoint_file(4)) and problems[0].fix
    with pytest.raises(CorruptCheckpointError, match="missing"):
        chain.load(5)


def test_verify_names_an_edited_index(small_chain):
    chain, _, root = small_chain
    index = root / INDEX
    doc = json.loads(index.read_text())
    doc["entries"][1]["nbytes"] += 1  # an edit without updating the index checksum
    index.write_text(json.dumps(doc))
    problems = list(map(str, chain.verify()))
    assert len(problems) == 1 and INDEX in problems[0] and "corrupt" in problems[0]
    with pytest.raises(CorruptCheckpointError, match=INDEX):
        chain.load()
    # an edit that keeps the index self-consistent but points at the wrong file content
    doc["entries"][1]["nbytes"] -= 1
    doc["entries"][1]["sha256"] = "0" * 64
    doc["sha256"] = sha256(json.dumps(doc["entries"], sort_keys=True, separators=(",", ":")).encode())
    index.write_text(json.dumps(doc))
    problems = list(map(str, chain.verify()))
    assert len(problems) == 1 and checkpoint_file(2) in problems[0] and "index checksum" in problems[0]


def test_verify_catches_a_swapped_file(small_chain):
    chain, _, root = small_chain
    shutil.copy(root / checkpoint_file(5), root / checkpoint_file(4))
    problems = list(map(str, chain.verify()))
    assert problems and all(checkpoint_file(4) in p for p in problems)
    assert any("holds step 5, index says 4" in p for p in problems)


def test_verify_deep_catches_an_undecodable_record(small_chain):
    chain, _, root = small_chain
    # a well-formed container whose record blob is garbage, committed with a matching index
    data = encode_container({"step": 5, "parent_step": 4, "keyframe": False, "method": "lossless/1", "config": {},
                             "method_meta": {}, "skeleton": {"model": {"w": {"__t": "tensor", "ref": "model/w"}}},
                             "extra": {}, "records": {"model/w": {"role": "weight", "dtype": "float32",
                                                                  "shape": [2000], "layer_type": "other", "param": "w",
                                                                  "pipeline": ["lossless/1", "xor/1", "bytegroup/1"],
                                                                  "meta": {}, "blobs": {"data": "0.data"}}},
                             "raw_bytes": 8000}, {"0.data": b"\x04\x00garbage"})
    (root / checkpoint_file(5)).write_bytes(data)
    doc = json.loads((root / INDEX).read_text())
    doc["entries"][-1]["header_sha256"] = header_sha256(data)
    doc["sha256"] = sha256(json.dumps(doc["entries"], sort_keys=True, separators=(",", ":")).encode())
    (root / INDEX).write_text(json.dumps(doc))
    assert chain.verify(deep=False) == []
    problems = chain.verify(deep=True)
    assert len(problems) == 1 and str(problems[0]).startswith("step 5: ") and problems[0].step == 5


def test_orphans_and_gc(small_chain):
    chain, states, root = small_chain
    # leftovers of a save that crashed before its commit, and of an interrupted atomic write
    (root / checkpoint_file(6)).write_bytes(b"half a container")
    (root / f".{INDEX}.deadbeef.tmp").write_bytes(b"{")
    (root / "notes.txt").write_text("mine, not the chain's")
    assert chain.orphans() == sorted([f".{INDEX}.deadbeef.tmp", checkpoint_file(6)])
    assert chain.verify() == []  # orphans are not damage: every committed step is intact
    assert sorted(chain.gc()) == sorted([f".{INDEX}.deadbeef.tmp", checkpoint_file(6)])
    assert chain.orphans() == [] and (root / "notes.txt").exists()
    assert not (root / checkpoint_file(6)).exists()
    # the crashed step can be saved again
    e = chain.save(states[5], step=6)
    assert not e.keyframe and e.parent == 5
    assert_same(states[5], chain.load(6))


def test_index_json_is_the_indented_dump_of_its_entries():
    """dumps builds index.json from each entry's cached serialization: the same bytes as
    json.dumps of the whole document (what index version 2 files hold), and parse reads them back."""
    import dataclasses

    from ckptzip.index import Entry, dumps, parse

    entries = [Entry(step=i, file=checkpoint_file(i), parent=i - 1 or None, keyframe=i == 1, method="lossless/1",
                     nbytes=10 * i, raw_bytes=99, sha256=None, created_unix=1.5 + i, bytes_by_role={"weight": [1, 2]},
                     summary={"knobs": {"bits": [4, 8]}, "note": "é\n\"x\""}, header_sha256="ab" * 32)
               for i in range(1, 4)]
    for n in range(4):
        for owner in (None, {"pid": 3, "host": "h", "gen": [1, {"x": None}]}):
            body = [dataclasses.asdict(e) for e in entries[:n]]
            doc = {"format": "ckptzip-chain", "version": 2, "entries": body,
                   "sha256": sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()), "owner": owner}
            raw = dumps(entries[:n], owner)
            assert raw == json.dumps(doc, indent=1).encode()
            assert parse(raw, None, "index.json").entries == entries[:n]


def test_crc32_blob_checksums_are_format_2_and_catch_a_flipped_byte(tmp_path, digits_snapshots, monkeypatch):
    """checksum="crc32": blobs checked by CRC-32 (format version 2, which a reader of version 1
    refuses by name); the files restore exactly, and a byte flipped in a blob is found and named.
    Files with SHA-256 (the default) stay version 1, byte for byte as before (the golden tests)."""
    import ckptzip.format as fmt
    from ckptzip.errors import FormatVersionError

    _, _, snaps, _ = digits_snapshots
    states = digits_states(snaps)[:3]
    chain = CheckpointChain(tmp_path, "lossless", checksum="crc32")
    for step, state in states:
        chain.save(state, step=step)
    manifest = chain.manifest(states[1][0])
    assert manifest["format_version"] == 2 and all(set(b) == {"nbytes", "crc32"} for b in manifest["blobs"].values())
    reader = CheckpointChain(tmp_path)
    for step, state in states:
        assert_same(state, reader.load(step))
    assert reader.verify() == []
    path = tmp_path / checkpoint_file(states[1][0])
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01  # in the last blob
    with pytest.raises(CorruptCheckpointError, match="fails its checksum"):
        fmt.decode_container(bytes(data))
    monkeypatch.setattr(fmt, "NEWEST_VERSION", 1)  # a reader from before issue 15
    with pytest.raises(FormatVersionError, match="format version 2"):
        fmt.decode_container(path.read_bytes())
    with pytest.raises(ValueError, match="checksum"):
        CheckpointChain(tmp_path / "x", "lossless", checksum="md5")
