"""CPU time of a method's encode and decode with its system time and page faults, beside zstd-3
(issue 15, "Narrow code streams" in docs/BENCHMARKS.md). A fresh page costs microseconds on a VM:
``getrusage(RUSAGE_THREAD)`` splits the thread's CPU into user and sys and counts minor faults; a
decode's peak extra memory (VmHWM over the RSS before it, reset per decode) is given as a multiple
of the state's bytes (the larger of the two checkpoints).

Two GPT-2 124M checkpoints (bench/speed.py's ``gpt2_states``), trained once and kept in --states so
that builds compare over the same bytes, one process per build (PYTHONPATH picks the build):

    PYTHONPATH=src .venv/bin/python bench/pagefaults.py dynaquant [--states /tmp/gpt2_states.pt]

``--keyframe``: also a keyframe after a delta (as a chain's periodic one), its reference copied
fresh and into the spent reference's buffers (``EncodeContext.recycle``; lossless uses it).
"""
from __future__ import annotations

import argparse
import gc
import os
import resource
import sys

import torch
import zstandard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from speed import gpt2_states, raw_bytes  # noqa: E402


def usage() -> tuple[float, float, int]:
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_utime + r.ru_stime, r.ru_stime, r.ru_minflt


def main() -> None:
    from ckptzip.methods.base import DecodeContext, EncodeContext, get_method
    from ckptzip.state import flatten_state

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("method", nargs="?", default="dynaquant")
    p.add_argument("--states", default="/tmp/gpt2_states.pt")
    p.add_argument("--keyframe", action="store_true", help="also time a keyframe after a delta, fresh vs recycled")
    args = p.parse_args()
    torch.set_num_threads(1)
    if not os.path.exists(args.states):
        torch.save(gpt2_states(2), args.states)
    states = torch.load(args.states)

    def add(acc, a, b):
        return [x + (y - z) for x, y, z in zip(acc, b, a)]

    def status(key):  # bytes of a /proc/self/status line (VmRSS, VmHWM)
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(key))

    cz, z = zstandard.ZstdCompressor(level=3), [0.0, 0.0, 0]
    for s in states:
        raw = raw_bytes(s)
        a = usage()
        cz.compress(raw)
        z = add(z, a, usage())
        del raw
    enc_m, dec_m = get_method(args.method), get_method(args.method)
    e, d, ref, dref, peak = [0.0, 0.0, 0], [0.0, 0.0, 0], None, None, 0.0
    for i, s in enumerate(states):
        a = usage()
        flat = flatten_state(s)
        enc, ref = enc_m.encode(flat, ref, ctx=EncodeContext(step=i + 1))
        e = add(e, a, usage())
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM from here: the decode's own peak
        base = status("VmRSS")
        a = usage()
        out, dref = dec_m.decode(flat.records, enc, dref, ctx=DecodeContext(step=i + 1, device="cpu"))
        d = add(d, a, usage())
        peak = max(peak, (status("VmHWM") - base) / sum(t.numel() * t.element_size() for t in flat.tensors.values()))
        del enc, flat, out
        gc.collect()
    print(f"{args.method}: encode CPU {e[0]:.2f} s (sys {e[1]:.2f}, faults {e[2]}), decode CPU {d[0]:.2f} s "
          f"(sys {d[1]:.2f}, faults {d[2]}, peak extra {peak:.2f}x the state); zstd-3 CPU {z[0]:.2f} s "
          f"(sys {z[1]:.2f}); encode x zstd-3 {e[0] / z[0]:.2f}")
    if args.keyframe:
        keyframes(args.method, states)


def keyframes(method: str, states: list[dict]) -> None:
    """A keyframe of the first state after a chain of every state (each save spends its reference,
    as CheckpointChain's do): its reference copied fresh, then into the spent reference's buffers."""
    from ckptzip.methods.base import EncodeContext, get_method
    from ckptzip.state import flatten_state

    m = get_method(method)
    flats = [flatten_state(s) for s in states]
    ref = None
    for i, f in enumerate(flats):
        _, ref = m.encode(f, ref, ctx=EncodeContext(step=i + 1, reference_spent=True))
    gc.collect()
    for label, recycle in (("fresh copies", None), ("into the spent reference", ref)):
        a = usage()
        _, new = m.encode(flats[0], None, ctx=EncodeContext(step=len(flats) + 1, reference_spent=True, recycle=recycle))
        r = [y - x for x, y in zip(a, usage())]
        print(f"{method} keyframe after a delta, {label}: CPU {r[0]:.2f} s (sys {r[1]:.2f}, faults {r[2]})")
        del new
        gc.collect()


if __name__ == "__main__":
    main()
