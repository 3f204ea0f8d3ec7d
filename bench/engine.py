"""How long training waits for a checkpoint: async engine vs torch.save (BitSnap Table 2).

Table 1 -- blocking time of one save, CPU. The model is a stack of nn.Linear layers; the state is
its state_dict plus Adam's (weights + exp_avg + exp_avg_sq = 12 bytes per parameter, after one
optimizer step). Both write to the same folder (--dir, default a temp folder on the local disk):
  torch.save   the whole state into a new file per save (no fsync, as Megatron-LM does): median of 3
  async        AsyncCheckpointEngine.save -> returns when the state is in shared memory; the agent
               compresses (lossless, zstd level 1) and commits in the background. Between saves the
               bench waits for the commit, untimed, as a training loop would train meanwhile.
               "first" is save 1 (it also allocates its shared-memory slot); "steady" is the median
               of saves 3..5, which reuse the R=2 slots. "commit" is the agent's time per save
               (median of saves 2..5: encode against the previous step + fsync'd write).
Sizes whose peak memory (about 70 bytes per parameter over trainer, shared memory and agent)
would not fit in the available memory are skipped and say so.

Table 2 -- the fault-tolerant demo (ckptzip.demo.faults.run on the digits workload, lossless,
3 failures) with synchronous and asynchronous saves: time blocked in save, time training, their
ratio (RunResult.overhead), the restore time (which includes starting a new agent after each
failure) and the final metric (lossless resumes are exact: async must equal sync). Training time
is what the machine gave the loop: on a shared, loaded machine it varies between runs far more
than the checkpoint time does, so compare the "blocked in save" column first.

Run:  .venv/bin/python bench/engine.py                         (sizes 10 50 100 200 M params)
      .venv/bin/python bench/engine.py --sizes 10 50 --no-demo
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
from torch import nn

from ckptzip.engine import AsyncCheckpointEngine, EngineOptions
from ckptzip.methods.lossless import LosslessConfig

BYTES_PER_PARAM_PEAK = 70


def build(n_params: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    width = 1024 if n_params < 40e6 else 2048
    layers = max(1, round(n_params / (width * width + width)))
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    for p in model.parameters():
        p.grad = None
    return model, opt


def state_of(model, opt, step):
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}


@torch.no_grad()
def train_a_little(model):
    for p in model.parameters():  # moves every weight by a few ulps, like an optimizer step
        p.mul_(1.0001)


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 40


def bench_size(n_params: int, folder: str) -> dict | None:
    model, opt = build(n_params)
    n = sum(p.numel() for p in model.parameters())
    state_bytes = 3 * 4 * n
    res = {"params": n, "state_bytes": state_bytes}
    # torch.save
    ts = []
    for k in range(3):
        path = os.path.join(folder, f"torch-{k}.pt")
        t0 = time.perf_counter()
        torch.save(state_of(model, opt, k), path)
        ts.append(time.perf_counter() - t0)
    for k in range(3):
        os.unlink(os.path.join(folder, f"torch-{k}.pt"))
    res["torch_save_s"] = statistics.median(ts)
    # async engine
    url = os.path.join(folder, "chain")
    eng = AsyncCheckpointEngine(url, "lossless", LosslessConfig(zstd_level=1),
                                options=EngineOptions(warn_on_backpressure=False))
    blocking, commit = [], []
    try:
        for k in range(1, 6):
            train_a_little(model)
            st = state_of(model, opt, k)
            t0 = time.perf_counter()
            h = eng.save(st, k, model=model, optimizer=opt)
            t1 = time.perf_counter()
            h.wait()
            commit.append(time.perf_counter() - t1)
            blocking.append(t1 - t0)
    finally:
        eng.close()
        shutil.rmtree(url, ignore_errors=True)
    res.update(first_s=blocking[0], steady_s=statistics.median(blocking[2:]), commit_s=statistics.median(commit[1:]))
    res["speedup"] = res["torch_save_s"] / res["steady_s"]
    return res


def table_blocking(sizes_m: list[float], folder: str) -> None:
    print(f"\nTable 1: blocking time of one save (CPU, {torch.get_num_threads()} torch threads), folder {folder}")
    print(f"{'params':>8} {'state':>9} {'torch.save':>11} {'async first':>12} {'async steady':>13} "
          f"{'speedup':>8} {'agent commit':>13}")
    for m in sizes_m:
        need = int(m * 1e6 * BYTES_PER_PARAM_PEAK)
        if need > 0.8 * mem_available():
            print(f"{m:>7.0f}M  skipped: needs about {need / 2**30:.1f} GiB, "
                  f"{mem_available() / 2**30:.1f} GiB available")
            continue
        r = bench_size(int(m * 1e6), folder)
        print(f"{r['params'] / 1e6:>7.1f}M {r['state_bytes'] / 2**30:>7.2f}GiB {r['torch_save_s']:>10.3f}s "
              f"{r['first_s']:>11.3f}s {r['steady_s']:>12.3f}s {r['speedup']:>7.1f}x {r['commit_s']:>12.2f}s",
              flush=True)


def table_demo() -> None:
    from ckptzip.demo.faults import run
    from ckptzip.demo.workloads import digits_workload

    wl = digits_workload()
    rows = [("sync", run(wl, "lossless", failures=3)), ("async", run(wl, "lossless", failures=3, async_save=True))]
    ref = rows[0][1]
    print(f"\nTable 2: fault-tolerant demo, {wl.name}, {wl.total_steps} steps, a save every {wl.ckpt_every}, "
          f"3 failures, lossless")
    print(f"{'saves':>6} {'blocked in save':>16} {'training':>9} {'overhead':>9} {'restores':>9} "
          f"{wl.metric_name:>14} {'= sync':>7}")
    for name, r in rows:
        print(f"{name:>6} {r.ckpt_s:>15.3f}s {r.train_s:>8.2f}s {100 * r.overhead:>8.2f}% {r.restore_s:>8.2f}s "
              f"{r.final_metric:>14.4f} {str(r.final_metric == ref.final_metric):>7}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=float, nargs="+", default=[10, 50, 100, 200], help="millions of parameters")
    ap.add_argument("--dir", default=None, help="folder on the disk to write to (default: a temp folder)")
    ap.add_argument("--no-demo", action="store_true", help="skip table 2")
    args = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="ckptzip-bench-engine-", dir=args.dir)
    try:
        table_blocking(args.sizes, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if not args.no_demo:
        table_demo()


if __name__ == "__main__":
    main()
