"""BitSnap's two compressors on real training runs, side by side with their baselines.

(a) Lossless weight deltas (paper Fig. 9): compression ratio vs the fraction of changed elements
    for the packed bitmask, COO (int32 index + value) and dense storage, and what
    ``encode_delta`` picks per tensor, on real deltas 1, 10 and 100 steps after a base checkpoint,
    for fp32 weights and for their bf16 copies (what mixed-precision training keeps as model
    states). With fp32 Adam nearly every element moves every step, so the bitmask cannot help
    there; bf16 rounds most small moves away.
(b) Lossy optimizer states (paper Tables 3-4): cluster8 vs naive min-max uint8 on Adam m, v and
    the fp32 master weights: MRE, MSE, relative L2 error, and the relative error of the Adam
    update direction m_hat / (sqrt(v_hat) + eps) rebuilt from the dequantized m and v.
(c) The ``bitsnap`` method end to end (methods/bitsnap.py).
    (c1) Lossless pass over the delta payloads: bytes of one base -> delta encode of the model
         weights with payload_codec "none" (the paper's raw bitmask + values), "zstd" (one frame)
         and "bytegroup" (the default: mask through zstd, values byte-grouped), on the same real
         weight pairs as (a).
    (c2) ``--fault``: fault-tolerant training through the demo harness (ckptzip.demo.faults.run):
         the uncompressed reference, then each method with 10 failures, each resuming from the
         compressed chain only. Reports the final metric, its relative degradation vs the
         reference (positive = worse), the whole-chain and weights-only ratios, and checkpoint
         time / training time. ``bitsnap (paper rounding)`` is adam_guard=False: round-to-nearest
         on Adam's v, as in the paper. The paper saw about 4.5 % loss impact after restoring
         GPT-2 Medium from a quantized checkpoint (Fig. 13). About 2-3 min on 1 CPU thread.

Definitions (pooled over every element of every parameter tensor of the model):
    MRE    = mean over elements with x != 0 of |x - x'| / |x|          (x' = dequantized x)
    MSE    = mean of (x - x')^2 over all elements
    relL2  = ||x - x'||_2 / ||x||_2
    update = m_hat / (sqrt(v_hat) + eps), m_hat = m / (1 - b1^t), v_hat = v / (1 - b2^t)
             (torch.optim.Adam's direction); reported as relL2, cosine similarity and the share
             of elements with |u - u'| > |u|. Any linear 8-bit grid on v rounds small nonzero v
             to the cluster minimum (often 0), and then u' = m / eps explodes: that, not the m
             error, dominates the update error.

Workloads (both trained with Adam, peak lr 1e-3, 20 warmup steps then cosine decay to 1e-5):
    digits  DigitsMLP on scikit-learn digits (ckptzip.demo.workloads), batch 64
    gpt2    transformers GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=128, n_layer=4,
            n_head=4, n_positions=128)) on the bytes of the Python stdlib source, batch 8 x 64

Run:  .venv/bin/python bench/bitsnap.py            (about 1-2 min on 1 CPU thread)
      .venv/bin/python bench/bitsnap.py --fault    (adds (c2), about 2-3 min more)
"""
from __future__ import annotations

import argparse
import math
import pathlib
import sys
import time

import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # bench/ is not a package
import paper_baselines as pb  # noqa: E402

from ckptzip.codec import bitmask as bm  # noqa: E402
from ckptzip.quant import cluster8 as c8  # noqa: E402

WARMUP, PEAK_LR, MIN_LR = 20, 1e-3, 1e-5
INTERVALS = (1, 10, 100)


# --------------------------------------------------------------------------- training
def lr_at(step: int, total: int) -> float:
    if step < WARMUP:
        return PEAK_LR * (step + 1) / WARMUP
    p = (step - WARMUP) / max(1, total - WARMUP)
    return MIN_LR + 0.5 * (PEAK_LR - MIN_LR) * (1 + math.cos(math.pi * p))


def train(model: nn.Module, loss_fn, total: int, weight_steps: set[int], opt_steps: set[int]):
    """Adam run; returns ({step: {name: fp32 weights}}, {step: (weights, optimizer state_dict)}, lrs)."""
    params = dict(model.named_parameters())  # dedupes tied weights (GPT-2 lm_head = wte)
    opt = torch.optim.Adam(params.values(), lr=PEAK_LR)
    weights, states, lrs = {}, {}, {}
    for step in range(total + 1):
        if step in weight_steps or step in opt_steps:
            w = {n: p.detach().clone() for n, p in params.items()}
            weights[step] = w
            lrs[step] = lr_at(step, total)
            if step in opt_steps:
                sd = opt.state_dict()
                states[step] = (w, list(params), {i: {k: v.clone() for k, v in s.items()} for i, s in sd["state"].items()},
                                sd["param_groups"][0])
        if step == total:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total)
        loss = loss_fn(step)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return weights, states, lrs, float(loss.detach())


