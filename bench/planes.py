"""Sparse byte planes (stage ``bytegroup/2``) against one zstd frame a plane, on real deltas (issue 15).

The lossless method's steady saves of the small chain (``speed.small_states``: a byte-level GPT,
208 tensors, AdamW) call ``bytegroup.compress`` once a large record; this script records those
calls (their words, parents and arguments) from a chain's third save on, and replays them with
``sparse=True`` (the default since sparse planes) and ``sparse=False`` alternately, paired
repetition by repetition: thread CPU time of the calls, of ``decompress_words`` of their blobs, and
the blobs' bytes. A second table splits the compressed planes by their share of nonzero bytes: one
zstd frame against the sparse form (a mask frame and a frame of the nonzero bytes), bytes and time
(the split kernel's included), best of the repetitions. One torch thread, as speed.py.

Run:  .venv/bin/python bench/planes.py                  (~1 min)
      .venv/bin/python bench/planes.py --reps 60 --saves 4
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def record_calls(states: list[dict]) -> list[tuple]:
    """(words, width, kwargs) of every bytegroup.compress call of a lossless chain's saves 3 onwards."""
    from ckptzip.chain import CheckpointChain
    from ckptzip.codec import bytegroup

    calls, real = [], bytegroup.compress

    def spy(raw, width, **kw):
        prev = kw.get("prev")
        calls.append((np.array(raw, copy=True), width,
                      {**kw, "advance": False, "prev": None if prev is None else np.array(prev, copy=True)}))
        return real(raw, width, **kw)

    chain = CheckpointChain("memory://bench-planes", "lossless")
    try:
        for i, s in enumerate(states):
            bytegroup.compress = spy if i >= 2 else real
            chain.save(s, i + 1)
    finally:
        bytegroup.compress = real
        import fsspec

        fsspec.filesystem("memory").rm("bench-planes", recursive=True)
    return calls


def replay(calls: list[tuple], sparse: bool) -> tuple[float, float, int]:
    """(compress seconds, decompress seconds, bytes) of the calls, thread CPU time."""
    from ckptzip.codec import bytegroup

    t = time.thread_time()
    blobs = [bytegroup.compress(w, width, **{**kw, "sparse": sparse}) for w, width, kw in calls]
    enc = time.thread_time() - t
    t = time.thread_time()
    for b, (_, width, kw) in zip(blobs, calls):
        prev = kw["prev"]
        bytegroup.decompress_words(b, None if prev is None else prev.reshape(-1).view(bytegroup._UINT[width]))
    return enc, time.thread_time() - t, sum(map(len, blobs))


def plane_table(calls: list[tuple], reps: int) -> None:
    from ckptzip.codec import bytegroup

    bins = [(0.0, 0.2), (0.2, 0.35), (0.35, 0.5), (0.5, 0.8), (0.8, 1.01)]
    rows = {b: [0, 0, 0, 0.0, 0.0, 0] for b in bins}  # planes, bytes, one frame's bytes, its s, sparse s, sparse bytes
    for w, width, kw in calls:
        words = w.reshape(-1).view(bytegroup._UINT[width])
        prev = None if kw["prev"] is None else kw["prev"].reshape(-1).view(bytegroup._UINT[width])
        planes = bytegroup.split_planes(words, width > 1 and kw.get("float_bits", True), prev)
        keep_raw = bytegroup._probed_raw(planes, kw.get("store_raw", ()), kw.get("min_gain", 0.0))
        for i, p in enumerate(planes):
            if i in keep_raw or p.size < bytegroup.SPARSE_MIN:
                continue
            share = np.count_nonzero(p) / p.size
            row = rows[next(b for b in bins if b[0] <= share < b[1])]
            best_one = best_sparse = 1e9
            for _ in range(reps):
                t = time.thread_time()
                one = bytegroup.zstd_compress(p.data, 3, plane=True)
                best_one = min(best_one, time.thread_time() - t)
                t = time.thread_time()
                mask, nonzero = bytegroup.sparse_split(p)
                m = bytegroup.zstd_compress(mask.data, 3, plane=True)
                z = bytegroup.zstd_compress(nonzero.data, 3, plane=True)
                best_sparse = min(best_sparse, time.thread_time() - t)
            row[0] += 1
            row[1] += p.size
            row[2] += len(one)
            row[3] += best_one
            row[4] += best_sparse
            row[5] += 4 + len(m) + len(z)
    print("\n#### Compressed planes of those calls by their share of nonzero bytes (best of "
          f"{reps}; the writer stores a plane sparse at <= {bytegroup.SPARSE_SHARE})\n")
    print("| nonzero share | planes | bytes | one frame: bytes, ms | sparse: bytes, ms (split included) "
          "| sparse / one frame: bytes, time |")
    print("|---|---|---|---|---|---|")
    for (lo, hi), (n, size, one, t1, ts, sb) in rows.items():
        if n:
            print(f"| [{lo:.2f}, {min(hi, 1):.2f}{')' if hi < 1 else ']'} | {n} | {size:,} | {one:,}, {t1 * 1e3:.2f} | "
                  f"{sb:,}, {ts * 1e3:.2f} | {sb / one:.3f}, {ts / t1:.3f} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--saves", type=int, default=6, help="checkpoints of the small chain (the first two not replayed)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    import speed

    states = speed.small_states(args.saves, 20)
    calls = record_calls(states)
    print(f"# bench/planes.py  torch {torch.__version__}  threads=1  load average {os.getloadavg()[0]:.1f}")
    print(f"# {len(calls)} bytegroup.compress calls of {args.saves - 2} steady lossless saves, "
          f"{sum(w.nbytes for w, _, _ in calls):,} bytes of words\n")
    replay(calls, True), replay(calls, False)  # warm: kernels, scratch buffers
    res = {True: [], False: []}
    for r in range(args.reps):
        for sparse in (True, False) if r % 2 else (False, True):
            res[sparse].append(replay(calls, sparse))
    print("| planes | compress ms, median [min, max] | decompress ms, median | bytes |")
    print("|---|---|---|---|")
    for sparse in (False, True):
        enc = [e * 1e3 for e, _, _ in res[sparse]]
        dec = [d * 1e3 for _, d, _ in res[sparse]]
        print(f"| {'sparse where at most half nonzero' if sparse else 'one frame each (bytegroup/1)'} | "
              f"{statistics.median(enc):.2f} [{min(enc):.2f}, {max(enc):.2f}] | {statistics.median(dec):.2f} | "
              f"{res[sparse][0][2]:,} |")
    pe = [a[0] / b[0] for a, b in zip(res[True], res[False])]
    pd = [a[1] / b[1] for a, b in zip(res[True], res[False])]
    print(f"\nsparse / one frame, paired: compress {statistics.median(pe):.3f}x [{min(pe):.3f}, {max(pe):.3f}], "
          f"decompress {statistics.median(pd):.3f}x [{min(pd):.3f}, {max(pd):.3f}], bytes "
          f"{res[True][0][2] / res[False][0][2]:.4f}x")
    plane_table(calls, max(3, args.reps // 8))


if __name__ == "__main__":
    main()
