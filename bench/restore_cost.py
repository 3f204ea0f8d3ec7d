"""A restore's code streams decoded in one batch against one at a time, paired (issue 15).

A quantizing method's restore decodes every record's code stream; most of the small chain's are
short, low-entropy, single-lane rANS streams, whose decode is one chain of dependent loads and
multiplies. ``qrecord.predecode`` decodes a file's streams in one batch first
(``rans_decode_many``: single-lane streams four at a time). This script restores the same chain
with it and without it (``predecode`` a no-op: each stream decoded at its record's load, the
previous version's path), in turn, and times zstd-3 decompressing the same checkpoints' raw bytes
beside them. Thread CPU time, ``torch.set_num_threads(1)``; the first repetition warms up. Both
restores are checked equal, bit for bit. ``--threads N`` (N > 1): torch's threads, which the batch
spreads its streams over too, and wall-clock time (thread CPU time would miss the other threads).

Run:  .venv/bin/python bench/restore_cost.py [--reps 30] [--method dynaquant] [--width 32 --layers 48]
                                             [--threads 2]
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))
sys.path.insert(1, HERE)

from compare import md_table  # noqa: E402
from speed import ZSTD_LEVEL, raw_bytes, same_tensors, small_states  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--method", default="dynaquant")
    p.add_argument("--width", type=int, default=96)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)

    import zstandard

    from ckptzip.chain import CheckpointChain
    from ckptzip.methods import qrecord

    states = small_states(6, 8, n_embd=args.width, n_layer=args.layers)
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    url = f"memory://restore-cost-{os.getpid()}"
    chain = CheckpointChain(url, args.method)
    for i, s in enumerate(states):
        chain.save(s, i + 1)
    dz = zstandard.ZstdDecompressor()
    frames = [zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw_bytes(s)) for s in states]
    batched = qrecord.predecode

    def restore(batch: bool):
        qrecord.predecode = batched if batch else (lambda enc, names: None)
        try:
            t = clock()
            r = CheckpointChain(url).restore(len(states))
            return clock() - t, r
        finally:
            qrecord.predecode = batched

    times = {"batch": [], "one at a time": [], "zstd-3": []}
    for rep in range(args.reps + 1):
        order = (True, False) if rep % 2 else (False, True)
        got = {}
        for batch in order:
            dt, got[batch] = restore(batch)
            if rep:
                times["batch" if batch else "one at a time"].append(dt)
        t = clock()
        for f in frames:
            dz.decompress(f)
        if rep:
            times["zstd-3"].append(clock() - t)
        a = got[True].flat.tensors
        assert same_tensors(a, got[False].flat.tensors), "the two restores differ"
    diff = [x - y for x, y in zip(times["one at a time"], times["batch"])]
    z = statistics.median(times["zstd-3"])
    rows = [[k, f"{1e3 * statistics.median(v):.1f}", f"{1e3 * min(v):.1f}",
             f"{statistics.median(v) / z:.2f}"] for k, v in times.items()]
    print(f"\n### Restore of step {len(states)}: {len(states)} files from the keyframe, {len(a)} records, "
          f"{args.method}, {args.reps} repetitions, {args.threads} torch thread(s)\n")
    print(md_table(["restore", "median ms", "min ms", "x zstd-3 decompress"], rows))
    print(f"\npaired saving of the batch: {1e3 * statistics.mean(diff):.1f} +- "
          f"{1e3 * statistics.stdev(diff) / math.sqrt(len(diff)):.1f} ms a restore "
          f"({statistics.median(times['batch']) / statistics.median(times['one at a time']):.3f}x the time)")


if __name__ == "__main__":
    main()
