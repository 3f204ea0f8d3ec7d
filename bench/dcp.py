"""ckptzip inside torch.distributed.checkpoint vs plain DCP and DCP + its zstd extension, same run.

A GPT-2 from config (vocab 256, byte-level on the Python stdlib source; embeddings, Conv1D
attention/MLP, LayerNorms, biases, tied lm_head) trains with FSDP2 + AdamW on W rank processes
(gloo, CPU). At every checkpoint step each rank saves the same state four ways, in rotating order:

  dcp          dcp.save(checkpoint_id=...)                        (FileSystemWriter, torch.save format)
  dcp+zstd     FileSystemWriter(..., _extensions=[ZStandard()])   DCP's byte-stream compression
  lossless     CompressedWriter(method="lossless")                ckptzip, deltas per rank (zstd level 3)
  lossless-z1  the same with config={"zstd_level": 1}
  dynaquant    CompressedWriter(method="dynaquant", eval_fn=val loss, threshold=1 %): the config
               search runs collectively on the sharded model; sketches merged across ranks

and times each save (wall clock of dcp.save per rank, and the calling thread's CPU time). Then:
loads at world W (every method, timed), a 2-rank FSDP load of lossless and plain DCP (reshard
W -> 2, compared bit for bit), and in this process (world 1, no process group) the consolidated
states of every step (lossless must equal plain DCP's), the validation loss of the model rebuilt
from the dynaquant checkpoint, and a single-process dynaquant encode of the first checkpoint with
the config the sharded search chose (the ratio a single process reaches on the same state).

Timings on a shared, loaded machine are noisy: the table gives ratios to dcp+zstd measured side by
side in one run; re-run on a quiet machine for final numbers.

Run:  .venv/bin/python bench/dcp.py                       (world 4, 60 steps, checkpoints every 20)
      .venv/bin/python bench/dcp.py --world 2 --steps 20 --every 10 --n-embd 128   (quick)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch

warnings.filterwarnings("ignore")
METHODS = ("dcp", "dcp+zstd", "lossless", "lossless-z1", "dynaquant")
FAST = METHODS[:4]  # the methods timed side by side in one process


def _counting_fs():
    """``countfile://`` -- a local folder with object-store semantics (no rename: whole-object PUTs)
    that counts requests per kind, so each rank can report what a save and a load cost it."""
    import collections

    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    class CountingFS(LocalFileSystem):
        protocol = "countfile"
        calls = collections.Counter()

        def __init__(self, **kw):
            super().__init__(auto_mkdir=True, **kw)

        @classmethod
        def _strip_protocol(cls, path):
            return super()._strip_protocol(str(path).removeprefix("countfile://"))

        def ls(self, path, detail=False, **kw):
            self.calls["LIST"] += 1
            return super().ls(path, detail=detail, **kw)

        def exists(self, path, **kw):
            self.calls["HEAD"] += 1
            return super().exists(path)

        def _open(self, path, mode="rb", **kw):
            self.calls["GET" if "r" in mode else "PUT"] += 1
            return super()._open(path, mode, **kw)

        def rm_file(self, path):
            self.calls["DELETE"] += 1
            return super().rm_file(path)

    fsspec.register_implementation("countfile", CountingFS, clobber=True)
    return CountingFS.calls


# --- the workload ---------------------------------------------------------------------------------
def workload(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    from ckptzip.demo.workloads import stdlib_text

    text = torch.frombuffer(bytearray(stdlib_text(1_500_000)), dtype=torch.uint8).long()
    train, val = text[:-200_000], text[-200_000:]
    cfg = GPT2Config(vocab_size=256, n_embd=args.n_embd, n_layer=args.layers, n_head=8, n_positions=args.seq,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

    def windows(src, n, seed):
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, len(src) - args.seq, (n,), generator=g)
        return torch.stack([src[s:s + args.seq] for s in starts.tolist()])

    search_val = [windows(val[:100_000], 8, 7 + i) for i in range(2)]      # what eval_fn sees
    held_out = [windows(val[100_000:], 16, 70 + i) for i in range(4)]      # the reported val loss

    @torch.no_grad()
    def val_loss(m, batches=search_val) -> float:
        was = m.training
        m.eval()
        out = sum(float(m(input_ids=b, labels=b).loss) for b in batches) / len(batches)
        m.train(was)
        return out

    def build(seed=0):
        torch.manual_seed(seed)
        return GPT2LMHeadModel(cfg)

    return build, (lambda step: windows(train, args.batch, 20_000 + step)), val_loss, held_out


def shard(model, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def state_of(model, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def writer(method, root, step, model=None, eval_fn=None):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._extension import ZStandard

    from ckptzip.dcp import CompressedWriter

    if method == "dcp":
        return dcp.FileSystemWriter(f"{root}/{step}")
    if method == "dcp+zstd":
        return dcp.FileSystemWriter(f"{root}/{step}", _extensions=[ZStandard()])
    if method.startswith("lossless"):
        return CompressedWriter(root, step=step, method="lossless", config={"zstd_level": 1 if "z1" in method else 3})
    return CompressedWriter(root, step=step, method="dynaquant", model=model, eval_fn=eval_fn, threshold=0.01)


def reader(method, root, step):
    import torch.distributed.checkpoint as dcp

    from ckptzip.dcp import CompressedReader

    return dcp.FileSystemReader(f"{root}/{step}") if method.startswith("dcp") else CompressedReader(root, step)


def timed(fn) -> tuple[float, float]:
    w, c = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - w, time.thread_time() - c


# --- rank processes -------------------------------------------------------------------------------
def rank_main(args):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world, timeout=datetime.timedelta(minutes=30))
    build, batch, val_loss, _ = workload(args)
    out = pathlib.Path(args.out)
    calls = _counting_fs()
    # dynaquant's root counts requests (object-store semantics: no fsync); the timed ones fsync as DCP does
    roots = {m: ("countfile://" if m == "dynaquant" else "") + str(out / m.replace("+", "_")) for m in METHODS}
    result: dict = {"saves": [], "loads": {}}
    if args.phase == "train":
        model = shard(build(0), args.world)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        for step in range(1, args.steps + 1):
            model(input_ids=(b := batch(step)), labels=b).loss.backward()
            opt.step()
            opt.zero_grad()
            if step % args.every:
                continue
            sd = state_of(model, opt)
            k = step // args.every
            for method in METHODS[k % len(METHODS):] + METHODS[:k % len(METHODS)]:  # rotating: none always first
                dist.barrier()
                calls.clear()
                w, c = timed(lambda: dcp.save(sd, storage_writer=writer(method, roots[method], step, model, val_loss)))
                result["saves"].append({"step": step, "method": method, "wall_s": w, "cpu_s": c,
                                        "requests": dict(calls)})
        result["val_loss_exact"] = val_loss(model)
    loaded = {}
    for method in ("dcp",) + METHODS:  # the first (untimed, overwritten) warms imports and the group
        model = shard(build(1), args.world)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(input_ids=(b := batch(0)), labels=b).loss.backward()
        opt.step()
        sd = state_of(model, opt)
        dist.barrier()
        calls.clear()
        w, c = timed(lambda: dcp.load(sd, storage_reader=reader(method, roots[method], args.steps)))
        result["loads"][method] = {"wall_s": w, "cpu_s": c, "requests": dict(calls)}
        if args.phase == "reshard" and method in ("dcp", "lossless"):
            loaded[method] = _flat_dict(sd)
    if args.phase == "reshard":
        result["reshard_identical"] = _identical(loaded["lossless"], loaded["dcp"])
    json.dump(result, open(out / f"{args.phase}-r{args.rank}.json", "w"))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _flat_tensors(sd):
    from ckptzip.dcp.tools import flat_tensors

    return flat_tensors(sd)


def _flat_dict(sd):
    return {k: v.to_local().clone() if hasattr(v, "to_local") else v for k, v in _flat_tensors(sd)}


def _identical(a: dict, b: dict) -> bool:
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return sorted(a) == sorted(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].contiguous().view(bits[a[k].element_size()]), b[k].contiguous().view(bits[b[k].element_size()]))
        for k in a)


def spawn(args, phase: str, world: int) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = [sys.executable, __file__, "--phase", phase, "--world", str(world), "--port", str(port), "--out", args.out,
            "--steps", str(args.steps), "--every", str(args.every), "--n-embd", str(args.n_embd),
            "--layers", str(args.layers), "--seq", str(args.seq), "--batch", str(args.batch)]
    procs = [subprocess.Popen(base + ["--rank", str(r)], stderr=subprocess.PIPE) for r in range(world)]
    for r, p in enumerate(procs):
        _, err = p.communicate()
        if p.returncode:
            raise SystemExit(f"rank {r} of {phase} failed:\n{err.decode()[-4000:]}")
    return [json.load(open(pathlib.Path(args.out) / f"{phase}-r{r}.json")) for r in range(world)]


# --- the report (this process, world 1) -----------------------------------------------------------
def folder_bytes(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def report(args, train: list[dict], reshard: list[dict]) -> dict:
    from ckptzip.dcp import CompressedWriter, tools
    from ckptzip.dcp.layout import Root

    out = pathlib.Path(args.out)
    steps = list(range(args.every, args.steps + 1, args.every))
    size = {m: {} for m in METHODS}
    for m in METHODS:
        for s in steps:
            p = out / m.replace("+", "_") / (str(s) if m.startswith("dcp") else f"step-{s:012d}")
            size[m][s] = folder_bytes(p)
    saves = {m: [x for r in train for x in r["saves"] if x["method"] == m] for m in METHODS}
    # consolidated states (world 1): lossless == plain DCP at every step; dynaquant's quality
    plain = {s: _consolidated(out / "dcp" / str(s)) for s in steps}
    lossless_equal = all(_identical(dict(_flat_tensors(tools.load_full(out / "lossless", s))), dict(_flat_tensors(plain[s])))
                         for s in steps)
    build, _, val_loss, held_out = workload(args)
    losses = {}
    for name, sd in (("exact", plain[steps[-1]]), ("dynaquant", tools.load_full(out / "dynaquant", steps[-1]))):
        model = build(0)
        model.load_state_dict({k: v for k, v in sd["model"].items()}, strict=False)
        model.tie_weights()
        losses[name] = val_loss(model, held_out)
    meta = Root(out / "dynaquant").read_metadata(steps[0])["ranks"][0]
    knobs = {k: meta["summary"][k] for k in ("bins", "embedding_bins", "prune_fraction", "prune_metric",
                                             "protect_fraction") if k in meta["summary"]}
    single = out / "single"
    first = plain[steps[0]]
    first["model"]["lm_head.weight"] = first["model"]["transformer.wte.weight"]  # tied, as live
    torch.distributed.checkpoint.save(first, storage_writer=CompressedWriter(single, step=steps[0], method="dynaquant",
                                                                            config={"quantizer": knobs}))
    last_meta = {m: [f for f in Root(out / m).read_metadata(steps[-1])["ranks"] if f["rank"] >= 0]
                 for m in ("lossless", "dynaquant")}
    res = {
        "single_process_save": single_process_saves(plain[steps[-1]], out / "single-saves"),
        "requests_last_save": [next(x.get("requests") for x in r["saves"] if x["method"] == "dynaquant"
                                    and x["step"] == steps[-1]) for r in train],
        "requests_load": [r["loads"]["dynaquant"].get("requests") for r in train],
        "requests_load_2": [r["loads"]["dynaquant"].get("requests") for r in reshard],
        "reference_bytes": {m: [f.get("reference_bytes") for f in last_meta[m]] for m in last_meta},
        "rank_raw_bytes": {m: [f["raw_bytes"] for f in last_meta[m]] for m in last_meta},
        "dynaquant_passes": [f.get("passes") for f in last_meta["dynaquant"]],
        "dynaquant_encode_s": [f.get("encode_s") for f in last_meta["dynaquant"]],
        "world": args.world, "steps": steps, "params": sum(v.numel() for v in plain[steps[-1]]["model"].values()),
        "bytes": size, "lossless_equal_plain_dcp_all_steps": lossless_equal,
        "reshard_to_2_identical": all(r["reshard_identical"] for r in reshard),
        "save_wall_s": {m: statistics.median(x["wall_s"] for x in saves[m]) for m in METHODS},
        "save_cpu_s": {m: statistics.median(x["cpu_s"] for x in saves[m]) for m in METHODS},
        "load_wall_s_world": {m: statistics.median(r["loads"][m]["wall_s"] for r in train) for m in METHODS},
        "load_wall_s_2": {m: statistics.median(r["loads"][m]["wall_s"] for r in reshard) for m in METHODS},
        "val_loss": losses, "val_loss_exact_fsdp": train[0]["val_loss_exact"],
        "dynaquant_first_search": {k: meta["summary"].get(k) for k in ("search", "evals", "degradation", "search_s")},
        "dynaquant_knobs": knobs, "single_process_first_bytes": folder_bytes(single / f"step-{steps[0]:012d}"),
    }
    return res


def single_process_saves(state: dict, folder: pathlib.Path, repeats: int = 5) -> dict:
    """dcp, dcp+zstd and ckptzip lossless (zstd 3 and 1) saving the same consolidated state in this process (no
    process group, no other rank to wait for), alternating, ``repeats`` each: median wall and thread
    CPU seconds. Every ckptzip save is a keyframe on a fresh root (its deltas cost an XOR more)."""
    import torch.distributed.checkpoint as dcp

    from ckptzip.dcp import forget

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the rank processes; intra-op threads only contend on a shared CPU
    times = {m: [] for m in FAST}
    for i in range(repeats):
        for m in FAST:
            root = folder / f"{m.replace('+', '_')}-{i}"
            w, c = timed(lambda: dcp.save(state, storage_writer=writer(m, str(root), 1), no_dist=True))
            times[m].append((w, c))
            forget(str(root))
    torch.set_num_threads(threads)
    return {m: {"wall_s": statistics.median(w for w, _ in v), "cpu_s": statistics.median(c for _, c in v)}
            for m, v in times.items()}


def _consolidated(path) -> dict:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    sd: dict = {}
    _load_state_dict(sd, storage_reader=FileSystemReader(str(path)), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return sd


def print_report(r: dict) -> None:
    steps, last = r["steps"], r["steps"][-1]
    total = {m: sum(r["bytes"][m].values()) for m in METHODS}
    print(f"\nGPT-2 ({r['params'] / 1e6:.2f}M params), FSDP2 at world {r['world']}, checkpoints at steps {steps}")
    print("| method | bytes (all steps) | ratio vs dcp | last step | save wall (median) | save / dcp+zstd "
          "| save thread CPU | load wall (world W) | load wall (world 2) |")
    print("|---|---|---|---|---|---|---|---|---|")
    z = r["save_wall_s"]["dcp+zstd"]
    for m in METHODS:
        print(f"| {m} | {total[m] / 1e6:.2f} MB | {total['dcp'] / total[m]:.2f}x | "
              f"{r['bytes']['dcp'][last] / r['bytes'][m][last]:.2f}x | {r['save_wall_s'][m]:.3f} s | "
              f"{r['save_wall_s'][m] / z:.2f} | {r['save_cpu_s'][m]:.3f} s | {r['load_wall_s_world'][m]:.3f} s | "
              f"{r['load_wall_s_2'][m]:.3f} s |")
    sp = r["single_process_save"]
    print("\nsingle process, the consolidated last state, 5 alternating saves (median): " + ", ".join(
        f"{m} {v['wall_s']:.3f} s wall / {v['cpu_s']:.3f} s CPU" for m, v in sp.items())
        + "; vs dcp+zstd: " + ", ".join(f"{m} {sp[m]['wall_s'] / sp['dcp+zstd']['wall_s']:.2f} (wall) "
                                         f"{sp[m]['cpu_s'] / sp['dcp+zstd']['cpu_s']:.2f} (CPU)"
                                         for m in ("lossless", "lossless-z1")))
    ve, vq = r["val_loss"]["exact"], r["val_loss"]["dynaquant"]
    first = steps[0]
    print(f"\nlossless == plain DCP (world 1, every step): {r['lossless_equal_plain_dcp_all_steps']}; "
          f"reshard {r['world']} -> 2 bit-identical: {r['reshard_to_2_identical']}")
    print(f"dynaquant reloaded: held-out val loss {vq:.4f} vs exact {ve:.4f} ({(vq - ve) / ve * 100:+.2f} %); "
          f"first search {r['dynaquant_first_search']}; knobs {r['dynaquant_knobs']}")
    print(f"requests per rank (dynaquant root): last save {r['requests_last_save']}; load at world {r['world']} "
          f"{r['requests_load']}, at world 2 {r['requests_load_2']}")
    for m in ("lossless", "dynaquant"):
        print(f"{m}: reference kept per rank {[round(b / 1e6, 2) for b in r['reference_bytes'][m]]} MB of "
              f"{[round(b / 1e6, 2) for b in r['rank_raw_bytes'][m]]} MB")
    print(f"dynaquant sharded encode: passes {r['dynaquant_passes']}, encode s {r['dynaquant_encode_s']}")
    print(f"first checkpoint (keyframe) dynaquant: sharded {r['bytes']['dcp'][first] / r['bytes']['dynaquant'][first]:.2f}x"
          f", single process with the same knobs {r['bytes']['dcp'][first] / r['single_process_first_bytes']:.2f}x")


def metadata_scale(worlds=(8, 64, 1000), n_params: int = 291) -> None:
    """Metadata size for a Llama-7B-shaped AdamW state (291 parameters of 4096 x 4096 / 11008;
    weight, exp_avg, exp_avg_sq each split FSDP-style on dim 0): ckptzip's zstd'd JSON against the
    pickled ``Metadata`` DCP's FileSystemWriter writes for the same chunks (with its storage_data)."""
    import pickle
    import secrets

    import zstandard
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    print("| world | tensors x chunks | ckptzip metadata (JSON) | stored (zstd) | DCP .metadata (pickle) |")
    print("|---|---|---|---|---|")
    for world in worlds:
        tensors, sdm, storage = {}, {}, {}
        for i in range(n_params):
            rows, cols = (4096, 11008) if i % 3 else (4096, 4096)
            per = -(-rows // world)
            ch = [(r * per, min(per, rows - r * per), r) for r in range(world) if r * per < rows]
            for fqn in (f"model.layers.{i // 9}.p{i}.weight", f"optim.state.layers.{i // 9}.p{i}.weight.exp_avg",
                        f"optim.state.layers.{i // 9}.p{i}.weight.exp_avg_sq"):
                tensors[fqn] = {"dtype": "float32", "size": [rows, cols],
                                "chunks": [[[o, 0], [n, cols], r] for o, n, r in ch]}
                sdm[fqn] = TensorStorageMetadata(TensorProperties(torch.float32), torch.Size([rows, cols]),
                                                 [ChunkStorageMetadata(torch.Size([o, 0]), torch.Size([n, cols]))
                                                  for o, n, _ in ch])
                for o, n, r in ch:
                    storage[MetadataIndex(fqn, [o, 0])] = _StorageInfo(f"__{r}_0.distcp", 123_456 * o, n * cols * 4)
        ranks = [{"rank": r, "file": f"rank-{r:05d}.ckz", "sha256": secrets.token_hex(32), "nbytes": 10**8 + r,
                  "keyframe": False, "parent": 100, "chain": [100, 200], "layout": secrets.token_hex(16),
                  "raw_bytes": 3 * 10**8 + r, "method": "dynaquant/2", "passes": 5, "encode_s": 1.234,
                  "reference_bytes": 10**7 + r, "summary": {"bins": 8, "search": "neighbourhood"}}
                 for r in range(world)]
        ours = json.dumps({"tensors": tensors, "ranks": ranks}, separators=(",", ":")).encode()
        theirs = pickle.dumps(Metadata(sdm, storage_data=storage))
        stored = zstandard.ZstdCompressor(level=3).compress(ours)
        print(f"| {world} | {len(tensors)} x {world} | {len(ours) / 1e6:.2f} MB | {len(stored) / 1e6:.3f} MB | "
              f"{len(theirs) / 1e6:.2f} MB |")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--out", default=None, help="working folder (default: a temp folder, removed)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--only", choices=("run", "metadata"), default=None,
                   help="metadata: only the metadata-size table at 8 / 64 / 1,000 ranks (no training)")
    p.add_argument("--reuse", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.phase is not None:
        return rank_main(args)
    if args.only == "metadata":
        return metadata_scale()
    keep = args.out is not None
    args.out = args.out or tempfile.mkdtemp(prefix="ckptzip-bench-dcp-")
    pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.time()
        if args.reuse:  # re-report a finished run (--out of a run kept with --out)
            train, reshard = ([json.load(open(pathlib.Path(args.out) / f"{ph}-r{r}.json")) for r in range(n)]
                              for ph, n in (("train", args.world), ("reshard", 2)))
        else:
            train = spawn(args, "train", args.world)
            reshard = spawn(args, "reshard", 2)
        r = report(args, train, reshard)
        r["bench_s"] = round(time.time() - t0, 1)
        print_report(r)
        if args.only is None:
            print()
            metadata_scale()
        if args.json:
            json.dump(r, open(args.json, "w"), indent=1)
    finally:
        if not keep:
            shutil.rmtree(args.out, ignore_errors=True)


if __name__ == "__main__":
    main()
