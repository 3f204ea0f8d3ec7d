"""Save and restore cost beside zstd-3 in one process, and against v0.1 (issue 15).

Every figure is a ratio measured in one process on the same checkpoint bytes: the method's save (or
restore) time divided by zstd level 3 compressing (or decompressing) the checkpoint's raw tensor
bytes, concatenated ("x zstd-3"), plus us per model parameter. Time is thread CPU time
(``time.thread_time``) with ``torch.set_num_threads(--threads)`` (default 1: every kernel and zstd
call runs on the measuring thread; the thread pool stays inline), repetitions interleave the method
and zstd so a change in machine load hits both; medians with [min, max] over repetitions.

  save     = ``CheckpointChain.save`` into fsspec's in-memory filesystem: flatten, the method's encode,
             container (manifest, blob checksums), index commit; no disk. A chain of the workload's
             checkpoints, keyframe first, the rest deltas (the default keyframe policy).
  restore  = ``CheckpointChain.load`` of the last step (replays every file from the keyframe),
             against zstd decompressing as many checkpoints.
  v0.1     = the same measurement run by ``git worktree add /tmp/v01 47704d1`` in a subprocess
             (PYTHONPATH=/tmp/v01/src), its own zstd-3 in its own process; "x v0.1" divides the two
             x-zstd figures.

Workloads (states built by this file with torch + transformers only, so v0.1 sees the same bytes):
  small   byte-level GPT-2 from config (vocab 256, d=96, 4 layers, 4 heads, 64 positions): 0.48M
          parameters, 208 tensors incl. biases/norms, trained with AdamW on the Python stdlib's
          source (``demo.workloads.gpt2_workload``), a checkpoint every --small-every steps.
  gpt2    GPT-2 124M (``transformers.GPT2Config()``), random init, then a few AdamW steps (lr 1e-4,
          batch 2 x 128) on stdlib bytes mapped to token ids as byte pairs (b[i] * 256 + b[i+1]) mod
          50257, so every embedding row the text touches gets real gradients and moments (not
          synthetic moments); a checkpoint after --big-steps and another --big-steps later.

Also:
  memory  peak extra memory of one dynaquant / lossless save of the gpt2 state, in a fresh
          process (VmHWM reset before the save, minus VmRSS at its start) / the state's bytes;
          "dynaquant+search": the chain's first save with the config search (exhaustive: 3 trials),
          the live model beside it.
  checksums  lossless saves of the small chain with each blob checksum (format.CHECKSUMS), side by
          side in one process, each rep interleaved with zstd-3 over the same bytes.
  search  dynaquant with the config search on the small chain (the workload's validation loss,
          --threshold): search seconds beyond the eval_fn calls vs the fixed-config save of the
          same checkpoint, saved in turn; --reps fresh pairs of chains, medians per checkpoint and
          the steady checkpoints' ratio per repetition; the evaluations per steady-state checkpoint.
  search-gpt2  the same on the gpt2 pair (eval_fn: the loss of one 64-token batch), one repetition.

Timings on the shared 2-core development machine are noisy (other jobs; torch suffers more than
zstd); the figures in docs/BENCHMARKS.md are to be re-run on a quiet machine.

Run:  .venv/bin/python bench/speed.py                       (small chain, search, v0.1: ~5 min)
      .venv/bin/python bench/speed.py --only small,gpt2,memory,search,v01 --big-steps 2

The build measured is the ``src`` beside this script (its child processes set PYTHONPATH to it and
this process puts it first on sys.path, whatever the caller's): to compare two builds, run each
checkout's own bench/speed.py.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch

V01 = "47704d1"
_SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")  # the build measured
ZSTD_LEVEL = 3


# ----------------------------------------------------------------------------- workloads (no ckptzip code)
def stdlib_bytes(n: int) -> torch.Tensor:
    import pathlib
    import sysconfig

    out = bytearray()
    for p in sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        out += p.read_bytes()
        if len(out) >= n:
            break
    return torch.frombuffer(bytearray(out[:n]), dtype=torch.uint8).long()


def small_states(n: int, every: int, *, n_embd: int = 96, n_layer: int = 4) -> list[dict]:
    """A byte-level GPT chain: n checkpoints ``every`` AdamW steps apart (``n_embd``, ``n_layer``:
    the small workload's unless bench/record_cost.py asks for another mix of tensors)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    text = stdlib_bytes(1_000_000)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=n_embd, n_layer=n_layer, n_head=4, n_positions=64,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    return train(model, opt, text, seq=64, batch=8, every=every, n=n)


def train(model, opt, ids: torch.Tensor, *, seq: int, batch: int, every: int, n: int) -> list[dict]:
    """n checkpoints ``every`` steps apart of a causal LM trained on windows of ``ids`` (fixed seed)."""
    g = torch.Generator().manual_seed(1)
    states = []
    for step in range(1, n * every + 1):
        starts = torch.randint(0, ids.numel() - seq, (batch,), generator=g)
        x = torch.stack([ids[s:s + seq] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % every == 0:
            states.append(copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()}))
    return states


def gpt2_states(steps: int) -> list[dict]:
    """GPT-2 124M from config: two checkpoints ``steps`` AdamW steps apart (see module docstring)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    b = stdlib_bytes(400_000)
    ids = (b[:-1] * 256 + b[1:]) % 50257
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    states = train(model, opt, ids, seq=128, batch=2, every=steps, n=2)
    del model, opt
    gc.collect()
    return states


def n_params(state: dict) -> int:
    return sum(v.numel() for k, v in state["model"].items() if k != "lm_head.weight")  # tied to wte


# ----------------------------------------------------------------------------- measurement (old or new ckptzip)
def state_nbytes(state: dict) -> int:
    """Bytes of a state's model and optimizer-state tensors (what a save's peak memory is divided by)."""
    n = sum(t.numel() * t.element_size() for t in state["model"].values())
    return n + sum(t.numel() * t.element_size() for st in state["optimizer"]["state"].values()
                   for t in st.values() if isinstance(t, torch.Tensor))


def raw_bytes(state: dict) -> bytes:
    from ckptzip.state import flatten_state
    from ckptzip.tensorbytes import tensor_to_bytes

    return b"".join(tensor_to_bytes(t) for t in flatten_state(state).tensors.values())


def same_tensors(a: dict, b: dict) -> bool:
    """Whether two {name: tensor} dicts hold the same names and the same bits (two restores)."""
    from ckptzip.tensorbytes import same_bits, to_numpy_bits

    return a.keys() == b.keys() and all(same_bits(to_numpy_bits(a[n]), to_numpy_bits(b[n])) for n in a)


def tensors_digest(state) -> str:
    """SHA-256 of a state's tensor names and bits: same_tensors across processes (two builds)."""
    import hashlib

    from ckptzip.dcp.tools import flat_tensors
    from ckptzip.tensorbytes import to_numpy_bits

    h = hashlib.sha256()
    for name, t in flat_tensors(state):
        h.update(name.encode())
        h.update(to_numpy_bits(t).tobytes())
    return h.hexdigest()


