"""The DynaQuant delta encoder (§6) on real quantized checkpoints: sizes and speeds.

Data (``--source``): a real Adam run on scikit-learn digits, checkpoints 20 steps apart. Every
parameter tensor of checkpoints ``--pair - 1`` and ``--pair`` is quantized with a 16-level
uniform quantizer over its own range and the codes of all tensors are concatenated.
  tiled  the digits run of ckptzip.demo.workloads (DigitsMLP(128), 26.6K params) tiled to --n
         codes: real delta statistics at benchmark size. Order-0 coders (Huffman, ANS) do not
         see the repetition, but zstd's match finder does (the period fits its window), so
         zstd's size on this source is a tiling artifact.
  wide   the same model and loop with hidden=--hidden (3072 -> 9.67M params), no tiling: the
         honest source for the zstd comparison (takes ~1 min more to train).

Tables:
  1. the full pipeline ``encode_codes``/``decode_codes`` for the keyframe and every
     (rearrange, rle) x coder combination: bytes, bits/param, ratio against 4-bit packing,
     encode and decode throughput in M params/s (best of --repeats, after a warm-up call)
  2. stage breakdown of the default pipeline (rearrange + RLE + Huffman)
  3. the raw coders on the plain delta stream and on the RLE stream: M symbols/s, size against
     the order-0 entropy
  4. the paper's encoder against rANS on the plain delta as the share of unchanged codes grows to
     99.9 % (the pair's changes thinned at random): the evidence for ``coder="auto"``

Run:  .venv/bin/python bench/codec.py                  (~1-2 min; 1 torch thread, numba single-core)
      .venv/bin/python bench/codec.py --source wide    (~3 min)
      .venv/bin/python bench/codec.py --n 2e6 --repeats 1
"""
from __future__ import annotations

import argparse
import time

import torch

from ckptzip.codec import delta as D
from ckptzip.codec import rle as R
from ckptzip.codec.entropy import decode_codes, encode_codes, entropy_bits, get_coder
from ckptzip.demo.workloads import DigitsMLP, digits_data, digits_run

CODERS = ("huffman", "ans", "rans", "zstd")


def uniform_codes(x: torch.Tensor, n_levels: int = 16) -> torch.Tensor:
    x = x.float().reshape(-1)
    lo, hi = x.min(), x.max()
    return torch.clamp(torch.round((x - lo) / (hi - lo).clamp_min(1e-12) * (n_levels - 1)),
                       0, n_levels - 1).long()


