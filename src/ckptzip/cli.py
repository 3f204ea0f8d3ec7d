"""The ``ckptzip`` command line: compress existing checkpoints into a chain, list, inspect, verify, restore.

Every command validates its inputs before writing anything. Bad input (a missing path, a pickle that
needs arbitrary code, an unknown method, a step not in the chain, an unwritable output, a folder that
is not a chain) prints one line on stderr naming the thing and the fix, and exits 2 with the chain
untouched; ``verify`` exits 1 when it finds a problem. Heavy imports (torch) happen inside the
commands so ``ckptzip --help`` stays fast.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import json
import math
import os
import pathlib
import sys
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from .errors import CkptzipError, ConfigError, IncompleteCheckpointError

if TYPE_CHECKING:
    from .chain import CheckpointChain

EXIT_BAD_INPUT = 2
EXIT_PROBLEMS = 1

app = typer.Typer(
    name="ckptzip",
    help="Compress deep-learning training checkpoints into a verified chain, and restore any step.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,  # bad input is handled below; anything else is a bug worth a traceback
    rich_markup_mode="rich",
)


# ---------------------------------------------------------------------------------------------
# errors -> one line + exit 2

def _fail(msg: str) -> typer.Exit:
    typer.echo(f"error: {' '.join(msg.split())}", err=True)  # one line, whatever the message held
    return typer.Exit(EXIT_BAD_INPUT)


@contextlib.contextmanager
def _bad_input():
    """Map the errors a user can cause to a one-line message and exit 2."""
    try:
        yield
    except (typer.Exit, typer.Abort):
        raise
    except CkptzipError as e:
        raise _fail(str(e)) from None
    except OSError as e:
        if e.errno is not None and e.filename:  # raised by the OS: say which path and what to do
            raise _fail(f"{e.filename}: {e.strerror}; check the path and its permissions") from None
        raise _fail(str(e)) from None


# ---------------------------------------------------------------------------------------------
# consoles and progress

def _out():
    from rich.console import Console

    # piped output: wide enough that tables do not wrap (rich defaults to 80 columns off a terminal)
    width = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 200
    return Console(width=width, highlight=False)


def _progress():
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                               TimeElapsedColumn)

    console = Console(stderr=True)
    # off a terminal (pipes, CI logs, tests) a live bar only leaves blank lines behind
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, transient=True, disable=not console.is_terminal)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _ratio(raw: int, stored: int) -> str:
    return f"{raw / stored:.1f}x" if stored else "inf"


# summary fields shown by `ls` (chosen config, search cost, measured degradation), in this order
LS_COLUMNS = ("bins", "embedding_bins", "prune_fraction", "prune_metric", "protect_fraction",  # dynaquant
              "min_bins", "max_bins", "n_bins", "n_bins_embedding", "n_step_bins", "range_ratio",  # qd/cnr/gobo
              "search", "evals", "degradation", "infeasible", "search_s", "encode_s")


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict | list):
        return json.dumps(v, separators=(",", ":"), sort_keys=True)
    return str(v)


# ---------------------------------------------------------------------------------------------
# chain helpers

def _open_chain(url: str, *, read_index: bool = True) -> "CheckpointChain":
    """An existing, committed chain, or a one-line error saying what the path is instead."""
    from .chain import INDEX, CheckpointChain

    chain = CheckpointChain(url)
    st = chain.storage
    if not st.fs.exists(st.root):
        raise FileNotFoundError(f"{url}: no such chain; check the path (create one with `ckptzip compress`)")
    if not st.exists(INDEX):
        raise IncompleteCheckpointError(f"{url}: not a ckptzip chain (no index.json); pass a folder written by "
                                        "`ckptzip compress` or CheckpointChain")
    if read_index:
        chain.entries(refresh=True)  # a corrupt index raises CorruptCheckpointError here
    return chain


def _check_chain_target(url: str):
    """Where `compress --out` will write: a new/empty folder or an existing chain. Returns its entries."""
    from .chain import INDEX, CheckpointChain

    chain = CheckpointChain(url)
    st = chain.storage
    if st.local:
        root = pathlib.Path(st.root)
        if root.exists() and not root.is_dir():
            raise NotADirectoryError(f"{url} is a file, not a chain folder; choose a folder for --out")
        if root.is_dir() and not (root / INDEX).exists() and any(root.iterdir()):
            raise IncompleteCheckpointError(f"{url} is a folder with other files and no index.json, not a chain; "
                                            "choose a new or empty folder for --out")
        probe = root
        while not probe.exists():
            probe = probe.parent
        if not probe.is_dir():
            raise NotADirectoryError(f"cannot create {url}: {probe} is a file; choose another --out")
        if not os.access(probe, os.W_OK | os.X_OK):
            raise PermissionError(f"cannot write {url}: no write permission on {probe}; choose a writable --out")
    return chain.entries(refresh=True) if st.exists(INDEX) else []


def _load_eval(spec: str):
    """(model, eval_fn) from ``module:function`` or ``path/to/file.py:function``."""
    import torch

    mod_name, sep, fn_name = spec.rpartition(":")
    if not sep or not mod_name or not fn_name:
        raise ConfigError(f"--eval {spec!r} must be module:function or path/to/file.py:function")
    try:
        if mod_name.endswith(".py") or os.sep in mod_name or "/" in mod_name:
            path = pathlib.Path(mod_name)
            if not path.is_file():
                raise FileNotFoundError(f"--eval {spec}: no such file {path}; check the path")
            ispec = importlib.util.spec_from_file_location(path.stem, path)
            mod = importlib.util.module_from_spec(ispec)
            ispec.loader.exec_module(mod)
        else:
            # a console script does not put the working directory on sys.path; python -m would
            added = os.getcwd() not in sys.path and "" not in sys.path
            if added:
                sys.path.insert(0, os.getcwd())
            try:
                mod = importlib.import_module(mod_name)
            finally:
                if added:
                    sys.path.remove(os.getcwd())
    except ImportError as e:
        raise ConfigError(f"--eval {spec}: cannot import {mod_name} ({e}); put it on PYTHONPATH") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ConfigError(f"--eval {spec}: {mod_name} has no function {fn_name}")
    res = fn()
    if not (isinstance(res, tuple) and len(res) == 2 and isinstance(res[0], torch.nn.Module) and callable(res[1])):
        raise ConfigError(f"--eval {spec}: {fn_name}() must return (model, eval_fn), got {type(res).__name__}")
    return res


def _load_weights(model, state: dict, src) -> None:
    sd = state.get("model")
    if not isinstance(sd, dict):
        raise ConfigError(f"{src.path}: holds no model state dict to load into the --eval model")
    try:
        missing, unexpected = model.load_state_dict(sd, strict=False)
    except RuntimeError as e:
        raise ConfigError(f"{src.path}: weights do not fit the --eval model ({str(e).splitlines()[0]})") from None
    if unexpected:
        raise ConfigError(f"{src.path}: weights do not fit the --eval model (unexpected key {unexpected[0]!r}); "
                          "return the model these checkpoints were trained with")


# ---------------------------------------------------------------------------------------------
# commands

@app.command()
def compress(
    src: Annotated[list[pathlib.Path], typer.Argument(
        metavar="SRC", show_default=False,
        help="torch.save files or Trainer checkpoint-N folders (a folder of checkpoint-* folders stands for all)")],
    out: Annotated[str, typer.Option("--out", "-o", help="chain folder (or fsspec URL); created or appended to",
                                     show_default=False)],
    method: Annotated[str, typer.Option(help="compression method (see `ckptzip methods`)")] = "lossless",
    config: Annotated[Optional[str], typer.Option(help="method config as JSON, e.g. '{\"zstd_level\": 9}'")] = None,
    keyframe_every: Annotated[int, typer.Option(min=1, help="a keyframe at least every K checkpoints")] = 10,
    threshold: Annotated[Optional[float], typer.Option(
        help="relative quality budget per checkpoint for methods with a config search (needs --eval)")] = None,
    eval_spec: Annotated[Optional[str], typer.Option(
        "--eval", help="module:function returning (model, eval_fn)")] = None,
    higher_is_better: Annotated[bool, typer.Option(
        "--higher-is-better", help="eval_fn is a score, not a loss")] = False,
) -> None:
    """Ingest existing checkpoints, in step order, into a compressed chain."""
    with _bad_input():
        from .chain import CheckpointChain, KeyframePolicy
        from .ingest import find_sources, load_source
        from .methods.base import EncodeContext, get_method

        cfg = None
        if config is not None:
            try:
                cfg = json.loads(config)
            except ValueError:
                raise ConfigError(f"--config {config!r} is not valid JSON; pass e.g. '{{\"zstd_level\": 9}}'") from None
            if not isinstance(cfg, dict):
                raise ConfigError("--config must be a JSON object of config fields")
        m = get_method(method, cfg)
        if (threshold is not None or higher_is_better) and eval_spec is None:
            raise ConfigError("--threshold and --higher-is-better need --eval module:function returning "
                              "(model, eval_fn)")
        if threshold is not None and not (math.isfinite(threshold) and threshold > 0):
            raise ConfigError(f"--threshold must be a positive relative budget such as 0.01, got {threshold}")
        entries = _check_chain_target(out)
        with _progress() as prog:
            prog.add_task("checking sources", total=None)
            sources = find_sources(src)
        if entries and sources[0].step <= entries[-1].step:
            raise ConfigError(f"{sources[0].path} has step {sources[0].step}, not after the chain's latest step "
                              f"{entries[-1].step}; pass later checkpoints or choose a new --out")
        model = eval_fn = None
        if eval_spec is not None:
            model, eval_fn = _load_eval(eval_spec)

        raw = stored = 0
        with CheckpointChain(out, m, keyframe=KeyframePolicy(every=keyframe_every)) as chain, _progress() as prog:
            task = prog.add_task("compressing", total=len(sources))
            for s in sources:
                prog.update(task, description=f"step {s.step} <- {s.path.name}")
                state = load_source(s)
                if model is not None:
                    _load_weights(model, state, s)
                ctx = EncodeContext(step=s.step, model=model, eval_fn=eval_fn, higher_is_better=higher_is_better,
                                    **({"threshold": threshold} if threshold is not None else {}))
                e = chain.save(state, s.step, model=model, ctx=ctx)
                raw += e.raw_bytes
                stored += e.nbytes
                prog.advance(task)
    steps = [s.step for s in sources]
    typer.echo(f"compressed {len(sources)} checkpoint(s) (steps {steps[0]}..{steps[-1]}) into {out} with "
               f"{m.descriptor}: {_size(raw)} -> {_size(stored)} ({_ratio(raw, stored)})")


@app.command("ls")
def ls_(
    chain_url: Annotated[str, typer.Argument(metavar="CHAIN", help="chain folder or URL", show_default=False)],
    as_json: Annotated[bool, typer.Option("--json", help="print the index entries as JSON")] = False,
) -> None:
    """List a chain's checkpoints: kind, parent, method, sizes, ratio and what the method chose."""
    from rich.table import Table

    with _bad_input():
        entries = _open_chain(chain_url).entries()
    if as_json:
        typer.echo(json.dumps([dataclasses.asdict(e) for e in entries], indent=1))
        return
    keys: list[str] = []  # the facts worth a column; `--json` has every summary field
    for e in entries:
        keys += [k for k in e.summary if k not in keys and k in LS_COLUMNS]
    t = Table(title=chain_url)
    for col in ["step", "kind", "parent", "method", "bytes", "raw bytes", "ratio", *keys]:
        t.add_column(col, justify="right" if col in ("step", "parent", "bytes", "raw bytes", "ratio") else "left")
    for e in entries:
        t.add_row(str(e.step), "keyframe" if e.keyframe else "delta", "-" if e.parent is None else str(e.parent),
                  e.method, _size(e.nbytes), _size(e.raw_bytes), _ratio(e.raw_bytes, e.nbytes),
                  *[_cell(e.summary[k]) if k in e.summary else "" for k in keys])
    raw, stored = sum(e.raw_bytes for e in entries), sum(e.nbytes for e in entries)
    t.caption = f"{len(entries)} checkpoints: {_size(raw)} -> {_size(stored)} ({_ratio(raw, stored)})"
    _out().print(t)


