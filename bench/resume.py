"""Resume fidelity: what a restored optimizer state costs the training that continues from it.

For checkpoints early / middle / late in a real run, training continues K steps (same batches,
same learning-rate schedule: the workload's batches depend only on the step, the scheduler state
is restored) from the exact state and from each *restored* state, and the eval metric is compared
with the exact resume's: rel = (metric - exact) / exact, positive = worse for a loss. The judged
figure is the mean of the eval metric at K-40, K-30, ..., K (``rel``): at K alone (``rel_end``) a
harmless 1e-3 perturbation of the moments moved GPT-2's validation loss by up to 1 % (the runs
diverge chaotically and the loss fluctuates from batch to batch). Weights are restored exactly in
every row, so a row measures its moments alone.

Rows (``VARIANTS``):
- controls: ``exact``; ``bf16`` (moments rounded to bfloat16) and ``jitter1``/``jitter2`` (moments
  times 1 + 1e-3 N(0, 1)): harmless perturbations whose spread is the run's chaotic noise floor;
  ``zero-mv`` (both moments zeroed, step kept); ``fresh`` (a new optimizer state:
  moments zeroed and step reset to 0, so bias correction rebuilds them); ``zero-m``; ``zero-v``;
- moment recipes: each codec of the moment module at its settings, bytes per moment element from
  its encoded records (keyframe: no delta).

Proxies, each cheap beside the K-step resume, with their Spearman rank correlation against the
K-step change (pooled over checkpoints and rows, ``exact`` left out):
- ``dir``: quant/dynaquant.adam_direction_error of the restored (m, v) (no training step);
- ``upd1``: relative error of the first update after the resume, ||dtheta_1 - dtheta_1*|| /
  ||dtheta_1*|| (one step, the real gradient and weight decay included);
- ``div10``: ||theta_10 - theta_10*|| / ||theta_10* - theta_0|| after 10 steps;
- ``rel10`` / ``rel50``: the eval metric's relative change after 10 / 50 steps.

Snapshots of the training run are cached in --cache (default /tmp/ckz-resume), so reruns and new
recipes skip the training. Results go to --out as JSON, tables to stdout.

Run:  PYTHONPATH=src .venv/bin/python bench/resume.py --workloads gpt2-3m,gpt2,digits
      (gpt2-3m: 3.2M params, ~0.15 s per step on one thread: ~30 s per 200-step resume)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import sys
import time
from dataclasses import dataclass

import torch

from ckptzip.codec.entropy import entropy_bits
from ckptzip.demo import workloads as W
from ckptzip.quant import moments as M
from ckptzip.quant.dynaquant import adam_direction_error
from ckptzip.state import flatten_state, unflatten_state

PROBES = (1, 10, 50)  # resume steps at which the proxies are taken
SEED_SHIFT = 1_000_000  # --seeds: seed s continues on the batches of step + s * SEED_SHIFT
WINDOW, WINDOW_EVERY = 5, 10  # the judged figure: mean eval at K-40, K-30, ..., K (less chaotic than at K alone)
MOMENTS = ("exp_avg", "exp_avg_sq", "momentum_buffer")


@dataclass(frozen=True)
class Case:
    """A workload and the steps of its early / middle / late checkpoints."""

    make: object       # () -> Workload
    steps: tuple[int, ...]


def _digits_sgd():
    """The digits workload trained with SGD + momentum 0.9 (its state: momentum_buffer only)."""
    wl = W.digits_workload()

    def build(seed):
        model, _, _ = wl.build(seed)
        return model, torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9), None
    return dataclasses.replace(wl, name="digits-sgd", build=build)


CASES = {
    "digits": Case(lambda: W.digits_workload(), (60, 300, 540)),
    "gpt2": Case(lambda: W.gpt2_workload(), (60, 240, 480)),                            # 0.83M params
    "digits-sgd": Case(_digits_sgd, (60, 300, 540)),
    "gpt2-3m": Case(lambda: W.gpt2_workload(n_embd=256, n_layer=4), (100, 500, 900)),  # 3.2M params
}


# ---------------------------------------------------------------------------------------------
# snapshots of one real run, cached

def snapshots(name: str, cache: pathlib.Path) -> tuple[W.Workload, dict[int, dict]]:
    case = CASES[name]
    wl = case.make()
    path = cache / f"{name}-{'-'.join(map(str, case.steps))}.pt"
    if path.exists():
        return wl, torch.load(path, weights_only=True)
    model, opt, sched = wl.build(0)
    snaps = {}
    t0 = time.perf_counter()
    for step in range(1, max(case.steps) + 1):
        model.train()
        wl.train_step(model, opt, sched, step)
        if step in case.steps:
            snaps[step] = _clone({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                  "scheduler": sched.state_dict() if sched is not None else None})
    print(f"# trained {name} to step {max(case.steps)} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    cache.mkdir(parents=True, exist_ok=True)
    torch.save(snaps, path)
    return wl, snaps


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_clone(v) for v in x)
    return x


# ---------------------------------------------------------------------------------------------
# rows: a function (flat state) -> (restored moment tensors by record name, stored bytes or None)

def _moment_names(flat, *roles):
    return [n for n, r in flat.records.items() if r.role in roles]


def _zero(*roles, reset_step=False):
    def row(flat):
        out = {n: torch.zeros_like(flat.tensors[n]) for n in _moment_names(flat, *roles)}
        if reset_step:
            out.update({n: torch.zeros_like(flat.tensors[n]) for n in _moment_names(flat, "step")})
        return out, None
    return row


def _bf16(flat):
    return {n: flat.tensors[n].to(torch.bfloat16).to(flat.tensors[n].dtype)
            for n in _moment_names(flat, *MOMENTS)}, None


def _jitter(seed: int, rel: float = 1e-3):
    """Moments times (1 + rel * N(0, 1)): a harmless perturbation, to see the run's chaotic spread."""
    def row(flat):
        g = torch.Generator().manual_seed(seed)
        return {n: flat.tensors[n] * (1 + rel * torch.randn(flat.tensors[n].shape, generator=g))
                for n in _moment_names(flat, *MOMENTS)}, None
    return row


