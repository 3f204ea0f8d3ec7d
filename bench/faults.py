"""Faults a long training run meets (issue 18): randomized injections across every scenario, and
the fault matrix with what was lost.

Each trial draws its scenario, fault and moment from one seeded RNG, injects it into a real chain,
then audits the chain with a fresh reader:
  lost        a step whose save was reported committed (or that a crash left committed), and that
              retention keeps (the two newest: keep_last=2), missing from the chain or not loading
              bit-exact -- must be 0
  unreadable  the chain fails verify(deep=True) or its latest step does not load -- must be 0

Scenarios (tests/faultfs.py, tests/s3faults.py and tests/data/fault_writer.py inject them):
  transient   a timeout / reset / throttle at a random storage call of a save (with a retention
              sweep), a restore or a verify, the call lost or only its answer; failing fsspec
              filesystem over memory or a local folder
  permanent   no space / read-only / permission denied from a random call of a save on, until
              cleared; then the next save
  crash       a writer process SIGKILLed at a random storage call of a save with retention
              (forked children of a fork server); the next writer takes the dead one's chain over
  writer      a second writer process: while the owner lives (busy), with takeover=True (the
              owner is fenced at its next save), or racing a commit (compare-and-swap)
  s3          moto's S3 server answering 503 / 500, cutting a PUT midway or losing an answer at a
              random request of a save, restore or verify (the clients' own retries off)
  mismatch    a restore into a model or optimizer that does not fit (shape, dtype, names, order)
  readers     a reader process looping restore + verify while a writer saves and sweeps (counted
              per reader iteration; reported apart, not in the trial count)

Run:  .venv/bin/python bench/faults.py                  (220 trials, seed 0; about 2-4 minutes)
      .venv/bin/python bench/faults.py --trials 40 --no-s3
"""
from __future__ import annotations

import argparse
import collections
import copy
import os
import pathlib
import queue
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "data")]
import faultfs  # noqa: E402
import fault_writer  # noqa: E402
from ckptzip.api import Compressor  # noqa: E402
from ckptzip.chain import CheckpointChain  # noqa: E402
from ckptzip.demo.workloads import DigitsMLP  # noqa: E402
from ckptzip.errors import ChainBusyError, StateMismatchError, StorageError  # noqa: E402

SEQ = faultfs.states(3)
NEXT = faultfs.states(2, start=4)


class Row:
    def __init__(self, how: str):
        self.how, self.trials, self.lost, self.unreadable = how, 0, 0, 0
        self.outcomes: collections.Counter = collections.Counter()
        self.messages: dict[str, str] = {}  # outcome -> the first one-line message seen


ROWS: dict[str, Row] = {}


def record(fault: str, how: str, outcome: str, message: str, lost: int, unreadable: int) -> None:
    row = ROWS.setdefault(fault, Row(how))
    row.trials += 1
    row.outcomes[outcome] += 1
    row.lost += lost
    row.unreadable += unreadable
    if message:
        row.messages.setdefault(outcome, message)


def audit(loc: faultfs.Location) -> tuple[int, int]:
    """(lost, unreadable) of a location, read by a fresh chain without faults."""
    reader = loc.make()
    try:
        unreadable = int(bool(reader.verify(deep=True)))
        steps = reader.steps()
        committed = sorted(loc.saved)
        lost = sum(1 for s in committed[-2:] if s not in steps)
        for s in steps:
            try:
                got = reader.load(s)
                same = s in loc.saved and all(torch.equal(got["model"][k], loc.saved[s]["model"][k])
                                              for k in loc.saved[s]["model"])
                lost += int(not same and s in committed)
            except Exception:  # noqa: BLE001 - any failure to load is the chain's
                unreadable = 1
    except Exception:  # noqa: BLE001
        return 0, 1
    return lost, unreadable


def one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


# --- scenarios ---------------------------------------------------------------------------------

