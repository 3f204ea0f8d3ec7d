"""Flaky and failing storage under a real chain (storage.py, retry.py): a fault at every storage call
of a save, a restore, a retention sweep and a verify, through a failing fsspec filesystem
(tests/faultfs.py) over memory and over a local folder.

Transient faults (timeouts, resets, throttling; the call skipped or its answer lost) are retried:
the operation succeeds and the chain is what it would have been. Permanent faults (no space,
read-only, permission) raise one typed, one-line error at once; the chain keeps every committed
step, stays readable, and the next save after the fault clears succeeds. Full disk and read-only
storage are also shown on a real tmpfs where the test may mount one.
"""
import errno
import os
import subprocess
import uuid
import warnings

import pytest
import torch

import faultfs
from faultfs import every_call, states
from ckptzip.chain import CheckpointChain, KeyframePolicy
from ckptzip.errors import (StorageError, StorageFullError, StorageReadOnlyError, StorageUnavailableError,
                            WriteConflictError)
from ckptzip.retry import RetryPolicy, call, transient
from ckptzip.storage import Storage
from helpers import assert_same

FAST = faultfs.FAST


@pytest.fixture(params=["memory", "file"])
def faulty(request, tmp_path):
    """(new_location, plan): chains on a faulty filesystem over memory or a local folder, each
    new location seeded with three saves."""
    plan = faultfs.FaultPlan()
    base = f"/ckz-{uuid.uuid4().hex}" if request.param == "memory" else str(tmp_path)
    opts = {"target_protocol": request.param, "plan": plan}
    seq = states(3)

    def new() -> faultfs.Location:
        return faultfs.Location(f"faulty://{base}/{uuid.uuid4().hex[:8]}", opts).seed(seq)
    yield new, plan
    plan.clear()
    fs = faultfs.fsspec.filesystem("memory")
    if request.param == "memory" and fs.exists(base):
        fs.rm(base, recursive=True)


def test_retry_classifies_and_bounds():
    assert transient(TimeoutError()) and transient(ConnectionResetError()) and transient(OSError(errno.EBUSY, "x"))
    assert not transient(FileNotFoundError()) and not transient(PermissionError()) and not transient(ValueError())
    assert not transient(OSError(errno.ENOSPC, "full"))
    tries = []

    def flaky():
        tries.append(1)
        if len(tries) < 3:
            raise TimeoutError("read timed out")
        return "ok"
    assert call(FAST, "reading", "x", flaky) == "ok" and len(tries) == 3

    def down():
        raise OSError(errno.EBUSY, "SlowDown")
    with pytest.raises(StorageUnavailableError, match=r"s3://b/x: reading failed 6 times .*SlowDown.*RetryPolicy") as ei:
        call(FAST, "reading", "s3://b/x", down)
    assert ei.value.errno == errno.EBUSY and isinstance(ei.value, OSError)
    budget = RetryPolicy(attempts=100, first_delay_s=0.01, max_delay_s=0.01, budget_s=0.05)
    with pytest.raises(StorageUnavailableError):
        call(budget, "reading", "x", down)

    def full():
        raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(StorageFullError, match="No space left on device while writing") as ei:
        call(FAST, "writing", "/d/f", full)
    assert ei.value.errno == errno.ENOSPC
    with pytest.raises(StorageReadOnlyError) as ei:
        call(FAST, "writing", "/d/f", lambda: (_ for _ in ()).throw(OSError(errno.EROFS, "Read-only file system")))
    assert isinstance(ei.value, PermissionError) and "\n" not in str(ei.value)


def test_conditional_writes_on_local_and_memory(tmp_path):
    for url in (tmp_path / "s", f"memory:///ckz-{uuid.uuid4().hex}"):
        st = Storage(url)
        assert st.conditional
        assert st.read_versioned("doc") == (None, None)
        v1 = st.write_if("doc", b"one", None)
        with pytest.raises(WriteConflictError):
            st.write_if("doc", b"two", None)  # someone created it meanwhile
        v2 = st.write_if("doc", b"two", v1)
        with pytest.raises(WriteConflictError):
            st.write_if("doc", b"three", v1)  # stale version
        assert st.read_versioned("doc") == (b"two", v2)
        st.create("c", b"x")
        with pytest.raises(FileExistsError):
            st.create("c", b"y")
        assert st.read("c") == b"x"
        assert sorted(st.list()) == ["c", "doc"]  # no temporary leftovers


NEXT = states(1, start=4)[0][1]


@pytest.mark.parametrize("when", ["before", "after"])  # the call is lost, or only its answer is
@pytest.mark.parametrize("kind", sorted(faultfs.TRANSIENT))
def test_transient_fault_at_every_call_of_save_restore_sweep_verify(faulty, kind, when):
    new, plan = faulty
    ops = {"save+sweep": lambda loc: loc.save(4, NEXT),  # a restarted writer: reads, replays, writes,
           "restore": lambda loc: loc.make().load(),      # commits, deletes what retention drops
           "verify": lambda loc: loc.make().verify()}
    for name, op in ops.items():
        hits = 0
        for loc, out, hit in every_call(plan, new, op, lambda at: plan.arm(at, faultfs.TRANSIENT[kind], when=when)):
            hits += hit
            if name == "verify":
                assert out == []  # the fault happened and the operation did not notice
            elif name == "restore":
                assert_same(loc.saved[3], out)
            else:
                assert out.step == 4
            loc.check()
        assert hits >= {"save+sweep": 6, "restore": 2, "verify": 3}[name], name