def digits_workload(total: int):
    from ckptzip.demo.workloads import DigitsMLP, digits_data

    torch.manual_seed(0)
    xtr, ytr, _, _ = digits_data(0)
    model = DigitsMLP(128)
    g = torch.Generator().manual_seed(0)

    def loss_fn(step):
        idx = torch.randint(0, len(xtr), (64,), generator=g)
        return nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])

    return model, loss_fn


def gpt2_workload(total: int):
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    from ckptzip.demo.workloads import stdlib_text

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=256, n_embd=128, n_layer=4, n_head=4, n_positions=128,
                     bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    data = torch.frombuffer(bytearray(stdlib_text(1_000_000)), dtype=torch.uint8).long()
    g = torch.Generator().manual_seed(0)
    B, T = 8, 64

    def loss_fn(step):
        idx = torch.randint(0, len(data) - T, (B,), generator=g)
        x = torch.stack([data[i:i + T] for i in idx.tolist()])  # (B, T)
        return model(input_ids=x, labels=x).loss

    return model, loss_fn


# --------------------------------------------------------------------------- (a) deltas
def delta_row(base: dict, cur: dict, dtype: torch.dtype) -> dict:
    n = k = dense = bitmask = coo = chosen = 0
    kinds = {"same": 0, "bitmask": 0, "dense": 0}
    t0 = time.perf_counter()
    for name, b in base.items():
        b, c = b.to(dtype), cur[name].to(dtype)
        kind, payload, meta = bm.encode_delta(c, b)
        assert torch.equal(bm.decode_delta(kind, payload, b, meta).view(torch.uint8), c.view(torch.uint8))
        sizes = bm.encoded_sizes(c.numel(), meta["n_changed"], c.element_size())
        n += c.numel()
        k += meta["n_changed"]
        dense += sizes["dense"]
        bitmask += sizes["bitmask"]
        coo += sizes["coo"]
        chosen += len(payload)
        kinds[kind] += 1
    secs = time.perf_counter() - t0
    return dict(n=n, frac=k / n, dense=dense, bitmask=bitmask, coo=coo, chosen=chosen, kinds=kinds, secs=secs)


def ratio(dense: int, size: int) -> str:
    return "inf" if size == 0 else f"{dense / size:.2f}x"


