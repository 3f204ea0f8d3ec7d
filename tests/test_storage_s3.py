"""A chain on a real S3 API (moto's server over HTTP, through s3fs): save, load, verify, retention
and orphan collection behave as on a local folder.
"""
import logging
import os
import uuid

import pytest
import torch

moto_server = pytest.importorskip("moto.server")
s3fs = pytest.importorskip("s3fs")
boto3 = pytest.importorskip("boto3")

from ckptzip.chain import INDEX, CheckpointChain, KeyframePolicy, RetentionPolicy, checkpoint_file  # noqa: E402
from ckptzip.errors import (ChainBusyError, CorruptCheckpointError, IncompleteCheckpointError,  # noqa: E402
                            StepNotFoundError, StorageUnavailableError, WriteConflictError)
from ckptzip.retry import RetryPolicy  # noqa: E402
from ckptzip.storage import Storage  # noqa: E402


@pytest.fixture(autouse=True)
def _one_torch_thread():
    # many tiny ops: intra-op threads only add contention on a shared CPU (conftest restores the count)
    torch.set_num_threads(1)


BUCKET = "ckptzip-test"
ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
       "AWS_SESSION_TOKEN": "testing", "AWS_SECURITY_TOKEN": "testing"}


@pytest.fixture(scope="module")
def s3_endpoint():
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)
    log = logging.getLogger("werkzeug")  # one INFO line per request otherwise
    log_level = log.level
    log.setLevel(logging.WARNING)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    try:
        boto3.client("s3", endpoint_url=url, region_name="us-east-1").create_bucket(Bucket=BUCKET)
        yield url
    finally:
        server.stop()
        s3fs.S3FileSystem.clear_instance_cache()
        log.setLevel(log_level)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3(s3_endpoint):
    """(url of a fresh prefix, storage_options, boto3 client) for one test."""
    opts = {"client_kwargs": {"endpoint_url": s3_endpoint}, "skip_instance_cache": True}
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    return f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}", opts, client


def keys(client, url) -> set[str]:
    prefix = url.removeprefix(f"s3://{BUCKET}/") + "/"
    resp = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return {o["Key"].removeprefix(prefix) for o in resp.get("Contents", [])}


def same_tree(a, b):
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b))
    return a == b


def test_storage_options_reach_s3fs(s3):
    url, opts, client = s3
    st = Storage(url, opts)
    assert "s3" in st.fs.protocol and not st.local
    assert st.fs.client_kwargs["endpoint_url"] == opts["client_kwargs"]["endpoint_url"]
    st.write_atomic("a.bin", b"hello")
    assert st.read("a.bin") == b"hello" and st.exists("a.bin") and st.size("a.bin") == 5
    assert st.list() == ["a.bin"] and keys(client, url) == {"a.bin"}
    st.delete("a.bin")
    st.delete("a.bin")  # deleting a missing object is not an error
    assert st.list() == [] and not st.exists("a.bin")


def test_chain_on_s3_round_trip_verify_retention(s3, digits_snapshots):
    url, opts, client = s3
    _, _, snaps, _ = digits_snapshots
    states = [(s.step, {"model": s.model, "optimizer": s.optimizer, "step": s.step}) for s in snaps]
    empty = CheckpointChain(url, storage_options=opts)
    with pytest.raises(IncompleteCheckpointError):
        empty.load()
    chain = CheckpointChain(url, "lossless", keyframe=KeyframePolicy(every=3),
                            retention=RetentionPolicy(keep_last=2), storage_options=opts)
    for step, state in states:
        chain.save(state, step=step)
        kept = chain.steps()
        # the objects in the bucket are exactly the index and the files of the kept steps
        assert keys(client, url) == {INDEX} | {checkpoint_file(s) for s in kept}
    kept = chain.steps()
    # keyframes at saves 0, 3, 6, 9; keep_last=2 keeps saves 8 and 9 and what save 8 replays (6, 7)
    assert kept == [s for s, _ in states[6:]]
    reader = CheckpointChain(url, storage_options=opts)
    assert reader.verify() == []
    for step, state in states:
        if step in kept:
            assert same_tree(state, reader.load(step))
        else:
            with pytest.raises(StepNotFoundError):
                reader.load(step)


