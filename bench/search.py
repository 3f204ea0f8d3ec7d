"""Config search on a real run: cost per checkpoint, configs over time, ratio vs threshold.

Workload: ``gpt2_workload`` (GPT-2 from config, vocab 256, d=128, 4 layers, AdamW + warmup, byte-level
LM on the Python stdlib's source), trained ONCE for STEPS steps; every EVERY steps a snapshot
(model, optimizer, and the gradient EMA of the WINDOW batches before it, as Compressor's recorder
takes it) is kept. Each threshold then replays the same snapshots into its own dynaquant chain,
exactly as ``Compressor.save`` does (``CheckpointChain.save`` with an EncodeContext carrying
model, eval_fn = the workload's validation loss, threshold and gradients). As in Compressor, the
first save has no gradient EMA yet (magnitude only).

Reported:
1. per checkpoint (threshold ``--detail``, 0.3 %): search kind, evaluations (and quantize-only estimates),
   seconds of search, chosen config, estimated and real ratio, degradation measured by the search
   and re-measured after restoring the checkpoint from the chain (eval_fn on the restored model
   vs on the exact snapshot);
2. per threshold: overall ratio (all bytes; and the model weights alone), exhaustive searches
   (first + fallbacks), evaluations and search seconds of the first checkpoint vs the steady
   state, worst re-measured degradation and how many checkpoints exceed the threshold (only
   allowed where the search reported ``infeasible``: nothing in the cube passes);
3. the cost of one full guided exhaustive search at the last checkpoint (detail threshold), where
   the feasible frontier lies inside the cube;
4. how well the cheap ratio estimate ranks candidates: Spearman rank correlation between the
   estimated bits and the real encoded bytes (delta + rearrange + RLE + Huffman codes, codebook,
   bf16 protected values) of the quantized weights, over SAMPLES random cube configs, at the
   first checkpoint (keyframe) and at a mid-run one (delta against the reference of the detailed
   threshold's chain),
   for our estimate and for the plain code entropy that ignores the reference.

Run:  .venv/bin/python bench/search.py          (about 5 min on 2 busy CPU cores)
"""
from __future__ import annotations

import argparse
import copy
import random
import tempfile
import time
from dataclasses import replace

import torch

from ckptzip.chain import CheckpointChain
from ckptzip.codec.entropy import encode_codes, entropy_bits
from ckptzip.demo.workloads import gpt2_workload
from ckptzip.methods.base import EncodeContext, get_method
from ckptzip.methods.qrecord import Codes
from ckptzip.methods.quantizing import QuantizedReference
from ckptzip.search import search_config
from ckptzip.search.cube import ConfigCube
from ckptzip.search.spaces import DynaQuantSpace
from ckptzip.search.strategies import estimate_bits
from ckptzip.sensitivity import GradientRecorder, should_arm
from ckptzip.state import flatten_state

THRESHOLDS = (0.001, 0.003, 0.01, 0.05)  # the 0.1 %, 1 %, 5 %, and 0.3 % where the config moves


def train(wl, steps: int, every: int, window: int):
    model, opt, sched = wl.build(0)
    rec = GradientRecorder(model, window=window)
    snaps = []
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        if should_arm(step, every, window):
            rec.arm()
        wl.train_step(model, opt, sched, step)
        if step % every == 0:
            grads = rec.gradients() if snaps else None  # Compressor's first save has no EMA yet
            snaps.append({"step": step, "model": copy.deepcopy(model.state_dict()),
                          "optimizer": copy.deepcopy(opt.state_dict()), "grads": grads,
                          "exact": wl.eval_fn(model)})
            rec.disarm()
    rec.close()
    return snaps, time.perf_counter() - t0


def replay(wl, snaps, threshold: float, root: str):
    model, opt, _ = wl.build(0)
    chain = CheckpointChain(f"{root}/t{threshold}", "dynaquant")
    rows = []
    for s in snaps:
        model.load_state_dict(s["model"])
        opt.load_state_dict(s["optimizer"])
        ctx = EncodeContext(step=s["step"], model=model, eval_fn=wl.eval_fn, threshold=threshold,
                            gradients=s["grads"])
        e = chain.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": s["step"]}, s["step"],
                       model=model, optimizer=opt, ctx=ctx)
        fresh, _, _ = wl.build(1)
        fresh.load_state_dict(chain.load(s["step"])["model"])
        measured = (wl.eval_fn(fresh) - s["exact"]) / abs(s["exact"])
        rows.append({"entry": e, "measured": measured})
    return rows


