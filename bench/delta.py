"""Delta-encoder evidence (issue 4): the paper's Fig. 12 ablation, throughput, memory, cost/param.

    python bench/delta.py                 # ablation on a real GPT-2 chain + throughput
    python bench/delta.py --memory 100    # + peak memory and time/param of a save & restore at 100M params
    python bench/delta.py --only sameness # the auto coder's evidence: PE vs rANS by share of unchanged codes

Ablation variants (all with the same dynaquant quantizer, fixed config, pruning 0.1):
  HE  = cyclic delta -> Huffman               RLE = delta -> run-length -> Huffman
  PE  = delta -> rearrange by source bucket -> run-length -> Huffman  (DynaQuant's encoder)
  and the same three with ANS (constriction) instead of Huffman, and "zstd" of the PE stream.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import torch

from ckptzip.chain import CheckpointChain, KeyframePolicy
from ckptzip.demo.workloads import gpt2_workload

VARIANTS = {
    "HE": dict(rearrange=False, rle=False, coder="huffman"),
    "RLE": dict(rearrange=False, rle=True, coder="huffman"),
    "PE": dict(rearrange=True, rle=True, coder="huffman"),
    "HE-ans": dict(rearrange=False, rle=False, coder="ans"),
    "RLE-ans": dict(rearrange=False, rle=True, coder="ans"),
    "PE-ans": dict(rearrange=True, rle=True, coder="ans"),
    "PE-zstd": dict(rearrange=True, rle=True, coder="zstd"),
    "auto": dict(coder="auto"),  # our default: rANS on the plain delta (HE-ans's stream, the rANS coder)
}


def training_snapshots(n_ckpt: int, every: int):
    wl = gpt2_workload(total_steps=n_ckpt * every, ckpt_every=every)
    model, opt, sched = wl.build(0)
    snaps = []
    for step in range(1, wl.total_steps + 1):
        wl.train_step(model, opt, sched, step)
        if step % every == 0:
            snaps.append((step, copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})))
    return model, opt, snaps


def ablation(args):
    t0 = time.perf_counter()
    model, opt, snaps = training_snapshots(args.checkpoints, args.every)
    print(f"trained GPT-2 ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params), "
          f"{len(snaps)} checkpoints every {args.every} steps in {time.perf_counter() - t0:.0f} s")
    results = {}
    for name, knobs in VARIANTS.items():
        with tempfile.TemporaryDirectory() as d:
            chain = CheckpointChain(d, "dynaquant", {"codes": dict(knobs)}, keyframe=KeyframePolicy(every=10_000))
            t = time.perf_counter()
            per = []
            for step, st in snaps:
                e = chain.save(st, step, model=model, optimizer=opt)
                w = e.bytes_by_role["weight"]
                per.append({"step": step, "weights_ratio": w[0] / w[1], "ratio": e.ratio})
            enc_s = time.perf_counter() - t
            es = chain.entries()
            w_raw = sum(e.bytes_by_role["weight"][0] for e in es)
            w_st = sum(e.bytes_by_role["weight"][1] for e in es)
            results[name] = {"per_checkpoint": per, "weights_ratio": w_raw / w_st,
                             "ratio": sum(e.raw_bytes for e in es) / sum(e.nbytes for e in es), "encode_s": enc_s}
    print("\nFig. 12 ablation (dynaquant quantizer fixed: 16 bins, prune 0.1; keyframe only at the first save)")
    print(f"{'variant':9s} {'weights ratio':>14s} {'full-state ratio':>17s} {'last ckpt (weights)':>20s} {'encode s':>9s}")
    for name, r in results.items():
        print(f"{name:9s} {r['weights_ratio']:13.1f}x {r['ratio']:16.1f}x {r['per_checkpoint'][-1]['weights_ratio']:19.1f}x"
              f" {r['encode_s']:9.1f}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "delta_ablation.json").write_text(json.dumps(results, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name, r in results.items():
            ax.plot([p["step"] for p in r["per_checkpoint"]], [p["weights_ratio"] for p in r["per_checkpoint"]],
                    marker=".", ls="-" if "ans" not in name else "--", label=f"{name} ({r['weights_ratio']:.1f}x)")
        ax.set(title="Delta encoder ablation (weights, GPT-2 on stdlib)", xlabel="step", ylabel="compression ratio",
               yscale="log")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "delta_ablation.png", dpi=110)
        print(f"plot: {out / 'delta_ablation.png'}")
    except ImportError:
        pass
    return results


def throughput(args):
    """Delta stage alone (cyclic delta -> rearrange -> RLE -> Huffman) on real consecutive codes."""
    from ckptzip.codec.entropy import decode_codes, encode_codes
    from ckptzip.methods.base import get_method
    from ckptzip.state import flatten_state

    _, _, snaps = training_snapshots(2, args.every)
    method = get_method("dynaquant")
    qs = [method.search_quantize(flatten_state(st), {}) for _, st in snaps]
    names = sorted(qs[0])
    prev = torch.cat([qs[0][n].codes for n in names])
    cur = torch.cat([qs[1][n].codes for n in names])
    reps = max(1, args.throughput_params // prev.numel())
    prev, cur = prev.repeat(reps), cur.repeat(reps)
    B = int(max(prev.max(), cur.max())) + 1
    print(f"\nDelta stage throughput on {cur.numel() / 1e6:.1f}M real codes (tiled), {torch.get_num_threads()} threads")
    for name, knobs in VARIANTS.items():
        if knobs.get("coder") == "auto":
            continue  # a per-tensor choice between the rows above
        t = time.perf_counter()
        buf = encode_codes(prev, cur, B, **knobs)
        te = time.perf_counter() - t
        t = time.perf_counter()
        back = decode_codes(buf, prev)
        td = time.perf_counter() - t
        assert torch.equal(back, cur)
        print(f"{name:9s} encode {cur.numel() / te / 1e6:7.1f} M params/s   decode {cur.numel() / td / 1e6:7.1f} M params/s"
              f"   {8 * len(buf) / cur.numel():.3f} bits/param")


MEMORY_CHILD = r"""
import os, sys, time, resource, tempfile, torch
torch.manual_seed(0)
n_params = int(float(sys.argv[1]) * 1e6); method = sys.argv[2]; phase = sys.argv[3]
side = 2048
layers = max(1, n_params // (side * side))
model = torch.nn.Sequential(*[torch.nn.Linear(side, side, bias=False) for _ in range(layers)])
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x = torch.randn(8, side)
for _ in range(2):
    model(x).square().mean().backward(); opt.step(); opt.zero_grad()
state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3
from ckptzip.chain import CheckpointChain
d = sys.argv[4]
chain = CheckpointChain(d, method)
def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
def rss():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark, so VmHWM is the peak of the phase measured
    return status("VmRSS")
if phase == "save":
    base = rss(); t = time.perf_counter()
    chain.save(state, 1, model=model, optimizer=opt)
    el = time.perf_counter() - t
else:
    del state, model, opt
    import gc; gc.collect()
    base = rss(); t = time.perf_counter()
    out = chain.load(1)
    el = time.perf_counter() - t
peak = status("VmHWM")
print(f"{layers * side * side} {state_bytes} {base} {peak} {el}")
"""


def memory(args):
    print(f"\nPeak extra memory and time of one save / restore at ~{args.memory}M parameters (+ Adam m, v), "
          f"{torch.get_num_threads()} threads")
    print(f"{'method':10s} {'phase':8s} {'params':>8s} {'state MB':>9s} {'extra peak / state':>19s} {'s':>7s} {'us/param':>9s}")
    for method in args.memory_methods.split(","):
        with tempfile.TemporaryDirectory() as d:
            for phase in ("save", "restore"):
                r = subprocess.run([sys.executable, "-c", MEMORY_CHILD, str(args.memory), method, phase, d],
                                   capture_output=True, text=True, env=os.environ)
                if r.returncode:
                    print(r.stderr[-2000:])
                    raise SystemExit(1)
                n, sb, base, peak, el = r.stdout.split()
                n, sb, base, peak, el = int(n), int(sb), int(base), int(peak), float(el)
                # restore starts from an empty process: its "state" is what it builds
                extra = (peak - base) / sb if phase == "save" else (peak - base - sb) / sb
                print(f"{method:10s} {phase:8s} {n / 1e6:7.0f}M {sb / 1e6:9.0f} {extra:18.2f}x {el:7.1f} {1e6 * el / n:9.3f}")


def sameness(args):
    """The ``auto`` coder's evidence on real deltas: every dynaquant weight delta of GPT-2 chains
    saved 1, 2, 8 and 32 steps apart, coded both ways, binned by the share of codes that repeat
    their parent's: the paper's rearranged RLE + Huffman against rANS on the plain delta."""
    from ckptzip.codec import entropy
    from ckptzip.methods import qrecord

    rows = []
    real = qrecord.encode_codes_many

    def spy(jobs):
        for prev, cur, n_levels, _ in jobs:
            if prev is not None:
                same = float((prev.long() == cur.long()).float().mean())
                pe = len(entropy.encode_codes(prev, cur, n_levels, rearrange=True, rle=True, coder="huffman"))
                o0 = len(entropy.encode_codes(prev, cur, n_levels, rearrange=False, rle=False, coder="rans"))
                rows.append((same, pe, o0))
        return real(jobs)

    qrecord.encode_codes_many = spy
    try:
        for every in (1, 2, 8, 32):
            model, opt, snaps = training_snapshots(4, every)
            with tempfile.TemporaryDirectory() as d:
                chain = CheckpointChain(d, "dynaquant", keyframe=KeyframePolicy(every=10_000))
                for step, st in snaps:
                    chain.save(st, step, model=model, optimizer=opt)
    finally:
        qrecord.encode_codes_many = real
    print("\nThe auto coder: weight and moment deltas of GPT-2 chains 1-32 steps apart, by share of unchanged codes")
    print(f"{'unchanged':>10} {'tensors':>8} {'PE huffman B':>13} {'rANS delta B':>13} {'rANS / PE':>10}")
    for lo in [x / 10 for x in range(10)]:
        sel = [r for r in rows if lo <= r[0] < lo + 0.1 or (lo == 0.9 and r[0] == 1.0)]
        if sel:
            pe, o0 = sum(r[1] for r in sel), sum(r[2] for r in sel)
            print(f"{lo:>9.0%}+ {len(sel):>8} {pe:>13,} {o0:>13,} {o0 / pe:>10.3f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoints", type=int, default=24)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--throughput-params", type=int, default=10_000_000)
    ap.add_argument("--memory", type=float, default=0, help="millions of parameters for the memory test (0: skip)")
    ap.add_argument("--memory-methods", default="dynaquant,lossless")
    ap.add_argument("--only", default="ablation,throughput,memory")
    ap.add_argument("--out", default="docs")
    args = ap.parse_args()
    only = args.only.split(",")
    if "ablation" in only:
        ablation(args)
    if "throughput" in only:
        throughput(args)
    if "memory" in only and args.memory:
        memory(args)
    if "sameness" in only:
        sameness(args)


if __name__ == "__main__":
    main()
