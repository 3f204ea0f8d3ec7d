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
from ckptzip.errors import CorruptCheckpointError, IncompleteCheckpointError, StepNotFoundError  # noqa: E402
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
