"""Two builds' saves side by side, paired repetition by repetition (issue 15).

On the shared 2-core machine the load moves from one minute to the next, and zstd-3 itself has
taken 9.5-16 ms a small-chain checkpoint within an hour, so separate runs of bench/speed.py mix
two builds' difference with the load's. Here two long-lived worker processes, one per build,
take turns: each repetition saves the small chain (``speed.small_states``: the same states for
both, built once) in one worker and then in the other, the order alternating, and each worker
times zstd-3 over the same bytes right after its chain. A repetition's two saves are seconds
apart, so a paired difference sees the same load. Per build: mean and median save time a
checkpoint, x zstd-3, the sum of each checkpoint's minimum over repetitions (the least disturbed
figure), the steady checkpoints' (2 onwards, the deltas) save over zstd-3 of the same bytes per
repetition (median [min, max]: the issue's "medians over steady-state checkpoints", paired), the
same against a zstd-3 checkpointer that keeps its frames in the same memory store as the chain's
files (a save's file is new memory the process must fault in; bare zstd-3 drops its frame and
compresses the next into the pages it freed), and the paired difference (mean +- standard
error: over the repetitions, and over the worker pairs' means). Time is thread CPU time with
``torch.set_num_threads(1)``, as in speed.py. A worker process's luck (its memory layout, its
caches) moves a build's times by ~5 % for the process's life: an A/A run of this build against
itself with one pair of workers read 0.947x. So a fresh pair of workers is started every
``--respawn`` repetitions (default 10; 0: one pair throughout, as before), and the paired error
over the pairs' means counts that luck (docs/BENCHMARKS.md, "Sparse exponent planes").

The other build is checked out with ``git worktree add --detach`` into a temporary folder and
removed after; each worker imports its own build's ``src``. The first repetition's files are
compared: the script says whether both builds wrote the same bytes.

``--restore`` also restores every step of each repetition's chain (a fresh chain object each,
as a resume does) and times zstd-3's decompress of the same bytes: a second table, and whether
both builds restored the same tensors, bit for bit.

``--search`` also saves each repetition's states into a second chain with the config search
(``speed.search_model``'s GPT and validation loss, threshold 0.01): a table of the search's own
time at the steady checkpoints (2 onwards: the neighbourhood search), the searched save less its
eval_fn calls less the same repetition's fixed save of that checkpoint, against that fixed save
(issue 15's "<= 1x a fixed-config save beyond eval_fn"), and whether both builds restored the
same tensors from the searched chain.

Each worker's kernels compile into its own fresh numba cache: in a child process where the build
has ``jitcache.py`` (the worker then loads them), else in the worker. ``--other-jit inprocess``
makes the other build's worker compile in its own process (``CKPTZIP_JIT=inprocess``); against
``HEAD`` it measures what that costs a process's saves.

Run:  .venv/bin/python bench/ab.py 9d5692e                     (dynaquant, 40 repetitions)
      .venv/bin/python bench/ab.py 2e0d380 --restore --reps 20
      .venv/bin/python bench/ab.py HEAD~3 --method lossless --reps 30
      .venv/bin/python bench/ab.py d89f8b4 --width 32 --layers 48 --reps 10   (a deep, narrow GPT)
      .venv/bin/python bench/ab.py HEAD~2 --search --reps 30
      .venv/bin/python bench/ab.py HEAD --other-jit inprocess --reps 30   (kernels compiled in the worker)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def worker(src: str, states_path: str, method: str, restore: str = "0", search: str = "0") -> None:
    """One build: a line "go <rep>" on stdin -> one JSON line (save seconds per checkpoint, zstd-3's,
    the files' SHA-256; with ``restore`` "1" the restore of every step, zstd-3's decompress and the
    restored tensors' SHA-256; with ``search`` "1" the searched saves less their eval_fn seconds
    and the searched chain's restored tensors' SHA-256) on stdout."""
    sys.path.insert(0, src)
    sys.path.insert(1, HERE)
    torch.set_num_threads(1)
    import fsspec
    import zstandard

    import speed
    from ckptzip.chain import CheckpointChain
    from ckptzip.methods.base import EncodeContext

    if search == "1":
        model, eval_fn, spent = speed.search_model()
    states = torch.load(states_path, weights_only=False)
    raws = [speed.raw_bytes(s) for s in states]
    cz, fs = zstandard.ZstdCompressor(level=speed.ZSTD_LEVEL), fsspec.filesystem("memory")
    dz = zstandard.ZstdDecompressor()
    print("ready", flush=True)
    for line in sys.stdin:
        rep = int(line.split()[1])
        url = f"memory://ab-{os.getpid()}-{rep}"
        ch = CheckpointChain(url, method)
        save = []
        for i, s in enumerate(states):
            t = time.thread_time()
            ch.save(s, i + 1)
            save.append(time.thread_time() - t)
        files = [hashlib.sha256(fs.cat(f"{url[len('memory://'):]}/{e.file}")).hexdigest() for e in ch.entries()]
        out = {"save": save, "files": files}
        if restore == "1":  # every step from a fresh chain object, as a resume does
            out["restore"], digests = [], []
            for i in range(len(states)):
                t = time.thread_time()
                got = CheckpointChain(url).restore(i + 1).state
                out["restore"].append(time.thread_time() - t)
                digests.append(speed.tensors_digest(got))
            out["restored"] = digests
        fs.rm(url[len("memory://"):], recursive=True)
        if search == "1":
            ch = CheckpointChain(url, method)
            out["searched"] = []
            for i, s in enumerate(states):
                model.load_state_dict(s["model"])
                spent[0] = 0.0
                t = time.thread_time()
                ch.save(s, i + 1, ctx=EncodeContext(step=i + 1, model=model, eval_fn=eval_fn, threshold=0.01))
                out["searched"].append(time.thread_time() - t - spent[0])
            out["searched_restored"] = [speed.tensors_digest(ch.restore(i + 1).state) for i in range(len(states))]
            fs.rm(url[len("memory://"):], recursive=True)
        out["zstd"], out["unzstd"], out["zstd_stored"] = [], [], []
        for r in raws:
            t = time.thread_time()
            z = cz.compress(r)
            out["zstd"].append(time.thread_time() - t)
            if restore == "1":
                t = time.thread_time()
                dz.decompress(z)
                out["unzstd"].append(time.thread_time() - t)
        zurl = f"ab-zstd-{os.getpid()}-{rep}"
        for i, r in enumerate(raws):  # a zstd-3 checkpointer: its frames kept in the same store as the chain's files
            t = time.thread_time()
            fs.pipe_file(f"{zurl}/{i}.zst", cz.compress(r))
            out["zstd_stored"].append(time.thread_time() - t)
        fs.rm(zurl, recursive=True)
        print(json.dumps(out), flush=True)


def start(src: str, states_path: str, method: str, cache: str, restore: bool, search: bool,
          jit: str | None = None) -> subprocess.Popen:
    # each worker compiles its kernels into a fresh numba cache, so both start alike (one on the
    # checkout's cache beside one that compiled gave an A/A test of 0.905x: docs/BENCHMARKS.md;
    # builds with jitcache.py compile in a child, ``jit="inprocess"`` in the worker itself)
    env = dict(os.environ, NUMBA_CACHE_DIR=cache, **({"CKPTZIP_JIT": jit} if jit else {}))
    p = subprocess.Popen([sys.executable, __file__, "--worker", src, states_path, method, str(int(restore)),
                          str(int(search))],
                         stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env)
    if p.stdout.readline().strip() != "ready":
        raise SystemExit(f"the worker for {src} did not start")
    return p


def ask(p: subprocess.Popen, rep: int) -> dict:
    p.stdin.write(f"go {rep}\n")
    p.stdin.flush()
    line = p.stdout.readline()
    if not line:
        raise SystemExit("a worker exited early (its error is above)")
    return json.loads(line)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(*sys.argv[2:7])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rev", help="the other build: a commit of this repository")
    ap.add_argument("--method", default="dynaquant")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--small-n", type=int, default=6)
    ap.add_argument("--small-every", type=int, default=8)
    ap.add_argument("--width", type=int, default=96, help="the GPT's n_embd (default: the small chain's)")
    ap.add_argument("--layers", type=int, default=4, help="the GPT's n_layer (48 with --width 32: bench/record_cost.py's "
                    "deep, narrow GPT of ~2,300 records)")
    ap.add_argument("--respawn", type=int, default=10,
                    help="a fresh pair of workers every N repetitions (0: one pair for the whole run). A worker "
                         "process's luck moves a build's times by ~5 %% for its life (an A/A run of one pair: "
                         "0.947x); the error over pairs counts it")
    ap.add_argument("--restore", action="store_true", help="also restore every step, paired the same way")
    ap.add_argument("--search", action="store_true", help="also save with the config search, paired the same way")
    ap.add_argument("--other-jit", choices=["child", "inprocess"], default=None,
                    help="CKPTZIP_JIT for the other build's worker (with HEAD as the other build, inprocess "
                         "measures what compiling the kernels in the training process costs)")
    args = ap.parse_args()
    if args.search and (args.width, args.layers) != (96, 4):
        ap.error("--search evaluates the small chain's GPT (speed.search_model): drop --width / --layers")
    sys.path.insert(0, HERE)
    import speed

    with tempfile.TemporaryDirectory(prefix="ckptzip-ab-") as tmp:
        other = os.path.join(tmp, "other")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", other, args.rev], check=True,
                       capture_output=True)
        try:
            states_path = os.path.join(tmp, "states.pt")
            torch.save(speed.small_states(args.small_n, args.small_every, n_embd=args.width, n_layer=args.layers),
                       states_path)
            def spawn() -> dict:
                return {args.rev: start(os.path.join(other, "src"), states_path, args.method, os.path.join(tmp, "nb1"),
                                        args.restore, args.search, args.other_jit),
                        "this": start(os.path.join(ROOT, "src"), states_path, args.method, os.path.join(tmp, "nb2"),
                                      args.restore, args.search)}

            runs: dict[str, list[dict]] = {args.rev: [], "this": []}
            files, pair, builds = {}, -1, {}
            for rep in range(args.reps):
                if not builds:  # a fresh pair of workers; its first repetition warms both up (numba's cache,
                    builds, pair = spawn(), pair + 1  # first touches) and is not counted
                    for b in builds:
                        r = ask(builds[b], 0)
                        files.setdefault(b, (r["files"], r.get("restored"), r.get("searched_restored")))
                for b in (list(builds) if rep % 2 else list(builds)[::-1]):
                    runs[b].append({**ask(builds[b], rep + 1), "pair": pair})
                if args.respawn and (rep + 1) % args.respawn == 0 or rep + 1 == args.reps:
                    for p in builds.values():
                        p.stdin.close()
                        p.wait()
                    builds = {}
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", other], capture_output=True)
    report(args, runs, files)


def report(args, runs: dict, files: dict) -> None:
    (a, ra), (b, rb) = runs.items()
    n = len(ra[0]["save"])
    ms = lambda xs: 1e3 * sum(xs) / n  # noqa: E731 (seconds of a chain -> ms a checkpoint)
    zm = statistics.mean(ms(r["zstd"]) for r in ra + rb)
    zmin = 1e3 * sum(min(col) for col in zip(*(r["zstd"] for r in ra + rb))) / n
    chain = "the small chain" if (args.width, args.layers) == (96, 4) else f"a GPT of width {args.width}, {args.layers} layers"
    print(f"### {args.method}: {b} build vs {a}, {args.reps} paired repetitions of {chain} ({n} checkpoints)\n")
    print(f"same bytes written: {files[a][0] == files[b][0]}\n")
    zs = statistics.mean(ms(r["zstd_stored"]) for r in ra + rb)
    print(f"| build | save, mean ms | median | x zstd-3 (mean {zm:.2f} ms) | per-checkpoint minima, ms "
          f"| x zstd-3 minima ({zmin:.2f} ms) | steady checkpoints x zstd-3, median [min, max] "
          f"| the same x zstd-3 stored alike (mean {zs:.2f} ms) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, rs in ((a, ra), (b, rb)):
        s = [ms(r["save"]) for r in rs]
        mn = 1e3 * sum(min(col) for col in zip(*(r["save"] for r in rs))) / n
        # the issue's own figure: checkpoints 2 onwards (deltas), each repetition against its zstd-3
        steady = sorted(sum(r["save"][1:]) / sum(r["zstd"][1:]) for r in rs)
        stored = sorted(sum(r["save"][1:]) / sum(r["zstd_stored"][1:]) for r in rs)
        print(f"| {name} | {statistics.mean(s):.2f} | {statistics.median(s):.2f} | {statistics.mean(s) / zm:.2f}x "
              f"| {mn:.2f} | {mn / zmin:.2f}x | {statistics.median(steady):.2f}x [{steady[0]:.2f}, {steady[-1]:.2f}] "
              f"| {statistics.median(stored):.2f}x [{stored[0]:.2f}, {stored[-1]:.2f}] |")
    d, se, ratio = paired(ra, rb, "save", ms)
    print(f"\n{a} - {b}, paired: {d:.2f} +- {se} ms a checkpoint (mean +- se); "
          f"{b} takes {ratio:.3f}x the time of {a}")
    if "restore" in ra[0]:
        restores(a, ra, b, rb, files[a][1] == files[b][1])
    if "searched" in ra[0]:
        searches(a, ra, b, rb, files[a][2] == files[b][2])


def searches(a: str, ra: list[dict], b: str, rb: list[dict], same: bool) -> None:
    """The search's own time at the steady checkpoints: the searched save less its eval_fn calls
    less the same repetition's fixed save of the checkpoint."""
    for r in ra + rb:
        r["own"] = [s - f for s, f in zip(r["searched"][1:], r["save"][1:])]
        r["fixed"] = r["save"][1:]
    n = len(ra[0]["own"])
    ms = lambda xs: 1e3 * sum(xs) / n  # noqa: E731 (seconds of the steady checkpoints -> ms a checkpoint)
    print(f"\n#### The config search beyond eval_fn, steady checkpoints 2-{n + 1}, the same repetitions\n\n"
          f"same tensors restored from the searched chains: {same}\n")
    print("| build | search beyond eval_fn, mean ms | median | fixed save, mean ms | x fixed save (means) | "
          "per repetition: median [min, max] |")
    print("|---|---|---|---|---|---|")
    for name, rs in ((a, ra), (b, rb)):
        o, f = [ms(r["own"]) for r in rs], [ms(r["fixed"]) for r in rs]
        per = sorted(x / y for x, y in zip(o, f))
        print(f"| {name} | {statistics.mean(o):.2f} | {statistics.median(o):.2f} | {statistics.mean(f):.2f} | "
              f"{statistics.mean(o) / statistics.mean(f):.2f}x | {statistics.median(per):.2f}x [{per[0]:.2f}, {per[-1]:.2f}] |")
    d, se, ratio = paired(ra, rb, "own", ms)
    print(f"\n{a} - {b}, paired: {d:.2f} +- {se} ms a steady search; {b}'s takes {ratio:.3f}x the time of {a}'s")


