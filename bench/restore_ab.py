"""Two builds' restores of one chain side by side, in fresh processes taken in turn (issue 15).

bench/ab.py keeps one long-lived worker per build, which a GPT-2 124M state does not fit twice
on a 24 GiB host. Here each round runs one process per build, the order alternating; a process
restores the chain's step ``--step`` ``--each`` times from a fresh chain object and reports the
thread CPU time of all but the first (a fresh process's first restore pays its heap's first
touches: 1.4-2x the later ones on this VM) and the SHA-256 of the restored tensors, which must
match between builds. The chain is written once by this build (``--states``: a ``torch.save``d
list of training states, bench/tuples.py's) or read from ``--chain``; both builds must read it.
The other build is checked out with ``git worktree add --detach`` into a temporary folder.

Run:  .venv/bin/python bench/restore_ab.py 2e0d380 --states gpt2.pt [--rounds 4 --each 3]
      .venv/bin/python bench/restore_ab.py 2e0d380 --chain runs/ckpt --step 6
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def worker(src: str, url: str, step: int, each: int) -> None:
    """One build's restores -> one JSON line: seconds of each restore after the first, the hash."""
    sys.path.insert(0, src)
    sys.path.insert(1, HERE)
    import torch

    torch.set_num_threads(1)
    import speed
    from ckptzip.chain import CheckpointChain

    times, digest = [], None
    for i in range(each):
        t = time.thread_time()
        state = CheckpointChain(url).restore(step).state
        times.append(time.thread_time() - t)
        if i == 0:
            digest = speed.tensors_digest(state)
        del state
    print(json.dumps({"times": times[1:], "hash": digest}), flush=True)


def run(src: str, url: str, step: int, each: int, cache: str) -> dict:
    env = dict(os.environ, NUMBA_CACHE_DIR=cache)  # each build compiles into its own numba cache
    out = subprocess.run([sys.executable, __file__, "--worker", src, url, str(step), str(each)], env=env,
                         capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"the restore with {src} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rev", help="the other build: a commit of this repository")
    ap.add_argument("--states", help="a torch.save'd list of states: this build saves them as the chain")
    ap.add_argument("--chain", help="an existing chain both builds read")
    ap.add_argument("--step", type=int, default=None, help="the step restored (default: the chain's last)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--each", type=int, default=3, help="restores a process (the first is not counted)")
    ap.add_argument("--method", default="dynaquant")
    args = ap.parse_args()
    if bool(args.states) == bool(args.chain) or args.each < 2:
        raise SystemExit("give one of --states and --chain, and --each of at least 2")
    with tempfile.TemporaryDirectory(prefix="ckptzip-restore-ab-") as tmp:
        url, step = args.chain, args.step
        if args.states:
            import torch

            sys.path.insert(0, os.path.join(ROOT, "src"))
            from ckptzip.chain import CheckpointChain

            states = torch.load(args.states, weights_only=False)
            url, step = os.path.join(tmp, "chain"), step or len(states)
            chain = CheckpointChain(url, args.method)
            for i, s in enumerate(states):
                chain.save(s, i + 1)
            del states, chain
        if step is None:
            raise SystemExit("--chain needs --step")
        other = os.path.join(tmp, "other")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", other, args.rev], check=True,
                       capture_output=True)
        try:
            builds = {args.rev: os.path.join(other, "src"), "this": os.path.join(ROOT, "src")}
            runs: dict[str, list[dict]] = {b: [] for b in builds}
            for r in range(args.rounds):
                for b in (list(builds) if r % 2 else list(builds)[::-1]):
                    runs[b].append(run(builds[b], url, step, args.each, os.path.join(tmp, f"nb-{b}")))
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", other], capture_output=True)
    report(args, step, runs)


def report(args, step: int, runs: dict) -> None:
    (a, ra), (b, rb) = runs.items()
    print(f"### {b} build vs {a}: restore of step {step}, {args.rounds} rounds of one process a build, "
          f"{args.each - 1} timed restores each\n")
    print(f"same tensors restored: {len({r['hash'] for r in ra + rb}) == 1}\n")
    print("| build | median s | min s | max s |")
    print("|---|---|---|---|")
    for name, rs in ((a, ra), (b, rb)):
        t = [x for r in rs for x in r["times"]]
        print(f"| {name} | {statistics.median(t):.2f} | {min(t):.2f} | {max(t):.2f} |")
    # paired: the same round's processes, restore by restore
    q = [y / x for ar, br in zip(ra, rb) for x, y in zip(ar["times"], br["times"])]
    lq = [math.log(v) for v in q]
    se = statistics.stdev(lq) / math.sqrt(len(lq)) if len(lq) > 1 else float("nan")
    g = math.exp(statistics.mean(lq))
    print(f"\n{b} / {a}, paired by round: {g:.3f}x the time (geometric mean of {len(q)} ratios; "
          f"x/ {math.exp(se):.3f} standard error), median ratio {statistics.median(q):.3f}")


if __name__ == "__main__":
    main()