def measure(states: list[dict], methods: list[str], reps: int, *, chain: bool = True, warmup: bool = True) -> dict:
    """Per method and rep: encode / decode (and with ``chain``: save / restore) seconds (thread
    CPU), and zstd-3's on the same bytes. Checkpoint bytes are built one at a time and dropped:
    at 124M parameters a copy of every checkpoint would not fit beside the methods' own."""
    import fsspec
    import zstandard

    from ckptzip.chain import CheckpointChain
    from ckptzip.methods.base import DecodeContext, EncodeContext, get_method
    from ckptzip.state import flatten_state

    cz, dz = zstandard.ZstdCompressor(level=ZSTD_LEVEL), zstandard.ZstdDecompressor()
    out = {"raw_bytes": 0, "zstd_bytes": 0, "methods": {}}

    def timed(fn):
        t = time.thread_time()
        res = fn()
        return time.thread_time() - t, res

    def zstd():  # (compress s, decompress s) over every checkpoint
        tc = td = 0.0
        out["raw_bytes"] = out["zstd_bytes"] = 0
        for s in states:
            raw = raw_bytes(s)
            c, frame = timed(lambda: cz.compress(raw))
            d, _ = timed(lambda: dz.decompress(frame))
            tc, td = tc + c, td + d
            out["raw_bytes"] += len(raw)
            out["zstd_bytes"] += len(frame)
            del raw, frame
        return tc, td

    def codec(method):  # (encode s, decode s, stored bytes): each file decoded right after it is encoded
        enc_m, dec_m = get_method(method), get_method(method)
        te = td = 0.0
        stored, eref, dref = 0, None, None
        for i, s in enumerate(states):
            t = time.thread_time()
            flat = flatten_state(s)
            enc, eref = enc_m.encode(flat, eref, ctx=EncodeContext(step=i + 1))
            te += time.thread_time() - t
            t = time.thread_time()
            _, dref = dec_m.decode(flat.records, enc, dref, ctx=DecodeContext(step=i + 1, device="cpu"))
            td += time.thread_time() - t
            stored += sum(len(b) for b in enc.blobs.values())
            del enc, flat
        return te, td, stored

    phases = ("encode", "decode", "zsave", "zload") + (("save", "restore") if chain else ())
    for method in methods:
        rows = {k: [] for k in phases}
        for rep in range(0 if warmup else 1, reps + 1):  # rep 0 warms up (numba compiles, caches)
            zs, zl = zstd()
            te, td, rows["stored"] = codec(method)
            gc.collect()
            ts = tl = 0.0
            if chain:
                url = f"memory://speed-{method}-{rep}-{os.getpid()}"
                ch = CheckpointChain(url, method)
                ts, _ = timed(lambda: [ch.save(s, i + 1) for i, s in enumerate(states)])
                tl, _ = timed(lambda: CheckpointChain(url, method).load(len(states)))
                rows["stored"] = sum(e.nbytes for e in ch.entries())
                fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)
                del ch
                gc.collect()
            if rep:
                for k, v in zip(("encode", "decode", "zsave", "zload", "save", "restore"), (te, td, zs, zl, ts, tl)):
                    if k in rows:
                        rows[k].append(v)
        out["methods"][method] = rows
    return out