def _method_row(method: str, **config):
    """Moments as a method encodes and decodes them (weights ignored: the row keeps them exact)."""
    from ckptzip.methods.base import DecodeContext, EncodeContext, get_method

    def row(flat):
        m = get_method(method, config)
        enc, _ = m.encode(flat, None, ctx=EncodeContext(step=0))
        out, _ = m.decode(flat.records, enc, None, ctx=DecodeContext(step=0))
        names = _moment_names(flat, *MOMENTS)
        nbytes = sum(len(enc.blobs[k]) for n in names for k in enc.records[n]["blobs"].values())
        return {n: out[n] for n in names}, nbytes
    return row


def _adam_params(flat):
    """(exp_avg name, exp_avg_sq name, AdamHP) of every Adam parameter with both moments."""
    groups = flat.skeleton["optimizer"]["param_groups"]
    hp_of = {}
    for g in groups:
        if "betas" not in g:
            continue  # not Adam (SGD)
        betas = g["betas"]["v"] if isinstance(g["betas"], dict) else g["betas"]
        for i in g["params"]:
            hp_of[str(i)] = (float(betas[0]), float(betas[1]), float(g["eps"]))
    for name, rec in flat.records.items():
        if rec.role == "exp_avg":
            base = name.removesuffix("exp_avg")
            b1, b2, eps = hp_of[name.split("/")[2]]
            yield name, base + "exp_avg_sq", M.AdamHP(float(flat.tensors[base + "step"]), b1, b2, eps)