def print_delta_table(rows):
    print("\n(a) lossless weight deltas: compression ratio = dense bytes / encoded bytes (whole model)")
    print("| model | base step (lr) | interval | dtype | changed % | bitmask | COO | dense | encode_delta "
          "(same/bitmask/dense tensors) | enc+dec s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        kd = r["kinds"]
        print(f"| {r['model']} | {r['base']} ({r['lr']:.1e}) | +{r['interval']} | {r['dtype']} | "
              f"{100 * r['frac']:.3f} | {ratio(r['dense'], r['bitmask'])} | {ratio(r['dense'], r['coo'])} | 1.00x | "
              f"{ratio(r['dense'], r['chosen'])} ({kd['same']}/{kd['bitmask']}/{kd['dense']}) | {r['secs']:.2f} |")
    print("\nbyte model (n elements, k changed, width w): dense n*w, bitmask n/8 + k*w, COO k*(4+w);")
    print("ratio vs changed fraction f (the curve of paper Fig. 9):")
    print("| f % | bitmask bf16/fp16 | COO bf16/fp16 | bitmask fp32 | COO fp32 |")
    print("|---|---|---|---|---|")
    for f in (1 / 32, 0.05, 0.15, 0.5, 0.9375, 0.96875, 1.0):
        cells = []
        for w in (2, 4):
            cells += [f"{w / (1 / 8 + f * w):.2f}x", f"{w / (f * (4 + w)):.2f}x"]
        print(f"| {100 * f:.3f} | " + " | ".join(cells) + " |")
    for d in (torch.float16, torch.bfloat16, torch.float32):
        print(f"break-even (bitmask < dense) for {str(d).removeprefix('torch.')}: "
              f"changed < {100 * bm.break_even_fraction(d):.4g} %; COO < bitmask only below 3.125 %")


# --------------------------------------------------------------------------- (b) optimizer states
def err_stats(xs, ys) -> dict:
    num = den = sq = n = l2e = l2x = 0.0
    for x, y in zip(xs, ys):
        x, y = x.double().reshape(-1), y.double().reshape(-1)
        nz = x != 0
        num += float(((x - y).abs()[nz] / x.abs()[nz]).sum())
        den += int(nz.sum())
        d2 = float(((x - y) ** 2).sum())
        sq += d2
        n += x.numel()
        l2e += d2
        l2x += float((x ** 2).sum())
    return dict(mre=num / den, mse=sq / n, rel=math.sqrt(l2e / l2x))


def adam_direction(m, v, step, group):
    b1, b2 = group["betas"]
    eps = group["eps"]
    return (m / (1 - b1 ** step)) / ((v / (1 - b2 ** step)).sqrt() + eps)


def optimizer_rows(name, states):
    rows = []
    for step, (weights, names, state, group) in states.items():
        ms = [state[i]["exp_avg"] for i in range(len(names))]
        vs = [state[i]["exp_avg_sq"] for i in range(len(names))]
        ws = [weights[n] for n in names]
        t = [float(state[i]["step"]) for i in range(len(names))]
        schemes = {
            "cluster8": (lambda x: c8.dequantize(c8.quantize(x))),
            "naive uint8": (lambda x: pb.naive_uint8_dequantize(pb.naive_uint8_quantize(x))),
        }
        n_el = sum(x.numel() for x in ms)
        for sname, f in schemes.items():
            t0 = time.perf_counter()
            ms2, vs2, ws2 = [f(x) for x in ms], [f(x) for x in vs], [f(x) for x in ws]
            secs = time.perf_counter() - t0
            u = [adam_direction(m.double(), v.double(), s, group) for m, v, s in zip(ms, vs, t)]
            u2 = [adam_direction(m.double(), v.double(), s, group) for m, v, s in zip(ms2, vs2, t)]
            dot = sum(float((a * b).sum()) for a, b in zip(u, u2))
            na = math.sqrt(sum(float((a * a).sum()) for a in u))
            nb = math.sqrt(sum(float((b * b).sum()) for b in u2))
            nbytes = (sum(c8.packed_nbytes(x.numel(), 16) for x in ms) if sname == "cluster8"
                      else sum(x.numel() + 8 for x in ms))
            # elements whose update is off by more than its own size (e.g. small v rounded to 0)
            bad = sum(int(((a - b).abs() > a.abs()).sum()) for a, b in zip(u, u2)) / n_el
            rows.append(dict(model=name, step=step, scheme=sname, m=err_stats(ms, ms2), v=err_stats(vs, vs2),
                             w=err_stats(ws, ws2), upd=err_stats(u, u2), cos=dot / (na * nb), bad=bad,
                             ratio=4 * n_el / nbytes, secs=secs))
    return rows


def print_opt_table(rows):
    print("\n(b) optimizer states, 8-bit: cluster8 (16 normal-quantile clusters, uint4 labels) vs naive min-max uint8")
    print("MRE = mean |x-x'|/|x| over x != 0 (pooled over all tensors), MSE over all elements, "
          "relL2 = ||x-x'||/||x||; update = m_hat/(sqrt(v_hat)+eps)")
    print("| model@step | scheme | size ratio | m MRE % | m MSE | m relL2 | v MRE % | v MSE | v relL2 | "
          "w(fp32) MRE % | w MSE | update relL2 | update cos | update err>100% (% elems) | q+dq s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        m, v, w, u = r["m"], r["v"], r["w"], r["upd"]
        print(f"| {r['model']}@{r['step']} | {r['scheme']} | {r['ratio']:.2f}x | {100 * m['mre']:.4g} | "
              f"{m['mse']:.3g} | {m['rel']:.3g} | {100 * v['mre']:.4g} | {v['mse']:.3g} | {v['rel']:.3g} | "
              f"{100 * w['mre']:.4g} | {w['mse']:.3g} | {u['rel']:.3g} | {r['cos']:.4f} | {100 * r['bad']:.3f} | {r['secs']:.2f} |")
    print("paper (GPT-2 345M, Table 4): BitSnap m MRE 9.86 %, v MRE 0.18 %; naive m MRE 401188 %, v MRE 0.11 %")


# --------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--early", type=int, default=50, help="early base step")
    ap.add_argument("--late", type=int, default=200, help="late base step (run ends at late + 100; a tail base at end - 10)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a busy box)")
    ap.add_argument("--fault", action="store_true", help="also run (c2): fault-tolerant training, ~2-3 min")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    total = args.late + max(INTERVALS)
    # (base step, intervals); the tail base sits in the low-lr end of the cosine, like late training
    bases = ((args.early, INTERVALS), (args.late, INTERVALS), (total - 10, (1, 10)))
    weight_steps = {b + i for b, ivs in bases for i in (0, *ivs)}
    delta_rows, opt_rows, codec_rows = [], [], []
    t_all = time.perf_counter()
    for name, make in (("digits", digits_workload), ("gpt2", gpt2_workload)):
        t0 = time.perf_counter()
        model, loss_fn = make(total)
        weights, states, lrs, loss = train(model, loss_fn, total, weight_steps, {total})
        n_params = sum(p.numel() for p in weights[total].values())
        print(f"{name}: {n_params} params, {total} Adam steps in {time.perf_counter() - t0:.1f} s, final loss {loss:.3f}")
        for b, ivs in bases:
            for i in ivs:
                for dtype in (torch.float32, torch.bfloat16):
                    r = delta_row(weights[b], weights[b + i], dtype)
                    r.update(model=name, base=b, lr=lrs[b], interval=i, dtype=str(dtype).removeprefix("torch."))
                    delta_rows.append(r)
        opt_rows += optimizer_rows(name, states)
        codec_rows += payload_codec_rows(name, weights, bases, lrs)
    print_delta_table(delta_rows)
    print_opt_table(opt_rows)
    print_codec_table(codec_rows)
    if args.fault:
        print_fault_table(fault_rows())
    print(f"\ntotal {time.perf_counter() - t_all:.1f} s")


# --------------------------------------------------------------------------- (c) the bitsnap method
CODECS = ("none", "zstd", "bytegroup")


def payload_codec_rows(name, weights, bases, lrs):
    from ckptzip.methods.base import EncodeContext, get_method
    from ckptzip.state import flatten_state

    rows = []
    for b, ivs in bases:
        for i in ivs:
            for dtype in (torch.float32, torch.bfloat16):
                flat_b = flatten_state({"model": {n: t.to(dtype) for n, t in weights[b].items()}})
                flat_c = flatten_state({"model": {n: t.to(dtype) for n, t in weights[b + i].items()}})
                row = dict(model=name, base=b, lr=lrs[b], interval=i, dtype=str(dtype).removeprefix("torch."),
                           raw=sum(t.numel() * t.element_size() for t in flat_c.tensors.values()))
                for codec in CODECS:
                    m = get_method("bitsnap", payload_codec=codec)
                    _, ref = m.encode(flat_b, None, ctx=EncodeContext(step=b))
                    t0 = time.perf_counter()
                    enc, _ = m.encode(flat_c, ref, ctx=EncodeContext(step=b + i))
                    row[codec] = (sum(len(x) for x in enc.blobs.values()), time.perf_counter() - t0)
                    assert not enc.keyframe
                rows.append(row)
    return rows


def print_codec_table(rows):
    print("\n(c1) bitsnap delta of the model weights vs its base: ratio = raw bytes / stored bytes, "
          "per payload_codec (encode s)")
    print("| model | base step | interval | dtype | none (paper) | zstd | bytegroup (default) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [f"{r['raw'] / r[c][0]:.2f}x ({r[c][1]:.3f})" for c in CODECS]
        print(f"| {r['model']} | {r['base']} | +{r['interval']} | {r['dtype']} | " + " | ".join(cells) + " |")


def fault_rows():
    from ckptzip.demo.faults import run
    from ckptzip.demo.workloads import digits_workload as digits_wl
    from ckptzip.demo.workloads import gpt2_workload as gpt2_wl

    runs = (("bitsnap", "bitsnap", None), ("bitsnap (paper rounding)", "bitsnap", {"adam_guard": False}),
            ("bitsnap-lossless", "bitsnap-lossless", None))
    rows = []
    for wl in (digits_wl(), gpt2_wl()):
        t0 = time.perf_counter()
        ref = run(wl, None)
        rows.append(dict(wl=wl, label="uncompressed", res=ref, deg=0.0, secs=time.perf_counter() - t0))
        for label, method, cfg in runs:
            t0 = time.perf_counter()
            r = run(wl, method, failures=10, method_config=cfg)
            rows.append(dict(wl=wl, label=label, res=r, deg=r.degradation(ref), secs=time.perf_counter() - t0))
    return rows


def print_fault_table(rows):
    print("\n(c2) fault-tolerant training, 10 failures, resume from the compressed chain only")
    print("| workload (steps, ckpt every) | method | final metric | degradation vs reference | ratio | "
          "weights ratio | ckpt s / train s | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        wl, r = row["wl"], row["res"]
        ratio = "-" if r.method == "uncompressed" else f"{r.ratio:.2f}x"
        wratio = "-" if r.method == "uncompressed" else f"{r.weights_ratio:.2f}x"
        ovh = "-" if r.method == "uncompressed" else f"{100 * r.overhead:.1f} %"
        print(f"| {wl.name} ({wl.total_steps}, {wl.ckpt_every}) | {row['label']} | {r.metric_name} "
              f"{r.final_metric:.4f} | {100 * row['deg']:+.2f} % | {ratio} | {wratio} | {ovh} | {row['secs']:.1f} |")
    print("paper (GPT-2 Medium, restored once from a quantized checkpoint): about 4.5 % loss impact")


if __name__ == "__main__":
    main()
