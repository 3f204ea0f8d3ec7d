"""Loss-judged vs output-fidelity-judged config search on MiniLM fine-tuning, side by side.

The same fault-tolerant run (ckptzip.demo.faults.run, 3 failures) of the demo's MiniLM workload
three times: uncompressed; dynaquant whose search judges the validation *loss* (relative 1 %,
the fine-tuning preset FINETUNE_SEARCH_SPACE, as the demo did before); dynaquant whose search
judges *output fidelity* (relative [CLS]-state error <= 10 %, FIDELITY_SEARCH_SPACE, the demo's
default now). Reported: final test accuracy, its change against the uncompressed run, full-state
and weights-only ratios, and what each search chose per checkpoint.

Section "blind" first shows why, on the pretrained weights (step 0) and after 32 fine-tuning steps:
for a few DynaQuant configs, the relative change of the validation loss next to the relative error
of the [CLS] states and the share of validation predictions that change.

Run:  .venv/bin/python bench/fidelity.py                 (both sections, ~9 min on 2 cores)
      .venv/bin/python bench/fidelity.py --only blind    (~1 min)
"""
from __future__ import annotations

import argparse
import copy
import os
import time

import torch

from ckptzip.demo import workloads as W
from ckptzip.demo.faults import run
from ckptzip.methods.base import get_method
from ckptzip.state import flatten_state, unflatten_state

BLIND_CONFIGS = [(4, 16, 0.5, 0.0005), (8, 16, 0.2, 0.005), (16, 32, 0.0, 0.005), (32, 32, 0.0, 0.01),
                 (128, 32, 0.0, 0.01)]  # bins, embedding bins, prune fraction, protect fraction


def blind() -> None:
    fid_wl, loss_wl = W.minilm_workload(), W.minilm_workload(judge="loss")
    model, opt, sched = fid_wl.build(0)
    method = get_method("dynaquant")
    scratch = copy.deepcopy(model)

    @torch.no_grad()
    def predictions(m):
        h = fid_wl.eval_fn(m)  # [CLS] states of the fidelity batch; the classifier sees them pooled
        return h, m.classifier(m.bert.pooler(h[:, None]))

    print("\n| step | config (bins/emb bins/prune/protect) | val loss change | [CLS] state error | "
          "predictions changed |")
    print("|---|---|---|---|---|")
    done = 0
    for step in (0, 32):
        while done < step:
            fid_wl.train_step(model, opt, sched, done)
            done += 1
        flat = flatten_state({"model": model.state_dict()}, model)
        loss0, (h0, p0) = loss_wl.eval_fn(model), predictions(model)
        for b, e, pf, pt in BLIND_CONFIGS:
            q = method.search_quantize(flat, {"bins": b, "embedding_bins": e, "prune_fraction": pf,
                                              "protect_fraction": pt, "prune_metric": "magnitude"}, None)
            rep = {n: method.search_dequantize(x) for n, x in q.items()}
            scratch.load_state_dict(unflatten_state(flat.skeleton["model"], {**flat.tensors, **rep}))
            loss, (h, p) = loss_wl.eval_fn(scratch), predictions(scratch)
            changed = float((p.argmax(-1) != p0.argmax(-1)).float().mean())
            print(f"| {step} | {b}/{e}/{pf:g}/{pt:g} | {(loss - loss0) / loss0:+.2%} | "
                  f"{float((h - h0).norm() / h0.norm()):.1%} | {changed:.0%} |", flush=True)


def runs() -> None:
    wl = W.minilm_workload()                  # judge="fidelity", the demo's default
    loss_wl = W.minilm_workload(judge="loss")  # what the demo's MiniLM search judged before
    rows = []
    t0 = time.time()
    ref = run(wl, None)
    print(f"#   uncompressed: {time.time() - t0:.0f}s", flush=True)
    for label, w in (("validation loss, 1 %", loss_wl), (f"output fidelity, {wl.threshold:.0%}", wl)):
        t0 = time.time()
        r = run(w, "dynaquant", failures=3, threshold=0.01)
        print(f"#   {label}: {time.time() - t0:.0f}s", flush=True)
        rows.append((label, r))
    print("\n| search judges | test accuracy | change vs uncompressed | ratio (full state) | ratio (weights) | "
          "configs chosen (bins/embedding bins/prune, infeasible marked *) |")
    print("|---|---|---|---|---|---|")
    print(f"| (uncompressed) | {ref.final_metric:.4f} | - | 1.0x | 1.0x | - |")
    for label, r in rows:
        sums = [c["summary"] for c in r.checkpoints]
        cfgs = ", ".join(f"{s['bins']}/{s['embedding_bins']}/{s['prune_fraction']:g}"
                         + ("*" if s.get("infeasible") else "") for s in sums)
        print(f"| {label} | {r.final_metric:.4f} | {(r.final_metric - ref.final_metric) / ref.final_metric:+.2%} | "
              f"{r.ratio:.1f}x | {r.weights_ratio:.1f}x | {cfgs} |")
    print(f"\n{wl.description}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="blind,runs", help="comma list of sections: blind, runs")
    only = [x for x in p.parse_args().only.split(",") if x]
    torch.set_num_threads(1)
    print(f"# bench/fidelity.py --only {','.join(only)}  torch {torch.__version__}  threads=1  "
          f"load average {os.getloadavg()[0]:.1f}")
    for name in only:
        {"blind": blind, "runs": runs}[name]()


if __name__ == "__main__":
    main()