def _sgd_row(bits: int, group: int = 256, min_numel: int = 1024):
    """SGD momentum buffers through quant/moments.quantize_m (no v: the buffer is the direction)."""
    def row(flat):
        out, nbits = {}, 0.0
        for n in _moment_names(flat, "momentum_buffer"):
            t = flat.tensors[n]
            if t.numel() < min_numel:
                nbits += 32 * t.numel()
                continue
            q = M.quantize_m(t, None, bits=bits, group=group)
            out[n] = M.dequantize_m(q, None)
            nbits += entropy_bits(q.codes) + 16 * q.side["scale"].numel()
        return out, nbits / 8
    return row


def _grid_row(codec: M.GridCodec, min_numel: int = 1024):
    """Moments through quant/moments.py at a keyframe; bits = order-0 entropy of the codes + side."""
    def row(flat):
        out, bits = {}, 0.0
        for mn, vn, hp in _adam_params(flat):
            m, v = flat.tensors[mn], flat.tensors[vn]
            if m.numel() < min_numel:
                bits += 64 * m.numel()
                continue
            qm, qv = M.encode_pair(m, v, hp, codec)
            out[mn], out[vn] = M.decode_pair(qm, qv, hp)
            bits += sum(entropy_bits(q.codes) + sum(16 * t.numel() for t in q.side.values())
                        for q in (qm, qv) if q is not None)
        return out, bits / 8
    return row


CONTROLS = {"exact": lambda flat: ({}, None), "bf16": _bf16, "zero-mv": _zero(*MOMENTS),
            "fresh": _zero(*MOMENTS, reset_step=True), "zero-m": _zero("exp_avg"),
            "zero-v": _zero("exp_avg_sq"), "jitter1": _jitter(1), "jitter2": _jitter(2)}
RECIPES = {f"dynaquant/1 k={k}": _method_row("dynaquant", moments={"codec": "normalized", "bins": k})
           for k in (16, 8, 4)}
_GRID_ROWS = [(0.5, 3, 0.0), (0.5, 1, 0.0), (1.0, 1, 0.0), (2.0, 1, 0.0), (3.0, 1, 0.9), (1.0, 2, 0.0), (2.0, 2, 0.0),
              (1.0, 0, 0.0), (2.0, 0, 0.0), *((v, 1, p) for v in (1.0, 2.0) for p in (0.5, 0.7, 0.8, 0.9))]
RECIPES.update({f"grid v{v:g} m{b}" + (f"p{p:g}" if p else ""): _grid_row(M.GridCodec(v, m_bits=b, prune=p))
                for v, b, p in _GRID_ROWS})
RECIPES["grid v1 m1 dec"] = _grid_row(M.GridCodec(1.0, m_bits=1, prune=0.0, normalize="decoded"))
RECIPES["grid v2 m1p0.9 g1024"] = _grid_row(M.GridCodec(2.0, m_bits=1, prune=0.9, group=1024))
RECIPES.update({f"sgd m{b}": _sgd_row(b) for b in (1, 2, 3)})
VARIANTS = {**CONTROLS, **RECIPES}


# ---------------------------------------------------------------------------------------------
# one resume

LOOKAHEAD = 10  # 1 / (1 - beta1): the steps of displacement Adam's momentum still carries


def _updates(flat, tensors) -> dict[str, torch.Tensor]:
    """param name -> lr * the update direction the optimizer state holds (Adam: m_hat / (sqrt(v_hat)
    + eps); SGD: the momentum buffer)."""
    lr_of = {str(i): float(g["lr"]) for g in flat.skeleton["optimizer"]["param_groups"] for i in g["params"]}
    out = {}
    for mn, vn, hp in _adam_params(flat):
        d = tensors[mn].float() / (1 - hp.beta1 ** hp.step) / M.denominator(tensors[vn], hp).reshape(tensors[mn].shape)
        out[flat.records[mn].param] = lr_of[mn.split("/")[2]] * d
    for n in _moment_names(flat, "momentum_buffer"):
        out[flat.records[n].param] = lr_of[n.split("/")[2]] * tensors[n].float()
    return out


