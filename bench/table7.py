"""Table 7 of Inshrinkerator/DynaQuant on our own runs: bins needed per quality threshold.

For >= 10 checkpoints of two real training runs (the digits MLP of ``digits_run``, and a small
GPT-2 built from GPT2Config(vocab_size=256, n_embd=128, n_layer=4, n_head=4, n_positions=128)
trained with Adam on the standard library's source bytes) and each quantizer, find the smallest
number of bins in BINS whose quantized model keeps the held-out eval loss within 0.1 %, 1 % and
5 % of the unquantized checkpoint's, and report the mean over checkpoints (paper §9.2: pruning off,
protection at its default). Quantizers:

- dynaquant         DynaQuant, k-means centers per tensor (our default)
- dynaquant/ltype   DynaQuant, one codebook per layer type (center_scope="layer_type")
- uniform           plain min-max uniform grid with ``bins`` levels per tensor (written here)

All quantizable weights are quantized (is_quantizable: linear/conv/embedding/other weights with
>= 1024 elements; biases and norms exact); embeddings get the same bins as the rest so the
comparison is one knob. Sensitivity: GPT-2 records g_ema with GradientRecorder over the last
WINDOW batches before each save; digits_run keeps only the last batch's gradient, used as a
1-batch EMA.

Second table: relative error of Adam's update direction m_hat/(sqrt(v_hat)+eps) when both moments
are quantized (exp_avg in the identity domain, exp_avg_sq in each candidate domain), mean over
checkpoints; it picks DEFAULT_DOMAIN in quant/dynaquant.py.

Run:  .venv/bin/python bench/table7.py            (~4-5 min on 2 busy cores; 1 torch thread)
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from ckptzip.demo.workloads import digits_run, stdlib_text
from ckptzip.quant.dynaquant import (DynaQuantConfig, adam_direction_error, denormalize_exp_avg, dequantize,
                                     fit_layer_thresholds, is_quantizable, normalize_exp_avg, quantize)
from ckptzip.sensitivity import GradientRecorder, should_arm
from ckptzip.state import layer_types

THRESHOLDS = (0.001, 0.01, 0.05)
BINS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)
WINDOW = 10  # batches of gradient EMA before each GPT-2 save
METHODS = ("dynaquant", "dynaquant/ltype", "uniform")


@dataclass
class Ckpt:
    step: int
    model: dict          # state_dict
    optimizer: dict      # optimizer.state_dict()
    grads: dict          # param name -> g_ema (or last gradient)


@dataclass
class Workload:
    name: str
    model: torch.nn.Module
    ckpts: list[Ckpt]
    eval_fn: object      # model -> held-out loss
    ltypes: dict         # param name -> layer type
    pnames: list[str]    # optimizer state index -> param name


# ---------------------------------------------------------------------------------------------
# workloads

def digits_workload() -> Workload:
    model, _opt, snaps, eval_fn = digits_run(n_checkpoints=10, steps_between=20)
    ckpts = [Ckpt(s.step, s.model, s.optimizer, s.grads) for s in snaps]
    return Workload("digits-mlp", model, ckpts, eval_fn, layer_types(model),
                    [n for n, _ in model.named_parameters()])


def gpt2_workload(n_ckpt: int = 10, steps_between: int = 30, batch: int = 8, seq: int = 128) -> Workload:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=256, n_embd=128, n_layer=4, n_head=4, n_positions=seq, bos_token_id=0,
                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    data = torch.frombuffer(bytearray(stdlib_text(1_000_000)), dtype=torch.uint8).long()
    split = int(len(data) * 0.9)
    train, held = data[:split], data[split:]
    g = torch.Generator().manual_seed(0)
    ev_ix = torch.linspace(0, len(held) - seq - 1, 16).long()
    ev_x = torch.stack([held[i:i + seq] for i in ev_ix])  # (16, seq) fixed held-out batch

    def eval_fn(m) -> float:
        m.eval()
        with torch.no_grad():
            return float(m(input_ids=ev_x, labels=ev_x).loss)

    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    rec = GradientRecorder(model, beta=0.9, window=WINDOW)
    ckpts = []
    for step in range(1, n_ckpt * steps_between + 1):
        if should_arm(step, steps_between, WINDOW):
            rec.arm()
        model.train()
        ix = torch.randint(0, len(train) - seq - 1, (batch,), generator=g)
        x = torch.stack([train[i:i + seq] for i in ix])  # (B, T) byte tokens
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % steps_between == 0:
            ckpts.append(Ckpt(step, {k: v.clone() for k, v in model.state_dict().items()},
                              _clone_opt(opt.state_dict()), rec.gradients()))
            rec.disarm()
    rec.close()
    return Workload("gpt2-tiny", model, ckpts, eval_fn, layer_types(model),
                    [n for n, _ in model.named_parameters()])


def _clone_opt(sd: dict) -> dict:
    return {"state": {i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
                      for i, st in sd["state"].items()},
            "param_groups": [dict(gr) for gr in sd["param_groups"]]}


# ---------------------------------------------------------------------------------------------
# quantizers

def uniform_minmax(x: torch.Tensor, bins: int) -> torch.Tensor:
    """Plain uniform quantization: ``bins`` equally spaced levels from min(x) to max(x)."""
    xf = x.float()
    lo, hi = float(xf.min()), float(xf.max())
    if bins < 2 or hi == lo:
        return torch.full_like(xf, (lo + hi) / 2).to(x.dtype)
    step = (hi - lo) / (bins - 1)
    return (torch.round((xf - lo) / step) * step + lo).to(x.dtype)


def quantize_weights(w: Workload, ck: Ckpt, method: str, bins: int, names: list[str]) -> dict:
    if method == "uniform":
        return {n: uniform_minmax(ck.model[n], bins) for n in names}
    cfg = DynaQuantConfig(bins=bins, embedding_bins=bins, prune_fraction=0.0,
                          center_scope="layer_type" if method == "dynaquant/ltype" else "tensor")
    plan = fit_layer_thresholds({n: (ck.model[n], w.ltypes[n]) for n in names}, cfg, grads=ck.grads)
    return {n: dequantize(quantize(ck.model[n], n, plan)) for n in names}


def load_into(model, sd: dict, override: dict | None = None) -> None:
    model.load_state_dict(sd)
    if override:
        params = dict(model.named_parameters())  # writes through tied weights (GPT-2 wte/lm_head)
        with torch.no_grad():
            for n, t in override.items():
                params[n].copy_(t)


def quantizable_names(w: Workload) -> list[str]:
    return [n for n, p in w.model.named_parameters()
            if is_quantizable(w.ltypes.get(n, "other"), "weight", p.numel())]


def bins_needed(w: Workload, method: str) -> list[dict]:
    """Per checkpoint: threshold -> smallest bins meeting it (None if none in BINS)."""
    names = quantizable_names(w)
    out = []
    for ck in w.ckpts:
        load_into(w.model, ck.model)
        base = w.eval_fn(w.model)
        need: dict[float, int | None] = {t: None for t in THRESHOLDS}
        for b in BINS:
            load_into(w.model, ck.model, quantize_weights(w, ck, method, b, names))
            deg = (w.eval_fn(w.model) - base) / abs(base)
            for t in THRESHOLDS:
                if need[t] is None and deg <= t:
                    need[t] = b
            if all(v is not None for v in need.values()):
                break
        out.append(need)
    load_into(w.model, w.ckpts[-1].model)
    return out


# ---------------------------------------------------------------------------------------------
# Adam direction error

ADAM_BINS = (4, 8, 16, 32)
ADAM_VARIANTS = (  # (label, exp_avg treatment, exp_avg_sq domain, k-means sigma for both)
    ("uniform min-max", "uniform", None, None),
    ("m id   | v id   s.2", "identity", "identity", 0.2),
    ("m id   | v id   s1", "identity", "identity", 1.0),
    ("m id   | v sqrt s1", "identity", "sqrt", 1.0),
    ("m id   | v log  s.2", "identity", "log", 0.2),
    ("m id   | v log  s1", "identity", "log", 1.0),
    ("m sqrt | v log  s1", "sqrt", "log", 1.0),
    ("m/den  | v log  s1", "normalized", "log", 1.0),
)


def _moments(w: Workload, ck: Ckpt):
    ms, vs, step = {}, {}, None
    for i, st in ck.optimizer["state"].items():
        n = w.pnames[int(i)]
        if not is_quantizable(w.ltypes.get(n, "other"), "exp_avg", st["exp_avg"].numel()):
            continue
        ms[n], vs[n] = st["exp_avg"], st["exp_avg_sq"]
        step = float(st["step"])
    grp = ck.optimizer["param_groups"][0]
    return ms, vs, step, tuple(grp["betas"]), float(grp["eps"])


def _quant_moments(ts: dict, ltypes: dict, bins: int, domain: str | None, sigma: float) -> dict:
    if domain is None:
        return {n: uniform_minmax(t, bins) for n, t in ts.items()}
    cfg = DynaQuantConfig(bins=bins, embedding_bins=bins, prune_fraction=0.0, domain=domain, sigma=sigma)
    plan = fit_layer_thresholds({n: (t, ltypes[n], "exp_avg") for n, t in ts.items()}, cfg)
    return {n: dequantize(quantize(t, n, plan)) for n, t in ts.items()}


def adam_table(w: Workload, ckpt_idx: list[int]) -> dict:
    """(variant, bins) -> (mean error with m and v quantized, mean error with only v quantized)."""
    res: dict = {}
    for i in ckpt_idx:
        ms, vs, step, betas, eps = _moments(w, w.ckpts[i])
        for b in ADAM_BINS:
            for label, m_mode, v_dom, sig in ADAM_VARIANTS:
                if m_mode == "uniform":
                    v_q = _quant_moments(vs, w.ltypes, b, None, 0.0)
                    m_q = _quant_moments(ms, w.ltypes, b, None, 0.0)
                else:
                    v_q = _quant_moments(vs, w.ltypes, b, v_dom, sig)
                    if m_mode == "normalized":
                        us = {n: normalize_exp_avg(ms[n], vs[n], step, betas, eps) for n in ms}
                        u_q = _quant_moments(us, w.ltypes, b, "identity", sig)
                        m_q = {n: denormalize_exp_avg(u_q[n], v_q[n], step, betas, eps) for n in ms}
                    else:
                        m_q = _quant_moments(ms, w.ltypes, b, m_mode, sig)
                both = adam_direction_error(ms, vs, m_q, v_q, step, betas, eps)
                vonly = adam_direction_error(ms, vs, ms, v_q, step, betas, eps)
                res.setdefault((label, b), []).append((both, vonly))
    return {k: tuple(sum(x) / len(x) for x in zip(*v)) for k, v in res.items()}


# ---------------------------------------------------------------------------------------------

def _num(x: float) -> str:
    return f"{x:.3f}" if x < 100 else f"{x:.2e}"


def _fmt_mean(vals: list[int | None]) -> str:
    ok = [v for v in vals if v is not None]
    if not ok:
        return ">256"
    s = f"{sum(ok) / len(ok):.1f}"
    return s + (f" ({len(vals) - len(ok)} >256)" if len(ok) < len(vals) else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps-between", type=int, default=30, help="GPT-2 steps between checkpoints")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the machine is shared; 1 thread is also faster than oversubscribed 2
    t0 = time.time()
    loads = [digits_workload(), gpt2_workload(steps_between=args.steps_between)]
    runs = ", ".join(f"{w.name} ({len(w.ckpts)} ckpts, steps {w.ckpts[0].step}..{w.ckpts[-1].step})" for w in loads)
    print(f"# trained {runs} in {time.time() - t0:.0f}s")

    print("\nTable 7: mean bins needed over checkpoints to keep eval-loss degradation within threshold")
    print("(pruning off, protect_fraction 0.005 for DynaQuant; bins searched over "
          f"{{{','.join(map(str, BINS))}}})")
    hdr = f"{'workload':<12} {'quantizer':<17}" + "".join(f"{f'<= {t * 100:g}%':>16}" for t in THRESHOLDS)
    print(hdr)
    print("-" * len(hdr))
    for w in loads:
        for m in METHODS:
            t1 = time.time()
            per = bins_needed(w, m)
            cells = "".join(f"{_fmt_mean([p[t] for p in per]):>16}" for t in THRESHOLDS)
            print(f"{w.name:<12} {m:<17}{cells}   [{time.time() - t1:.0f}s]", flush=True)

    print("\nAdam update-direction relative error ||d_q - d|| / ||d||, d = m_hat/(sqrt(v_hat)+eps);")
    print("rows: exp_avg as is (id), signed sqrt, or normalized u = m/(sqrt(v_hat)+eps) decoded with v_q")
    print("(m/den) | exp_avg_sq domain | s = k-means sigma (both moments); pruning off, protect 0.005.")
    print("cells: both moments quantized / only exp_avg_sq quantized; mean over 3 checkpoints")
    for w in loads:
        idx = [0, len(w.ckpts) // 2, len(w.ckpts) - 1]
        tab = adam_table(w, idx)
        print(f"\n{w.name} (steps {', '.join(str(w.ckpts[i].step) for i in idx)})")
        print(f"{'variant':<21}" + "".join(f"{f'k={b}':>19}" for b in ADAM_BINS))
        for label, *_ in ADAM_VARIANTS:
            print(f"{label:<21}" + "".join(f"{f'{_num(tab[(label, b)][0])}/{_num(tab[(label, b)][1])}':>19}"
                                          for b in ADAM_BINS))
    print(f"\n# total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
