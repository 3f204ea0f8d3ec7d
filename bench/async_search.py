"""Where an async save's config search runs, side by side (issue 15): on a thread of the trainer
(``Compressor(async_save=True, eval_fn=...)``) or in the agent (``EngineOptions.agent_eval``).

Each workload trains once uncompressed, then with ``dynaquant`` in each mode, without failures (so
an agent that falls behind shows as blocked saves and as the final wait, not hidden in restarts)
and with 10, in one process, on the cores the agent leaves (as ``ckptzip demo --async``). "step
time" is the loop's time per executed step, save blocking included, over the uncompressed run's,
minus 1; "drain" is the time spent waiting for queued saves over the training time: at the end,
and with failures also at each close (which waits for the agent it started: ~1.5 s of imports).

``--paced``: the intervals of ``ckptzip demo --async`` (``demo.run.PACED``: training dominates,
as in real runs) and its 3 failures, instead of the default demo's intervals and 10.

Run:  .venv/bin/python bench/async_search.py                 (digits and GPT-2; about 6 minutes)
      .venv/bin/python bench/async_search.py --paced         (about 8 minutes)
      .venv/bin/python bench/async_search.py -w digits
"""
from __future__ import annotations

import argparse
import itertools
import os
import time

import torch

from ckptzip.demo import faults
from ckptzip.demo.report import markdown
from ckptzip.demo.run import PACED_FAILURES, workload_for
from ckptzip.engine import EngineOptions

COLUMNS = ("workload", "search runs in", "failures", "end-to-end degradation", "ratio (full state)", "ckpt overhead",
           "step time vs uncompressed", "drain", "wall s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-w", "--workload", action="append", choices=("digits", "gpt2"))
    ap.add_argument("--paced", action="store_true", help="the async demo's save intervals (training dominates)")
    args = ap.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - EngineOptions().threads))
    rows = []
    for name in args.workload or ["digits", "gpt2"]:
        wl = workload_for(name, False, args.paced)
        base = faults.run(wl, None)
        for failures, (where, in_agent) in itertools.product((0, PACED_FAILURES if args.paced else 10), (("trainer thread", False), ("agent", True))):
            t0 = time.perf_counter()
            r = faults.run(wl, "dynaquant", failures=failures, async_save=True, search_in_agent=in_agent)
            rows.append([wl.name, where, str(failures), f"{100 * r.degradation(base):+.2f} %", f"{r.ratio:.1f}x",
                         f"{100 * r.overhead:.1f} %", f"{100 * r.slowdown(base):+.0f} %", f"{100 * r.drain:.1f} %",
                         f"{time.perf_counter() - t0:.0f}"])
            print(markdown(COLUMNS, rows[-1:]).splitlines()[-1], flush=True)
    print(markdown(COLUMNS, rows))


if __name__ == "__main__":
    main()