@app.command()
def inspect(
    chain_url: Annotated[str, typer.Argument(metavar="CHAIN", help="chain folder or URL", show_default=False)],
    step: Annotated[Optional[int], typer.Option(help="step to inspect (default: the latest)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the records as JSON")] = False,
) -> None:
    """Per-tensor view of one checkpoint: role, layer type, dtype, shape, stored bytes, pipeline."""
    from rich.table import Table

    from .format import read_manifest

    with _bad_input():
        chain = _open_chain(chain_url)
        e = chain.entry(step)
        where = chain.storage.path(e.file)
        man = read_manifest(chain.storage.read(e.file), name=where)
    blobs = man.get("blobs", {})
    rows = []
    for name, r in man["records"].items():
        nbytes = sum(int(blobs.get(k, {}).get("nbytes", 0)) for k in r.get("blobs", {}).values())
        rows.append({"name": name, "role": r.get("role"), "layer_type": r.get("layer_type"), "dtype": r.get("dtype"),
                     "shape": r.get("shape"), "stored_bytes": nbytes, "pipeline": r.get("pipeline")})
    if as_json:
        typer.echo(json.dumps({"step": e.step, "file": where, "keyframe": e.keyframe, "parent": e.parent,
                               "method": man.get("method"), "config": man.get("config"), "records": rows}, indent=1))
        return
    layout = man.get("skeleton", {}).get("__layout__") if isinstance(man.get("skeleton"), dict) else None
    head = (f"step {e.step}: {'keyframe' if e.keyframe else f'delta of step {e.parent}'}, {man.get('method')} "
            f"{json.dumps(man.get('config', {}), sort_keys=True)}, {where}")
    if isinstance(layout, dict) and layout.get("name"):
        head += f", ingested from {layout['name']}"
    t = Table(title=head, title_justify="left")
    for col in ("name", "role", "layer type", "dtype", "shape", "stored bytes", "pipeline"):
        t.add_column(col, justify="right" if col == "stored bytes" else "left")
    for r in rows:
        t.add_row(r["name"], str(r["role"]), str(r["layer_type"]), str(r["dtype"]),
                  "x".join(map(str, r["shape"])) or "scalar", str(r["stored_bytes"]), " | ".join(r["pipeline"]))
    t.caption = (f"{len(rows)} tensors, {_size(e.raw_bytes)} -> {_size(e.nbytes)} "
                 f"({_ratio(e.raw_bytes, e.nbytes)}) including the manifest")
    kept = _exact_optimizer_state(rows)
    if kept:
        t.caption += f"\noptimizer state stored exact: {kept}"
    _out().print(t)


