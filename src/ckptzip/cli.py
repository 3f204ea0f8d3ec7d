"""The ``ckptzip`` command line: compress existing checkpoints into a chain, list, inspect, verify, restore.

This module only parses arguments, prints (tables.py) and maps errors to exit codes (``EXIT_CODES``);
the work is done where it belongs (ingest/ for compress and restore, chain.py, format.py). Every
command checks its inputs before writing anything: bad input prints one line on stderr naming the
thing and the fix and exits 2, the chain untouched; ``verify`` exits 1 when it finds a problem.
Heavy imports (torch) happen inside the commands so ``ckptzip --help`` stays fast.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import sys
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from .errors import CkptzipError, ConfigError

if TYPE_CHECKING:
    from .chain import CheckpointChain

EXIT_PROBLEMS = 1   # verify found a problem in the chain
EXIT_BAD_INPUT = 2  # the user's input is wrong: one line on stderr, nothing written
# error class -> exit code, first match wins; any other error is a bug and keeps its traceback
EXIT_CODES = ((CkptzipError, EXIT_BAD_INPUT),  # bad input we detected: one line naming the thing and the fix
              (OSError, EXIT_BAD_INPUT))       # a path that is missing, unwritable, a file not a folder, ...

app = typer.Typer(
    name="ckptzip",
    help="Compress deep-learning training checkpoints into a verified chain, and restore any step.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,  # bad input is handled below; anything else is a bug worth a traceback
    rich_markup_mode="rich",
)


@contextlib.contextmanager
def _bad_input():
    """Map the errors a user can cause (``EXIT_CODES``) to one line on stderr and their exit code."""
    try:
        yield
    except (typer.Exit, typer.Abort):
        raise
    except Exception as e:
        code = next((code for cls, code in EXIT_CODES if isinstance(e, cls)), None)
        if code is None:
            raise
        msg = str(e)
        if isinstance(e, OSError) and e.errno is not None and e.filename:  # raised by the OS: say which path
            msg = f"{e.filename}: {e.strerror}; check the path and its permissions"
        typer.echo(f"error: {' '.join(msg.split())}", err=True)  # one line, whatever the message held
        raise typer.Exit(code) from None


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


def _open_chain(url: str, *, read_index: bool = True, base: pathlib.Path | None = None) -> "CheckpointChain":
    from .basestate import BaseWeights
    from .chain import open_chain  # imported here: --help stays fast

    return open_chain(url, read_index=read_index, base=None if base is None else BaseWeights.from_file(base))


BASE_OPTION = typer.Option("--base", help="the model weights (.safetensors or .pt state_dict) the run started "
                           "from: a quantizing method codes the chain's keyframes as residuals against them "
                           "(compress), and decoding them needs the same file (restore, verify)", show_default=False)


def _dcp_root(url: str) -> bool:
    """Whether URL is a torch.distributed.checkpoint root written by ckptzip.dcp (not a chain)."""
    from .dcp.tools import is_root

    return is_root(url)


def _config(text: str | None) -> dict | None:
    """--config: a JSON object of config fields."""
    try:
        obj = None if text is None else json.loads(text)
    except ValueError:
        raise ConfigError(f"--config {text!r} is not valid JSON; pass e.g. '{{\"zstd_level\": 9}}'") from None
    if obj is not None and not isinstance(obj, dict):
        raise ConfigError("--config must be a JSON object of config fields")
    return obj


def _floats(text: str, option: str) -> tuple[float, ...]:
    """A comma-separated list of thresholds in [0, 1), e.g. '0.01,0.05'."""
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or not all(0 <= v < 1 for v in values):
        raise ConfigError(f"{option} {text!r} must be comma-separated thresholds in [0, 1), e.g. 0.01,0.05")
    return values


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
        "--eval", help="module:function returning (model, eval_fn); pretrained:HF_FOLDER judges a pretrained "
                  "encoder's hidden states, the threshold in points of fine-tuned accuracy (pretrained-states-raw:"
                  "HF_FOLDER, pretrained-probe:..., pretrained-retrieval:...: other checks)")] = None,
    higher_is_better: Annotated[bool, typer.Option(
        "--higher-is-better", help="eval_fn is a score, not a loss")] = False,
    checksum: Annotated[Optional[str], typer.Option(
        help="each blob's checksum: blake3 (default), sha256, or crc32 (against accidental corruption only)")] = None,
    base: Annotated[Optional[pathlib.Path], BASE_OPTION] = None,
) -> None:
    """Ingest existing checkpoints, in step order, into a compressed chain."""
    with _bad_input():
        from .ingest.compress import plan, run
        from .tables import totals

        cfg = _config(config)
        with _progress() as prog:
            prog.add_task("checking sources", total=None)
            job = plan(src, out, method, cfg, keyframe_every=keyframe_every, eval_spec=eval_spec,
                       threshold=threshold, higher_is_better=higher_is_better, base=base,
                       **({"checksum": checksum} if checksum else {}))  # else the library's default
        with _progress() as prog:
            task = prog.add_task("compressing", total=len(job.sources))
            entries = run(job, on_source=lambda s: prog.update(
                task, description=f"step {s.step} <- {s.path.name}", completed=job.sources.index(s)))
    steps = [s.step for s in job.sources]
    typer.echo(f"compressed {len(job.sources)} checkpoint(s) (steps {steps[0]}..{steps[-1]}) into {out} with "
               f"{job.method.descriptor}: {totals(entries)}")


@app.command("ls")
def ls_(
    chain_url: Annotated[str, typer.Argument(metavar="CHAIN", help="chain folder or URL", show_default=False)],
    as_json: Annotated[bool, typer.Option("--json", help="print the index entries as JSON")] = False,
) -> None:
    """List a chain's checkpoints (or a DCP root's steps): kind, parent, method, sizes, ratio and what
    the method chose."""
    with _bad_input():
        if _dcp_root(chain_url):
            from .dcp.tools import list_steps
            from .tables import dcp_steps_table

            rows = list_steps(chain_url)
            return typer.echo(json.dumps(rows, indent=1)) if as_json else _out().print(dcp_steps_table(rows, chain_url))
        entries = _open_chain(chain_url).entries()
    if as_json:
        typer.echo(json.dumps([dataclasses.asdict(e) for e in entries], indent=1))
        return
    from .tables import chain_table

    _out().print(chain_table(entries, chain_url))


@app.command()
def inspect(
    chain_url: Annotated[str, typer.Argument(metavar="CHAIN", help="chain folder or URL", show_default=False)],
    step: Annotated[Optional[int], typer.Option(help="step to inspect (default: the latest)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the records as JSON")] = False,
) -> None:
    """Per-tensor view of one checkpoint: role, layer type, dtype, shape, stored bytes, pipeline
    (on a DCP root: one row per rank file, and the tensors' chunk layout with --json)."""
    from .tables import checkpoint_table, dcp_step_table, record_rows

    with _bad_input():
        if _dcp_root(chain_url):
            from .dcp.tools import inspect_step

            info = inspect_step(chain_url, step)
            if as_json:
                return typer.echo(json.dumps({**info, "commit": dataclasses.asdict(info["commit"])}, indent=1))
            return _out().print(dcp_step_table(info, f"step {info['step']} of {chain_url}"))
        chain = _open_chain(chain_url)
        e = chain.entry(step)
        where = chain.storage.path(e.file)
        man = chain.manifest(e.step)
    rows = record_rows(man)
    if as_json:
        typer.echo(json.dumps({"step": e.step, "file": where, "keyframe": e.keyframe, "parent": e.parent,
                               "method": man.get("method"), "config": man.get("config"), "records": rows}, indent=1))
        return
    _out().print(checkpoint_table(e, man, rows, where))


@app.command()
def verify(
    chain_url: Annotated[str, typer.Argument(metavar="CHAIN", help="chain folder or URL", show_default=False)],
    base: Annotated[Optional[pathlib.Path], BASE_OPTION] = None,
) -> None:
    """Check every file's checksums and decode every step; exit 1 on any problem."""
    from .chain import INDEX

    with _bad_input():
        if _dcp_root(chain_url):
            return _verify_dcp(chain_url)
        chain = _open_chain(chain_url, read_index=False, base=base)
    with _bad_input(), _progress() as prog:
        task = prog.add_task("checking files", total=None)

        def progress(step: int, done: int, total: int) -> None:
            prog.update(task, description=f"decoding step {step}", completed=done, total=total)
        problems = chain.verify(deep=True, progress=progress)
    if problems and problems[0].file == chain.storage.path(INDEX):  # a damaged index: nothing else to check
        typer.echo(" ".join(str(problems[0]).split()))
        typer.echo("FAILED: the chain index cannot be read")
        raise typer.Exit(EXIT_PROBLEMS)
    n = len(chain.entries())
    for name in chain.orphans():
        typer.echo(f"warning: {chain.storage.path(name)} is in no index entry (left by an interrupted save); "
                   "it can be deleted", err=True)
    _report(problems, f"{n} checkpoints")


def _verify_dcp(url: str) -> None:
    from .dcp.tools import committed, leftovers, verify as verify_root

    with _progress() as prog:
        prog.add_task("checking and decoding every rank file", total=None)
        problems = verify_root(url)
    for where in leftovers(url):
        typer.echo(f"warning: {where} holds no commit (left by an interrupted save); it can be deleted", err=True)
    _report(problems, f"{len(committed(url))} steps")


def _report(problems: list, what: str) -> None:
    """verify's verdict: one line per problem and FAILED (exit 1), or OK."""
    if problems:
        for p in problems:
            typer.echo(" ".join(f"{p}; {p.fix}".split()) if p.fix else " ".join(str(p).split()))
        typer.echo(f"FAILED: {len(problems)} problem(s) in {what}")
        raise typer.Exit(EXIT_PROBLEMS)
    typer.echo(f"OK: {what} verified")


@app.command()
def restore(
    chain_url: Annotated[str, typer.Argument(metavar="CHAIN", help="chain folder or URL", show_default=False)],
    out: Annotated[pathlib.Path, typer.Option(
        "--out", "-o", show_default=False,
        help="x.pt: the full state as ingested; x.safetensors: model weights only; "
             "a folder: the Trainer checkpoint folder it came from")],
    step: Annotated[Optional[int], typer.Option(help="step to restore (default: the latest)")] = None,
    force: Annotated[bool, typer.Option("--force", help="replace OUT if it exists")] = False,
    base: Annotated[Optional[pathlib.Path], BASE_OPTION] = None,
) -> None:
    """Rebuild one checkpoint from the chain and write it as a .pt, .safetensors or folder (a DCP
    root: its whole state consolidated, as dcp_to_torch_save does, into a .pt or .safetensors)."""
    with _bad_input():
        from .ingest import check_output, write_restored

        if _dcp_root(chain_url):
            from .dcp.tools import restore_file

            check_output(out, force=force)
            with _progress() as prog:
                prog.add_task("decoding every rank file", total=None)
                got = restore_file(chain_url, str(out), step)
            return typer.echo(f"restored step {got['step']} -> {out} ({got['tensors']} tensors, {got['format']})")
        chain = _open_chain(chain_url, base=base)
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
def jit(
    method: Annotated[list[str], typer.Argument(help="methods whose kernels to compile [default: dynaquant lossless]")] = [],
) -> None:
    """Compile the methods' numba kernels into numba's disk cache now (e.g. while building an
    image), in a child process as a chain's first save would."""
    from . import jitcache
    from .methods.base import method_class

    names = method or ["dynaquant", "lossless"]
    with _bad_input():
        for name in names:
            method_class(name)  # an unknown method: its one-line error here, not the child's
    if not jitcache.enabled():
        typer.echo(f"nothing to compile: numba is not installed, or {jitcache.ENV}=inprocess / NUMBA_DISABLE_JIT=1")
        return
    jitcache.compile_kernels(names)
    missing = [n for n in names if not os.path.exists(jitcache.stamp_path(n))]
    if missing:
        typer.echo(f"error: the compile child failed for {', '.join(missing)} (its last line is above)", err=True)
        raise typer.Exit(1)
    typer.echo(f"compiled into {jitcache.cache_dir()}: {', '.join(names)}")


@app.command()
def demo(
    workload: Annotated[list[str], typer.Option("--workload", "-w", help="digits, gpt2, minilm (repeatable)")] = [],
    methods: Annotated[str, typer.Option("--methods", "-m", help="comma-separated methods")] = "",
    failures: Annotated[Optional[int], typer.Option("--failures", "-f", min=0,
                                                    help="simulated failures per run [default: 10; minilm 3]")] = None,
    full: Annotated[bool, typer.Option("--full", help="longer, larger runs")] = False,
    threshold: Annotated[float, typer.Option("--threshold", help="quality budget of each run, end to end over its restores")] = 0.01,
    out: Annotated[str, typer.Option("--out", "-o", help="report folder")] = "demo-report",
    transfer: Annotated[bool, typer.Option("--transfer", help="transfer-learning study (MiniLM)")] = False,
    async_save: Annotated[bool, typer.Option("--async", help="save through the asynchronous engine")] = False,
    paced: Annotated[Optional[bool], typer.Option(
        "--paced/--no-paced", help="save intervals where training dominates (digits every 1000 steps, GPT-2 "
                                   "every 96; 3 failures) [default: with --async]")] = None,
    transfer_check: Annotated[Optional[str], typer.Option(
        "--transfer-check", help="quality check for --transfer: states | states-raw | probe | retrieval [default: states]")] = None,
    transfer_space: Annotated[str, typer.Option(
        "--transfer-space", help="search space for --transfer: pretrained | paper | finetune")] = "pretrained",
    transfer_thresholds: Annotated[str, typer.Option(
        "--transfer-thresholds", help="comma-separated thresholds for --transfer")] = "0.01,0.05",
    seeds: Annotated[int, typer.Option("--seeds", min=1, help="fine-tuning seeds per row for --transfer")] = 1,
) -> None:
    """Fault-tolerant training on real workloads with compressed checkpoints (the main job)."""
    from .demo import run as demo_run

    with _bad_input():
        if transfer:
            demo_run.transfer(out=out, thresholds=_floats(transfer_thresholds, "--transfer-thresholds"),
                              check=transfer_check, space=transfer_space, seeds=tuple(range(seeds)))
            return
        demo_run.main(workloads=tuple(workload) or demo_run.DEFAULT_WORKLOADS,
                      methods=[m for m in methods.split(",") if m] or None, failures=failures, full=full,
                      out=out, threshold=threshold, async_save=async_save, paced=paced)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point (``ckptzip = ckptzip.cli:main``)."""
    app(args=argv, prog_name="ckptzip")