def real_pair(pair: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    _, _, snaps, _ = digits_run(n_checkpoints=10, steps_between=20)
    names = list(snaps[0].model)
    prev = torch.cat([uniform_codes(snaps[pair - 1].model[k]) for k in names])
    cur = torch.cat([uniform_codes(snaps[pair].model[k]) for k in names])
    reps = -(-n // prev.numel())
    return prev.repeat(reps)[:n].contiguous(), cur.repeat(reps)[:n].contiguous()


def wide_pair(pair: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """digits_run's loop (seed 0, Adam lr 1e-3, batch 64, 20 steps a checkpoint) on a wide MLP,
    keeping only the codes of checkpoints pair-1 and pair."""
    torch.manual_seed(0)
    xtr, ytr, _, _ = digits_data(0)
    model = DigitsMLP(hidden)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    codes = []
    for ckpt in range(pair + 1):
        for _ in range(20):
            idx = torch.randint(0, len(xtr), (64,), generator=g)
            loss = torch.nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        if ckpt >= pair - 1:
            codes.append(torch.cat([uniform_codes(p.detach()) for p in model.state_dict().values()]))
    return codes[0], codes[1]


def best(fn, repeats: int) -> tuple[float, object]:
    out = fn()  # warm-up: numba compile / page faults
    t = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        t = min(t, time.perf_counter() - t0)
    return t, out


def table_pipeline(prev, cur, repeats):
    n = cur.numel()
    print(f"\n1. encode_codes / decode_codes on {n / 1e6:.1f}M codes (16 levels; 4-bit packed = {n // 2:,} B)")
    print(f"{'kind':<9}{'rearr':>6}{'rle':>5}{'coder':>9}{'bytes':>12}{'bits/param':>11}"
          f"{'vs 4-bit':>9}{'enc Mp/s':>10}{'dec Mp/s':>10}")
    rows = [("keyframe", False, rle, c) for rle in (False, True) for c in CODERS]
    rows += [("delta", rr, rle, c) for rr in (False, True) for rle in (False, True) for c in CODERS]
    for kind, rr, rle, coder in rows:
        ref = None if kind == "keyframe" else prev
        t_enc, buf = best(lambda: encode_codes(ref, cur, 16, rearrange=rr, rle=rle, coder=coder), repeats)
        t_dec, out = best(lambda: decode_codes(buf, ref), repeats)
        assert torch.equal(out, cur)
        print(f"{kind:<9}{'yes' if rr else '-':>6}{'yes' if rle else '-':>5}{coder:>9}{len(buf):>12,}"
              f"{8 * len(buf) / n:>11.3f}{(n / 2) / len(buf):>9.2f}x{n / t_enc / 1e6:>9.1f}{n / t_dec / 1e6:>10.1f}")


def table_stages(prev, cur, repeats):
    n = cur.numel()
    enc, dec = get_coder("huffman")
    t_g, (ds, _) = best(lambda: D.grouped_cyclic_delta(prev, cur, 16), repeats)
    t_d, d = best(lambda: D.cyclic_delta(prev, cur, 16), repeats)
    t_r, _ = best(lambda: D.rearrange(d, prev, 16), repeats)
    t_rt, _ = best(lambda: D.rearrange(d, prev, 16, backend="torch"), repeats)
    t_l, s = best(lambda: R.rle_encode(ds), repeats)
    t_lt, _ = best(lambda: R.rle_encode(ds, backend="torch"), repeats)
    t_h, buf = best(lambda: enc(s), repeats)
    t_hd, s2 = best(lambda: dec(buf), repeats)
    t_ld, ds2 = best(lambda: R.rle_decode(torch.from_numpy(s2), n), repeats)
    t_ldt, _ = best(lambda: R.rle_decode(torch.from_numpy(s2), n, backend="torch"), repeats)
    t_ug, c2 = best(lambda: D.undo_grouped_cyclic_delta(prev, ds2, 16), repeats)
    t_u, d2 = best(lambda: D.unrearrange(ds2, prev, 16), repeats)
    t_ut, _ = best(lambda: D.unrearrange(ds2, prev, 16, backend="torch"), repeats)
    t_ud, _ = best(lambda: D.undo_cyclic_delta(prev, d2, 16), repeats)
    assert torch.equal(c2, cur)
    print(f"\n2. stages of the default pipeline (rearrange + RLE + huffman), {n / 1e6:.1f}M codes,"
          f" RLE stream {s.numel():,} symbols; (*) = what encode_codes/decode_codes run")
    print(f"{'stage':<42}{'ms':>9}{'M params/s':>12}")
    for name, t in [("grouped_cyclic_delta (fused numba) *", t_g), ("  cyclic_delta (numba)", t_d),
                    ("  rearrange (numba counting sort)", t_r), ("  rearrange (torch radix reference)", t_rt),
                    ("rle_encode (numba) *", t_l), ("  rle_encode (torch reference)", t_lt),
                    ("huffman_encode (RLE stream) *", t_h), ("huffman_decode (RLE stream) *", t_hd),
                    ("rle_decode (numba) *", t_ld), ("  rle_decode (torch reference)", t_ldt),
                    ("undo_grouped_cyclic_delta (fused numba) *", t_ug),
                    ("  unrearrange (numba)", t_u), ("  unrearrange (torch radix reference)", t_ut),
                    ("  undo_cyclic_delta (numba)", t_ud)]:
        print(f"{name:<42}{1e3 * t:>9.1f}{n / t / 1e6:>12.1f}")


def table_coders(prev, cur, repeats):
    d = D.cyclic_delta(prev, cur, 16)
    ds, _ = D.rearrange(d, prev, 16)
    streams = {"delta (no RLE)": d, "rearranged+RLE": R.rle_encode(ds)}
    print("\n3. raw coders (M symbols/s; entropy = order-0 bound of the stream)")
    print(f"{'stream':<16}{'symbols':>12}{'coder':>9}{'bytes':>12}{'/ entropy':>10}{'enc Ms/s':>10}{'dec Ms/s':>10}")
    for sname, stream in streams.items():
        sym = stream.numpy()
        h_bytes = entropy_bits(stream) / 8
        for coder in CODERS:
            enc, dec = get_coder(coder)
            t_e, buf = best(lambda: enc(sym), repeats)
            t_d, out = best(lambda: dec(buf), repeats)
            assert (out == sym).all()
            print(f"{sname:<16}{sym.size:>12,}{coder:>9}{len(buf):>12,}{len(buf) / h_bytes:>10.3f}"
                  f"{sym.size / t_e / 1e6:>10.1f}{sym.size / t_d / 1e6:>10.1f}")


def table_sameness(prev, cur):
    """The ``auto`` coder's evidence: the paper's encoder (rearranged RLE + Huffman) against rANS on
    the plain delta as fewer codes change. The pair's changed codes are thinned at random (a kept
    code takes its parent's value) down to 1 % of them: real delta values, more repeats."""
    changed = (prev != cur).nonzero().reshape(-1)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(changed.numel(), generator=g)
    print("\n4. the paper's encoder against order-0 rANS on the plain delta, as fewer codes change (bytes)")
    print(f"{'unchanged':>10}{'PE huffman':>12}{'rANS delta':>12}{'rANS / PE':>11}")
    for share in (1.0, 0.5, 0.25, 0.1, 0.05, 0.02, 0.01):
        c = prev.clone()
        sel = changed[order[:int(share * changed.numel())]]
        c[sel] = cur[sel]
        pe = len(encode_codes(prev, c, 16, rearrange=True, rle=True, coder="huffman"))
        order0 = len(encode_codes(prev, c, 16, rearrange=False, rle=False, coder="rans"))
        print(f"{float((c == prev).float().mean()):>10.2%}{pe:>12,}{order0:>12,}{order0 / pe:>11.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", choices=("tiled", "wide"), default="tiled")
    p.add_argument("--n", type=float, default=10e6, help="tiled: codes per stream (default 10M)")
    p.add_argument("--hidden", type=int, default=3072, help="wide: hidden width (3072 -> 9.67M params)")
    p.add_argument("--pair", type=int, default=9, help="checkpoint pair (pair-1, pair), 1..9")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (numba kernels are single-core)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    if args.source == "tiled":
        prev, cur = real_pair(args.pair, int(args.n))
    else:
        prev, cur = wide_pair(args.pair, args.hidden)
    print(f"data ready in {time.perf_counter() - t0:.0f} s")
    d = D.cyclic_delta(prev, cur, 16)
    n = cur.numel()
    print(f"digits run ({args.source}), checkpoints {args.pair - 1}->{args.pair}: {n:,} codes, "
          f"{float((d != 0).float().mean()):.1%} changed, order-0 entropy of the delta "
          f"{entropy_bits(d) / n:.3f} bits/param, runs {R.run_count(d):,}; torch threads {args.threads}")
    table_pipeline(prev, cur, args.repeats)
    table_stages(prev, cur, args.repeats)
    table_coders(prev, cur, args.repeats)
    table_sameness(prev, cur)


if __name__ == "__main__":
    main()