def _exact_optimizer_state(rows: list[dict]) -> str:
    """Optimizer-state records (step counts aside) a method kept exact, counted by role: states a
    moment codec does not know (Adagrad's sum, AMSGrad's max_exp_avg_sq, ...) and small tensors."""
    roles: dict[str, int] = {}
    for r in rows:
        if r["name"].startswith("optimizer/state/") and r["role"] != "step" and (r["pipeline"] or [""])[0] == "exact/1":
            roles[str(r["role"])] = roles.get(str(r["role"]), 0) + 1
    return ", ".join(f"{role} x{n}" for role, n in sorted(roles.items()))


@app.command()
def verify(
    chain_url: Annotated[str, typer.Argument(metavar="CHAIN", help="chain folder or URL", show_default=False)],
) -> None:
    """Check every file's checksums and decode every step; exit 1 on any problem."""
    from .chain import INDEX

    with _bad_input():
        chain = _open_chain(chain_url, read_index=False)
    try:
        entries = chain.entries(refresh=True)
    except CkptzipError as e:  # a damaged index is a problem of the chain, not bad input
        msg = " ".join(str(e).split())
        typer.echo(msg if INDEX in msg else f"{chain.storage.path(INDEX)}: {msg}")
        typer.echo("FAILED: the chain index cannot be read")
        raise typer.Exit(EXIT_PROBLEMS) from None
    with _progress() as prog:
        prog.add_task("checking files", total=None)
        problems = chain.verify(deep=False)
    problems += _damaged_records(chain, problems)
    if not problems:
        with _progress() as prog:
            task = prog.add_task("decoding", total=len(entries))
            for e in entries:
                prog.update(task, description=f"decoding step {e.step}")
                try:
                    chain.restore(e.step)
                except CkptzipError as err:
                    problems.append(f"step {e.step}: {err}")
                except Exception as err:  # a decoder crash on valid checksums is still a problem
                    problems.append(f"step {e.step} ({chain.storage.path(e.file)}): decode failed: "
                                    f"{err.__class__.__name__}: {err}")
                prog.advance(task)
    for name in chain.orphans():
        typer.echo(f"warning: {chain.storage.path(name)} is in no index entry (left by an interrupted save); "
                   "it can be deleted", err=True)
    if problems:
        for p in problems:
            typer.echo(" ".join(p.split()))
        typer.echo(f"FAILED: {len(problems)} problem(s) in {len(entries)} checkpoints")
        raise typer.Exit(EXIT_PROBLEMS)
    typer.echo(f"OK: {len(entries)} checkpoints verified")