def faulty_location(proto, plan, base) -> faultfs.Location:
    root = f"/ckz-bench-{uuid.uuid4().hex}" if proto == "memory" else f"{base}/{uuid.uuid4().hex[:8]}"
    return faultfs.Location(f"faulty://{root}", {"target_protocol": proto, "plan": plan}).seed(SEQ)


def calls_of(injector, op: str, loc) -> int:
    """How many storage calls (requests) ``OPS[op]`` makes on ``loc``; ``injector``: a FaultPlan or server."""
    injector.arm(None)
    OPS[op](loc)
    n = len(injector.calls)
    injector.clear()
    return n


def run_op(injector, op: str, loc) -> tuple[str, str]:
    """(outcome, one-line message) of ``OPS[op]`` on ``loc`` with a fault armed; the fault cleared after."""
    try:
        OPS[op](loc)
        return "no error", ""
    except Exception as e:  # noqa: BLE001 - any error is an outcome to report
        return "error", one_line(e)
    finally:
        injector.clear()


OPS = {"save+sweep": lambda loc: loc.save(4, NEXT[0][1]), "restore": lambda loc: loc.make().load(),
       "verify": lambda loc: loc.make().verify()}


def transient(rng, plan, base):
    kind, when, op = rng.choice(sorted(faultfs.TRANSIENT)), rng.choice(["before", "after"]), rng.choice(sorted(OPS))
    proto = rng.choice(["memory", "file"])
    n = calls_of(plan, op, faulty_location(proto, plan, base))
    loc = faulty_location(proto, plan, base)
    plan.arm(rng.randint(1, n), faultfs.TRANSIENT[kind], when=when)
    outcome, msg = run_op(plan, op, loc)
    record(f"transient {kind}", "failing fsspec fs (memory or local): a random call of a save + sweep, restore or "
           "verify; the call lost or only its answer", outcome, msg, *audit(loc))


def permanent(rng, plan, base):
    kind, proto = rng.choice(sorted(faultfs.PERMANENT)), rng.choice(["memory", "file"])
    n = calls_of(plan, "save+sweep", faulty_location(proto, plan, base))
    loc = faulty_location(proto, plan, base)
    plan.arm(rng.randint(1, n), faultfs.PERMANENT[kind], times=10**6)
    outcome, msg = "no error", ""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loc.save(4, NEXT[0][1])
        if caught:
            outcome, msg = "warning", str(caught[0].message)
    except StorageError as e:
        outcome, msg = "typed error", one_line(e)
    except Exception as e:  # noqa: BLE001
        outcome, msg = "error", one_line(e)
    finally:
        plan.clear()
    lost, unreadable = audit(loc)
    try:
        loc.save(5, NEXT[1][1])  # the fault cleared: the next save
    except Exception:  # noqa: BLE001
        unreadable += 1
    lost2, unreadable2 = audit(loc)
    record(f"permanent {kind}", "failing fsspec fs, a save, from a random call on; then cleared", outcome, msg,
           lost + lost2,
           min(1, unreadable + unreadable2))


class ForkServer:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, fault_writer.__file__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(x.strip()) for x in self.proc.stdout], daemon=True).start()
        assert self.next() == "ready"

    def next(self, timeout=120.0) -> str:
        return self.lines.get(timeout=timeout)

    def run(self, cmd: str) -> tuple[int, str]:
        """(exit status, error line or '') of one forked child."""
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        err = ""
        while True:
            line = self.next()
            if line.startswith("exit"):
                return int(line.split()[1]), err
            err = line.removeprefix("error ")

    def close(self):
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        self.proc.wait(30)


def local_location(base) -> faultfs.Location:
    """A plain local chain with the fork server's policies, seeded and released."""
    d = f"{base}/{uuid.uuid4().hex[:8]}"
    loc = faultfs.Location(d, None)
    loc.make = lambda **kw: fault_writer.writer_chain(d, **kw)
    chain = loc.make()
    for step in (1, 2, 3):
        loc.save(step, fault_writer.state(step), chain)
    chain.close()  # released: the children may write
    return loc