def test_chain_on_s3_restart_and_damage(s3, digits_snapshots):
    url, opts, client = s3
    _, _, snaps, _ = digits_snapshots
    states = [(s.step, {"model": s.model, "optimizer": s.optimizer}) for s in snaps[:5]]
    first = CheckpointChain(url, keyframe=KeyframePolicy(every=10), storage_options=opts)
    for step, state in states[:3]:
        first.save(state, step=step)
    second = CheckpointChain(url, keyframe=KeyframePolicy(every=10), storage_options=opts)  # a restart
    for step, state in states[3:]:
        e = second.save(state, step=step)
        assert not e.keyframe
    for step, state in states:
        assert same_tree(state, second.load(step))
    # an orphan from a crashed save, then damage to a committed object
    prefix = url.removeprefix(f"s3://{BUCKET}/")
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/{checkpoint_file(999)}", Body=b"partial")
    assert second.orphans() == [checkpoint_file(999)]
    assert second.gc() == [checkpoint_file(999)] and checkpoint_file(999) not in keys(client, url)
    victim = checkpoint_file(states[2][0])
    body = bytearray(client.get_object(Bucket=BUCKET, Key=f"{prefix}/{victim}")["Body"].read())
    body[100] ^= 0xFF
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/{victim}", Body=bytes(body))
    fresh = CheckpointChain(url, storage_options=opts)
    problems = fresh.verify(deep=False)
    assert problems and all(victim in str(p) for p in problems)
    with pytest.raises(CorruptCheckpointError, match=victim):
        fresh.load(states[4][0])


# --- faults: a server that throttles, fails, cuts connections (tests/s3faults.py) -----------------

s3faults = pytest.importorskip("s3faults")
faultfs = pytest.importorskip("faultfs")


@pytest.fixture(scope="module")
def faulty_s3(s3_endpoint):
    server = s3faults.FaultyS3Server().start()
    try:
        boto3.client("s3", endpoint_url=server.url, region_name="us-east-1").create_bucket(Bucket=BUCKET)
        yield server
    finally:
        server.stop()


@pytest.fixture
def faulty_locations(faulty_s3, monkeypatch):
    """new() -> a fresh prefix on the faulty server, seeded with three saves; the clients' retries off."""
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)  # s3fs's own retry loop: ckptzip's is the one
    opts = s3faults.chain_options(faulty_s3)
    seq = faultfs.states(3)

    def new():
        return faultfs.Location(f"s3://{BUCKET}/f-{uuid.uuid4().hex[:8]}", opts).seed(seq)
    yield new, faulty_s3
    faulty_s3.clear()


def test_conditional_writes_on_s3(faulty_locations):
    new, server = faulty_locations
    st = Storage(new().url, s3faults.chain_options(server))
    assert st.conditional
    v1 = st.write_if("doc", b"one", None)
    with pytest.raises(WriteConflictError):
        st.write_if("doc", b"two", None)  # PUT If-None-Match: * on an existing key
    v2 = st.write_if("doc", b"two", v1)  # PUT If-Match: etag
    with pytest.raises(WriteConflictError):
        st.write_if("doc", b"three", v1)
    assert st.read_versioned("doc") == (b"two", v2)
    st.create("c", b"x")
    with pytest.raises(FileExistsError):
        st.create("c", b"y")
    server.arm(1, "500", times=2)  # a server error, twice: retried
    assert st.read("c") == b"x" and len(server.failed) == 2


