"""Method ``lossless`` on real training sequences: compression ratio and speed beside plain zstd.

Workloads (both real runs on data shipped with installed packages, nothing downloaded):
  digits  DigitsMLP(128) + Adam on scikit-learn digits (ckptzip.demo.workloads.digits_run),
          --checkpoints checkpoints 20 steps apart (26.6K params, 0.32 MB of tensors each)
  gpt2    transformers GPT-2 (vocab 256 = bytes, n_embd 128, 4 layers, 4 heads, 128 positions)
          trained with Adam (lr 1e-3, batch 8 x 128 bytes) on the Python stdlib's source text
          (ckptzip.demo.workloads.stdlib_text), a checkpoint every --gpt2-every steps
          (0.88M params incl. the tied lm_head copy, 10.5 MB of tensors each)

Each checkpoint is the full training state {"model": state_dict, "optimizer": state_dict}.
Rows (ratio = raw tensor bytes / stored bytes; key = keyframes, delta = the others):
  lossless (files) the method as a chain stores it: keyframe every --every saves, XOR deltas
                   between, byte-grouped zstd-3 planes; stored bytes = whole container files
                   (manifest included); encode = flatten + method.encode + container,
                   decode = container parse + method.decode, in save order (each delta decoded
                   once from the previous result, as a sequential restore does)
  lossless (blobs) the same run counting only the blobs (no manifest), comparable to the rows below
  lossless, no sparse
                   lossless (files) with ``sparse_planes=False``: every byte plane one zstd frame
                   or raw (stage bytegroup/1 only, the writer before sparse planes)
  bytegroup        every checkpoint a keyframe (byte grouping + zstd-3, no XOR), blobs only
  zstd-3 raw       zstd level 3 of each checkpoint's raw tensor bytes concatenated, one frame
MB/s are raw tensor MB (1e6 bytes) per second of wall time, single process, --threads torch
threads (default 1); best of --repeats.

Run:  .venv/bin/python bench/lossless.py                      (~1-2 min; both workloads)
      .venv/bin/python bench/lossless.py --workload digits --checkpoints 10
"""
from __future__ import annotations

import argparse
import time

import torch
import zstandard

from ckptzip.codec import bytegroup
from ckptzip.format import decode_container, encode_container
from ckptzip.methods.base import DecodeContext, EncodeContext, Encoded
from ckptzip.methods.lossless import LosslessConfig, LosslessMethod
from ckptzip.state import TensorRecord, flatten_state
from ckptzip.tensorbytes import tensor_from_bytes, tensor_to_bytes


# --- workloads -------------------------------------------------------------------------------------

def digits_states(n: int) -> list[dict]:
    from ckptzip.demo.workloads import digits_run

    _, _, snaps, _ = digits_run(n_checkpoints=n, steps_between=20)
    return [{"model": s.model, "optimizer": s.optimizer} for s in snaps]