def lookahead(wl, snap: dict, flat, restored: dict) -> float:
    """Relative eval change between the weights moved LOOKAHEAD steps along the restored update
    direction and along the exact one (no new gradients): a proxy for the momentum's pending
    displacement that a restored state gets wrong. Needs only the model and eval_fn, as a save does."""
    model, _, _ = wl.build(0)
    scores = []
    for tensors in (flat.tensors, {**flat.tensors, **restored}):
        model.load_state_dict(snap["model"])
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, u in _updates(flat, tensors).items():
                params[name].sub_(LOOKAHEAD * u.to(params[name].dtype))
        scores.append(wl.eval_fn(model))
    return (scores[1] - scores[0]) / abs(scores[0])


def _params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


def resume(wl: W.Workload, step: int, snap: dict, opt_state: dict, k_steps: int) -> dict:
    """Train k_steps from (snap's weights and scheduler, opt_state); metrics at PROBES and the end."""
    model, opt, sched = wl.build(0)
    model.load_state_dict(snap["model"])
    opt.load_state_dict(_clone(opt_state))
    if sched is not None:
        sched.load_state_dict(snap["scheduler"])
    theta0 = _params(model)
    out = {"params": {}, "metric": {}}
    window = {k_steps - WINDOW_EVERY * j for j in range(WINDOW)}
    for i in range(1, k_steps + 1):
        model.train()
        wl.train_step(model, opt, sched, step + i)
        if i in PROBES:
            out["params"][i] = _params(model)
        if i in PROBES or i in window:
            out["metric"][i] = wl.eval_fn(model)
    out["window"] = sum(out["metric"][i] for i in window) / len(window)
    out["theta0"] = theta0
    return out


def _cached(path: pathlib.Path, fn):
    """The exact resume is every row's reference: computed once per (workload, step, K)."""
    if path.exists():
        return torch.load(path, weights_only=True)
    r = fn()
    torch.save(r, path)
    return r


def _direction_error(flat, restored) -> float:
    """adam_direction_error over every parameter with both moments (betas/eps of group 0); for SGD
    the relative error of the momentum buffers (the update direction itself)."""
    bufs = _moment_names(flat, "momentum_buffer")
    if bufs:
        x = torch.cat([flat.tensors[n].reshape(-1) for n in bufs])
        y = torch.cat([restored.get(n, flat.tensors[n]).reshape(-1) for n in bufs])
        return float((y - x).norm() / x.norm())
    g = flat.skeleton["optimizer"]["param_groups"][0]
    betas = g["betas"]["v"] if isinstance(g["betas"], dict) else g["betas"]
    ms, vs, mq, vq, steps = [], [], [], [], set()
    for name, rec in flat.records.items():
        if rec.role != "exp_avg":
            continue
        vname = name.removesuffix("exp_avg") + "exp_avg_sq"
        sname = name.removesuffix("exp_avg") + "step"
        ms.append(flat.tensors[name])
        vs.append(flat.tensors[vname])
        mq.append(restored.get(name, flat.tensors[name]))
        vq.append(restored.get(vname, flat.tensors[vname]))
        steps.add(float(flat.tensors[sname]))
    return adam_direction_error(ms, vs, mq, vq, max(steps), tuple(betas), float(g["eps"]))