def crash(rng, server, base):
    loc = local_location(base)
    at = rng.randint(1, 9)
    status, err = server.run(f"save {loc.url} 4 {at}")
    if 4 in loc.make().steps():
        loc.saved[4] = fault_writer.state(4)  # killed after its commit: committed all the same
    lost, unreadable = audit(loc)
    chain = loc.make()
    chain.gc()
    loc.save(5, fault_writer.state(5), chain)  # the next writer takes the dead owner's chain over
    lost2, unreadable2 = audit(loc)
    outcome = {9: "killed", 0: "saved before the kill"}.get(status, f"exit {status}: {err}")
    record("writer killed mid-save", "SIGKILL at a storage call of a save + sweep", outcome, "",
           lost + lost2, min(1, unreadable + unreadable2))


def second_writer(rng, server, base):
    variant = rng.choice(["busy", "takeover", "race"])
    loc = local_location(base)
    owner = loc.make()
    loc.save(4, fault_writer.state(4), owner)  # this process owns the chain
    msg, outcome = "", "no error"
    if variant == "busy":
        status, err = server.run(f"save {loc.url} 5 0")
        outcome, msg = ("ChainBusyError", err) if err.startswith("ChainBusyError") else (f"exit {status}", err)
        loc.save(5, fault_writer.state(5), owner)  # the owner goes on
    elif variant == "takeover":
        status, err = server.run(f"save {loc.url} 5 0 takeover")
        if status == 0:
            loc.saved[5] = fault_writer.state(5)
        try:
            owner.save(fault_writer.state(6), step=6)
            outcome = "old owner not fenced"
        except ChainBusyError as e:
            outcome, msg = "old owner fenced", one_line(e)
    else:
        slow = CheckpointChain(loc.url, faultfs.HookedLossless(), keyframe=owner.keyframe, retention=owner.retention)
        slow.method.hook = lambda: loc.save(5, fault_writer.state(5), owner)
        try:
            slow.save(fault_writer.state(50), step=5)
            outcome = "both committed"
        except ChainBusyError as e:
            outcome, msg = "loser refused", one_line(e)
    lost, unreadable = audit(loc)
    orphans = len(loc.make().orphans())
    record(f"second writer: {variant}", "a forked writer process" if variant != "race" else "a commit between "
           "another writer's read and commit", outcome + (f", {orphans} orphans" if orphans else ""), msg, lost,
           unreadable)


def s3(rng, server, opts):
    kind = rng.choice(["503", "500", "drop", "lost"])
    op = rng.choice(sorted(OPS))
    n = calls_of(server, op, faultfs.Location(f"s3://ckz-bench/{uuid.uuid4().hex[:8]}", opts).seed(SEQ))
    loc = faultfs.Location(f"s3://ckz-bench/{uuid.uuid4().hex[:8]}", opts).seed(SEQ)
    server.arm(rng.randint(1, n), kind)
    outcome, msg = run_op(server, op, loc)
    record(f"s3 {kind}", "moto S3 server behind a failing middleware: a random request of a save + sweep, restore "
           "or verify", outcome, msg, *audit(loc))


MISMATCH = {
    "shape": lambda: (DigitsMLP(hidden=64), None),
    "dtype": lambda: (DigitsMLP(hidden=32).double(), None),
    "names": lambda: (torch.nn.Sequential(DigitsMLP(hidden=32)), None),
    "optimizer order": lambda: (lambda m: (m, torch.optim.Adam(list(m.parameters())[::-1])))(DigitsMLP(hidden=32)),
}