def child(args) -> None:
    """--child: build a workload's states and measure them with the ckptzip on PYTHONPATH; JSON out."""
    torch.set_num_threads(args.threads)
    states = small_states(args.small_n, args.small_every) if args.child == "small" else gpt2_states(args.big_steps)
    small = args.child == "small"
    res = measure(states, args.methods.split(","), args.reps if small else 1, chain=small, warmup=small)
    res["params"] = n_params(states[0])
    print("JSON" + json.dumps(res))


def run_child(kind: str, args, pythonpath: str) -> dict:
    env = dict(os.environ, PYTHONPATH=pythonpath)
    cmd = [sys.executable, __file__, "--child", kind, "--threads", str(args.threads), "--reps", str(args.reps),
           "--small-n", str(args.small_n), "--small-every", str(args.small_every),
           "--big-steps", str(args.big_steps), "--methods", args.methods]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("JSON")), None)
    if r.returncode or line is None:
        raise SystemExit(f"child {kind} ({pythonpath}) failed:\n{r.stderr[-3000:]}")
    return json.loads(line[4:])


def v01_src() -> str:
    """A checkout of v0.1 (commit 47704d1), made once in /tmp/v01."""
    path = "/tmp/v01"
    if not os.path.isdir(path):
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        subprocess.run(["git", "-C", repo, "worktree", "add", "--detach", path, V01], check=True,
                       capture_output=True)
    return os.path.join(path, "src")


# ----------------------------------------------------------------------------- reporting
def ratio(a: list[float], b: list[float]) -> tuple[float, float, float]:
    r = [x / y for x, y in zip(a, b)]
    return statistics.median(r), min(r), max(r)


def fmt(r: tuple[float, float, float]) -> str:
    return f"{r[0]:.2f} [{r[1]:.2f}, {r[2]:.2f}]"


