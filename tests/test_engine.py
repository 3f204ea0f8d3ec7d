"""AsyncCheckpointEngine (engine/): real agent processes, real digits states, injected faults.

Trainer-side scenarios that must die (SIGKILL mid-copy, an exception) run this file as a script in
a subprocess: ``python tests/test_engine.py <scenario> <url> <outdir> <linger_s>``.
"""
import errno
import os
import pathlib
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch

from ckptzip.chain import CheckpointChain
from ckptzip.engine import AsyncCheckpointEngine, BackpressureWarning, EngineOptions, newest_common_step
from ckptzip.engine import staging
from ckptzip.engine.engine import slots_for_budget
from ckptzip.errors import AgentError, ConfigError, StepNotFoundError
from helpers import assert_same


# Loaded by the agent through EngineOptions.agent_imports: a method that can be made slow (to kill
# the agent mid-compress) and a local filesystem that raises ENOSPC while a DISK_FULL file exists.
PLUGIN = '''
import errno, os, pathlib, time
import fsspec
from fsspec.implementations.local import LocalFileSystem
from ckptzip.methods.base import register
from ckptzip.methods.lossless import LosslessMethod


@register
class SlowLosslessMethod(LosslessMethod):
    name = "slow-lossless"

    def encode(self, state, reference, *, ctx):
        d = os.environ.get("CKZ_TEST_DIR")
        if d:
            pathlib.Path(d, f"encoding-{ctx.step}").touch()
            f = pathlib.Path(d, "sleep_s")
            if f.exists():
                time.sleep(float(f.read_text()))
        return super().encode(state, reference, ctx=ctx)


class FullFileSystem(LocalFileSystem):
    protocol = ("fullfs",)

    def __init__(self, *args, **kwargs):
        kwargs["auto_mkdir"] = True
        super().__init__(*args, **kwargs)

    def pipe_file(self, path, value, **kwargs):
        if (pathlib.Path(path).parent / "DISK_FULL").exists():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return super().pipe_file(path, value, **kwargs)


fsspec.register_implementation("fullfs", FullFileSystem, clobber=True)
'''


def states_of(snaps):
    return [(s.step, {"model": s.model, "optimizer": s.optimizer, "step": s.step, "tag": f"s{s.step}"})
            for s in snaps]


