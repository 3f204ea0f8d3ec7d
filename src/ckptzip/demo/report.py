"""Tables, JSON and plots for the fault-tolerant demo (like the paper's Table 5 and Fig. 11)."""
from __future__ import annotations

import json
import math
import pathlib

from .faults import RunResult

COLUMNS = ("workload", "method", "metric", "end-to-end degradation", "ratio (full state)", "ratio (weights)",
           "ckpt overhead", "step time vs uncompressed", "restores")


def rows(results: list[RunResult]) -> list[list[str]]:
    ref = {r.workload: r for r in results if r.method == "uncompressed"}
    out = []
    for r in results:
        base = ref.get(r.workload)
        if r.method == "uncompressed":
            out.append([r.workload, r.method, f"{r.final_metric:.4f}", "-", "1.0x", "1.0x", "-", "-", "0"])
            continue
        deg = r.degradation(base) if base else math.nan
        wr = f"{r.weights_ratio:.1f}x" if not math.isnan(r.weights_ratio) else "n/a"
        out.append([r.workload, r.method, f"{r.final_metric:.4f}", f"{100 * deg:+.2f} %", f"{r.ratio:.1f}x", wr,
                    f"{100 * r.overhead:.1f} %", f"{100 * r.slowdown(base):+.0f} %" if base else "n/a",
                    str(len(r.restores))])
    return out


def markdown_table(results: list[RunResult]) -> str:
    return markdown(COLUMNS, rows(results))


def markdown(columns, table_rows) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in table_rows])


def print_table(results: list[RunResult], console) -> None:
    print_rows((COLUMNS, rows(results)), console, "Fault-tolerant training with compressed checkpoints")


def print_rows(table: tuple, console, title: str, left=("workload", "method", "weights")) -> None:
    """``table`` = (columns, rows of strings): a Rich table on a terminal; the markdown table otherwise,
    written as is, so a pipe or a log file keeps every column (Rich would crop or wrap it to 80 characters)."""
    columns, table_rows = table
    if not console.is_terminal:
        console.file.write(markdown(columns, table_rows) + "\n")
        console.file.flush()
        return
    from rich.table import Table

    t = Table(title=title)
    for c in columns:
        t.add_column(c, justify="left" if c in left else "right")
    for row in table_rows:
        t.add_row(*row)
    console.print(t)


def write_report(results: list[RunResult], out: pathlib.Path, meta: dict) -> list[pathlib.Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "runs": [r.to_dict() for r in results]}, indent=1,
                                                 default=float))
    (out / "table.md").write_text(markdown_table(results) + "\n")
    written = [out / "results.json", out / "table.md"]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return written
    for wl in dict.fromkeys(r.workload for r in results):
        runs = [r for r in results if r.workload == wl]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.5))
        for r in runs:
            if r.checkpoints:
                a1.plot([c["step"] for c in r.checkpoints], [c["ratio"] for c in r.checkpoints], marker=".",
                        label=r.method)
            xs, ys = zip(*r.losses) if r.losses else ([], [])
            a2.plot(xs, _smooth(ys), lw=1, label=r.method)
            for s in r.restores:
                a2.axvline(s, color="grey", lw=0.4, ls=":")
        a1.set(title=f"{wl}: compression ratio per checkpoint", xlabel="step", ylabel="ratio (full state)",
               yscale="log")
        a2.set(title=f"{wl}: training loss (dotted: restore points)", xlabel="step (in execution order)",
               ylabel="loss (smoothed)")
        a1.legend(fontsize=8)
        a2.legend(fontsize=8)
        fig.tight_layout()
        p = out / f"{wl}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
    return written


def _smooth(ys, k: int = 10):
    out, acc = [], []
    for y in ys:
        acc.append(y)
        acc = acc[-k:]
        out.append(sum(acc) / len(acc))
    return out
