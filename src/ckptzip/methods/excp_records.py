"""What the files of both ExCP methods share: the payload blob with its spans, and joint records.

payload  ONE shared blob ``"payload"`` = the payload stage applied to a concatenation of byte
         strings; ``method_meta["payload"] = {"stage": descriptor, "raw_bytes": n}`` (stage
         ``xz/1``; ``excp-fixed`` keeps the smaller of ``xz/1`` and ``zstd-frame/1``). A record
         whose pipeline ends in ``span/1`` reads its bytes at ``meta.span`` (a parameter's parts:
         ``meta.spans``) = ``[offset, length]`` of the decompressed payload.
joint    the ``exp_avg`` / ``exp_avg_sq`` records of a parameter with Adam state have no bytes of
         their own (``joint/1``, meta ``{"of": weight record, "part": "m" | "v"}``): the weight
         record decodes all three.

A *parameter with Adam state* (:func:`adam_parameters`) is a parameter of ``FlatState.params()``
with a float weight record and float ``exp_avg`` and ``exp_avg_sq`` records of its shape; nothing
is exempt by name. The reference (:class:`ExcpReference`) holds the reconstructed weights.

Files of ckptzip 0.1 wrote ``raw/1, <payload stage>`` for bytes at a span (now ``exact/1, span/1``),
``excp-tensor/1, ...`` for joint records (now ``joint/1``) and, in ``excp-fixed``, ``zstd/1`` for
the zstd payload stage (now ``zstd-frame/1``); :func:`is_span` and :func:`is_joint` read both.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from ..codec import stages as S
from ..errors import ConfigError, CorruptCheckpointError
from ..quant.excp import apply_residual
from ..state import FlatState, TensorRecord
from .base import Encoded, Reference

PAYLOAD = "payload"   # shared blob keys: not starting with a digit, the chain counts them as "shared"
CODES = "codes"
SPAN = S.pipeline(S.EXACT, S.SPAN)
JOINT = S.JOINT.descriptor
_JOINT_V1 = (S.EXCP_TENSOR_V1.descriptor, S.KMEANS_NONZERO.descriptor)


@dataclass(frozen=True)
class ExcpReference(Reference):
    """The reconstructed weights W~ (residuals are taken against them); ``excp`` also keeps the
    base's step tensors and param_groups, which its deltas restore (methods/excp.py)."""

    weights: Mapping[str, torch.Tensor]
    base: Mapping[str, torch.Tensor] = field(default_factory=dict)
    groups: object = None

    def tensors(self) -> Iterator[torch.Tensor]:
        yield from self.weights.values()
        yield from self.base.values()


def checked_reference(reference: Reference | None, method: str) -> ExcpReference | None:
    if reference is not None and not isinstance(reference, ExcpReference):
        raise ConfigError(f"{method} was given a reference it did not make ({type(reference).__name__}); pass the "
                          "Reference its encode/decode returned, or None for a keyframe")
    return reference


def open_file(encoded: Encoded, reference: Reference | None, method: str) -> tuple[bytes, ExcpReference | None]:
    """(the decompressed payload, the parent's reference) of a file about to be decoded; a delta
    decoded without its parent's reference is refused."""
    raw = read_payload(encoded)
    prev = checked_reference(reference, method)
    if not encoded.keyframe and prev is None:
        raise CorruptCheckpointError(f"{method} delta checkpoint decoded without its parent's reference")
    return raw, prev


class SpanWriter:
    """One growing byte string; ``add`` returns the ``[offset, length]`` of what it appended."""

    def __init__(self):
        self._parts: list[bytes] = []
        self.n = 0

    def add(self, data: bytes) -> list[int]:
        span = [self.n, len(data)]
        self._parts.append(data)
        self.n += len(data)
        return span

    def getvalue(self) -> bytes:
        return b"".join(self._parts)


def cut(raw: bytes | memoryview, span, what: str) -> bytes:
    """The bytes of ``span`` in the decompressed payload."""
    try:
        off, n = int(span[0]), int(span[1])
    except (TypeError, ValueError, IndexError, KeyError):
        raise CorruptCheckpointError(f"{what}: malformed span {span!r}") from None
    if off < 0 or n < 0 or off + n > len(raw):
        raise CorruptCheckpointError(f"{what}: span [{off}, {n}] lies outside the {len(raw)}-byte payload")
    return bytes(raw[off:off + n])


def write_payload(enc: Encoded, raw: bytes, stage: S.Stage, data: bytes | None = None) -> None:
    """The payload blob (``data``: already compressed by ``stage``) and its method_meta entry."""
    enc.blobs[PAYLOAD] = S.encode([stage], raw) if data is None else data
    enc.meta["payload"] = {"stage": stage.descriptor, "raw_bytes": len(raw)}


def read_payload(encoded: Encoded) -> bytes:
    """The decompressed payload of an ExCP file."""
    info = encoded.meta.get("payload")
    if not isinstance(info, dict) or PAYLOAD not in encoded.blobs:
        raise CorruptCheckpointError("ExCP checkpoint lacks its payload blob or its method_meta['payload']")
    stage, n = info.get("stage"), info.get("raw_bytes")
    if not isinstance(n, int) or n < 0:
        raise CorruptCheckpointError(f"ExCP payload size {n!r} is malformed")
    s = S.ZSTD_FRAME if stage == S.ZSTD_LEGACY.descriptor else S.STAGES.get(stage)  # zstd/1: 0.1's name
    if s not in (S.XZ, S.ZSTD_FRAME):
        raise CorruptCheckpointError(f"ExCP payload has unknown stage {stage!r}")
    raw = S.decode([s], encoded.blobs[PAYLOAD], max_bytes=n, what="ExCP payload")
    if len(raw) != n:
        raise CorruptCheckpointError(f"ExCP payload holds {len(raw)} bytes, its meta says {n}")
    return raw