def mismatch(rng, url):
    kind = rng.choice(sorted(MISMATCH))
    model, opt = MISMATCH[kind]()
    before = copy.deepcopy(model.state_dict())
    try:
        Compressor(model, opt, url).restore()
        outcome, msg = "loaded", ""
    except StateMismatchError as e:
        outcome, msg = "typed error", one_line(e)
    touched = any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    record(f"mismatched restore: {kind}", "restore into another model / optimizer", outcome, msg, 0, int(touched))


def readers(server, base, seconds: float) -> tuple[int, int, int, str]:
    loc = local_location(base)
    chain, step = loc.make(), 3
    server.proc.stdin.write(f"read {loc.url} {seconds}\n")
    server.proc.stdin.flush()
    answer = None
    while answer is None:
        step += 1
        chain.save(fault_writer.state(step), step=step)
        time.sleep(0.01)
        try:
            answer = server.lines.get_nowait()
        except queue.Empty:
            pass
    server.next()  # exit
    _, n, errors, *first = answer.split()
    return int(n), int(errors), step - 3, " ".join(first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=220)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-s3", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    plan = faultfs.FaultPlan()
    base = tempfile.mkdtemp(prefix="ckz-faults-")
    server = ForkServer()
    s3server = opts = None
    if not args.no_s3:
        import boto3
        import s3fs
        import s3faults

        os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                           "AWS_DEFAULT_REGION": "us-east-1"})
        s3fs.S3FileSystem.retries = 1  # ckptzip's retry layer is the one that sees every fault
        s3server = s3faults.FaultyS3Server().start()
        boto3.client("s3", endpoint_url=s3server.url, region_name="us-east-1").create_bucket(Bucket="ckz-bench")
        opts = s3faults.chain_options(s3server)
    fit_url = f"{base}/fit"
    model = DigitsMLP(hidden=32)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    with Compressor(model, opt, fit_url) as ck:
        ck.save(1)
    weights = {"transient": 30, "permanent": 15, "crash": 15, "writer": 12, "s3": 18 if opts else 0, "mismatch": 10}
    t0 = time.perf_counter()
    try:
        for _ in range(args.trials):
            scenario = rng.choices(list(weights), weights=list(weights.values()))[0]
            if scenario == "transient":
                transient(rng, plan, base)
            elif scenario == "permanent":
                permanent(rng, plan, base)
            elif scenario == "crash":
                crash(rng, server, base)
            elif scenario == "writer":
                second_writer(rng, server, base)
            elif scenario == "s3":
                s3(rng, s3server, opts)
            else:
                mismatch(rng, fit_url)
        reads = readers(server, base, 3.0)
    finally:
        server.close()
        if s3server is not None:
            s3server.stop()
        shutil.rmtree(base, ignore_errors=True)
    wall = time.perf_counter() - t0

    print(f"\n{args.trials} randomized fault injections (seed {args.seed}), {wall:.0f} s\n")
    print("| fault | injected | trials | outcome | lost | unreadable | what the user sees (one line) |")
    print("|---|---|---:|---|---:|---:|---|")
    for fault, r in sorted(ROWS.items()):
        outcomes = ", ".join(f"{k} {v}" for k, v in r.outcomes.most_common())
        msg = r.messages.get("typed error") or next(iter(r.messages.values()), "")
        msg = msg if len(msg) < 240 else msg[:237] + "..."
        print(f"| {fault} | {r.how} | {r.trials} | {outcomes} | {r.lost} | {r.unreadable} | {msg or '-'} |")
    n, errors, saves, first = reads
    print(f"| readers during commits | a reader process, restore + verify in a loop | {n} iterations | "
          f"{errors} errors over {saves} saves with sweeps | 0 | {errors} | {first or '-'} |")
    lost = sum(r.lost for r in ROWS.values())
    unreadable = sum(r.unreadable for r in ROWS.values()) + errors
    print(f"\ntotal: {sum(r.trials for r in ROWS.values())} trials, {lost} committed steps lost, "
          f"{unreadable} unreadable chains")


if __name__ == "__main__":
    main()