def restores(a: str, ra: list[dict], b: str, rb: list[dict], same: bool) -> None:
    """The restore of every step (each replays the chain from its keyframe: several checkpoints
    decoded), beside zstd-3's decompress of one checkpoint's bytes."""
    n = len(ra[0]["restore"])
    ms = lambda xs: 1e3 * sum(xs) / n  # noqa: E731
    zm = statistics.mean(ms(r["unzstd"]) for r in ra + rb)
    print(f"\n#### Restores of every step, the same repetitions\n\nsame tensors restored: {same}\n")
    print(f"| build | restore, mean ms a step | median | x zstd-3 decompress of one checkpoint (mean {zm:.2f} ms) |")
    print("|---|---|---|---|")
    for name, rs in ((a, ra), (b, rb)):
        s = [ms(r["restore"]) for r in rs]
        print(f"| {name} | {statistics.mean(s):.2f} | {statistics.median(s):.2f} | {statistics.mean(s) / zm:.2f}x |")
    d, se, ratio = paired(ra, rb, "restore", ms)
    print(f"\n{a} - {b}, paired: {d:.2f} +- {se} ms a step; {b} takes {ratio:.3f}x the time of {a}")


def paired(ra: list[dict], rb: list[dict], key: str, ms) -> tuple[float, str, float]:
    """(mean of a's minus b's ms(r[key]) repetition by repetition; its standard error over the
    repetitions and, with several worker pairs, over the pairs' means (a process's luck is shared by
    its repetitions); b's mean over a's)."""
    d = [ms(x[key]) - ms(y[key]) for x, y in zip(ra, rb)]
    se = f"{statistics.stdev(d) / math.sqrt(len(d)):.2f}" if len(d) > 1 else "nan"
    pairs: dict[int, list[float]] = {}
    for x, v in zip(ra, d):
        pairs.setdefault(x.get("pair", 0), []).append(v)
    if len(pairs) > 1:
        means = [statistics.mean(v) for v in pairs.values()]
        se += f" (+- {statistics.stdev(means) / math.sqrt(len(means)):.2f} over {len(means)} worker pairs)"
    return statistics.mean(d), se, statistics.mean(ms(r[key]) for r in rb) / statistics.mean(ms(r[key]) for r in ra)


if __name__ == "__main__":
    main()
