"""How the command line shows a chain and a checkpoint: byte sizes, ratios, and the ``ls`` / ``inspect`` tables.

    chain_table(entries, title)                  # ckptzip ls: one row per checkpoint
    rows = record_rows(manifest)                 # ckptzip inspect (--json prints these)
    checkpoint_table(entry, manifest, rows, where)

Pure formatting of what chain.py and format.py return: nothing here reads storage.
"""
from __future__ import annotations

import json

from rich.table import Table

from .ingest.layout import LAYOUT_KEY

# summary fields shown by `ls` (chosen config, search cost, measured degradation), in this order
LS_COLUMNS = ("bins", "embedding_bins", "prune_fraction", "prune_metric", "protect_fraction",  # dynaquant
              "min_bins", "max_bins", "step_bins", "range_ratio", "outlier_log_prob",  # qd/cnr/gobo
              "search", "evals", "degradation", "infeasible", "search_s", "encode_s")
_RIGHT = ("step", "parent", "bytes", "raw bytes", "ratio", "stored bytes")


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def ratio(raw: int, stored: int) -> str:
    return f"{raw / stored:.1f}x" if stored else "inf"


def totals(entries) -> str:
    """``<raw> -> <stored> (<ratio>)`` over index entries."""
    raw, stored = sum(e.raw_bytes for e in entries), sum(e.nbytes for e in entries)
    return f"{size(raw)} -> {size(stored)} ({ratio(raw, stored)})"


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict | list):
        return json.dumps(v, separators=(",", ":"), sort_keys=True)
    return str(v)


def _table(columns, **kw) -> Table:
    t = Table(**kw)
    for col in columns:
        t.add_column(col, justify="right" if col in _RIGHT else "left")
    return t


def chain_table(entries, title: str) -> Table:
    """One row per index entry: kind, parent, method, sizes, ratio and the method's summary facts."""
    keys: list[str] = []  # the facts worth a column; `ls --json` has every summary field
    for e in entries:
        keys += [k for k in e.summary if k not in keys and k in LS_COLUMNS]
    t = _table(["step", "kind", "parent", "method", "bytes", "raw bytes", "ratio", *keys], title=title)
    for e in entries:
        t.add_row(str(e.step), "keyframe" if e.keyframe else "delta", "-" if e.parent is None else str(e.parent),
                  e.method, size(e.nbytes), size(e.raw_bytes), ratio(e.raw_bytes, e.nbytes),
                  *[_cell(e.summary[k]) if k in e.summary else "" for k in keys])
    t.caption = f"{len(entries)} checkpoints: {totals(entries)}"
    return t


def record_rows(manifest: dict) -> list[dict]:
    """One dict per record of a checkpoint's manifest, with the bytes its blobs take."""
    blobs = manifest.get("blobs", {})
    rows = []
    for name, r in manifest["records"].items():
        nbytes = sum(int(blobs.get(k, {}).get("nbytes", 0)) for k in r.get("blobs", {}).values())
        span = r.get("meta", {}).get("batch")  # its span of the shared blob (stage batch/1)
        if isinstance(span, list) and len(span) == 3 and isinstance(span[2], int):
            nbytes += span[2]
        rows.append({"name": name, "role": r.get("role"), "layer_type": r.get("layer_type"), "dtype": r.get("dtype"),
                     "shape": r.get("shape"), "stored_bytes": nbytes, "pipeline": r.get("pipeline")})
    return rows


def checkpoint_table(e, manifest: dict, rows: list[dict], where: str) -> Table:
    """The records of one checkpoint, titled with its kind, method, config, file and ingested source."""
    skeleton = manifest.get("skeleton")
    layout = skeleton.get(LAYOUT_KEY) if isinstance(skeleton, dict) else None
    head = (f"step {e.step}: {'keyframe' if e.keyframe else f'delta of step {e.parent}'}, {manifest.get('method')} "
            f"{json.dumps(manifest.get('config', {}), sort_keys=True)}, {where}")
    if isinstance(layout, dict) and layout.get("name"):
        head += f", ingested from {layout['name']}"
    t = _table(("name", "role", "layer type", "dtype", "shape", "stored bytes", "pipeline"), title=head,
               title_justify="left")
    for r in rows:
        t.add_row(r["name"], str(r["role"]), str(r["layer_type"]), str(r["dtype"]),
                  "x".join(map(str, r["shape"])) or "scalar", str(r["stored_bytes"]), " | ".join(r["pipeline"]))
    t.caption = f"{len(rows)} tensors, {size(e.raw_bytes)} -> {size(e.nbytes)} ({ratio(e.raw_bytes, e.nbytes)}) " \
                "including the manifest"
    kept = exact_optimizer_state(rows)
    if kept:
        t.caption += f"\noptimizer state stored exact: {kept}"
    return t


def exact_optimizer_state(rows: list[dict]) -> str:
    """Optimizer-state records (step counts aside) a method kept exact, counted by role: states no
    moment codec knows (Adagrad's sum, AMSGrad's max_exp_avg_sq, ...) and tensors too small to code."""
    roles: dict[str, int] = {}
    for r in rows:
        if r["name"].startswith("optimizer/state/") and r["role"] != "step" and (r["pipeline"] or [""])[0] == "exact/1":
            roles[str(r["role"])] = roles.get(str(r["role"]), 0) + 1
    return ", ".join(f"{role} x{n}" for role, n in sorted(roles.items()))


def dcp_steps_table(rows: list[dict], title: str) -> Table:
    """ckptzip ls on a DCP root (dcp.tools.list_steps): one row per committed step."""
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r["summary"] if k not in keys and k in LS_COLUMNS]
    t = _table(["step", "world", "keyframe ranks", "method", "bytes", "raw bytes", "ratio", *keys], title=title)
    for r in rows:
        t.add_row(str(r["step"]), str(r["world_size"]), f"{r['keyframe_ranks']}/{r['world_size']}", r["method"],
                  size(r["nbytes"]), size(r["raw_bytes"]), ratio(r["raw_bytes"], r["nbytes"]),
                  *[_cell(r["summary"][k]) if k in r["summary"] else "" for k in keys])
    raw, stored = sum(r["raw_bytes"] for r in rows), sum(r["nbytes"] for r in rows)
    t.caption = f"{len(rows)} steps: {size(raw)} -> {size(stored)} ({ratio(raw, stored)})"
    return t


def dcp_step_table(info: dict, title: str) -> Table:
    """ckptzip inspect on a DCP root (dcp.tools.inspect_step): one row per rank file."""
    t = _table(("rank", "file", "kind", "parent", "bytes", "raw bytes", "ratio", "reference bytes"), title=title,
               title_justify="left")
    for f in info["ranks"]:
        t.add_row(str(f["rank"]), f["file"], "keyframe" if f["keyframe"] else "delta",
                  "-" if f["parent"] is None else str(f["parent"]), size(f["nbytes"]), size(f["raw_bytes"]),
                  ratio(f["raw_bytes"], f["nbytes"]), size(f.get("reference_bytes") or 0))
    t.caption = f"{len(info['tensors'])} tensors ({sum(v['chunks'] for v in info['tensors'].values())} chunks), " \
                f"{len(info['bytes_items'])} bytes items; restore needs steps {list(info['commit'].needs)}"
    return t