def table(title: str, res: dict, old: dict | None, n_ckpt: int) -> None:
    from compare import md_table

    params = res["params"]
    rows = []
    for m, r in res["methods"].items():
        phases = [(p, z) for p, z in (("encode", "zsave"), ("save", "zsave"), ("decode", "zload"),
                                      ("restore", "zload")) if p in r]
        for phase, z in phases:
            x = ratio(r[phase], r[z])
            row = [m, phase, fmt(x), f"{1e6 * statistics.median(r[phase]) / (n_ckpt * params):.3f}"]
            if old is not None and m in old["methods"]:
                ox = ratio(old["methods"][m][phase], old["methods"][m][z])[0]
                row += [f"{ox:.2f}", f"{x[0] / ox:.2f}"]
            rows.append(row)
        for j, row in enumerate(rows[-len(phases):]):
            row.insert(2, f"{res['raw_bytes'] / r['stored']:.2f}" if j == 0 else "")
    first = res["methods"][next(iter(res["methods"]))]
    for phase, z in (("compress", "zsave"), ("decompress", "zload")):
        rows.append(["zstd-3 of the raw bytes", phase, f"{res['raw_bytes'] / res['zstd_bytes']:.2f}", "1",
                     f"{1e6 * statistics.median(first[z]) / (n_ckpt * params):.3f}"] + (["1", "1"] if old else []))
    head = ["method", "phase", "ratio", "x zstd-3", "us/param"]
    if old is not None:
        head += ["v0.1 x zstd-3", "x v0.1"]
    print(f"\n### {title}\n")
    print(md_table(head, rows))
    print("\nencode = flatten + method.encode; save = CheckpointChain.save to memory:// (adds the container, "
          "its checksum per blob, the index); decode / restore likewise. ratio: raw bytes / stored bytes.")


MEMORY_CHILD = r"""
import sys, gc, time, tempfile, torch
sys.path.insert(0, sys.argv[4])
from speed import gpt2_states, state_nbytes, vm_bytes
torch.set_num_threads(int(sys.argv[3]))
state = gpt2_states(int(sys.argv[2]))[0]
from ckptzip.chain import CheckpointChain
nbytes = state_nbytes(state)
ctx = None
if sys.argv[1].endswith("+search"):  # the first save's exhaustive search: 3 trials of the whole model
    from transformers import GPT2Config, GPT2LMHeadModel
    from ckptzip.methods.base import EncodeContext
    from speed import stdlib_bytes
    b = stdlib_bytes(400_000)
    val = ((b[:-1] * 256 + b[1:]) % 50257)[-64:].reshape(1, 64)
    model = GPT2LMHeadModel(GPT2Config())
    model.load_state_dict(state["model"])

    @torch.no_grad()
    def eval_fn(m):
        m.eval()
        out = float(m(input_ids=val, labels=val).loss)
        m.train()
        return out
    eval_fn(model)
    ctx = EncodeContext(step=1, model=model, eval_fn=eval_fn, threshold=0.01)
gc.collect()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the high-water mark: VmHWM is then the peak of the save alone
base = vm_bytes("VmRSS")
with tempfile.TemporaryDirectory() as d:
    t = time.perf_counter()
    CheckpointChain(d + "/c", sys.argv[1].split("+")[0]).save(state, 1, ctx=ctx)
    el = time.perf_counter() - t
print(f"JSON{nbytes} {base} {vm_bytes('VmHWM')} {el}")
"""


def memory(args) -> None:
    from compare import md_table

    rows = []
    for method in ("dynaquant", "dynaquant+search", "lossless"):
        r = subprocess.run([sys.executable, "-c", MEMORY_CHILD, method, str(args.big_steps), str(args.threads),
                            os.path.dirname(os.path.abspath(__file__))], capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=_SRC))
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("JSON")), None)
        if r.returncode or line is None:
            raise SystemExit(r.stderr[-3000:])
        nbytes, base, peak, el = (float(v) for v in line[4:].split())
        rows.append([method, f"{nbytes / 1e6:.0f}", f"{(peak - base) / nbytes:.2f}x", f"{el:.1f}"])
    print("\n### Peak extra memory of one save, GPT-2 124M state (fresh process)\n")
    print(md_table(["method", "state MB", "extra peak / state", "wall s"], rows))