def is_span(pipe: list) -> bool:
    """Bytes at meta.span of the payload: ``exact/1, span/1`` (0.1: ``raw/1, <payload stage>``)."""
    return pipe == SPAN or (len(pipe) == 2 and pipe[0] == S.RAW.descriptor)


def is_joint(pipe: list, meta: dict) -> bool:
    """An exp_avg / exp_avg_sq record decoded with its weight (0.1 named the weight's first stage)."""
    return pipe[0] == JOINT or (pipe[0] in _JOINT_V1 and "excp" not in meta)


def record_meta(encoded: Encoded, name: str) -> tuple[list, dict]:
    """(pipeline, meta) of a record, or CorruptCheckpointError."""
    r = encoded.records.get(name)
    if not isinstance(r, dict) or not isinstance(r.get("pipeline"), list) or not r["pipeline"]:
        raise CorruptCheckpointError(f"record {name!r} has no pipeline in this ExCP checkpoint")
    meta = r.get("meta") or {}
    if not isinstance(meta, dict):
        raise CorruptCheckpointError(f"record {name!r} has malformed meta")
    return r["pipeline"], meta


def check(name: str, t: torch.Tensor, rec: TensorRecord) -> torch.Tensor:
    """``t`` if it has the record's shape and dtype, else CorruptCheckpointError."""
    if tuple(t.shape) != tuple(rec.shape) or str(t.dtype).removeprefix("torch.") != rec.dtype:
        raise CorruptCheckpointError(f"record {name!r} decodes to {t.dtype}{list(t.shape)}, "
                                     f"its manifest says {rec.dtype}{list(rec.shape)}")
    return t


def add_residual(name: str, w_prev: torch.Tensor | None, dw: torch.Tensor, rec: TensorRecord) -> torch.Tensor:
    """The record's weight W~_{t-1} + dW^ on dW's device, or CorruptCheckpointError when the parent
    lacks the weight or it, the residual and the manifest disagree on the shape."""
    if w_prev is None or tuple(w_prev.shape) != tuple(rec.shape) or tuple(dw.shape) != tuple(rec.shape):
        held = "no such weight" if w_prev is None else f"a weight of shape {list(w_prev.shape)}"
        raise CorruptCheckpointError(f"record {name!r} is an ExCP residual of shape {list(dw.shape)} for a "
                                     f"{list(rec.shape)} weight; its parent holds {held}")
    return check(name, apply_residual(w_prev.to(dw.device), dw), rec)


def adam_parameters(state: FlatState) -> dict[str, tuple[str, str]]:
    """weight record name -> (exp_avg record, exp_avg_sq record), for every parameter with Adam state
    (``FlatState.params()``): a float weight whose moments are float and of its shape."""
    out = {}
    for p in state.params().values():
        names = (p.weight, p.moments.get("exp_avg"), p.moments.get("exp_avg_sq"))
        if None in names:
            continue
        w, m, v = (state.records[n] for n in names)
        if w.is_float and m.is_float and v.is_float and w.shape == m.shape == v.shape:
            out[w.name] = (m.name, v.name)
    return out


def add_joint(enc: Encoded, wname: str, mname: str, vname: str, tail: dict[str, list[str]] | None = None) -> None:
    """The two moment records of parameter ``wname`` (``tail``: stages after ``joint/1`` per part)."""
    tail = tail or {}
    enc.add(mname, [JOINT, *tail.get("m", [])], {"of": wname, "part": "m"})
    enc.add(vname, [JOINT, *tail.get("v", [])], {"of": wname, "part": "v"})


def assign_joint(later: list, moments: dict[str, tuple[torch.Tensor, torch.Tensor]], out: dict) -> None:
    """Give each joint record (name, rec, meta) its part of the decoded parameter named in meta.of."""
    for name, rec, meta in later:
        pair = moments.get(meta.get("of"))
        if pair is None or meta.get("part") not in ("m", "v"):
            raise CorruptCheckpointError(f"record {name!r} names no decoded ExCP parameter ({meta.get('of')!r})")
        out[name] = check(name, pair[0] if meta["part"] == "m" else pair[1], rec)


def weight_records(records: dict[str, TensorRecord]) -> list[str]:
    return [n for n, r in records.items() if r.role == "weight"]


def clone(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


def stored(tmeta: dict) -> dict:
    """The tensor meta without its pruning figures: the manifest is uncompressed JSON, and the
    figures only feed the checkpoint's summary (``w_kept``, ``m_kept``)."""
    return {k: v for k, v in tmeta.items() if k != "prune"}


def summary(prune_facts: list[dict]) -> dict:
    n = sum(p["numel"] for p in prune_facts)
    if not n:
        return {}
    return {"w_kept": round(sum(p["w_kept"] for p in prune_facts) / n, 4),
            "m_kept": round(sum(p["m_kept"] for p in prune_facts) / n, 4)}
