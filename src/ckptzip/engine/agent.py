"""The checkpoint agent: a separate OS process that compresses staged slots into the chain.

Started by :class:`~ckptzip.engine.engine.AsyncCheckpointEngine` as ``python -m
ckptzip.engine.agent`` in its own session (``start_new_session``: a signal to the trainer's process
group, or a SIGKILL of the trainer, leaves it running). Only simple data crosses the process
boundary, as JSON lines:

    stdin, first line     the spec: url, method name + config dict, keyframe / retention policies,
                          storage options, chain key, rank, trainer pid, agent options
    stdin, then           {"op": "commit", "slot": i, "seq": n, "step": s}
                          {"op": "truncate", "step": s}        (drop committed steps after s)
                          {"op": "close"}                      (finish the queue, exit)
    stdout                {"ev": "ready" | "committed" | "failed" | "truncated" | "fatal" | "closed", ...}

Call order in one life:

    1. read the spec, import ``agent_imports`` (custom methods and fsspec filesystems register
       themselves there), lock byte 1 of the control block, build the chain, say "ready"; a
       searching method with ``agent_eval`` builds its (model, eval_fn) now, before the first commit
    2. per "commit": check the slot still holds that seq and is complete, verify its checksum (or
       compute it, when the trainer left that to the agent), build
       a FlatState whose tensors *view* the slot, ``chain.save`` it with an EncodeContext rebuilt
       from the slot (model and eval_fn cannot cross a process boundary: with ``agent_eval`` the
       agent builds its own once, and a searching method searches here), mark the slot
       COMMITTED, report the entry; on any error mark it FAILED and report the traceback. A step
       already in the chain is reported committed again (a restarted agent may be asked twice).
    3. trainer gone (stdin EOF or parent pid changed) -> orphan mode: finish the commands already
       queued, then commit every complete, uncommitted slot newer than the chain, then linger
       ``orphan_linger_s`` for a restarted trainer; a takeover request in the control block makes
       it exit at once, *leaving* the segments to the new owner; otherwise it unlinks them and exits.

Nothing is logged and forgotten: every failure goes back to the trainer as an event with its
traceback (the engine re-raises it as :class:`~ckptzip.errors.AgentError`).
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
import queue
import sys
import threading
import time
import traceback


class _Agent:
    def __init__(self, spec: dict, out):
        from ..chain import CheckpointChain, KeyframePolicy, RetentionPolicy
        from ..format import DEFAULT_CHECKSUM
        from ..methods.base import get_method
        from . import staging

        self.spec, self.out = spec, out
        self.key, self.rank = spec["key"], int(spec["rank"])
        self.trainer_pid = int(spec["trainer_pid"])
        self.opts = spec["options"]
        self.staging = staging
        self.ctl = staging.Control(self.key, self.rank)
        if not self.ctl.lock_wait(staging.AGENT_BYTE, float(self.opts["agent_start_timeout_s"])):
            raise TimeoutError(f"another agent (pid {self.ctl.agent_pid}) still owns {self.ctl.name}")
        self.ctl.agent_pid = os.getpid()
        method = get_method(spec["method"], spec.get("config") or None)
        self.chain = CheckpointChain(spec["url"], method,
                                     keyframe=KeyframePolicy(**spec["keyframe"]) if spec.get("keyframe") else None,
                                     retention=RetentionPolicy(**spec["retention"]) if spec.get("retention") else None,
                                     storage_options=spec.get("storage_options"),
                                     takeover=bool(spec.get("takeover")),
                                     checksum=spec.get("checksum", DEFAULT_CHECKSUM), base=self._base(spec.get("base")))
        self.evaluator = None  # (model, eval_fn) from options.agent_eval, built once ready (serve)
        self.segments: dict[int, object] = {}
        self.trainer_gone = False
        self.inbox: queue.Queue = queue.Queue()

    @staticmethod
    def _base(staged: dict | None):
        """The trainer's base weights, from the file it staged (engine._stage_base), checked by digest."""
        if not staged:
            return None
        from ..basestate import BaseWeights
        from ..errors import BaseMismatchError

        base = BaseWeights.from_file(staged["file"])
        if base.digest != staged["digest"]:
            raise BaseMismatchError(f"the agent read base weights {base.digest[:16]} from {staged['file']}, "
                                    f"not the trainer's {staged['digest'][:16]}; do not modify that file")
        return base

    # --- io -------------------------------------------------------------------------------
    def emit(self, **ev) -> None:
        if self.trainer_gone:
            return
        try:
            self.out.write(json.dumps(ev) + "\n")
            self.out.flush()
        except (BrokenPipeError, OSError, ValueError):
            self.trainer_gone = True

    def _read_stdin(self) -> None:
        for line in sys.stdin:
            line = line.strip()
            if line:
                self.inbox.put(json.loads(line))
        self.inbox.put(None)  # EOF: the trainer closed the pipe or died

    def _parent_alive(self) -> bool:
        return os.getppid() == self.trainer_pid

    # --- main loop ------------------------------------------------------------------------
    def serve(self) -> int:
        threading.Thread(target=self._read_stdin, daemon=True, name="ckptzip-agent-stdin").start()
        self.emit(ev="ready", pid=os.getpid())
        if self._searches():
            # build it now, while the trainer trains towards its first save (a model and its data
            # take seconds: GPT-2 imports transformers); a failure is reported by the first commit
            try:
                self._evaluator()
            except Exception:
                pass
        while True:
            try:
                cmd = self.inbox.get(timeout=0.25)
            except queue.Empty:
                if not self._parent_alive():
                    return self.orphan()
                continue
            if cmd is None:
                return self.orphan()
            op = cmd.get("op")
            if op == "commit":
                self.commit(int(cmd["slot"]), int(cmd["seq"]), int(cmd["step"]))
            elif op == "truncate":
                self.truncate(int(cmd["step"]))
            elif op == "close":
                self.emit(ev="closed")
                return 0

    def _searches(self) -> bool:
        from ..methods.base import searches

        return bool(self.opts.get("agent_eval")) and searches(self.chain.method)

    def _evaluator(self) -> tuple:
        """(model, eval_fn) from ``options.agent_eval``, built once."""
        if self.evaluator is None:
            from ..ingest.compress import load_eval

            self.evaluator = load_eval(self.opts["agent_eval"], "EngineOptions.agent_eval")
        return self.evaluator

    def orphan(self) -> int:
        """The trainer is gone: commit what it staged, wait for a successor, then clean up."""
        self.trainer_gone = True
        while True:  # commands it sent before dying
            if self._takeover_requested():
                return 0
            try:
                cmd = self.inbox.get_nowait()
            except queue.Empty:
                break
            if cmd and cmd.get("op") == "commit":
                self.commit(int(cmd["slot"]), int(cmd["seq"]), int(cmd["step"]))
        for i, info in self._uncommitted():  # staged, but the trainer died before sending the command
            if self._takeover_requested():
                return 0
            self.commit(i, info.seq, info.step)
        deadline = time.monotonic() + float(self.opts["orphan_linger_s"])
        while time.monotonic() < deadline:
            if self._takeover_requested():
                return 0  # the new owner keeps the segments
            time.sleep(0.05)
        if self._takeover_requested():
            return 0
        self._close_segments()
        self.staging.unlink_chain(self.key, self.rank, max(self.ctl.n_slots, int(self.opts["redundancy"])))
        return 0

    def _takeover_requested(self) -> bool:
        return self.ctl.takeover_pid != 0

    def _uncommitted(self):
        st = self.staging
        try:
            steps = self.chain.steps()
        except Exception:
            steps = []
        latest = steps[-1] if steps else -1
        found = []
        for i in range(max(self.ctl.n_slots, int(self.opts["redundancy"]))):
            seg = self._segment(i)
            if seg is None:
                continue
            info = st.read_header(seg)
            if info.usable and info.state == st.STAGED and info.step > latest:  # FAILED ones were reported
                found.append((i, info))
        return sorted(found, key=lambda x: x[1].step)

    # --- slots ----------------------------------------------------------------------------
    def _segment(self, i: int):
        st = self.staging
        seg = self.segments.get(i)
        if seg is not None and not seg.stale():
            return seg
        if seg is not None:
            seg.close()
            del self.segments[i]
        try:
            seg = st.Segment(st.slot_name(self.key, self.rank, i))
        except FileNotFoundError:
            return None
        self.segments[i] = seg
        return seg

    def _close_segments(self) -> None:
        for seg in self.segments.values():
            seg.close()
        self.segments.clear()

    # --- work -----------------------------------------------------------------------------
    def commit(self, slot: int, seq: int, step: int) -> None:
        from ..errors import CorruptCheckpointError, StepOrderError

        st = self.staging
        seg = None
        try:
            seg = self._segment(slot)
            if seg is None:
                raise FileNotFoundError(f"slot {slot} ({st.slot_name(self.key, self.rank, slot)}) does not exist")
            info = st.read_header(seg)
            if not info.valid or info.seq != seq or info.step != step:
                raise RuntimeError(f"slot {seg.name} no longer holds step {step} (seq {seq}): it was overwritten "
                                   "or torn before the agent reached it")
            if not st.ensure_checksum(seg, info):
                raise CorruptCheckpointError(f"slot {seg.name} (step {step}) fails its checksum; not committed")
            entries = self.chain.entries(refresh=True)
            done = next((e for e in entries if e.step == step), None)
            if done is not None:  # committed by an earlier life of the agent that died before reporting
                st.set_state(seg, st.COMMITTED)
                self.emit(ev="committed", seq=seq, step=step, entry=dataclasses.asdict(done), again=True)
                return
            if entries and step < entries[-1].step:
                raise StepOrderError(f"step {step} is older than the chain's latest step {entries[-1].step}; "
                                     "it was superseded and is not committed")
            entry = self._encode(seg, info, step)
            st.set_state(seg, st.COMMITTED)
            self.emit(ev="committed", seq=seq, step=step, entry=dataclasses.asdict(entry))
        except Exception as e:
            if seg is not None:
                try:
                    if st.read_header(seg).seq == seq:
                        st.set_state(seg, st.FAILED)
                except Exception:
                    pass
            self.emit(ev="failed", seq=seq, step=step, error=f"{type(e).__name__}: {e}",
                      exc_type=type(e).__name__, errno=getattr(e, "errno", None), traceback=traceback.format_exc())

    def _encode(self, seg, info, step: int):
        from ..methods.base import EncodeContext

        flat, aux, meta = self.staging.load_slot(seg, info, clone=False)
        try:
            fields = {f.name for f in dataclasses.fields(EncodeContext)} - {"step", "model", "eval_fn"}
            kwargs = {}
            for k, v in (meta.get("ctx") or {}).items():
                if k not in fields:
                    continue
                if isinstance(v, dict) and "__aux__" in v:  # a dict of tensors staged beside the state
                    v = {p: aux[n] for p, n in v["__aux__"].items()}
                kwargs[k] = v
            if self._searches():
                kwargs["model"], kwargs["eval_fn"] = self._evaluator()
            entry = self.chain.save(flat, step, ctx=EncodeContext(step=step, **kwargs))
        finally:
            del flat, aux
        self._drop_aliased_reference(seg)
        return entry

    def _drop_aliased_reference(self, seg) -> None:
        """Methods must not keep the input's tensors in their reference (all built-in ones copy).

        A reference that still views the slot would change under the next save's copy; drop it so
        the chain rebuilds the reference from storage instead (slower, never wrong).
        """
        import torch

        base = seg.tensor(torch.uint8, (seg.size,), 0)
        lo, hi = base.data_ptr(), base.data_ptr() + seg.size
        del base
        if any(lo <= t.untyped_storage().data_ptr() < hi for t in self.chain.reference_tensors()):
            self.chain.forget_reference()

    def truncate(self, step: int) -> None:
        """Roll the chain back to ``step`` (a distributed restore agreed on an older step)."""
        try:
            dropped = self.chain.truncate(step)
            self.emit(ev="truncated", step=step, dropped=dropped)
        except Exception as e:
            self.emit(ev="truncated", step=step, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())

    def close(self) -> None:
        self._close_segments()
        try:
            self.chain.close()
        finally:
            self.ctl.close()


def main() -> int:
    # events go to the original stdout; anything else printed (libraries, warnings) goes to stderr
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        spec = json.loads(sys.stdin.readline())
        opts = spec["options"]
        sys.path.extend(p for p in spec.get("sys_path", []) if p not in sys.path)  # the trainer's, for imports
        for mod in opts.get("agent_imports") or ():
            importlib.import_module(mod)
        # torch's thread count: OMP_NUM_THREADS, which the supervisor sets (EngineOptions.threads)
        agent = _Agent(spec, out)
    except BaseException as e:
        try:
            out.write(json.dumps({"ev": "fatal", "error": f"{type(e).__name__}: {e}", "exc_type": type(e).__name__,
                                  "traceback": traceback.format_exc()}) + "\n")
            out.flush()
        except OSError:
            pass
        return 1
    try:
        return agent.serve()
    finally:
        agent.close()


if __name__ == "__main__":
    rc = main()
    sys.stderr.flush()
    os._exit(rc)  # everything is committed and reported; skip the interpreter's (torch's) slow teardown