def test_s3_large_create_streams_a_multipart_upload_or_nothing(s3, monkeypatch):
    """Above one PUT's limit a container goes multipart, fed part by part from its Payload; an
    upload that fails midway is aborted: no object appears, and the name stays free."""
    from ckptzip import storage
    from ckptzip.payload import Payload

    url, opts, client = s3
    st = Storage(url, opts)
    monkeypatch.setattr(storage, "_S3_MAX_PUT", 16)  # every create of more than 16 bytes is multipart
    parts = [b"header..", os.urandom(6 << 20), b"x" * 1000]  # more than one 5 MiB upload part
    st.create("big", Payload(parts))
    assert st.read("big") == b"".join(parts)
    with pytest.raises(FileExistsError):
        st.create("big", Payload(parts))

    real_write = s3fs.core.S3File.write
    def write(self, data):  # the connection dies on the payload's second part
        if len(data) > 100:
            raise ConnectionResetError("cut")
        return real_write(self, data)
    monkeypatch.setattr(s3fs.core.S3File, "write", write)
    with pytest.raises(OSError):
        st.create("cut", Payload(parts))
    assert "cut" not in keys(client, url)
    monkeypatch.setattr(s3fs.core.S3File, "write", real_write)
    st.create("cut", Payload(parts))
    assert st.read("cut") == b"".join(parts)


@pytest.mark.parametrize("kind", ["503", "lost"])
def test_s3_fault_at_every_request_of_save_restore_sweep_verify(faulty_locations, kind):
    """Throttling or a lost answer at each request: retried, never noticed."""
    new, server = faulty_locations
    nxt = faultfs.states(1, start=4)[0][1]
    ops = {"save+sweep": lambda loc: loc.save(4, nxt), "restore": lambda loc: loc.make().load(),
           "verify": lambda loc: loc.make().verify()}
    for name, op in ops.items():
        hits = 0
        for loc, out, hit in faultfs.every_call(server, new, op, lambda at: server.arm(at, kind)):
            hits += hit
            if name == "verify":
                assert out == []
            loc.check()
        assert hits >= 2, name


@pytest.mark.parametrize("nth_put", [1, 2])  # the container's PUT, the index's PUT
def test_s3_put_cut_midway_never_becomes_visible(faulty_locations, nth_put):
    """A PUT cut after half its body, again and again: no partial object appears, the chain is
    unchanged (a container whose commit failed is deleted); a single cut goes unnoticed."""
    new, server = faulty_locations
    nxt = faultfs.states(1, start=4)[0][1]
    loc = new()
    client = boto3.client("s3", endpoint_url=server.url, region_name="us-east-1")
    before, objects = loc.check(), keys(client, loc.url)
    server.arm(nth_put, "drop", times=3, methods=("PUT",))  # more cuts than the HTTP client retries itself
    with pytest.raises(StorageUnavailableError, match="saving step 4 .*failed 1 time .*unchanged") as ei:
        loc.make(retry=RetryPolicy(attempts=1)).save(nxt, step=4)
    assert server.failed and "\n" not in str(ei.value)
    server.clear()
    assert loc.check() == before and keys(client, loc.url) == objects
    server.arm(nth_put, "drop", methods=("PUT",))
    loc.save(4, nxt)
    assert server.failed
    server.clear()
    assert loc.check()[-1] == 4


def test_s3_racing_commit_loses_cleanly(faulty_locations):
    """Two writers' commits race on S3: PUT If-Match lets exactly one land."""
    new, _ = faulty_locations
    loc = new()
    first = loc.make()
    slow = CheckpointChain(loc.url, faultfs.HookedLossless(), storage_options=loc.opts, retry=faultfs.FAST)
    slow.method.hook = lambda: loc.save(4, faultfs.states(1, start=4)[0][1], first)
    with pytest.raises(ChainBusyError, match="while this writer was saving step 4"):
        slow.save(faultfs.states(1, start=9)[0][1], step=4)
    assert loc.check()[-1] == 4 and first.orphans() == []
