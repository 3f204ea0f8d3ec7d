"""Full training state over a real chain: ratio vs keyframe interval vs restore time.

The GPT-2 workload of the demo (`ckptzip.demo.workloads.gpt2_workload`: byte-level LM on stdlib
source, 0.83M parameters, AdamW + warmup, 240 steps) is trained once and its 20 checkpoints
(every 12 steps) are cached. Each (method config, keyframe interval) writes the 20 checkpoints into
a fresh chain (`CheckpointChain`, config search against the workload's validation loss at
--threshold, as `Compressor` does), then restores every step. Reported per row: full-state ratio
(all 20 files, keyframes included), weights-only ratio, bits per element of m and v, the mean and
worst thread-CPU seconds of one restore (decoding from the nearest keyframe), and the worst
per-checkpoint weight degradation the search measured.

Run:  PYTHONPATH=src .venv/bin/python bench/keyframes.py --every 1,5,10,20
      --config '{"moments": {"codec": "normalized"}}' --label v0.1   (a JSON config for the method)
      ... --moments-only '{"codec": "normalized"}' '{"grid": {"v_step": 1.0}}'   (moments alone, fast)
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import pathlib
import shutil
import sys
import tempfile
import time

import torch

from ckptzip.chain import CheckpointChain, KeyframePolicy
from ckptzip.demo import workloads as W
from ckptzip.methods.base import EncodeContext

ROLES = {"weight": ("weight",), "m": ("exp_avg", "momentum_buffer"), "v": ("exp_avg_sq",)}


def chain_snapshots(cache: pathlib.Path) -> tuple[W.Workload, dict[int, dict]]:
    wl = W.gpt2_workload()
    path = cache / "gpt2-chain.pt"
    if path.exists():
        return wl, torch.load(path, weights_only=True)
    model, opt, sched = wl.build(0)
    snaps = {}
    for step in range(1, wl.total_steps + 1):
        model.train()
        wl.train_step(model, opt, sched, step)
        if step % wl.ckpt_every == 0:
            snaps[step] = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                         "scheduler": sched.state_dict()})
    cache.mkdir(parents=True, exist_ok=True)
    torch.save(snaps, path)
    return wl, snaps


def write_chain(wl, snaps, method: str, config: dict, every: int, threshold: float, url: str) -> dict:
    model, opt, _ = wl.build(0)
    chain = CheckpointChain(url, method, config, keyframe=KeyframePolicy(every=every))
    save_s, worst = 0.0, 0.0
    for step, snap in sorted(snaps.items()):
        model.load_state_dict(snap["model"])
        opt.load_state_dict(snap["optimizer"])
        ctx = EncodeContext(step=step, model=model, eval_fn=wl.eval_fn, threshold=threshold)
        t0 = time.thread_time()
        e = chain.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, step,
                       model=model, optimizer=opt, ctx=ctx)
        save_s += time.thread_time() - t0
        worst = max(worst, float(e.summary.get("degradation") or 0.0))
    entries = chain.entries(refresh=True)
    restore = []
    for e in entries:
        t0 = time.thread_time()
        chain.load(e.step)
        restore.append(time.thread_time() - t0)
    chain.close()
    out = {"raw": sum(e.raw_bytes for e in entries), "stored": sum(e.nbytes for e in entries),
           "keyframes": sum(e.keyframe for e in entries), "save_s": save_s / len(entries),
           "restore_mean_s": sum(restore) / len(restore), "restore_max_s": max(restore), "worst_degradation": worst}
    flat_roles = {}
    for e in entries:
        for role, (raw, stored) in e.bytes_by_role.items():
            r = flat_roles.setdefault(role, [0, 0])
            r[0] += raw
            r[1] += stored
    for key, roles in ROLES.items():
        raw = sum(flat_roles.get(r, [0, 0])[0] for r in roles)
        stored = sum(flat_roles.get(r, [0, 0])[1] for r in roles)
        out[f"{key}_ratio"] = raw / stored if stored else None
        out[f"{key}_bits"] = 8 * stored / (raw / 4) if raw else None  # fp32 elements
    return out


def moment_bits(snaps, wl, configs: list[str], every: list[int]) -> list[str]:
    """Moments alone (methods/moments.py's real records, no weights, no search): bits per element of
    m and v over the 20 checkpoints for each MomentConfig (JSON) and keyframe interval."""
    from ckptzip.methods.base import Encoded, config_from_dict
    from ckptzip.methods.moments import MomentConfig, MomentReference, plan_moments, store_moment
    from ckptzip.methods.qrecord import RecordBatch
    from ckptzip.methods.quantizing import CodesConfig
    from ckptzip.state import flatten_state

    model, opt, _ = wl.build(0)
    flats = [flatten_state({"model": snaps[s]["model"], "optimizer": snaps[s]["optimizer"]}, model, opt)
             for s in sorted(snaps)]
    n = sum(r.numel for r in flats[0].records.values() if r.role == "exp_avg")
    lines = ["| moments config | keyframe every | m bits/elem | v bits/elem |", "|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for spec in configs:
        cfg = config_from_dict(MomentConfig, json.loads(spec))
        for k in every:
            ref, total = None, {"exp_avg": 0, "exp_avg_sq": 0}
            for i, flat in enumerate(flats):
                plan = plan_moments(flat, cfg, None if i % k == 0 else ref, marker="dynaquant/1", codes=CodesConfig())
                enc, codes = Encoded(), {}
                batch = RecordBatch(enc)
                for name, item in plan.items():
                    c = store_moment(batch, name, item)
                    if c is not None:
                        codes[name] = c
                batch.flush()
                for role in total:  # exact moment records count at their raw size
                    for name, r in flat.records.items():
                        if r.role == role:
                            total[role] += sum(len(enc.blobs[b]) for b in enc.records[name]["blobs"].values()) \
                                if name in plan else 4 * r.numel
                ref = MomentReference(codes) if cfg.deltas(True) else None
            bits = {role: 8 * b / (n * len(flats)) for role, b in total.items()}
            lines.append(f"| `{spec}` | {k} | {bits['exp_avg']:.3f} | {bits['exp_avg_sq']:.3f} |")
            print(lines[-1], flush=True)
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", default="dynaquant")
    ap.add_argument("--config", default="{}", help="method config as JSON")
    ap.add_argument("--label", default=None)
    ap.add_argument("--every", default="1,5,10,20", help="keyframe intervals")
    ap.add_argument("--threshold", type=float, default=0.01)
    ap.add_argument("--cache", default="/tmp/ckz-resume")
    ap.add_argument("--out", default=None, help="append JSON rows here")
    ap.add_argument("--moments-only", nargs="*", metavar="MOMENT_CONFIG",
                    help="only the moments' bits per element for these MomentConfig JSONs (no weights, no search)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    wl, snaps = chain_snapshots(pathlib.Path(a.cache))
    if a.moments_only is not None:
        print(f"# bench/keyframes.py --moments-only  torch {torch.__version__}  threads=1")
        moment_bits(snaps, wl, a.moments_only, list(map(int, a.every.split(","))))
        return 0
    config = json.loads(a.config)
    label = a.label or a.config
    print(f"# bench/keyframes.py --method {a.method} --config '{a.config}' --threshold {a.threshold}  "
          f"torch {torch.__version__}  threads=1  load average {os.getloadavg()[0]:.1f}")
    print("| moments | keyframe every | keyframes | full state | weights | m bits/elem | v bits/elem | "
          "restore mean / worst (s) | worst ckpt degradation |")
    print("|---|---|---|---|---|---|---|---|---|")
    for every in map(int, a.every.split(",")):
        d = tempfile.mkdtemp(prefix="ckz-kf-")
        try:
            r = write_chain(wl, snaps, a.method, config, every, a.threshold, d)
        finally:
            shutil.rmtree(d, ignore_errors=True)
        r.update(label=label, every=every, method=a.method, config=config, threshold=a.threshold)
        print(f"| {label} | {every} | {r['keyframes']} | {r['raw'] / r['stored']:.1f}x | {r['weight_ratio']:.1f}x | "
              f"{r['m_bits']:.2f} | {r['v_bits']:.2f} | {r['restore_mean_s']:.2f} / {r['restore_max_s']:.2f} | "
              f"{100 * r['worst_degradation']:.2f} % |", flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