def _real_bytes(quantized: dict, reference) -> int:
    ref = reference.weights if reference is not None else {}
    n = 0
    for name, q in quantized.items():
        p = ref.get(name)
        prev = p.codes.long() if p is not None else None
        B = max(q.n_levels, p.n_levels) if p is not None else q.n_levels
        n += len(encode_codes(prev, q.codes.long(), B)) + 4 * q.n_levels + 2 * q.side["protected"].numel()
    return n


def _ranks(x: list[float]) -> torch.Tensor:
    t = torch.tensor(x, dtype=torch.float64)
    order = torch.argsort(t)
    r = torch.empty_like(t)
    r[order] = torch.arange(len(x), dtype=torch.float64)
    for v in torch.unique(t):  # average ranks of ties
        m = t == v
        r[m] = r[m].mean()
    return r


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def rank_quality(wl, snaps, rows_ref, samples: int, seed: int = 0):
    """Spearman(est bits, real bytes) at the first checkpoint and at a mid-run delta checkpoint."""
    model, _, _ = wl.build(0)
    method = get_method("dynaquant")
    cube = ConfigCube(embedding=True)
    pts = list(cube.points())
    rng = random.Random(seed)
    cands = [cube.candidate(p, m) for p, m in zip(rng.sample(pts, samples),
                                                  [rng.choice(("magnitude", "sensitivity")) for _ in range(samples)])]
    out = {}
    mid = len(snaps) // 2
    for label, i in (("keyframe (ckpt 0)", 0), (f"delta (ckpt {mid} vs {mid - 1})", mid)):
        s = snaps[i]
        flat = flatten_state({"model": s["model"]}, model)
        ref = None
        if i > 0:  # the codes that chain holds as reference for checkpoint i
            p = snaps[i - 1]
            knobs = {k: rows_ref[i - 1]["entry"].summary[k] for k in cube.knob_names + ("prune_metric",)}
            q_prev = method.search_quantize(flatten_state({"model": p["model"]}, model), knobs, p["grads"])
            ref = QuantizedReference(p["step"], {n: Codes(q.codes, q.n_levels) for n, q in q_prev.items()})
        est, plain, real = [], [], []
        for c in cands:
            q = method.search_quantize(flat, c.knobs(), s["grads"])
            est.append(estimate_bits(q, ref)[0])
            plain.append(sum(entropy_bits(t.codes) + 16 * t.side["protected"].numel() + 32 * t.n_levels
                             for t in q.values()))
            real.append(_real_bytes(q, ref))
        out[label] = (spearman(est, real), spearman(plain, real), min(real), max(real))
    return out


