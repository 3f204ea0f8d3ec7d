"""The order-0 coders alone on a real chain's code streams: rANS (codec/rans.py) vs constriction's ANS.

Streams: every integer stream ``encode_codes`` hands an order-0 coder (``ans`` or ``rans``) while
dynaquant (fixed default config) saves bench/speed.py's small byte-level GPT chain (``small_states``:
6 checkpoints 8 AdamW steps apart; weight keyframes and deltas, grid moment levels, 1-bit
direction codes), captured by wrapping ``entropy.encode_stream``. Plus synthetic skewed streams
(1-bit at p = 0.95 / 0.99 / 0.999, 2- and 4-bin codes) for the size at extreme skew.

Each coder encodes and decodes every stream; time is thread CPU time, one thread, the best of
--reps passes over all streams (whole calls: symbol table, header, CRC included), in ns per symbol;
bytes are the coder's whole buffers. Run:

    .venv/bin/python bench/coders.py            (~2 min)
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

from ckptzip.codec import entropy as E  # noqa: E402
from ckptzip.codec import streamframe as S  # noqa: E402


def tapped_saves(states: list[dict], coder: str | None = None) -> tuple[list[np.ndarray], list[tuple]]:
    """Save ``states`` as a dynaquant chain, every order-0 stream coded with ``coder`` (None: as
    written) -> (the streams, per save: (coder seconds, zstd-3 seconds of the raw bytes, symbols)).
    The substitution happens below the codes header, so those files are for timing only."""
    import zstandard

    from ckptzip.chain import CheckpointChain
    from ckptzip.state import flatten_state

    streams, saves, acc, encode_stream = [], [], [0.0, 0], E.encode_stream

    def tap(name, symbols):
        if name not in ("ans", "rans"):
            return encode_stream(name, symbols)
        if coder is None:
            streams.append(S.as_symbols(symbols).copy())
        t0 = time.thread_time()
        out = encode_stream(coder or name, symbols)
        acc[0] += time.thread_time() - t0
        acc[1] += int(symbols.numel()) if isinstance(symbols, torch.Tensor) else int(np.size(symbols))
        return out

    E.encode_stream = tap
    try:
        chain = CheckpointChain(f"memory://bench-coders-{coder}-{time.perf_counter_ns()}", "dynaquant")
        for i, state in enumerate(states):
            raw = b"".join(t.numpy().tobytes() for t in flatten_state(state).tensors.values())
            t0 = time.thread_time()
            zstandard.ZstdCompressor(level=3).compress(raw)
            tz = time.thread_time() - t0
            acc[:] = [0.0, 0]
            chain.save(state, i + 1)
            saves.append((acc[0], tz, acc[1]))
    finally:
        E.encode_stream = encode_stream
    return streams, saves


def synthetic() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {f"1-bit p={p}": (rng.random(200_000) > p).astype(np.int64) for p in (0.95, 0.99, 0.999)}
    out["2 bins p=.9"] = (rng.random(200_000) > 0.9).astype(np.int64) * 3
    out["4 bins"] = rng.choice(4, 200_000, p=[0.9, 0.06, 0.03, 0.01])
    return out


def timed(fn, items, reps: int) -> tuple[float, list]:
    best, out = float("inf"), None
    for _ in range(reps):
        t0 = time.thread_time()
        out = [fn(x) for x in items]
        best = min(best, time.thread_time() - t0)
    return best, out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small-n", type=int, default=6)
    p.add_argument("--small-every", type=int, default=8)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from speed import small_states

    states = small_states(args.small_n, args.small_every)
    streams, _ = tapped_saves(states)
    n = sum(s.size for s in streams)
    h = sum(E.entropy_bits(s) for s in streams) / 8
    sizes = np.array([s.size for s in streams])
    print(f"{len(streams)} streams, {n} symbols (sizes {sizes.min()}-{sizes.max()}, median {int(np.median(sizes))}), "
          f"order-0 entropy {h:.0f} bytes; load average {os.getloadavg()[0]:.2f}")
    print("\n| coder | bytes | x ans | x entropy | encode ns/symbol | decode ns/symbol |\n|---|---|---|---|---|---|")
    base = None
    for coder in ("ans", "rans"):
        enc, dec = E.get_coder(coder)
        for s in streams[:4]:  # compile / warm up
            dec(enc(s))
        te, bufs = timed(enc, streams, args.reps)
        td, outs = timed(dec, bufs, args.reps)
        assert all(np.array_equal(a, b) for a, b in zip(outs, streams))
        nbytes = sum(map(len, bufs))
        base = base or nbytes
        print(f"| {coder} | {nbytes} | {nbytes / base:.4f} | {nbytes / h:.4f} | {te / n * 1e9:.2f} "
              f"| {td / n * 1e9:.2f} |")
    print("\nInside the chain's saves (each order-0 stream coded with the coder; median [min, max] over "
          f"{args.reps} passes of {len(states)} saves):\n\n| coder | x zstd-3 of the checkpoint | ns/symbol |\n|---|---|---|")
    for coder in ("ans", "rans"):
        rows = [s for _ in range(args.reps) for s in tapped_saves(states, coder)[1]]
        share, ns = [t / tz for t, tz, _ in rows], [t / n * 1e9 for t, _, n in rows]
        print(f"| {coder} | {statistics.median(share):.2f} [{min(share):.2f}, {max(share):.2f}] "
              f"| {statistics.median(ns):.2f} [{min(ns):.2f}, {max(ns):.2f}] |")
    print("\n| synthetic stream (200k symbols) | ans bytes | rans bytes | rans / ans |\n|---|---|---|---|")
    for name, x in synthetic().items():
        a, r = len(E.encode_stream("ans", x)), len(E.encode_stream("rans", x))
        print(f"| {name} | {a} | {r} | {r / a:.4f} |")


if __name__ == "__main__":
    main()