def gpt2_states(n: int, every: int, batch: int = 8, seq: int = 128) -> list[dict]:
    import copy

    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    from ckptzip.demo.workloads import stdlib_text

    hf_logging.set_verbosity_error()  # byte-level vocab: the default bos/eos ids warn
    torch.manual_seed(0)
    text = torch.frombuffer(bytearray(stdlib_text(1_000_000)), dtype=torch.uint8).long()
    cfg = GPT2Config(vocab_size=256, n_embd=128, n_layer=4, n_head=4, n_positions=seq, bos_token_id=0,
                     eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        for _ in range(every):
            starts = torch.randint(0, len(text) - seq - 1, (batch,), generator=g)
            x = torch.stack([text[s:s + seq] for s in starts])  # (B, T) byte ids
            loss = model(input_ids=x, labels=x).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
        out.append({"model": copy.deepcopy(model.state_dict()), "optimizer": copy.deepcopy(opt.state_dict())})
    print(f"  gpt2: final training loss {loss.item():.3f} nats/byte after {n * every} steps")
    return out


# --- measurements ------------------------------------------------------------------------------------

def raw_bytes(flat) -> int:
    return sum(t.numel() * t.element_size() for t in flat.tensors.values())


def best_of(repeats: int, fn):
    best, result = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def run_lossless(states, every: int, repeats: int, **config):
    m = LosslessMethod(LosslessConfig(**config))

    def encode():
        files, ref = [], None
        for i, state in enumerate(states):
            flat = flatten_state(state)
            enc, new_ref = m.encode(flat, None if i % every == 0 else ref, ctx=EncodeContext(step=i))
            ref = new_ref
            manifest = {"step": i, "keyframe": enc.keyframe, "skeleton": flat.skeleton,
                        "records": {n: {**r.to_dict(), **enc.records[n]} for n, r in flat.records.items()}}
            files.append((enc.keyframe, encode_container(manifest, enc.blobs),
                          sum(len(b) for b in enc.blobs.values())))
        return files

    t_enc, files = best_of(repeats, encode)

    def decode():
        ref, out = None, []
        for i, (_, data, _) in enumerate(files):
            man = (c := decode_container(data)).manifest
            records = {n: TensorRecord.from_dict(n, r) for n, r in man["records"].items()}
            parts = {n: {k: r[k] for k in ("pipeline", "meta", "blobs")} for n, r in man["records"].items()}
            enc = Encoded(records=parts, blobs=c.blobs, keyframe=man["keyframe"])
            tensors, ref = m.decode(records, enc, ref, ctx=DecodeContext(step=i))
            out.append(tensors)
        return out

    t_dec, decoded = best_of(repeats, decode)
    for state, tensors in zip(states, decoded):  # the point of the method: bit-exact
        flat = flatten_state(state)
        assert all(tensor_to_bytes(flat.tensors[n]) == tensor_to_bytes(tensors[n]) for n in flat.tensors)
    return [(kf, len(d)) for kf, d, _ in files], [(kf, nb) for kf, _, nb in files], t_enc, t_dec


def run_bytegroup(states, repeats: int):
    flats = [flatten_state(s) for s in states]

    def encode():
        return [[bytegroup.compress(tensor_to_bytes(t), t.element_size(), float_bits=t.is_floating_point())
                 for t in f.tensors.values()] for f in flats]

    t_enc, blobs = best_of(repeats, encode)

    def decode():
        return [[bytegroup.decompress(b) for b in bl] for bl in blobs]

    t_dec, raw = best_of(repeats, decode)
    assert raw[-1] == [tensor_to_bytes(t) for t in flats[-1].tensors.values()]
    return [(True, sum(len(b) for b in bl)) for bl in blobs], t_enc, t_dec


def run_zstd(states, repeats: int):
    flats = [flatten_state(s) for s in states]
    cctx, dctx = zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()

    def encode():
        return [cctx.compress(b"".join(tensor_to_bytes(t) for t in f.tensors.values())) for f in flats]

    t_enc, frames = best_of(repeats, encode)

    def decode():
        out = []
        for f, fr in zip(flats, frames):
            raw = dctx.decompress(fr)
            off = 0
            for n, t in f.tensors.items():  # back to tensors, as a loader would
                nb = t.numel() * t.element_size()
                tensor_from_bytes(raw[off:off + nb], f.records[n].dtype, f.records[n].shape)
                off += nb
            out.append(raw)
        return out

    t_dec, _ = best_of(repeats, decode)
    return [(True, len(fr)) for fr in frames], t_enc, t_dec


def table(name: str, states, every: int, repeats: int) -> list[str]:
    raw = [raw_bytes(flatten_state(s)) for s in states]
    total = sum(raw)
    rows = []
    files, blobs, t_enc, t_dec = run_lossless(states, every, repeats)
    dense, _, d_enc, d_dec = run_lossless(states, every, repeats, sparse_planes=False)
    for label, (sizes, t_enc, t_dec) in [("lossless (files)", (files, t_enc, t_dec)),
                                         ("lossless (blobs)", (blobs, t_enc, t_dec)),
                                         ("lossless, no sparse", (dense, d_enc, d_dec)),
                                         ("bytegroup (no XOR)", run_bytegroup(states, repeats)),
                                         ("zstd-3 raw bytes", run_zstd(states, repeats))]:
        key = [(r, s) for r, (kf, s) in zip(raw, sizes) if kf]
        delta = [(r, s) for r, (kf, s) in zip(raw, sizes) if not kf]

        def ratio(pairs):
            return f"{sum(r for r, _ in pairs) / sum(s for _, s in pairs):8.2f}" if pairs else f"{'-':>8}"

        stored = sum(s for _, s in sizes)
        rows.append(f"{name:<7} {label:<19} {ratio(key)} {ratio(delta)} {total / stored:8.2f} "
                    f"{stored / 1e6:9.2f} {total / 1e6 / t_enc:8.1f} {total / 1e6 / t_dec:8.1f}")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=["digits", "gpt2", "all"], default="all")
    p.add_argument("--checkpoints", type=int, default=20, help="checkpoints per workload")
    p.add_argument("--gpt2-every", type=int, default=5, help="GPT-2 training steps between checkpoints")
    p.add_argument("--every", type=int, default=10, help="lossless: a keyframe every N saves")
    p.add_argument("--repeats", type=int, default=1, help="best of N timings")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: on a shared or oversubscribed CPU, intra-op threads make the "
                        "many small XOR/clone calls ~10x slower)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    work = []
    t0 = time.perf_counter()
    if args.workload in ("digits", "all"):
        work.append(("digits", digits_states(args.checkpoints)))
    if args.workload in ("gpt2", "all"):
        work.append(("gpt2", gpt2_states(args.checkpoints, args.gpt2_every)))
    print(f"  training: {time.perf_counter() - t0:.1f} s; torch threads {torch.get_num_threads()}")
    head = (f"{'run':<7} {'method':<19} {'key x':>8} {'delta x':>8} {'all x':>8} {'stored MB':>9} "
            f"{'enc MB/s':>8} {'dec MB/s':>8}")
    lines = []
    for name, states in work:
        mb = raw_bytes(flatten_state(states[0])) / 1e6
        lines.append(f"# {name}: {len(states)} checkpoints x {mb:.2f} MB raw, keyframe every {args.every}")
        lines += table(name, states, args.every, args.repeats)
    print(head)
    print("-" * len(head))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