@pytest.fixture
def states(digits_snapshots):
    return states_of(digits_snapshots[2][:5])


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    d = tmp_path / "plugins"
    d.mkdir()
    (d / "ckz_engine_plugins.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(d))  # the agent gets the trainer's sys.path
    from ckptzip.methods import base

    registry = dict(base._REGISTRY)
    import ckz_engine_plugins  # noqa: F401  (registers the method and filesystem here too)

    yield ("ckz_engine_plugins",)
    sys.modules.pop("ckz_engine_plugins", None)
    base._REGISTRY.clear()  # tests leave global state as they found it
    base._REGISTRY.update(registry)


def wait_for(pred, timeout_s=30.0, what="condition"):
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def no_segments(url) -> bool:
    return staging.list_segments(staging.chain_key(str(url))) == []


@pytest.fixture(scope="module", autouse=True)
def dead_trainers(tmp_path_factory, digits_snapshots):
    """Three trainer processes, started with the module so their start-up (importing torch, starting an
    agent) overlaps the other tests: scenario -> (url, out, proc)."""
    states = states_of(digits_snapshots[2][:3])
    runs = {}
    for scenario, linger_s in (("kill-mid-copy", 60), ("kill-idle", 0.3), ("raise", 0.3)):
        d = tmp_path_factory.mktemp(scenario)
        url, out = d / "ckpt", d / "out"
        out.mkdir()
        torch.save(states, out / "states.pt")
        p = subprocess.Popen([sys.executable, __file__, scenario, str(url), str(out), str(linger_s)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        runs[scenario] = (url, out, p)
    yield runs
    for _, _, p in runs.values():
        p.kill()
        p.wait()


# --- pure parts ------------------------------------------------------------------------------

def test_newest_common_step_is_bitsnap_fig4():
    # ranks 0, 2, 3 staged 100; rank 1 failed to copy it: everyone resumes from 80
    assert newest_common_step([[60, 80, 100], [60, 80], [60, 80, 100], [60, 80, 100]]) == 80
    assert newest_common_step([[20, 60], [20, 40, 60]], step=20) == 20
    assert newest_common_step([[], []]) is None
    with pytest.raises(StepNotFoundError):
        newest_common_step([[20], [40]])
    with pytest.raises(StepNotFoundError):
        newest_common_step([[20, 40], [20]], step=40)


def test_budget_and_option_validation(tmp_path):
    assert slots_for_budget(100, 2, None) == 2
    assert slots_for_budget(100, 2, 250) == 2
    assert slots_for_budget(100, 3, 250) == 2
    with pytest.raises(ConfigError, match="memory_budget_bytes"):
        slots_for_budget(100, 2, 99)
    with pytest.raises(ConfigError, match="redundancy"):
        EngineOptions(redundancy=0)
    with pytest.raises(ConfigError, match="agent_imports"):
        EngineOptions(agent_imports="mypkg")
    with pytest.raises(ConfigError, match="memory://"):
        AsyncCheckpointEngine("memory://x/y")
    assert staging.chain_key(str(tmp_path / "a")) == staging.chain_key(f"file://{tmp_path}/a")
    assert staging.chain_key(str(tmp_path / "a")) != staging.chain_key(str(tmp_path / "b"))



def test_agent_is_niced_and_sized_before_it_imports_torch(tmp_path):
    # the start-up imports torch (~1.5 s of CPU): at the trainer's priority, on 2 cores, it stalled
    # the trainer's OpenMP pool (demo steps 100x slower); the niceness must hold from the first instant
    eng = AsyncCheckpointEngine(tmp_path / "ck", "lossless", options=EngineOptions(agent_nice=7, agent_threads=1))
    try:
        pid = eng.agent_pid
        assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + 7)
        env = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert b"OMP_NUM_THREADS=1" in env
    finally:
        eng.close()


def test_oversubscription_warning():
    from ckptzip.engine import OversubscriptionWarning
    from ckptzip.engine.options import warn_if_oversubscribed

    model, threads = torch.nn.Linear(2, 2), torch.get_num_threads()
    cores = os.cpu_count()
    try:
        torch.set_num_threads(cores)
        with pytest.warns(OversubscriptionWarning, match=r"torch.set_num_threads\("):
            warn_if_oversubscribed(model, EngineOptions(agent_threads=1))
        if cores > 1:
            torch.set_num_threads(cores - 1)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                warn_if_oversubscribed(model, EngineOptions(agent_threads=1))
    finally:
        torch.set_num_threads(threads)


# --- in-process trainer ----------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore::ckptzip.engine.BackpressureWarning")  # the agent may still be starting
def test_roundtrip_memory_first_then_storage(tmp_path, states):
    url = tmp_path / "ckpt"
    eng = AsyncCheckpointEngine(url, "lossless")
    try:
        with pytest.raises(ConfigError, match="already open"):
            AsyncCheckpointEngine(url, "lossless")
        grads = {"fc1.weight": torch.randn(128, 64)}
        from ckptzip.methods.base import EncodeContext

        handles = []
        for step, st in states[:3]:
            h = eng.save(st, step, ctx=EncodeContext(step=step, gradients=grads))
            assert h.staged.is_set()  # save returns only after the copy
            handles.append(h)
        with pytest.raises(ValueError, match="not after"):
            eng.save(states[0][1], states[0][0])
        eng.wait()
        assert [h.wait().step for h in handles] == [s for s, _ in states[:3]]
        assert all(h.committed.is_set() and h.error is None for h in handles)
        assert sorted(eng.segment_names()) == sorted([staging.ctl_name(eng.key, 0)] +
                                                     [staging.slot_name(eng.key, 0, i) for i in range(2)])
        # newest complete copy in memory first
        state, step = eng.restore()
        assert (step, eng.last_restore[1]) == (states[2][0], "memory")
        assert_same(state, states[2][1])
        # a damaged slot fails its checksum and is skipped: the same step comes from storage
        i = next(i for i, s in eng._slots.items() if s.step == states[2][0])
        seg = staging.Segment(staging.slot_name(eng.key, 0, i))
        info = staging.read_header(seg)
        seg.mm[info.data_off + 100] ^= 0xFF
        seg.close()
        state, step = eng.restore()
        assert (step, eng.last_restore[1]) == (states[2][0], "storage")
        assert_same(state, states[2][1])
        state, step = eng.restore(states[1][0])
        assert (step, eng.last_restore[1]) == (states[1][0], "memory")
        assert_same(state, states[1][1])
        # a step only the chain still has comes from storage
        state, step = eng.restore(states[0][0])
        assert (step, eng.last_restore[1]) == (states[0][0], "storage")
        assert_same(state, states[0][1])
    finally:
        eng.close()
    assert no_segments(url)
    chain = CheckpointChain(url)
    assert chain.steps() == [s for s, _ in states[:3]] and chain.verify() == []
    for s, st in states[:3]:
        assert_same(chain.load(s), st)


def test_compressor_async_save(tmp_path):
    import ckptzip
    from ckptzip.demo.workloads import DigitsMLP

    torch.manual_seed(0)
    model = DigitsMLP(32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def train(n):
        for _ in range(n):
            loss = model(torch.randn(8, 64)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

    url = tmp_path / "ck"
    ck = ckptzip.Compressor(model, opt, url, "lossless", async_save=True, checksum="crc32")
    try:
        train(3)
        h = ck.save(3)
        assert h.staged.is_set()
        train(3)
        ck.save(6)
        ck.wait()
        expect_model = {k: v.clone() for k, v in model.state_dict().items()}
        expect_opt = opt.state_dict()
    finally:
        ck.close()
    assert no_segments(url)
    assert CheckpointChain(url).manifest(6)["format_version"] == 2  # the agent wrote the checksum asked for
    model2 = DigitsMLP(32)
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    ck2 = ckptzip.Compressor(model2, opt2, url, "lossless")
    try:
        assert ck2.restore() == 6
    finally:
        ck2.close()
    assert_same(model2.state_dict(), expect_model)
    assert_same(opt2.state_dict()["state"], expect_opt["state"])


def test_backpressure_then_agent_killed_mid_compress(tmp_path, states, plugins, monkeypatch):
    d = tmp_path / "ctl"
    d.mkdir()
    monkeypatch.setenv("CKZ_TEST_DIR", str(d))
    url = tmp_path / "ckpt"
    (d / "sleep_s").write_text("0.2")
    eng = AsyncCheckpointEngine(url, "slow-lossless", options=EngineOptions(agent_imports=plugins))
    try:
        (s1, st1), (s2, st2), (s3, st3), (s4, st4), (s5, st5) = states
        eng.save(st1, s1)
        eng.save(st2, s2)
        with pytest.warns(BackpressureWarning, match="waits for the agent"):
            eng.save(st3, s3)  # both slots hold uncommitted work: waits for step s1's commit
        eng.wait()
        (d / "sleep_s").write_text("60")
        h4 = eng.save(st4, s4)
        wait_for(lambda: (d / f"encoding-{s4}").exists(), what="the agent to start encoding")
        pid = eng.agent_pid
        os.kill(pid, signal.SIGKILL)
        (d / "sleep_s").unlink()
        h5 = eng.save(st5, s5)
        eng.wait()
        assert eng.agent_pid not in (None, pid)  # restarted
        assert h4.wait().step == s4 and h5.wait().step == s5
    finally:
        eng.close()
    assert no_segments(url)
    chain = CheckpointChain(url)
    assert chain.steps() == [s for s, _ in states] and chain.verify() == []
    for s, st in states:
        assert_same(chain.load(s), st)


def test_storage_errors_reraised_with_agent_traceback(tmp_path, states, plugins):
    (tmp_path / "file").write_text("not a folder")
    bad_url = tmp_path / "file" / "ckpt"
    full_dir = tmp_path / "full"
    full_dir.mkdir()
    full_url = f"fullfs://{full_dir}"
    opts = EngineOptions(agent_imports=plugins)
    # the three agents start together
    bad = AsyncCheckpointEngine(bad_url, "lossless", options=EngineOptions(checksum_by="trainer"))
    full = AsyncCheckpointEngine(full_url, "lossless", options=opts)
    broken = AsyncCheckpointEngine(tmp_path / "broken", "lossless",
                                   options=EngineOptions(agent_imports=("no_such_module_for_ckptzip",)))
    (s1, st1), (s2, st2), (s3, st3) = states[:3]
    try:
        # an agent that cannot start fails the pending saves with its traceback
        with pytest.raises(AgentError, match="could not start: ModuleNotFoundError") as ei:
            broken.save(st1, s1).wait(60)
        assert "no_such_module_for_ckptzip" in ei.value.agent_traceback
        with pytest.raises(AgentError):
            broken.wait()

        # an unwritable location: the agent's error comes back with its traceback, once
        h = bad.save(st1, s1)
        with pytest.raises(AgentError, match="agent traceback") as ei:
            h.wait(60)
        assert ei.value.exc_type in ("NotADirectoryError", "FileExistsError")
        assert "write_atomic" in ei.value.agent_traceback or "makedirs" in ei.value.agent_traceback
        with pytest.raises(AgentError):
            h.committed.wait(1)
        with pytest.raises(AgentError):
            bad.wait()
        bad.wait()  # reported: not raised twice
        state, step = bad.restore()  # the failed step is still in shared memory
        assert (step, bad.last_restore[1]) == (s1, "memory")
        assert_same(state, st1)

        # disk full: the failed step is reported, the chain keeps what it had, later saves commit
        full.save(st1, s1).wait(60)
        (full_dir / "DISK_FULL").touch()
        h2 = full.save(st2, s2)
        with pytest.raises(AgentError, match="No space left") as ei:
            full.wait()
        assert ei.value.errno == errno.ENOSPC and h2.error is ei.value
        assert CheckpointChain(full_url).steps() == [s1]
        state, step = full.restore()
        assert (step, full.last_restore[1]) == (s2, "memory")
        assert_same(state, st2)
        (full_dir / "DISK_FULL").unlink()
        full.save(st3, s3).wait(60)
    finally:
        bad.close()
        full.close()
        broken.close()
    assert no_segments(bad_url) and no_segments(full_url) and no_segments(tmp_path / "broken")
    assert CheckpointChain(bad_url).steps() == [] and CheckpointChain(bad_url).verify() == []
    chain = CheckpointChain(full_url)
    assert chain.steps() == [s1, s3] and chain.verify() == [] and chain.orphans() == []
    assert_same(chain.load(s1), st1)
    assert_same(chain.load(s3), st3)


# --- trainer processes that die --------------------------------------------------------------

def kill_when(p, marker):
    try:
        wait_for(lambda: marker.exists() or p.poll() is not None, 60, f"{marker.name} from the trainer")
        assert p.poll() is None, p.communicate()[1].decode()[-3000:]
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.kill()
        p.wait()


def test_trainer_sigkill_mid_copy_restores_previous_in_memory(dead_trainers, states):
    url, out, p = dead_trainers["kill-mid-copy"]
    kill_when(p, out / "mid-copy")
    steps = [s for s, _ in states[:3]]
    # the restarted trainer takes the slots over from the orphaned agent and reads memory
    eng = AsyncCheckpointEngine(url, "lossless")
    try:
        state, step = eng.restore()
        assert (step, eng.last_restore[1]) == (steps[1], "memory")  # steps[2] is torn
        assert_same(state, states[1][1])
        eng.save(states[2][1], steps[2]).wait(60)
        eng.wait()
    finally:
        eng.close()
    assert no_segments(url)
    chain = CheckpointChain(url)
    assert chain.steps() == steps and chain.verify() == []


@pytest.mark.parametrize("scenario", ["kill-idle", "raise"])
def test_trainer_exit_paths_leave_no_shared_memory(dead_trainers, states, scenario):
    """SIGKILL while idle: the orphaned agent commits, lingers, cleans up. An exception: atexit does."""
    url, out, p = dead_trainers[scenario]
    if scenario == "kill-idle":
        kill_when(p, out / "staged")
    else:
        _, err = p.communicate(timeout=60)
        assert p.returncode == 1 and b"RuntimeError: boom" in err, err.decode()[-3000:]
    wait_for(lambda: no_segments(url), 30, f"{scenario}: shared memory to be cleaned up")
    chain = CheckpointChain(url)
    assert chain.steps() == [s for s, _ in states[:2]] and chain.verify() == []
    assert_same(chain.load(states[1][0]), states[1][1])


def _trainer_main(scenario, url, outdir, linger_s):
    outdir = pathlib.Path(outdir)
    states = torch.load(outdir / "states.pt", weights_only=True)
    eng = AsyncCheckpointEngine(url, "lossless", options=EngineOptions(orphan_linger_s=linger_s))
    (s1, st1), (s2, st2), (s3, st3) = states
    if scenario == "raise":
        eng.save(st1, s1)
        eng.save(st2, s2)
        raise RuntimeError("boom")  # the atexit hook flushes and unlinks
    eng.save(st1, s1).wait(60)
    eng.save(st2, s2)
    if scenario == "kill-idle":
        (outdir / "staged").touch()
        time.sleep(120)
    copied = []

    def stall(dst, src):  # the trainer "dies" in the middle of copying step s3
        staging_copy(dst, src)
        copied.append(1)
        if len(copied) == 3:
            (outdir / "mid-copy").touch()
            time.sleep(120)

    staging_copy = staging.copy_tensor
    staging.copy_tensor = stall
    eng.save(st3, s3)


if __name__ == "__main__":
    _trainer_main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]))


def test_an_eval_fn_the_agent_cannot_run_is_warned_only_when_the_method_would_search(tmp_path):
    """AsyncCheckpointEngine.save(ctx=EncodeContext(eval_fn=...)): the function cannot cross into the
    agent; a method whose search is on says so once, one whose search is off has nothing to lose."""
    from ckptzip.methods.base import EncodeContext

    model = torch.nn.Linear(8, 4)
    ctx = EncodeContext(step=1, eval_fn=lambda m: 0.0)
    for config, warns in (({"search": {"enabled": False}}, False), (None, True)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with AsyncCheckpointEngine(tmp_path / f"c{warns}", "dynaquant", config=config) as eng:
                eng.save({"model": model.state_dict()}, 1, ctx=ctx).wait()
        assert any("cannot run eval_fn" in str(w.message) for w in seen) == warns