def checksums(args, states: list[dict]) -> None:
    """Lossless saves of the small chain with each blob checksum, against zstd-3, in one process."""
    import fsspec
    import zstandard
    from compare import md_table

    from ckptzip.chain import CheckpointChain
    from ckptzip.format import CHECKSUMS, DEFAULT_CHECKSUM

    raws = [raw_bytes(s) for s in states]
    cz = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    times = {k: [] for k in CHECKSUMS}
    for rep in range(args.reps + 1):  # rep 0 warms up
        for kind in CHECKSUMS:
            z = time.thread_time()
            for raw in raws:
                cz.compress(raw)
            z = time.thread_time() - z
            url = f"memory://checksum-{kind}-{rep}-{os.getpid()}"
            ch = CheckpointChain(url, "lossless", checksum=kind)
            t = time.thread_time()
            for i, s in enumerate(states):
                ch.save(s, i + 1)
            t = time.thread_time() - t
            fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)
            if rep:
                times[kind].append(t / z)
    rows = [[k + (" (default)" if k == DEFAULT_CHECKSUM else ""), str(CHECKSUMS[k]),
             fmt((statistics.median(v), min(v), max(v)))] for k, v in times.items()]
    print(f"\n### Lossless save of the small chain by blob checksum ({args.reps} reps)\n")
    print(md_table(["checksum", "format version", "save x zstd-3"], rows))