def _cfg(summary: dict) -> str:
    return DynaQuantSpace().label(summary)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--every", type=int, default=12)
    ap.add_argument("--window", type=int, default=10, help="gradient-EMA batches before each save")
    ap.add_argument("--samples", type=int, default=16, help="random configs for the rank correlation")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--thresholds", default=",".join(map(str, THRESHOLDS)))
    ap.add_argument("--detail", type=float, default=0.003, help="threshold of the per-checkpoint table")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t_all = time.perf_counter()
    wl = gpt2_workload(total_steps=args.steps, ckpt_every=args.every)
    snaps, t_train = train(wl, args.steps, args.every, args.window)
    print(f"# {wl.description}\n# {len(snaps)} checkpoints every {args.every} steps; training {t_train:.0f} s; "
          f"torch threads {args.threads}\n")

    results = {}
    with tempfile.TemporaryDirectory() as root:
        for T in map(float, args.thresholds.split(",")):
            t0 = time.perf_counter()
            results[T] = replay(wl, snaps, T, root)
            print(f"threshold {T:.1%}: replay {time.perf_counter() - t0:.0f} s", flush=True)

    detail = args.detail if args.detail in results else next(iter(results))
    print(f"\n## Per checkpoint, threshold {detail:.1%}\n")
    print("| step | val loss | search | evals | est. | search s | config | est ratio* | ratio | "
          "deg (search) | deg (restored) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for s, r in zip(snaps, results[detail]):
        sm = r["entry"].summary
        print(f"| {s['step']} | {s['exact']:.3f} | {sm['search']}{' (infeasible)' if sm['infeasible'] else ''} | "
              f"{sm['evals']} | {sm['estimates']} | {sm['search_s']:.1f} | {_cfg(sm)} | {sm['est_ratio']:.1f} | "
              f"{r['entry'].ratio:.1f} | {sm['degradation']:+.4%} | {r['measured']:+.4%} |")
    print("\n*est ratio: estimated, quantized weights only; ratio: the whole checkpoint file (weights, Adam "
          "moments, exact tensors)\n")

    print("## Per threshold\n")
    print("| threshold | ratio (all) | ratio (weights) | exhaustive runs | evals first | evals steady (mean/max) | "
          "search s first | search s steady (mean) | worst deg (restored) | > threshold | infeasible |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for T, rows in results.items():
        es = [r["entry"] for r in rows]
        raw = sum(e.raw_bytes for e in es)
        stored = sum(e.nbytes for e in es)
        w_raw = sum(e.bytes_by_role.get("weight", [0, 0])[0] for e in es)
        w_st = sum(e.bytes_by_role.get("weight", [0, 0])[1] for e in es)
        steady = [e.summary for e in es[1:]]
        ev = [s["evals"] for s in steady]
        over = sum(r["measured"] > T + 1e-12 for r in rows)
        infeasible = sum(bool(e.summary["infeasible"]) for e in es)
        exh = sum(e.summary["search"] in ("exhaustive", "fallback") for e in es)
        print(f"| {T:.1%} | {raw / stored:.1f} | {w_raw / max(w_st, 1):.1f} | {exh} | {es[0].summary['evals']} | "
              f"{sum(ev) / len(ev):.1f} / {max(ev)} | {es[0].summary['search_s']:.1f} | "
              f"{sum(s['search_s'] for s in steady) / len(steady):.1f} | {max(r['measured'] for r in rows):+.4%} | "
              f"{over} | {infeasible} |")
    print("\nconfigs chosen over time (bins/embedding bins/prune fraction-metric/protect fraction):")
    for T, rows in results.items():
        seq, last, n = [], None, 0
        for r in rows:
            c = _cfg(r["entry"].summary)
            if c == last:
                n += 1
                continue
            if last is not None:
                seq.append(f"{last} x{n}")
            last, n = c, 1
        seq.append(f"{last} x{n}")
        print(f"  {T:.1%}: " + " -> ".join(seq))

    # what a full guided exhaustive search costs once the frontier lies inside the cube
    s = snaps[-1]
    model, _, _ = wl.build(0)
    model.load_state_dict(s["model"])
    ctx = EncodeContext(step=s["step"], model=model, eval_fn=wl.eval_fn, threshold=detail, gradients=s["grads"])
    _, info, st = search_config(get_method("dynaquant"), flatten_state({"model": s["model"]}, model), None, ctx,
                                None)
    print(f"\nforced exhaustive search at step {s['step']}, threshold {detail:.1%} (keyframe estimate): "
          f"{info['evals']} evaluations of {info['cube_size']} configs, {info['search_s']:.0f} s, chose "
          f"{_cfg(st['best'])} ({info['degradation']:+.4%})")

    t0 = time.perf_counter()
    rq = rank_quality(wl, snaps, results[detail], args.samples)
    print(f"\n## Ratio estimate vs real encoded size ({args.samples} random cube configs, "
          f"{time.perf_counter() - t0:.0f} s)\n")
    print("| checkpoint | Spearman: our estimate | Spearman: plain code entropy | real bytes (min..max) |")
    print("|---|---|---|---|")
    for label, (rho, rho_plain, lo, hi) in rq.items():
        print(f"| {label} | {rho:.3f} | {rho_plain:.3f} | {lo:,}..{hi:,} |")
    print(f"\ntotal {time.perf_counter() - t_all:.0f} s")


if __name__ == "__main__":
    main()