def study(name: str, variants: list[str], k_steps: int, cache: pathlib.Path, seeds: int = 1) -> list[dict]:
    """Every (row, checkpoint, data seed) of one workload, row by row (a partial run has whole rows);
    rows already in <cache>/<name>-rows-<K>w.jsonl are reused, the exact resume is cached per step
    and seed. Seed s > 0 continues on other batches (the workload's batch(step + s * SEED_SHIFT)),
    so the mean over seeds separates a row's effect from the chaos of one continuation."""
    wl0, snaps = snapshots(name, cache)
    model, opt, _ = wl0.build(0)
    log = cache / f"{name}-rows-{k_steps}w.jsonl"
    done = {(r["step"], r["variant"], r.get("seed", 0)): r for r in map(json.loads, log.read_text().splitlines())} \
        if log.exists() else {}
    flats = {step: flatten_state({"model": snap["model"], "optimizer": snap["optimizer"]}, model, opt)
             for step, snap in snaps.items()}
    rows, backfilled = [], False
    for seed in range(seeds):
        wl = wl0 if not seed else dataclasses.replace(wl0, batch=lambda st, s=seed: wl0.batch(st + s * SEED_SHIFT))
        for v in ["exact", *[v for v in variants if v != "exact"]]:
            for step, snap in sorted(snaps.items()):
                key = (step, v, seed)
                if key not in done:
                    done[key] = {**_row(wl, name, step, snap, flats[step], v, k_steps, cache, seed), "seed": seed}
                    with log.open("a") as f:
                        f.write(json.dumps(done[key]) + "\n")
                elif "look" not in done[key]:  # a proxy added after the row was measured
                    done[key]["look"] = lookahead(wl, snap, flats[step], VARIANTS[v](flats[step])[0])
                    backfilled = True
                rows.append(done[key])
    if backfilled:
        log.write_text("".join(json.dumps(r) + "\n" for r in done.values()))
    return rows


def _row(wl, name: str, step: int, snap: dict, flat, v: str, k_steps: int, cache: pathlib.Path, seed: int) -> dict:
    t0 = time.perf_counter()
    restored, nbytes = VARIANTS[v](flat)
    opt_state = unflatten_state(flat.skeleton, {**flat.tensors, **restored})["optimizer"]
    exact = _cached(cache / f"{name}-exact-{step}-{k_steps}w{f'-s{seed}' if seed else ''}.pt",
                    lambda: resume(wl, step, snap, snap["optimizer"], k_steps))
    r = exact if v == "exact" else resume(wl, step, snap, opt_state, k_steps)
    rel = {i: (r["metric"][i] - exact["metric"][i]) / abs(exact["metric"][i]) for i in r["metric"]}
    d1_ref = exact["params"][1] - exact["theta0"]
    n_mom = sum(flat.records[n].numel for n in _moment_names(flat, *MOMENTS))
    return {"workload": name, "step": step, "variant": v, "metric": r["metric"][k_steps],
            "rel": (r["window"] - exact["window"]) / abs(exact["window"]), "rel_end": rel[k_steps],
            "rel10": rel[10], "rel50": rel[50], "bits": None if nbytes is None else 8 * nbytes / n_mom,
            "dir": _direction_error(flat, restored), "look": lookahead(wl, snap, flat, restored),
            "upd1": float((r["params"][1] - r["theta0"] - d1_ref).norm() / d1_ref.norm()),
            "div10": float((r["params"][10] - exact["params"][10]).norm()
                           / (exact["params"][10] - exact["theta0"]).norm()),
            "s": round(time.perf_counter() - t0, 1)}


# ---------------------------------------------------------------------------------------------
# report

def spearman(x: list[float], y: list[float]) -> float:
    def ranks(a):
        t = torch.tensor(a, dtype=torch.float64)
        r = torch.empty_like(t)
        r[t.argsort()] = torch.arange(len(a), dtype=torch.float64)
        return r
    if len(x) < 3:
        return math.nan
    rx, ry = ranks(x), ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    return float((rx * ry).sum() / (rx.norm() * ry.norm()))


def _std(xs: list[float]) -> float:
    """Sample standard deviation (0 for a single value)."""
    if len(xs) < 2:
        return 0.0
    mu = sum(xs) / len(xs)
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1))


def _pct(x):
    return "-" if x is None else f"{100 * x:+.2f} %"