def search_model(big: bool = False):
    """(model, eval_fn, spent) of the search benchmarks: the small chain's GPT (two batches of 16
    held-out 64-byte windows) or (``big``) GPT-2 124M (one 64-token batch); eval_fn adds its
    thread CPU time to ``spent[0]``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    g = torch.Generator().manual_seed(7)
    if big:  # one batch of 64 byte-pair tokens, as gpt2_states maps the text
        b = stdlib_bytes(400_000)
        val = [((b[:-1] * 256 + b[1:]) % 50257)[-64:].reshape(1, 64)]
        model = GPT2LMHeadModel(GPT2Config())
    else:
        text = stdlib_bytes(1_000_000)[-60_000:]
        val = [torch.stack([text[s:s + 64] for s in torch.randint(0, text.numel() - 64, (16,), generator=g).tolist()])
               for _ in range(2)]
        model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=96, n_layer=4, n_head=4, n_positions=64))
    spent = [0.0]

    @torch.no_grad()
    def eval_fn(m):
        t = time.thread_time()
        was = m.training
        m.eval()
        out = sum(float(m(input_ids=b, labels=b).loss) for b in val) / len(val)
        m.train(was)
        spent[0] += time.thread_time() - t
        return out

    return model, eval_fn, spent


def search(args, states: list[dict], *, big: bool = False) -> None:
    """The config search's cost beyond eval_fn, against a fixed-config save: the small chain, or
    (``big``) the GPT-2 124M pair."""
    from compare import md_table

    from ckptzip.chain import CheckpointChain
    from ckptzip.methods.base import EncodeContext

    model, eval_fn, spent = search_model(big)

    def ctx(i, searching):
        return EncodeContext(step=i + 1, model=model, eval_fn=eval_fn, threshold=args.threshold) if searching else None

    def timed_save(chain, i, s, searching):
        t = time.thread_time()
        e = chain.save(s, i + 1, ctx=ctx(i, searching))
        return time.thread_time() - t, e

    # load every kernel first, fixed and searched, a first delta included (the search's delta
    # estimates and a delta's coder meet kernels a keyframe does not)
    for searching in (False, True):
        warm = CheckpointChain(f"memory://speed-warm-{searching}", "dynaquant")
        for i, s in enumerate(states[:2]):
            model.load_state_dict(s["model"])
            warm.save(s, i + 1, ctx=ctx(i, searching))
    del warm
    reps = 1 if big else args.reps
    fixed_s, beyond_s, rows, evals = [], [], [], []
    for rep in range(reps):  # each repetition: a fresh pair of chains, checkpoint by checkpoint in turn
        fixed = CheckpointChain(f"memory://speed-fixed-{rep}", "dynaquant")
        searched = CheckpointChain(f"memory://speed-search-{rep}", "dynaquant")
        fixed_s.append([])
        beyond_s.append([])
        for i, s in enumerate(states):
            model.load_state_dict(s["model"])
            t_fixed, _ = timed_save(fixed, i, s, False)
            spent[0] = 0.0
            t_search, e = timed_save(searched, i, s, True)
            fixed_s[-1].append(t_fixed)
            beyond_s[-1].append(t_search - spent[0] - t_fixed)
            if rep == 0:
                sm = e.summary
                if i:
                    evals.append(sm["evals"])
                rows.append([i + 1, sm["search"], sm["evals"], sm.get("estimates", 0), f"{spent[0]:.2f}"])
        del fixed, searched
    for i, row in enumerate(rows):
        f = statistics.median(r[i] for r in fixed_s)
        b = statistics.median(r[i] for r in beyond_s)
        per = [r[i] / q[i] for r, q in zip(beyond_s, fixed_s)]
        row += [f"{f:.3f}", f"{b:.3f}", f"{b / f:.2f}" + (f" [{min(per):.2f}, {max(per):.2f}]" if reps > 1 else "")]
    where = "the GPT-2 124M pair" if big else "the small chain"
    print(f"\n### Config search on {where} (threshold {args.threshold}, val loss eval_fn; "
          f"medians [min, max] over {reps} repetition(s))\n")
    print(md_table(["ckpt", "search", "evals", "estimates", "eval_fn s", "fixed save s", "search s beyond eval_fn",
                    "x fixed save"], rows))
    if len(states) > 1:
        steady = [sum(b[1:]) / sum(f[1:]) for b, f in zip(beyond_s, fixed_s)]
        print(f"\nsteady checkpoints, search beyond eval_fn over the fixed saves: median {statistics.median(steady):.2f}x "
              f"[{min(steady):.2f}, {max(steady):.2f}] over the repetitions")
    if evals:
        dist = {k: evals.count(k) for k in sorted(set(evals))}
        print(f"\nsteady-state evaluations per checkpoint: mean {statistics.mean(evals):.2f}, distribution {dist}")


def vm_bytes(key: str) -> int:
    """A /proc/self/status memory figure in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="small,search,v01", help="small,gpt2,memory,checksums,search,search-gpt2,v01")
    p.add_argument("--methods", default="dynaquant,lossless")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--small-n", type=int, default=6)
    p.add_argument("--small-every", type=int, default=8)
    p.add_argument("--big-steps", type=int, default=2)
    p.add_argument("--threshold", type=float, default=0.01)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    only = args.only.split(",")
    torch.set_num_threads(args.threads)
    here = _SRC
    sys.path.insert(0, here)  # the search and checksums tables run in this process: the same build
    print(f"torch threads {args.threads}; thread CPU time; medians [min, max] over {args.reps} reps "
          "(noisy shared machine: re-run on a quiet one)")
    for kind in ("small", "gpt2"):
        if kind not in only:
            continue
        old = run_child(kind, args, v01_src()) if "v01" in only else None
        res = run_child(kind, args, here)
        n = args.small_n if kind == "small" else 2
        title = (f"Small byte-level GPT chain ({res['params'] / 1e6:.2f}M params, {n} checkpoints)" if kind == "small"
                 else f"GPT-2 124M from config ({res['params'] / 1e6:.1f}M params, 2 checkpoints)")
        table(title, res, old, n)
    if "memory" in only:
        memory(args)
    if "checksums" in only:
        checksums(args, small_states(args.small_n, args.small_every))
    if "search" in only:
        search(args, small_states(args.small_n, args.small_every))
    if "search-gpt2" in only:
        search(args, gpt2_states(args.big_steps), big=True)


if __name__ == "__main__":
    main()
