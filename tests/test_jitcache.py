"""numba's kernels compiled in a child process (jitcache.py): the stamp, the fallbacks, and a real
cold cache from which a GPT chain's saves and restores compile nothing in the training process."""
import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from ckptzip import jitcache
from ckptzip.codec.huffman import HAVE_NUMBA

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_numba = pytest.mark.skipif(not HAVE_NUMBA, reason="the child compiles numba's kernels")


@pytest.fixture
def fresh(monkeypatch):
    """No child started or waited for in this process yet, the default mode."""
    monkeypatch.setattr(jitcache, "_children", {})
    monkeypatch.delenv(jitcache.ENV, raising=False)


@pytest.fixture
def child_script(fresh, tmp_path, monkeypatch):
    """``child_script(body)``: the child replaced by a shell script, no stamp in numba's cache."""
    def use(body: str) -> None:
        exe = tmp_path / "python"
        exe.write_text(f"#!/bin/sh\n{body}\n")
        exe.chmod(0o755)
        monkeypatch.setattr(jitcache, "stamp_path", lambda m: str(tmp_path / f"stamp-{m}"))
        monkeypatch.setattr(jitcache.sys, "executable", str(exe))
    return use


@needs_numba
def test_stamp_names_the_method_and_follows_the_sources(tmp_path, monkeypatch):
    assert jitcache.stamp_path("dynaquant/2") == jitcache.stamp_path("dynaquant") != jitcache.stamp_path("lossless")
    assert os.path.dirname(jitcache.stamp_path("dynaquant")) == jitcache.cache_dir()
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(jitcache, "__file__", str(pkg / "jitcache.py"))
    before = jitcache.stamp_path("dynaquant")
    assert jitcache.stamp_path("dynaquant") == before
    (pkg / "a.py").write_text("x = 22\n")  # an edited source: the cache may lack its kernels
    assert jitcache.stamp_path("dynaquant") != before


@needs_numba
def test_inprocess_starts_no_child(fresh, monkeypatch):
    monkeypatch.setenv(jitcache.ENV, "inprocess")
    monkeypatch.setattr(jitcache.subprocess, "Popen", lambda *a, **k: pytest.fail("a child was started"))
    jitcache.prepare("dynaquant")
    jitcache.ready("dynaquant")
    assert not jitcache.enabled()


@needs_numba
def test_a_method_of_the_users_compiles_here(fresh, monkeypatch):
    monkeypatch.setattr(jitcache.subprocess, "Popen", lambda *a, **k: pytest.fail("a child was started"))
    jitcache.prepare("my-method/1")  # registered in this process only: a child could not make it
    jitcache.ready("my-method")


@needs_numba
def test_a_failed_child_warns_and_the_save_goes_on(child_script, tmp_path, caplog):
    from ckptzip.chain import CheckpointChain
    import torch

    child_script("echo 'ImportError: no torch here' >&2; exit 3")
    with caplog.at_level(logging.WARNING, logger="ckptzip.jitcache"):
        chain = CheckpointChain(f"file://{tmp_path}/c", "lossless")
        chain.save({"w": torch.arange(10.0)}, 1)
    assert torch.equal(chain.load(1)["w"], torch.arange(10.0))
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "ImportError: no torch here" in msgs[0] and "compiling in this process" in msgs[0]
    chain.save({"w": torch.arange(10.0) + 1}, 2)  # warned once: the child is not retried within a process
    assert len(caplog.records) == 1


@needs_numba
def test_threads_waiting_for_one_child_report_once_and_block_no_other_method(child_script, caplog):
    import threading
    import time

    child_script("sleep 2; echo 'boom' >&2; exit 1")
    jitcache.prepare("lossless")
    with caplog.at_level(logging.WARNING, logger="ckptzip.jitcache"):
        waiters = [threading.Thread(target=jitcache.ready, args=("lossless",)) for _ in range(2)]
        for t in waiters:
            t.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        jitcache.prepare("dynaquant")  # another chain's child starts while both wait
        assert time.monotonic() - t0 < 1.5
        for t in waiters:
            t.join(30)
        jitcache.ready("dynaquant")
    lossless = [r.getMessage() for r in caplog.records if " lossless " in r.getMessage()]
    assert len(lossless) == 1 and "boom" in lossless[0]


@needs_numba
def test_a_child_nobody_waits_for_ends_and_is_reaped(child_script, tmp_path):
    """A chain that never saves (the trainer's side of an async engine) never calls ready(): the
    child must not block on what it writes to stderr (it would hold the lock other processes'
    children wait on), and it must not stay a zombie."""
    import time

    done = tmp_path / "done"
    child_script(f"head -c 300000 /dev/zero | tr '\\0' x >&2; touch {done}")
    jitcache.prepare("lossless")
    child, _ = jitcache._children["lossless"]
    deadline = time.monotonic() + 30
    while child.returncode is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert done.exists() and child.returncode == 0  # ended, and reaped by the thread (returncode set)


@needs_numba
def test_a_child_past_its_timeout_is_killed(child_script, caplog):
    child_script("exec sleep 60")
    jitcache.prepare("lossless")
    child, _ = jitcache._children["lossless"]
    with caplog.at_level(logging.WARNING, logger="ckptzip.jitcache"):
        jitcache.ready("lossless", timeout=0.5)
    assert child.poll() is not None
    assert "no result within" in caplog.records[0].getMessage()