def report(rows: list[dict], k_steps: int) -> str:
    lines = []
    for wname in dict.fromkeys(r["workload"] for r in rows):
        rs = [r for r in rows if r["workload"] == wname]
        steps = sorted({r["step"] for r in rs})
        lines += [f"\n### {wname}: eval metric after {k_steps} resumed steps, relative to the exact resume\n",
                  "| row | bits/moment | " + " | ".join(f"step {s}" for s in steps)
                  + " | worst | direction error (mean) | first-update error (mean) |",
                  "|---|---|" + "---|" * (len(steps) + 3)]
        for v in dict.fromkeys(r["variant"] for r in rs):
            by_step = {s: [r for r in rs if r["variant"] == v and r["step"] == s] for s in steps}
            vr = {s: {**g[0], "rel": sum(r["rel"] for r in g) / len(g),
                      "spread": _std([r["rel"] for r in g])} for s, g in by_step.items() if g}
            bits = [vr[s]["bits"] for s in steps if vr.get(s) and vr[s]["bits"] is not None]
            cells = [(_pct(vr[s]["rel"]) + (f" ± {100 * vr[s]['spread']:.2f}" if vr[s]["spread"] else ""))
                     if s in vr else "" for s in steps]
            worst = max(vr[s]["rel"] for s in vr)
            lines.append(f"| {v} | {sum(bits) / len(bits):.2f} | " if bits else f"| {v} | - | ")
            lines[-1] += " | ".join(cells) + f" | {_pct(worst)} | " \
                + f"{sum(r['dir'] for r in vr.values()) / len(vr):.3g} | " \
                + f"{sum(r['upd1'] for r in vr.values()) / len(vr):.3g} |"
        pool = [r for r in rs if r["variant"] != "exact" and "look" in r and not r.get("seed")]
        y = [r["rel"] for r in pool]
        proxies = ("dir", "look", "upd1", "div10", "rel10", "rel50")
        lines.append("\nSpearman rank correlation with the " + f"{k_steps}-step change, pooled ({len(pool)} rows): "
                     + ", ".join(f"{p} {spearman([r[p] for r in pool], y):+.2f}" for p in proxies))
        within = {p: [spearman([r[p] for r in pool if r["step"] == s], [r["rel"] for r in pool if r["step"] == s])
                      for s in steps] for p in proxies}
        lines.append("within each checkpoint (mean over checkpoints): "
                     + ", ".join(f"{p} {sum(v) / len(v):+.2f}" for p, v in within.items()))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="gpt2-3m,gpt2,digits")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"subset of {', '.join(VARIANTS)}")
    ap.add_argument("--steps", type=int, default=200, help="K: steps trained after the resume")
    ap.add_argument("--seeds", type=int, default=1, help="continuations per row on different batches (mean ± std)")
    ap.add_argument("--cache", default="/tmp/ckz-resume")
    ap.add_argument("--out", default=None, help="JSON file for the rows (default: <cache>/resume-<workloads>.json)")
    ap.add_argument("--report", action="store_true", help="only print the tables of the rows cached so far")
    a = ap.parse_args(argv)
    if a.report:
        rows = []
        for w in a.workloads.split(","):
            log = pathlib.Path(a.cache) / f"{w}-rows-{a.steps}w.jsonl"
            order = {v: i for i, v in enumerate(a.variants.split(","))}
            got = [r for r in map(json.loads, log.read_text().splitlines()) if r["variant"] in order]
            rows += sorted(got, key=lambda r: (order[r["variant"]], r["step"]))
        print(report(rows, a.steps))
        return
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    variants = a.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    cache = pathlib.Path(a.cache)
    rows = []
    t0 = time.perf_counter()
    for w in a.workloads.split(","):
        rows += study(w, variants, a.steps, cache, a.seeds)
    out = pathlib.Path(a.out or cache / f"resume-{a.workloads.replace(',', '+')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"steps": a.steps, "rows": rows, "wall_s": round(time.perf_counter() - t0)}, indent=1))
    print(f"# bench/resume.py --workloads {a.workloads} --steps {a.steps}  torch {torch.__version__}  threads=1  "
          f"load average {os.getloadavg()[0]:.1f}  wall {time.perf_counter() - t0:.0f} s")
    print(report(rows, a.steps))


if __name__ == "__main__":
    main()
