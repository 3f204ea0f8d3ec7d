"""Save and restore with the training state on a CUDA device, beside the same state on the CPU and
zstd-3 over the same bytes, in one process (issue 15, item 5); and whether the two write the same files.

For each workload (bench/speed.py's: the small byte-level GPT chain, GPT-2 124M from config) and
method, per repetition, interleaved:

  zstd-3      ``zstandard`` level 3 compressing every checkpoint's raw tensor bytes (one thread);
  save cpu    ``CheckpointChain.save`` of every checkpoint into fsspec's memory filesystem, the state
              on the CPU (speed.py's "save");
  save cuda   the same with every tensor of the state on the GPU (moved there before the clock
              starts, ties kept, as a training run holds it); the save's copy to the host counts;
  restore     ``CheckpointChain.restore`` of the last step onto ``device="cpu"`` / ``"cuda"`` (replays
              every file from the keyframe), against zstd-3 decompressing every checkpoint;
  same files  whether the cuda save wrote byte-identical files to the cpu save (sha256 per file);
  d2h         (gpt2) the save's copy of the state to the host alone, on_host against page-locked
              copies through torch's host cache (--d2h-reps, 0 skips it).

Times are wall-clock (``time.perf_counter``, after ``torch.cuda.synchronize()``): thread CPU time
would miss the GPU's work. Run on a quiet machine; torch threads --threads (default 1, as speed.py).
Medians [min, max] over --reps; x zstd-3 divides by the same repetition's zstd-3 (compress for a
save, decompress for a restore).

Run:  python bench/gpu.py                      (on a machine with a GPU; --device cpu dry-runs it)
      python bench/gpu.py --only small --methods dynaquant,lossless,excp-fixed,bitsnap --reps 5
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

from compare import md_table  # noqa: E402
from speed import ZSTD_LEVEL, gpt2_states, n_params, raw_bytes, small_states  # noqa: E402


def to(obj, device, memo=None):
    """``obj`` with every tensor on ``device``. Views of the same memory (GPT-2's lm_head.weight and
    transformer.wte.weight: two tensors, one storage) become one tensor there, so the copy keeps the
    ties a state dict of a model on that device has (unlinked, the copy would flatten differently)."""
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        key = (obj.data_ptr(), tuple(obj.shape), obj.stride(), obj.dtype) if obj.numel() else id(obj)
        if key not in memo:
            memo[key] = obj.to(device)
        return memo[key]
    if isinstance(obj, dict):
        return {k: to(v, device, memo) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to(v, device, memo) for v in obj)
    return obj


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def wall(fn, device: str):
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t, out


def chain_files(url: str, chain) -> list[str]:
    import fsspec

    fs, root = fsspec.filesystem("memory"), url.removeprefix("memory://")
    return [hashlib.sha256(fs.cat(f"{root}/{e.file}")).hexdigest() for e in chain.entries()]


def measure(states_cpu: list[dict], methods: list[str], reps: int, device: str, warmup: bool = True) -> dict:
    import fsspec
    import zstandard

    from ckptzip.chain import CheckpointChain

    states_dev = [to(s, device) for s in states_cpu]
    raws = [raw_bytes(s) for s in states_cpu]
    cz, dz = zstandard.ZstdCompressor(level=ZSTD_LEVEL), zstandard.ZstdDecompressor()
    frames = [cz.compress(r) for r in raws]
    out = {"raw": sum(map(len, raws)), "zstd": sum(map(len, frames)), "methods": {}}
    for m in methods:
        rows = {k: [] for k in ("zstd", "zload", "save_cpu", "save_dev", "restore_cpu", "restore_dev")}
        same, stored = True, 0
        for rep in range(0 if warmup else 1, reps + 1):  # rep 0 warms up (numba compiles, CUDA kernels load)
            tz = 0.0
            for r in raws:
                tz += wall(lambda: cz.compress(r), "cpu")[0]
            res = {"zstd": tz, "zload": wall(lambda: [dz.decompress(f) for f in frames], "cpu")[0]}
            files = {}
            for where, states in (("cpu", states_cpu), ("dev", states_dev)):
                url = f"memory://cuda-bench-{m}-{where}-{rep}-{os.getpid()}"
                ch = CheckpointChain(url, m)
                res[f"save_{where}"], _ = wall(lambda: [ch.save(s, i + 1) for i, s in enumerate(states)], device)
                files[where] = chain_files(url, ch)
                stored = sum(e.nbytes for e in ch.entries())
                res[f"restore_{where}"], _ = wall(
                    lambda: CheckpointChain(url).restore(len(states), device="cpu" if where == "cpu" else device),
                    device)
                fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)
                del ch
                gc.collect()
            same = same and files["cpu"] == files["dev"]
            if rep:
                for k, v in res.items():
                    rows[k].append(v)
            print(f"  {m} rep {rep}: " + ", ".join(f"{k} {v:.3f}s" for k, v in res.items())
                  + f"; same files {files['cpu'] == files['dev']}", flush=True)
        out["methods"][m] = {"rows": rows, "same": same, "stored": stored}
    return out


def d2h(state_cpu: dict, reps: int, device: str) -> None:
    """A save's copy of a device state to the host, alone: ``state.on_host`` (pageable, a tensor at a
    time, freed after the save) against async copies into torch's page-locked host cache, which the
    next save reuses (tried, not landed: the cache keeps its blocks, rounded up to powers of two)."""
    from ckptzip.state import flatten_state, on_host

    flat = flatten_state(to(state_cpu, device))
    nbytes = sum(t.numel() * t.element_size() for t in flat.tensors.values())
    ref = {n: t.cpu() for n, t in flat.tensors.items()}

    def pinned():
        out = {n: t.to("cpu", non_blocking=True, memory_format=torch.contiguous_format) for n, t in flat.tensors.items()}
        torch.cuda.current_stream().synchronize()
        return out

    times = {"on_host (pageable)": [], "page-locked cache, first": [], "page-locked cache, reused": []}
    for rep in range(reps + 1):
        for k, fn in (("on_host (pageable)", lambda: on_host(flat).tensors),
                      ("page-locked cache, reused", pinned)):
            if k.startswith("page") and device != "cuda":
                continue
            dt, out = wall(fn, device)
            times["page-locked cache, first" if k.startswith("page") and rep == 0 else k].append(dt)
            assert all(torch.equal(out[n], ref[n]) for n in ref), f"{k}: the host copy differs"
            del out
            gc.collect()
    held = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) if device == "cuda" else 0
    print(f"\n### A save's copy to the host ({nbytes / 1e9:.2f} GB, {len(flat.tensors)} tensors; "
          f"the page-locked cache holds {held / 1e9:.2f} GB after it)\n")
    rows = [[k, f"{1e3 * statistics.median(v):.0f} [{1e3 * min(v):.0f}, {1e3 * max(v):.0f}]",
             f"{nbytes / statistics.median(v) / 1e9:.1f}"] for k, v in times.items() if v]
    print(md_table(["copy", "ms, median [min, max]", "GB/s"], rows))


def fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}, {max(xs):.2f}]"


def report(title: str, res: dict, params: int, n_ckpt: int, device: str) -> None:
    rows = []
    for m, r in res["methods"].items():
        t = r["rows"]
        x = {k: [a / b for a, b in zip(t[k], t["zload" if k.startswith("restore") else "zstd"])]
             for k in t if not k.startswith("z")}
        rows.append([m, f"{res['raw'] / r['stored']:.2f}", fmt(x["save_cpu"]), fmt(x["save_dev"]),
                     f"{statistics.median(t['save_dev']) / statistics.median(t['save_cpu']):.2f}",
                     fmt(x["restore_cpu"]), fmt(x["restore_dev"]), "yes" if r["same"] else "**no**",
                     f"{1e6 * statistics.median(t['save_dev']) / (n_ckpt * params):.3f}"])
    zs = statistics.median(next(iter(res["methods"].values()))["rows"]["zstd"])
    rows.append(["zstd-3 of the raw bytes", f"{res['raw'] / res['zstd']:.2f}", "1", "", "", "", "", "",
                 f"{1e6 * zs / (n_ckpt * params):.3f}"])
    print(f"\n### {title}\n")
    print(md_table(["method", "ratio", "save x zstd-3, state on cpu", f"save x zstd-3, state on {device}",
                    f"{device} / cpu save", "restore x zstd-3 decompress, onto cpu",
                    f"restore, onto {device}",
                    "same files", f"us/param ({device} save)"], rows))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="small,gpt2")
    p.add_argument("--methods", default="dynaquant,lossless")
    p.add_argument("--big-methods", default="dynaquant,lossless", help="methods for gpt2")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--big-reps", type=int, default=1)
    p.add_argument("--d2h-reps", type=int, default=5, help="gpt2: time the save's copy to the host alone")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--build-threads", type=int, default=os.cpu_count() or 1, help="torch threads while training")
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/gpu.py: no CUDA device here; pass --device cpu for a dry run")
    if args.device == "cuda":
        print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; "
              f"{os.cpu_count()} CPUs; torch threads {args.threads}")
    for kind in args.only.split(","):
        torch.set_num_threads(args.build_threads)
        t = time.perf_counter()
        states = small_states(6, 8) if kind == "small" else gpt2_states(2)
        print(f"{kind}: built {len(states)} states in {time.perf_counter() - t:.0f}s", flush=True)
        torch.set_num_threads(args.threads)
        if kind == "gpt2" and args.d2h_reps:
            d2h(states[-1], args.d2h_reps, args.device)
        small = kind == "small"  # run first: it warms every kernel up for gpt2
        methods = (args.methods if small else args.big_methods).split(",")
        res = measure(states, methods, args.reps if small else args.big_reps, args.device, warmup=small)
        title = (f"Small byte-level GPT chain ({n_params(states[0]) / 1e6:.2f}M params, {len(states)} checkpoints)"
                 if kind == "small" else f"GPT-2 124M from config ({n_params(states[0]) / 1e6:.1f}M params, 2 checkpoints)")
        report(title, res, n_params(states[0]), len(states), args.device)
        del states, res
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