def _damaged_records(chain: "CheckpointChain", problems: list[str]) -> list[str]:
    """For files named in ``problems``, which records' blobs fail their checksums."""
    from .format import decode_container, sha256

    out = []
    for e in chain.entries():
        where = chain.storage.path(e.file)
        if not any(where in p for p in problems):
            continue
        try:
            c = decode_container(chain.storage.read(e.file), name=where, verify_blobs=False)
        except (CkptzipError, OSError):
            continue  # the header itself is damaged: the problem line already names the file
        owner = {k: n for n, r in c.manifest.get("records", {}).items() for k in r.get("blobs", {}).values()}
        for k, data in c.blobs.items():
            if sha256(data) != c.manifest["blobs"][k].get("sha256"):
                what = f"record {owner[k]!r}" if k in owner else f"shared blob {k!r}"
                out.append(f"{where}: {what} is damaged (blob {k} fails its checksum)")
    return out


@app.command()
def restore(
    chain_url: Annotated[str, typer.Argument(metavar="CHAIN", help="chain folder or URL", show_default=False)],
    out: Annotated[pathlib.Path, typer.Option(
        "--out", "-o", show_default=False,
        help="x.pt: the full state as ingested; x.safetensors: model weights only; "
             "a folder: the Trainer checkpoint folder it came from")],
    step: Annotated[Optional[int], typer.Option(help="step to restore (default: the latest)")] = None,
    force: Annotated[bool, typer.Option("--force", help="replace OUT if it exists")] = False,
) -> None:
    """Rebuild one checkpoint from the chain and write it as a .pt, .safetensors or folder."""
    with _bad_input():
        from .ingest import check_output, write_restored

        chain = _open_chain(chain_url)
        e = chain.entry(step)
        check_output(out, force=force)
        with _progress() as prog:
            prog.add_task(f"decoding step {e.step}", total=None)
            restored = chain.restore(e.step)
        kind = write_restored(restored.state, out, step=e.step, force=force)
    typer.echo(f"restored step {e.step} -> {out} ({kind})")