@pytest.mark.parametrize("kind", sorted(faultfs.PERMANENT))
def test_permanent_fault_at_every_call_of_a_save(faulty, kind):
    """Full disk, read-only or denied from one call on: a typed one-line error or (a sweep's delete)
    a warning; nothing committed is lost, the chain stays readable, the next save succeeds."""
    new, plan = faulty

    def save(loc):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                loc.save(4, NEXT)
            except StorageError as e:
                return e
        return caught  # the fault hit a delete after the commit: the save stands, with a warning
    hits = 0
    for loc, out, hit in every_call(plan, new, save, lambda at: plan.arm(at, faultfs.PERMANENT[kind], times=10**6)):
        if not hit:
            break
        hits += 1
        if isinstance(out, StorageError):
            assert "\n" not in str(out) and "saving step 4" in str(out) and "unchanged" in str(out)
            if kind == "full":
                assert isinstance(out, StorageFullError) and out.errno == errno.ENOSPC
            else:
                assert isinstance(out, StorageReadOnlyError) and isinstance(out, PermissionError)
        else:
            assert out and "gc()" in str(out[0].message) and 4 in loc.saved
        loc.check()
        loc.save(5, NEXT)  # space is back: the next save succeeds
        loc.check()
        c = loc.make()
        c.gc()
        assert c.orphans() == []
    assert hits >= 6


def test_permanent_read_fault_in_restore_and_verify_raises_typed(faulty):
    new, plan = faulty

    def attempt(op):
        try:
            op()
        except StorageReadOnlyError as e:
            return e

    for op in (lambda loc: loc.make().load(), lambda loc: loc.make().verify()):
        arm = lambda at: plan.arm(at, faultfs.PERMANENT["denied"], times=10**6)  # noqa: E731
        for loc, out, hit in every_call(plan, new, lambda loc: attempt(lambda: op(loc)), arm):
            assert (out is not None) == hit and (out is None or "not permitted" in str(out))
            loc.check()


def test_flaky_store_that_stays_down_gives_up_within_budget(faulty):
    new, plan = faulty
    loc = new()
    before = loc.check()
    chain = loc.make(retry=RetryPolicy(attempts=3, first_delay_s=0.0))
    plan.arm(at=1, error=faultfs.TRANSIENT["throttle"], times=10**6)
    with pytest.raises(StorageUnavailableError, match="failed 3 times") as ei:
        chain.save(NEXT, step=4)
    assert "\n" not in str(ei.value)
    plan.clear()
    assert loc.check() == before
    loc.save(4, NEXT, chain)
    assert loc.check()[-1] == 4


# --- a real full disk and a real read-only mount (tmpfs; needs root, else skipped) ---------------

@pytest.fixture
def tmpfs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_real_full_disk_and_read_only_mount(tmpfs):
    url = tmpfs / "run"
    chain = CheckpointChain(url, "lossless", keyframe=KeyframePolicy(every=1))
    small = {"w": torch.randn(1000)}
    chain.save(small, step=1)
    big = {"w": torch.randn(80_000)}  # 320 KB: over the 256 KiB device
    with pytest.raises(StorageFullError, match=r"saving step 2 .*No space left on device.*step 1 stays loadable") as ei:
        chain.save(big, step=2)
    assert ei.value.errno == errno.ENOSPC and "\n" not in str(ei.value)
    assert chain.steps() == [1] and chain.verify() == [] and chain.orphans() == []  # no temporary left
    assert_same(small, chain.load(1))
    chain.save({"w": torch.randn(1000)}, step=2)  # fits: the next save succeeds
    assert chain.steps() == [1, 2]

    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    with pytest.raises(StorageReadOnlyError, match="saving step 3 .*not permitted.*Read-only") as ei:
        chain.save(small, step=3)
    assert ei.value.errno == errno.EROFS
    assert CheckpointChain(url).steps() == [1, 2] and CheckpointChain(url).verify() == []
    subprocess.run(["mount", "-o", "remount,rw", str(tmpfs)], check=True)
    chain.save(small, step=3)
    assert CheckpointChain(url).steps() == [1, 2, 3]
    assert os.listdir(url) and all(not n.endswith(".tmp") for n in os.listdir(url))


def test_a_failed_save_after_encode_leaves_the_next_delta_right():
    """lossless advances its writer reference in place during encode (the chain spends it): a save
    whose file write then fails forgets it, and the next save of the same chain object codes its
    delta against what storage holds, not against the bits of the failed save."""
    plan = faultfs.FaultPlan()
    opts = {"target_protocol": "memory", "plan": plan}
    chain = CheckpointChain(f"faulty:///ckz-{uuid.uuid4().hex}", "lossless", retry=FAST,
                            keyframe=KeyframePolicy(every=10), storage_options=opts)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8192, generator=g)  # over GROUP_BELOW: a record of its own, advanced in place
    seq = []
    for step in range(1, 5):
        w = w - 1e-3 * torch.randn(8192, generator=g)
        seq.append((step, {"model": {"w": w.clone(), "b": w[:7].clone()}}))
    for step, state in seq[:2]:
        chain.save(state, step=step)
    plan.arm(1, faultfs.PERMANENT["full"], times=10**6, ops=("pipe_file",))
    with pytest.raises(StorageFullError):
        chain.save(seq[2][1], step=seq[2][0])
    plan.clear()
    for step, state in seq[3:]:
        e = chain.save(state, step=step)
    assert not e.keyframe
    for step, state in seq[:2] + seq[3:]:
        assert_same(state, CheckpointChain(chain.url, storage_options=opts).load(step))
