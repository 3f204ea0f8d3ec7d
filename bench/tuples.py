"""Code streams packed a few codes to a symbol (stage tuple/1) against plain, paired (issue 15).

An order-0 coder spends one state update a symbol. The grid moment codec's direction codes (Adam's
exp_avg: 3 levels, ~90 % of them the pruned middle) are a third of a chain's codes; packed three to
a symbol (``codec/tuples.py``) they take a third of the updates, and long cyclic-delta streams of
6-32 levels (weights, exp_avg_sq) half. This script saves the same chain with packing (the
writer's default floors, or ``--small-codes`` / ``--paired-codes``) and without it (the floors
``tuples.SMALL_CODES`` and ``PAIRED_CODES`` past every stream: the previous writer's bytes), in
turn, then restores its last step each way, and times zstd-3 over the same checkpoints' raw bytes
beside them. Thread CPU time, ``torch.set_num_threads(1)``; the first repetition warms up. The two
chains' restores are checked equal, bit for bit.

``--gpt2 STEPS``: GPT-2 124M from config instead (bench/speed.py's ``gpt2_states``: two checkpoints
STEPS AdamW steps apart); ``--states FILE``: a ``torch.save``d list of training states.

Run:  .venv/bin/python bench/tuples.py [--reps 20] [--width 96 --layers 4] [--paired-codes 4096]
                                       [--gpt2 2 --reps 2] [--states FILE]
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
from speed import ZSTD_LEVEL, gpt2_states, raw_bytes, same_tensors, small_states  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--width", type=int, default=96)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--gpt2", type=int, default=0, help="GPT-2 124M, checkpoints this many steps apart")
    p.add_argument("--states", default=None, help="a torch.save'd list of states (default: the small chain)")
    p.add_argument("--small-codes", type=int, default=None, help="tuples.SMALL_CODES (B <= 5) for the packed chain")
    p.add_argument("--paired-codes", type=int, default=None, help="tuples.PAIRED_CODES (B = 6..32) for the packed chain")
    args = p.parse_args(argv)

    import fsspec
    import zstandard

    from ckptzip.chain import CheckpointChain
    from ckptzip.codec import tuples
    from ckptzip.dcp.tools import flat_tensors

    states = torch.load(args.states, weights_only=False) if args.states else gpt2_states(args.gpt2) if args.gpt2 \
        else small_states(6, 8, n_embd=args.width, n_layer=args.layers)
    torch.set_num_threads(1)
    packing = (args.small_codes or tuples.SMALL_CODES, args.paired_codes or tuples.PAIRED_CODES)
    defaults = tuples.SMALL_CODES, tuples.PAIRED_CODES
    zc, dz = zstandard.ZstdCompressor(level=ZSTD_LEVEL), zstandard.ZstdDecompressor()
    raws = [raw_bytes(s) for s in states]
    frames = [zc.compress(r) for r in raws]

    def run(packed: bool, rep: int):
        """(save seconds, restore seconds, bytes, restored state) of one chain."""
        tuples.SMALL_CODES, tuples.PAIRED_CODES = packing if packed else (1 << 62, 1 << 62)
        url = f"memory://tuples-{os.getpid()}-{rep}-{packed}"
        try:
            chain = CheckpointChain(url, "dynaquant")
            save, nbytes = 0.0, 0
            for i, s in enumerate(states):
                t = time.thread_time()
                nbytes += chain.save(s, i + 1).nbytes
                save += time.thread_time() - t
            t = time.thread_time()
            got = CheckpointChain(url).restore(len(states))
            return save, time.thread_time() - t, nbytes, got
        finally:
            tuples.SMALL_CODES, tuples.PAIRED_CODES = defaults
            fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)

    times = {k: [] for k in ("save packed", "save plain", "restore packed", "restore plain", "zstd-3", "unzstd-3")}
    nbytes = {}
    for rep in range(args.reps + 1):
        got = {}
        for packed in ((True, False) if rep % 2 else (False, True)):
            save, restore, nbytes[packed], got[packed] = run(packed, rep)
            if rep:
                times[f"save {'packed' if packed else 'plain'}"].append(save)
                times[f"restore {'packed' if packed else 'plain'}"].append(restore)
        t = time.thread_time()
        for r in raws:
            zc.compress(r)
        t2 = time.thread_time()
        for f in frames:
            dz.decompress(f)
        if rep:
            times["zstd-3"].append(t2 - t)
            times["unzstd-3"].append(time.thread_time() - t2)
        assert same_tensors(got[True].flat.tensors, got[False].flat.tensors), "restores differ"
    z, uz = statistics.median(times["zstd-3"]), statistics.median(times["unzstd-3"])
    rows = []
    for what in ("save", "restore"):
        for kind in ("packed", "plain"):
            v = times[f"{what} {kind}"]
            base = z if what == "save" else uz
            rows.append([f"{what}, {kind}", f"{1e3 * statistics.median(v):.1f}", f"{1e3 * min(v):.1f}",
                         f"{statistics.median(v) / base:.2f}x"])
    model = {t.data_ptr(): t.numel() for n, t in flat_tensors(states[0]) if n.startswith("model")}  # tied: once
    n_params = sum(model.values())
    print(f"\n### dynaquant, {len(states)} checkpoints ({n_params / 1e6:.2f}M parameters), {args.reps} paired "
          f"repetitions; restore: step {len(states)} from its keyframe; packed from {packing[0]} codes (B <= 5), "
          f"{packing[1]} (B = 6..32)\n")
    print(md_table(["chain", "median ms", "min ms", "x zstd-3 (save) / its decompress (restore)"], rows))
    for what in ("save", "restore"):
        d = [x - y for x, y in zip(times[f"{what} plain"], times[f"{what} packed"])]
        se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else float("nan")
        print(f"\n{what}: packing saves {1e3 * statistics.mean(d):.1f} +- {1e3 * se:.1f} ms a chain (paired), "
              f"{statistics.median(times[f'{what} packed']) / statistics.median(times[f'{what} plain']):.3f}x the time")
    print(f"\nbytes: packed {nbytes[True]:,}, plain {nbytes[False]:,} ({100 * (nbytes[True] / nbytes[False] - 1):+.2f} %); "
          f"zstd-3 {sum(len(f) for f in frames):,} ms {1e3 * z:.1f}")


if __name__ == "__main__":
    main()