@app.command()
def methods() -> None:
    """List the compression methods this installation provides."""
    from .methods.base import available_methods

    for name in available_methods():
        typer.echo(name)


@app.command()
def demo(
    workload: Annotated[list[str], typer.Option("--workload", "-w", help="digits, gpt2, minilm (repeatable)")] = [],
    methods: Annotated[str, typer.Option("--methods", "-m", help="comma-separated methods")] = "",
    failures: Annotated[Optional[int], typer.Option("--failures", "-f", min=0,
                                                    help="simulated failures per run [default: 10; minilm 3]")] = None,
    full: Annotated[bool, typer.Option("--full", help="longer, larger runs")] = False,
    threshold: Annotated[float, typer.Option("--threshold", help="relative quality budget per checkpoint")] = 0.01,
    out: Annotated[str, typer.Option("--out", "-o", help="report folder")] = "demo-report",
    transfer: Annotated[bool, typer.Option("--transfer", help="transfer-learning study (MiniLM)")] = False,
    async_save: Annotated[bool, typer.Option("--async", help="save through the asynchronous engine")] = False,
    transfer_space: Annotated[str, typer.Option("--transfer-space",
                                                help="search space for --transfer: paper | finetune")] = "paper",
) -> None:
    """Fault-tolerant training on real workloads with compressed checkpoints (the main job)."""
    from .demo import run as demo_run

    with _bad_input():
        if transfer:
            demo_run.transfer(out=out, space=transfer_space)
            return
        demo_run.main(workloads=tuple(workload) or demo_run.DEFAULT_WORKLOADS,
                      methods=[m for m in methods.split(",") if m] or None, failures=failures, full=full,
                      out=out, threshold=threshold, async_save=async_save)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point (``ckptzip = ckptzip.cli:main``)."""
    app(args=argv, prog_name="ckptzip")