@needs_numba
def test_a_cold_cache_compiles_in_the_child_only(tmp_path):
    """A fresh numba cache: a GPT-2 chain's saves (with the search), restores and a resumed save in
    a new process load every kernel the child compiled; a second process finds the stamp and
    starts no child."""
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent("""
        import gc, json, resource, sys, torch
        from transformers import GPT2Config, GPT2LMHeadModel
        from ckptzip import jitcache
        from ckptzip.chain import CheckpointChain
        from ckptzip.methods.base import EncodeContext
        from numba.core.dispatcher import Dispatcher

        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=32))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randint(0, 256, (4, 32))
        score = lambda m: float(m(input_ids=x, labels=x).loss)
        chain = CheckpointChain(sys.argv[1], "dynaquant")
        started = jitcache._children.get("dynaquant") is not None
        for step in range(1, 5):
            for _ in range(4):
                opt.zero_grad()
                model(input_ids=x, labels=x).loss.backward()
                opt.step()
            ctx = EncodeContext(step=step, model=model, eval_fn=score, threshold=0.01) if step > 2 else None
            chain.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, step, model=model, ctx=ctx)
        for step in range(1, 5):
            CheckpointChain(sys.argv[1]).restore(step)
        resumed = CheckpointChain(sys.argv[1], "dynaquant")  # a restart after a failure
        model.load_state_dict(resumed.restore().state["model"])
        opt.zero_grad()
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        resumed.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, 5, model=model,
                     ctx=EncodeContext(step=5, model=model, eval_fn=score, threshold=0.01))
        compiled = sorted(o.py_func.__qualname__ for o in gc.get_objects() if isinstance(o, Dispatcher)
                          and o.py_func.__module__.startswith("ckptzip") and sum(o.stats.cache_misses.values()))
        print(json.dumps({"started": started, "compiled_here": compiled,
                          "stamp": jitcache.stamp_path("dynaquant")}))
    """))
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"), PYTHONPATH=os.path.join(ROOT, "src"))
    env.pop(jitcache.ENV, None)

    def run(i: int) -> dict:
        out = subprocess.run([sys.executable, str(script), f"file://{tmp_path}/chain{i}"], env=env,
                             capture_output=True, text=True, timeout=1500)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    cold = run(1)
    assert cold["started"] and cold["compiled_here"] == [] and os.path.exists(cold["stamp"])
    assert cold["stamp"].startswith(str(tmp_path / "numba"))
    warm = run(2)
    assert not warm["started"] and warm["compiled_here"] == []


@needs_numba
def test_cli_jit_compiles_and_names_bad_methods(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"), PYTHONPATH=os.path.join(ROOT, "src"))
    bad = subprocess.run([sys.executable, "-m", "ckptzip", "jit", "nosuch"], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "nosuch" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    ok = subprocess.run([sys.executable, "-m", "ckptzip", "jit", "lossless"], env=env, capture_output=True, text=True)
    assert ok.returncode == 0 and "compiled into" in ok.stdout and str(tmp_path / "numba") in ok.stdout, ok.stderr
    stamps = [d / f for d in (tmp_path / "numba").iterdir() for f in os.listdir(d) if f.startswith("ckptzip-jit-lossless-")]
    assert len(stamps) == 1
    off = subprocess.run([sys.executable, "-m", "ckptzip", "jit"], env={**env, jitcache.ENV: "inprocess"},
                         capture_output=True, text=True)
    assert off.returncode == 0 and "nothing to compile" in off.stdout
    # the child sweeps the files of kernels whose line moved (an edit), and only those
    folder = stamps[0].parent
    compiled = {f for f in os.listdir(folder) if f.endswith((".nbi", ".nbc"))}
    moved, other = folder / "rans._encode_kernel-1.py311.nbi", folder / "notimported.kernel-1.py311.nbi"
    for f in (moved, other, folder / "rans._encode_kernel-1.py311.1.nbc"):
        f.write_bytes(b"")
    stamps[0].unlink()
    again = subprocess.run([sys.executable, "-m", "ckptzip", "jit", "lossless"], env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    left = set(os.listdir(folder))
    assert compiled < left and other.name in left and not {moved.name, "rans._encode_kernel-1.py311.1.nbc"} & left


def test_stale_files_are_a_live_modules_files_of_no_live_kernel(tmp_path):
    live = {str(tmp_path): {"bytegroup.split-10.py311", "rans.enc-5.py311"}}
    keep = ["bytegroup.split-10.py311.nbi", "bytegroup.split-10.py311.1.nbc", "rans.enc-5.py311.nbi",
            "other.k-3.py311.nbi", "ckptzip-jit-lossless-0123", "bytegroup.cpython-311.pyc"]
    gone = ["bytegroup.split-7.py311.nbi", "bytegroup.split-7.py311.2.nbc", "rans.enc-50.py311.nbi"]
    for name in keep + gone:
        (tmp_path / name).write_bytes(b"")
    assert sorted(jitcache._stale_files(live)) == sorted(str(tmp_path / n) for n in gone)
    assert jitcache._stale_files({str(tmp_path / "missing"): {"x.k-1.py311"}}) == []


@needs_numba
def test_live_kernels_are_this_processes_cached_kernels_by_folder():
    from ckptzip.codec import bytegroup

    live = jitcache._live_kernels()
    assert any(s.startswith("bytegroup._sample_gains_kernel-") for s in live[bytegroup._sample_gains_kernel.stats.cache_path])
