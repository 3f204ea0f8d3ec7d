"""Methods ``excp`` (the paper, faithfully) and ``excp-fixed`` (ours): ExCP residual checkpoints.

ExCP (Li et al., 2024; paper 003) stores each parameter that has Adam state as a residual against
the *reconstructed* previous weights, jointly pruned with its moments and 4-bit k-means quantized;
the tensor core (eq. 5/6 masks, k-means, nibble packing) is quant/excp.py. This module puts it in
a chain. Per parameter ``P`` at checkpoint t::

    dW = W_t - W~_{t-1}                          float32 (quant/excp.residual)
    blobs, meta = encode_tensor(dW, m_t, v_t)    masks, k-means, codes, codebooks
    W~_t = W~_{t-1} + dequant(dW^)               back in the weight dtype; m^, v^ = dequant (0 if pruned)

The reference is ``{"w": {weight record: W~}, "base": {...}, "groups": ...}`` -- exactly what
``decode`` rebuilds: the encoder decodes its own residual to get W~_t, so encoder and decoder stay
in lockstep bit for bit. A *parameter with Adam state* is a ``weight`` record whose parameter
(``TensorRecord.param``) has exactly one ``exp_avg`` and one ``exp_avg_sq`` record of its shape;
nothing is exempt by name. Everything else (buffers, Adam ``step`` tensors, ints, RNG states,
weights without optimizer state, a parameter new since the reference) is stored exactly.

Deltas chain (``Reference.step`` = the previous step): restoring step t replays every file from the
nearest keyframe (the paper's Algorithm 3); the chain's KeyframePolicy starts a new base every K saves.

``excp`` -- faithful, quirks included:

- keyframe (reference None): the full state, uncompressed -- raw bytes inside the LZMA payload
  (the paper starts from an uncompressed base checkpoint; only deltas are compressed).
- codebooks fp16 (``EXCP_FAITHFUL``: small exp_avg_sq centers flush to 0, see quant/excp.py).
- the optimizer's step counts and hyper-parameters (lr, ...) on restore are the BASE's: the
  authors rebuild the optimizer from the base checkpoint and load only the moments. Deltas store
  no ``step`` tensors (decoded as the keyframe's values, kept in the reference), and the delta's
  optimizer ``param_groups`` (lr, betas, weight decay, ...) are replaced by the keyframe's in the
  file's skeleton (``Encoded.skeleton``: the chain stores it instead of the state's; the input
  state is never modified).
- final stage: xz (LZMA2, preset 9 | extreme) over the whole checkpoint payload.

``excp-fixed`` -- ours, beside it: fp32 codebooks; step counts and lr from the checkpoint itself;
a compressed keyframe (weights lossless byte-grouped + zstd, or 4-bit k-means against zero, see
``ExcpFixedConfig.keyframe_weights``; exp_avg / exp_avg_sq k-means quantized without masks); and a
code stage that exploits the masks' nesting (support(v^) <= support(m^) <= support(dW^)): each
child part's codes are stored only where its parent part is non-zero, split into sub-streams by
the parent's code (static conditional coding), and every stream kind keeps the smallest of
ANS / Huffman / xz / zstd-19 per checkpoint.

Tied tensors (GPT-2's ``lm_head.weight`` is ``wte.weight``) are one record already: flatten_state
writes the second name as an alias in the skeleton, so the restore shares the decoded value.

Payload layout. ``excp``: ONE shared blob ``"payload"`` = xz(concatenation of byte spans); records
have no blobs of their own and carry ``[offset, length]`` spans into the decompressed payload in
their meta; ``method_meta["payload"] = {"stage": "xz/1", "raw_bytes": n}``. A parameter's spans
are quant/excp's blobs (``dw.codes``, ``dw.codebook`` or ``dw.dense``, same for ``m``, ``v``).
``excp-fixed``: ``"payload"`` (codebooks, dense parts, small exact tensors; xz or zstd-19,
whichever is smaller, in ``method_meta["payload"]["stage"]``); ``"codes"``, the code sub-streams:
``method_meta["streams"][kind] = {"coder", "subs": {context: [offset, length, n_codes]}}`` for
kind dw / m / v. Context 0: a part coded at every element; 1..2**bits-1: the codes of a child part
(m under dW, v under m) where the parent's code is that value (only the parent's non-zeros are
coded); 2**bits: under a dense parent. Each sub-stream concatenates its parameters in sorted
weight-record order. Plus one ``<i>.data`` blob per large exact tensor (``exact/1, bytegroup/1``,
base.encode_exact), the keyframe's weights among them.

Record pipelines (the first entry says how to decode)::

    excp        keyframe record            raw/1, xz/1                  meta {"span"}
                weight (delta)             excp-residual/1, excp-tensor/1, xz/1
                                           meta {"excp": tensor meta, "spans": {"dw.codes": span, ...}}
                its exp_avg / exp_avg_sq   excp-tensor/1, xz/1          meta {"of": weight record, "part": "m"|"v"}
                optimizer step (delta)     excp-base/1                  no bytes: the keyframe's value
                anything else (delta)      raw/1, xz/1
    excp-fixed  weight (delta)             excp-residual/1, excp-tensor/1, excp-codes/1, <coder>/1
                weight (keyframe)          exact/1, bytegroup/1  |  kmeans-nonzero/1, excp-codes/1, <coder>/1
                                           meta {"excp": {..., "parts": {p: {"mode", "nnz", "cond", "span"}}}}
                exp_avg / exp_avg_sq       excp-tensor/1 | kmeans-nonzero/1, excp-codes/1, <coder>/1
                small exact tensor         raw/1, xz/1 | zstd/1         meta {"span"} into the payload
                large exact float tensor   exact/1, bytegroup/1

<coder> is ans, huffman, xz or zstd (zstd-19 / xz over the packed codes of the sub-streams).
"""
from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
import zstandard

from ..errors import ConfigError, CorruptCheckpointError
from ..quant.excp import (FORMAT as TENSOR_FORMAT, PARTS, ExcpConfig, apply_residual, decode_tensor,
                          encode_tensor, lzma_compress, lzma_decompress, pack_codes, quantize_nonzeros, residual,
                          unpack_codes)
from ..state import FlatState, TensorRecord
from ..tensorbytes import tensor_from_bytes, tensor_to_bytes, torch_dtype
from .base import (EXACT_PIPELINE, DecodeContext, EncodeContext, Encoded, Method, Reference, decode_exact, encode_exact,
                   register)

PAYLOAD = "payload"   # shared blob keys: not starting with a digit, the chain counts them as "shared"
CODES = "codes"
RAW = "raw/1"
XZ = "xz/1"
RESIDUAL = "excp-residual/1"
TENSOR = "excp-tensor/1"
FROM_BASE = "excp-base/1"
KMEANS = "kmeans-nonzero/1"
STREAMS = "excp-codes/1"
KEYFRAME_FORMAT = "excp-keyframe/1"  # joint meta of a fixed keyframe's parts (no residual)
CODERS = ("ans", "huffman", "xz", "zstd")
_STAGE = "<payload stage>"           # placeholder until the payload's stage is chosen
_PARENT = {"m": "dw", "v": "m"}      # v's support lies in m's, m's in dW's (eq. 6 nests the masks)


@dataclass(frozen=True)
class ExcpReference(Reference):
    """The reconstructed weights W~ (residuals are taken against them); ``excp`` also keeps the
    base's step tensors and param_groups, which its deltas restore (see the module docstring)."""

    weights: Mapping[str, torch.Tensor]
    base: Mapping[str, torch.Tensor] = field(default_factory=dict)
    groups: object = None

    def tensors(self) -> Iterator[torch.Tensor]:
        yield from self.weights.values()
        yield from self.base.values()


@dataclass(frozen=True)
class ExcpFixedConfig:
    alpha: float = 5e-5                  # eq. 5 (as ExcpConfig)
    beta: float = 2.0                    # eq. 6
    bits: int = 4                        # 2**bits - 1 centers + code 0
    codebook_dtype: str = "float32"      # fp32: keeps exp_avg_sq centers fp16 would flush to 0
    seed: int = 0
    kmeans_max_iter: int = 50
    keyframe_weights: str = "lossless"   # "lossless": byte-grouped + zstd, exact (bench/excp.py: the
                                         # 4-bit alternative costs eval loss at every keyframe);
                                         # "kmeans": 4-bit k-means against zero, errors fed back by deltas
    coders: tuple[str, ...] = CODERS     # candidates per code-stream kind; the smallest is kept
    exact_zstd_level: int = 9            # byte-grouped exact tensors (level 19: +0.3% smaller, ~50x slower)
    exact_min_bytes: int = 4096          # smaller exact tensors go raw into the payload instead

    def __post_init__(self):
        self.tensor_config()  # validates the shared fields with ExcpConfig's messages
        if self.keyframe_weights not in ("lossless", "kmeans"):
            raise ConfigError(f"ExcpFixedConfig.keyframe_weights must be 'lossless' or 'kmeans', "
                              f"got {self.keyframe_weights!r}")
        if not self.coders or any(c not in CODERS for c in self.coders):
            raise ConfigError(f"ExcpFixedConfig.coders must be a non-empty subset of {CODERS}, got {self.coders!r}")
        if not (isinstance(self.exact_zstd_level, int) and 1 <= self.exact_zstd_level <= 22):
            raise ConfigError(f"ExcpFixedConfig.exact_zstd_level must be an int in 1..22, "
                              f"got {self.exact_zstd_level!r}")
        if not (isinstance(self.exact_min_bytes, int) and self.exact_min_bytes >= 0):
            raise ConfigError(f"ExcpFixedConfig.exact_min_bytes must be an int >= 0, got {self.exact_min_bytes!r}")

    def tensor_config(self) -> ExcpConfig:
        return ExcpConfig(alpha=self.alpha, beta=self.beta, bits=self.bits, codebook_dtype=self.codebook_dtype,
                          seed=self.seed, kmeans_max_iter=self.kmeans_max_iter)


# ---------------------------------------------------------------------------------------------
# shared helpers
# ---------------------------------------------------------------------------------------------
def adam_parameters(records: dict[str, TensorRecord]) -> dict[str, tuple[str, str]]:
    """weight record name -> (exp_avg record, exp_avg_sq record), for every parameter with Adam state.

    Found through ``TensorRecord.param`` links; a parameter with several moment records of a
    role (two optimizers over one parameter) or a shape mismatch is left out (stored exactly).
    """
    moments: dict[str, dict[str, list[str]]] = {}
    for r in records.values():
        if r.role in ("exp_avg", "exp_avg_sq") and r.param is not None:
            moments.setdefault(r.param, {}).setdefault(r.role, []).append(r.name)
    out = {}
    for r in records.values():
        if r.role != "weight" or r.param is None or not r.is_float:
            continue
        mom = moments.get(r.param, {})
        if len(mom.get("exp_avg", ())) != 1 or len(mom.get("exp_avg_sq", ())) != 1:
            continue
        m, v = records[mom["exp_avg"][0]], records[mom["exp_avg_sq"][0]]
        if m.is_float and v.is_float and r.shape == m.shape == v.shape:
            out[r.name] = (m.name, v.name)
    return out


def _moments(later: list, moments: dict, out: dict) -> None:
    """Give each exp_avg / exp_avg_sq record its part of the jointly decoded parameter."""
    for name, rec, meta in later:
        pair = moments.get(meta.get("of"))
        if pair is None or meta.get("part") not in ("m", "v"):
            raise CorruptCheckpointError(f"record {name!r} names no decoded ExCP parameter ({meta.get('of')!r})")
        out[name] = _check(name, pair[0] if meta["part"] == "m" else pair[1], rec)


class _Spans:
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


def _cut(raw: bytes | memoryview, span, what: str) -> bytes:
    try:
        off, n = int(span[0]), int(span[1])
    except (TypeError, ValueError, IndexError, KeyError):
        raise CorruptCheckpointError(f"{what}: malformed span {span!r}") from None
    if off < 0 or n < 0 or off + n > len(raw):
        raise CorruptCheckpointError(f"{what}: span [{off}, {n}] lies outside the {len(raw)}-byte payload")
    return bytes(raw[off:off + n])


def _clone(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


def _meta(encoded: Encoded, name: str) -> tuple[list, dict]:
    r = encoded.records.get(name)
    if not isinstance(r, dict) or not isinstance(r.get("pipeline"), list) or not r["pipeline"]:
        raise CorruptCheckpointError(f"record {name!r} has no pipeline in this ExCP checkpoint")
    meta = r.get("meta") or {}
    if not isinstance(meta, dict):
        raise CorruptCheckpointError(f"record {name!r} has malformed meta")
    return r["pipeline"], meta


def _check(name: str, t: torch.Tensor, rec: TensorRecord) -> torch.Tensor:
    if tuple(t.shape) != tuple(rec.shape) or str(t.dtype).removeprefix("torch.") != rec.dtype:
        raise CorruptCheckpointError(f"record {name!r} decodes to {t.dtype}{list(t.shape)}, "
                                     f"its manifest says {rec.dtype}{list(rec.shape)}")
    return t


def _payload(encoded: Encoded) -> bytes:
    info = encoded.meta.get("payload")
    if not isinstance(info, dict) or PAYLOAD not in encoded.blobs:
        raise CorruptCheckpointError("ExCP checkpoint lacks its payload blob or its method_meta['payload']")
    stage, n = info.get("stage"), info.get("raw_bytes")
    if not isinstance(n, int) or n < 0:
        raise CorruptCheckpointError(f"ExCP payload size {n!r} is malformed")
    blob = encoded.blobs[PAYLOAD]
    if stage == XZ:
        raw = lzma_decompress(blob, max_bytes=n)
    elif stage == "zstd/1":
        try:
            raw = zstandard.ZstdDecompressor().decompress(blob, max_output_size=n)
        except zstandard.ZstdError as e:
            raise CorruptCheckpointError(f"ExCP payload does not decompress: {e}") from None
    else:
        raise CorruptCheckpointError(f"ExCP payload has unknown stage {stage!r}")
    if len(raw) != n:
        raise CorruptCheckpointError(f"ExCP payload holds {len(raw)} bytes, its meta says {n}")
    return raw


def _weight_records(records: dict[str, TensorRecord]) -> list[str]:
    return [n for n, r in records.items() if r.role == "weight"]


def _param_groups(skeleton):
    opt = skeleton.get("optimizer") if isinstance(skeleton, dict) else None
    groups = opt.get("param_groups") if isinstance(opt, dict) else None
    return groups if isinstance(groups, list) and all(isinstance(g, dict) for g in groups) else None


def _with_base_groups(skeleton, base_groups) -> tuple[object, bool]:
    """A copy of ``skeleton`` whose optimizer param_groups take every value but ``params`` from base."""
    groups = _param_groups(skeleton)
    if groups is None or not isinstance(base_groups, list) or len(base_groups) != len(groups):
        return skeleton, False
    new = copy.copy(skeleton)
    new["optimizer"] = dict(skeleton["optimizer"])
    new["optimizer"]["param_groups"] = [{**{k: copy.deepcopy(v) for k, v in b.items() if k != "params"},
                                         "params": g.get("params")} for g, b in zip(groups, base_groups)]
    return new, True


def _stored(tmeta: dict) -> dict:
    """The tensor meta without its pruning figures: the manifest is uncompressed JSON, and the
    figures only feed the checkpoint's summary (``w_kept``, ``m_kept``)."""
    return {k: v for k, v in tmeta.items() if k != "prune"}


def _summary(prune_facts: list[dict]) -> dict:
    n = sum(p["numel"] for p in prune_facts)
    if not n:
        return {}
    return {"w_kept": round(sum(p["w_kept"] for p in prune_facts) / n, 4),
            "m_kept": round(sum(p["m_kept"] for p in prune_facts) / n, 4)}


# ---------------------------------------------------------------------------------------------
# excp: the paper
# ---------------------------------------------------------------------------------------------
@register
class ExcpMethod(Method):
    """ExCP as published: uncompressed base, fp16 codebooks, optimizer scalars from the base, xz."""

    name = "excp"
    version = 1
    config_cls = ExcpConfig

    def encode(self, state: FlatState, reference: Reference | None, *, ctx: EncodeContext) -> tuple[Encoded, Reference]:
        prev = reference
        enc = Encoded(keyframe=prev is None)
        spans = _Spans()
        weights = _weight_records(state.records)
        if prev is None:
            for name, t in state.tensors.items():
                enc.add(name, [RAW, XZ], {"span": spans.add(tensor_to_bytes(t))})
            groups = copy.deepcopy(_param_groups(state.skeleton))
            enc.meta["excp"] = {"base_param_groups": groups}
            ref = ExcpReference(ctx.step, {n: _clone(state.tensors[n]) for n in weights},
                                {n: _clone(t) for n, t in state.tensors.items() if state.records[n].role == "step"},
                                groups)
        else:
            new_w, facts = {}, []
            for wname, (mname, vname) in adam_parameters(state.records).items():
                w = state.tensors[wname]
                w_prev = prev.weights.get(wname)
                if w_prev is None or w_prev.shape != w.shape or w_prev.dtype != w.dtype:
                    continue  # no reconstructed weights to take a residual from: exact below
                blobs, tmeta = encode_tensor(residual(w, w_prev.to(w.device)), state.tensors[mname],
                                             state.tensors[vname], self.config)
                enc.add(wname, [RESIDUAL, TENSOR, XZ], {"excp": _stored(tmeta),
                                                         "spans": {k: spans.add(b) for k, b in blobs.items()}})
                enc.add(mname, [TENSOR, XZ], {"of": wname, "part": "m"})
                enc.add(vname, [TENSOR, XZ], {"of": wname, "part": "v"})
                dw_hat = decode_tensor(blobs, tmeta, device=w.device)[0]  # what the decoder will add
                new_w[wname] = apply_residual(w_prev.to(w.device), dw_hat)
                facts.append(tmeta["prune"])
            base = prev.base
            for name, t in state.tensors.items():
                if name in enc.records:
                    continue
                b = base.get(name) if state.records[name].role == "step" else None
                if b is not None and b.shape == t.shape and b.dtype == t.dtype:
                    enc.add(name, [FROM_BASE], {})  # the authors restore the base optimizer's step
                else:
                    enc.add(name, [RAW, XZ], {"span": spans.add(tensor_to_bytes(t))})
                    if name in weights:
                        new_w[name] = _clone(t)
            enc.skeleton, patched = _with_base_groups(state.skeleton, prev.groups)
            enc.meta["excp"] = {"param_groups_from_base": patched}
            enc.meta["summary"] = _summary(facts)
            ref = ExcpReference(ctx.step, {n: new_w[n] for n in weights}, base, prev.groups)
        raw = spans.getvalue()
        enc.blobs[PAYLOAD] = lzma_compress(raw)
        enc.meta["payload"] = {"stage": XZ, "raw_bytes": len(raw)}
        return enc, ref

    def decode(self, records: dict[str, TensorRecord], encoded: Encoded, reference: Reference | None,
               *, ctx: DecodeContext) -> tuple[dict[str, torch.Tensor], Reference]:
        raw = _payload(encoded)
        prev = reference
        if not encoded.keyframe and prev is None:
            raise CorruptCheckpointError("ExCP delta checkpoint decoded without its parent's reference")
        out: dict[str, torch.Tensor] = {}
        moments: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        later = []
        for name, rec in records.items():
            pipe, meta = _meta(encoded, name)
            kind = pipe[0]
            if kind == RAW:
                out[name] = tensor_from_bytes(_cut(raw, meta.get("span"), name), rec.dtype, rec.shape).to(ctx.device)
            elif kind == RESIDUAL and prev is not None:
                w_prev = prev.weights.get(name)
                spans = meta.get("spans")
                if w_prev is None or not isinstance(spans, dict):
                    raise CorruptCheckpointError(f"record {name!r} is an ExCP residual; its parent lacks the weights")
                blobs = {k: _cut(raw, s, name) for k, s in spans.items()}
                dw, m, v = decode_tensor(blobs, meta.get("excp"), device=ctx.device)
                out[name] = _check(name, apply_residual(w_prev.to(ctx.device), dw), rec)
                moments[name] = (m, v)
            elif kind == FROM_BASE and prev is not None:
                b = prev.base.get(name)
                if b is None:
                    raise CorruptCheckpointError(f"record {name!r} takes the keyframe's value; the keyframe lacks it")
                out[name] = _check(name, b.clone().to(ctx.device), rec)
            elif kind == TENSOR:
                later.append((name, rec, meta))
            else:
                raise CorruptCheckpointError(f"record {name!r} has pipeline {pipe} that excp cannot decode here")
        _moments(later, moments, out)
        weights = _weight_records(records)
        if prev is None:
            groups = (encoded.meta.get("excp") or {}).get("base_param_groups")
            return out, ExcpReference(ctx.step, {n: out[n] for n in weights},
                                      {n: out[n] for n, r in records.items() if r.role == "step"}, groups)
        return out, ExcpReference(ctx.step, {n: out[n] for n in weights}, prev.base, prev.groups)


# ---------------------------------------------------------------------------------------------
# excp-fixed: ours
# ---------------------------------------------------------------------------------------------
@dataclass
class _Part:
    """One quantized part of a parameter: k-means codes + codebook bytes, or dense float32 bytes."""

    mode: str                          # "kmeans" | "dense"
    codes: np.ndarray | None = None    # (numel,) uint8, code 0 = exact zero
    codebook: bytes = b""              # 2**bits - 1 centers in codebook_dtype
    dense: bytes = b""                 # numel float32
    support: np.ndarray | None = None  # (numel,) bool: where the part is non-zero


def _parts_from_blobs(blobs: dict[str, bytes], tmeta: dict, numel: int, bits: int) -> dict[str, _Part]:
    parts = {}
    for p in PARTS:
        if tmeta["parts"][p]["mode"] == "kmeans":
            codes = unpack_codes(blobs[f"{p}.codes"], numel, bits).numpy()
            parts[p] = _Part("kmeans", codes=codes, codebook=blobs[f"{p}.codebook"], support=codes != 0)
        else:
            dense = blobs[f"{p}.dense"]
            parts[p] = _Part("dense", dense=dense, support=np.frombuffer(dense, "<f4") != 0)
    return parts


def _quantize_part(x: torch.Tensor, cfg: ExcpConfig) -> _Part:
    """k-means of all non-zeros of x (no mask); <= 2**bits - 1 non-zeros are kept dense, as encode_tensor."""
    flat = x.detach().reshape(-1).to(torch.float32)
    nnz = int((flat != 0).sum())
    if nnz <= 2 ** cfg.bits - 1:
        dense = tensor_to_bytes(flat)
        return _Part("dense", dense=dense, support=np.frombuffer(dense, "<f4") != 0)
    q = quantize_nonzeros(flat, bits=cfg.bits, seed=cfg.seed, codebook_dtype=cfg.codebook_dtype,
                          max_iter=cfg.kmeans_max_iter)
    codes = q.codes.to(torch.uint8).cpu().numpy()
    cb = tensor_to_bytes(q.codebook[1:].to(torch_dtype(cfg.codebook_dtype)))
    return _Part("kmeans", codes=codes, codebook=cb, support=codes != 0)


def _part_values(part: _Part, numel: int, cb_dtype: str, bits: int, shape, dtype: str, device) -> torch.Tensor:
    """Dequantized part in ``dtype`` (the same table lookup as quant/excp.decode_tensor)."""
    if part.mode == "dense":
        x = tensor_from_bytes(part.dense, "float32", (numel,))
    else:
        centers = tensor_from_bytes(part.codebook, cb_dtype, (2 ** bits - 1,))
        table = torch.cat([torch.zeros(1), centers.to(torch.float32)])
        x = table.index_select(0, torch.from_numpy(part.codes.astype(np.int64)))
    return x.reshape(shape).to(device=device, dtype=torch_dtype(dtype))


def _route(parts: dict[str, _Part], p: str, bits: int) -> tuple[np.ndarray | None, np.ndarray | int]:
    """(positions, contexts) of part p's codes in the streams; positions None = every element, ctx 0.

    Conditional when p's support lies inside its parent's: only the parent's non-zero positions
    are coded, each in the sub-stream of the parent's code there (2**bits for a dense parent).
    """
    parent = parts.get(_PARENT.get(p, ""))
    child = parts[p]
    if parent is None or (child.support & ~parent.support).any():
        return None, 0
    pos = parent.support
    ctx = parent.codes[pos].astype(np.int64) if parent.mode == "kmeans" else 2 ** bits
    return pos, ctx


def _encode_stream(coder: str, syms: np.ndarray, bits: int) -> bytes:
    from ..codec.entropy import encode_stream

    if coder in ("ans", "huffman"):
        return encode_stream(coder, syms)
    packed = pack_codes(torch.from_numpy(syms.astype(np.uint8)), bits)
    if coder == "xz":
        return lzma_compress(packed)
    return zstandard.ZstdCompressor(level=19).compress(packed)


def _decode_stream(coder: str, buf: bytes, n: int, bits: int) -> np.ndarray:
    from ..codec.entropy import decode_stream

    if coder in ("ans", "huffman"):
        out = decode_stream(coder, buf)
    elif coder in ("xz", "zstd"):
        n_bytes = -(-n // (8 // bits))
        if coder == "xz":
            packed = lzma_decompress(buf, max_bytes=n_bytes)
        else:
            try:
                packed = zstandard.ZstdDecompressor().decompress(buf, max_output_size=n_bytes)
            except zstandard.ZstdError as e:
                raise CorruptCheckpointError(f"code stream does not decompress: {e}") from None
        out = unpack_codes(packed, n, bits).numpy()
    else:
        raise CorruptCheckpointError(f"code stream has unknown coder {coder!r}")
    if out.shape != (n,) or (n and (int(out.min()) < 0 or int(out.max()) >= 2 ** bits)):
        raise CorruptCheckpointError(f"code stream decodes to {out.shape[0]} symbols in the wrong range, expected {n}")
    return out.astype(np.uint8)


class _StreamWriter:
    """Collects each kind's sub-streams (kind -> context -> code arrays, in parameter order)."""

    def __init__(self, bits: int):
        self.bits = bits
        self.subs: dict[str, dict[int, list[np.ndarray]]] = {p: {} for p in PARTS}

    def add(self, parts: dict[str, _Part]) -> dict[str, bool]:
        cond = {}
        for p, part in parts.items():
            if part.mode != "kmeans":
                continue
            pos, ctx = _route(parts, p, self.bits)
            cond[p] = pos is not None
            codes = part.codes if pos is None else part.codes[pos]
            if isinstance(ctx, int):
                self.subs[p].setdefault(ctx, []).append(codes)
            else:
                for c in np.unique(ctx):
                    self.subs[p].setdefault(int(c), []).append(codes[ctx == c])
        return cond

    def finish(self, coders: tuple[str, ...]) -> tuple[bytes, dict]:
        out = _Spans()
        meta = {}
        for p in PARTS:
            streams = {c: np.concatenate(v) for c, v in sorted(self.subs[p].items())}
            if not streams:
                continue
            best = None
            for coder in coders:
                try:
                    bufs = {c: _encode_stream(coder, s, self.bits) for c, s in streams.items()}
                except ImportError:  # ANS needs the optional constriction package
                    continue
                size = sum(map(len, bufs.values()))
                if best is None or size < best[0]:
                    best = (size, coder, bufs)
            _, coder, bufs = best
            meta[p] = {"coder": coder, "subs": {str(c): [*out.add(bufs[c]), int(streams[c].size)] for c in streams}}
        return out.getvalue(), meta


class _StreamReader:
    def __init__(self, blob: bytes, meta: dict, bits: int):
        self.bits = bits
        self.subs: dict[str, dict[int, np.ndarray]] = {}
        self.pos: dict[str, dict[int, int]] = {}
        self.coders: dict[str, str] = {}
        try:
            for p, info in meta.items():
                self.coders[p] = info["coder"]
                self.subs[p] = {int(c): _decode_stream(info["coder"], _cut(blob, s[:2], f"{p} codes"), int(s[2]), bits)
                                for c, s in info["subs"].items()}
                self.pos[p] = {c: 0 for c in self.subs[p]}
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            if isinstance(e, CorruptCheckpointError):
                raise
            raise CorruptCheckpointError(f"ExCP code streams meta is malformed ({e!r})") from None

    def _take(self, p: str, c: int, k: int) -> np.ndarray:
        sub = self.subs.get(p, {}).get(c)
        i = self.pos.get(p, {}).get(c, 0)
        if sub is None or i + k > sub.size:
            raise CorruptCheckpointError(f"ExCP {p} code sub-stream {c} ends early")
        self.pos[p][c] = i + k
        return sub[i:i + k]

    def read(self, parts: dict[str, _Part], p: str, numel: int, cond: bool) -> np.ndarray:
        """Part p's codes; its parent (already in parts) gives the positions when ``cond``."""
        if not cond:
            return self._take(p, 0, numel).copy()
        parent = parts.get(_PARENT.get(p, ""))
        if parent is None:
            raise CorruptCheckpointError(f"ExCP part {p!r} is coded against a parent part the record lacks")
        codes = np.zeros(numel, dtype=np.uint8)
        pos = np.flatnonzero(parent.support)
        if parent.mode != "kmeans":
            codes[pos] = self._take(p, 2 ** self.bits, pos.size)
            return codes
        ctx = parent.codes[pos]
        for c in np.unique(ctx):
            sel = pos[ctx == c]
            codes[sel] = self._take(p, int(c), sel.size)
        return codes

    def check_consumed(self) -> None:
        for p, subs in self.subs.items():
            for c, s in subs.items():
                if self.pos[p][c] != s.size:
                    raise CorruptCheckpointError(f"ExCP {p} code sub-stream {c} has {s.size - self.pos[p][c]} "
                                                 "codes no parameter reads")


@register
class ExcpFixedMethod(Method):
    """ExCP with our fixes: fp32 codebooks, exact optimizer scalars, compressed keyframes, conditional codes."""

    name = "excp-fixed"
    version = 1
    config_cls = ExcpFixedConfig

    def encode(self, state: FlatState, reference: Reference | None, *, ctx: EncodeContext) -> tuple[Encoded, Reference]:
        cfg = self.config
        tcfg = cfg.tensor_config()
        prev = reference
        enc = Encoded(keyframe=prev is None)
        spans = _Spans()
        streams = _StreamWriter(cfg.bits)
        new_w, facts, joint = {}, [], {}
        for wname, (mname, vname) in sorted(adam_parameters(state.records).items()):
            w, m, v = state.tensors[wname], state.tensors[mname], state.tensors[vname]
            numel = w.numel()
            head = {"shape": list(w.shape), "bits": cfg.bits, "codebook_dtype": cfg.codebook_dtype,
                    "dtypes": {"m": state.records[mname].dtype, "v": state.records[vname].dtype}}
            if prev is None:
                parts = {"m": _quantize_part(m, tcfg), "v": _quantize_part(v, tcfg)}
                if cfg.keyframe_weights == "kmeans":
                    parts = {"dw": _quantize_part(w, tcfg), **parts}
                    new_w[wname] = _part_values(parts["dw"], numel, cfg.codebook_dtype, cfg.bits, w.shape,
                                                state.records[wname].dtype, w.device)
                tmeta = {"format": KEYFRAME_FORMAT, **head,
                         "parts": {p: {"mode": part.mode, "nnz": int(part.support.sum())} for p, part in parts.items()}}
                first = KMEANS
            else:
                w_prev = prev.weights.get(wname)
                if w_prev is None or w_prev.shape != w.shape or w_prev.dtype != w.dtype:
                    continue  # new parameter: exact below, residuals from the next save on
                blobs, tmeta = encode_tensor(residual(w, w_prev.to(w.device)), m, v, tcfg)
                new_w[wname] = apply_residual(w_prev.to(w.device), decode_tensor(blobs, tmeta, device=w.device)[0])
                parts = _parts_from_blobs(blobs, tmeta, numel, cfg.bits)
                facts.append(tmeta["prune"])
                first = TENSOR
            cond = streams.add(parts)
            for p, part in parts.items():
                tmeta["parts"][p] = {**tmeta["parts"][p], "cond": cond.get(p, False),
                                     "span": spans.add(part.codebook if part.mode == "kmeans" else part.dense)}
            joint[wname] = (mname, vname, _stored(tmeta), first)
        codes, smeta = streams.finish(cfg.coders)  # the coder of each kind is known only now
        tag = {p: [STREAMS, f"{smeta[p]['coder']}/1"] if p in smeta else [] for p in PARTS}
        for wname, (mname, vname, tmeta, first) in joint.items():
            if prev is not None:
                enc.add(wname, [RESIDUAL, TENSOR, *tag["dw"]], {"excp": tmeta})
            elif cfg.keyframe_weights == "kmeans":
                enc.add(wname, [KMEANS, *tag["dw"]], {"excp": tmeta})
            else:
                self._exact(enc, spans, wname, state.tensors[wname], {"excp": tmeta}, force_blob=True)
                new_w[wname] = _clone(state.tensors[wname])
            enc.add(mname, [first, *tag["m"]], {"of": wname, "part": "m"})
            enc.add(vname, [first, *tag["v"]], {"of": wname, "part": "v"})
        for name, t in state.tensors.items():
            if name not in enc.records:
                self._exact(enc, spans, name, t, {})
                if state.records[name].role == "weight":
                    new_w[name] = _clone(t)
        raw = spans.getvalue()
        xz, zs = lzma_compress(raw), zstandard.ZstdCompressor(level=19).compress(raw)
        stage = XZ if len(xz) <= len(zs) else "zstd/1"
        enc.blobs[PAYLOAD] = xz if stage == XZ else zs
        enc.blobs[CODES] = codes
        for r in enc.records.values():
            if r["pipeline"] == [RAW, _STAGE]:
                r["pipeline"] = [RAW, stage]
        enc.meta.update(payload={"stage": stage, "raw_bytes": len(raw)}, streams=smeta,
                        summary={**_summary(facts), "coders": ",".join(f"{p}={smeta[p]['coder']}" for p in smeta),
                                 "payload_stage": stage})
        return enc, ExcpReference(ctx.step, {n: new_w[n] for n in _weight_records(state.records)})

    def _exact(self, enc: Encoded, spans: _Spans, name: str, t: torch.Tensor, meta: dict, force_blob: bool = False):
        """Large floats: own byte-grouped blob; the rest raw into the payload (its stage compresses them)."""
        if (force_blob or t.numel() * t.element_size() >= self.config.exact_min_bytes) and t.is_floating_point():
            encode_exact(enc, name, t, level=self.config.exact_zstd_level)
            enc.records[name]["meta"] = meta
        else:
            enc.add(name, [RAW, _STAGE], {**meta, "span": spans.add(tensor_to_bytes(t))})

    def decode(self, records: dict[str, TensorRecord], encoded: Encoded, reference: Reference | None,
               *, ctx: DecodeContext) -> tuple[dict[str, torch.Tensor], Reference]:
        raw = _payload(encoded)
        prev = reference
        if not encoded.keyframe and prev is None:
            raise CorruptCheckpointError("ExCP delta checkpoint decoded without its parent's reference")
        if CODES not in encoded.blobs:
            raise CorruptCheckpointError("excp-fixed checkpoint lacks its 'codes' blob")
        streams = _StreamReader(encoded.blobs[CODES], encoded.meta.get("streams") or {}, self.config.bits)
        out: dict[str, torch.Tensor] = {}
        moments: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        later = []
        for name in sorted(records):  # the encoder wrote the streams in sorted weight-name order
            rec = records[name]
            pipe, meta = _meta(encoded, name)
            if "excp" in meta:
                out[name], moments[name] = self._decode_joint(name, rec, pipe, meta["excp"], raw, streams,
                                                              encoded, prev, ctx)
            elif pipe[0] == RAW:
                out[name] = tensor_from_bytes(_cut(raw, meta.get("span"), name), rec.dtype, rec.shape).to(ctx.device)
            elif pipe[:1] == EXACT_PIPELINE[:1]:
                out[name] = decode_exact(encoded, name, rec).to(ctx.device)
            elif pipe[0] in (TENSOR, KMEANS):
                later.append((name, rec, meta))
            else:
                raise CorruptCheckpointError(f"record {name!r} has pipeline {pipe} that excp-fixed cannot decode")
        streams.check_consumed()
        _moments(later, moments, out)
        return out, ExcpReference(ctx.step, {n: out[n] for n in _weight_records(records)})

    def _decode_joint(self, name, rec, pipe, tmeta, raw, streams, encoded, prev, ctx):
        """One parameter: its weight and (m^, v^)."""
        try:
            bits, cb_dtype = int(tmeta["bits"]), tmeta["codebook_dtype"]
            shape = tuple(int(s) for s in tmeta["shape"])
            numel = math.prod(shape)
            parts: dict[str, _Part] = {}
            for p in PARTS:
                pm = tmeta["parts"].get(p)
                if pm is None:
                    continue
                data = _cut(raw, pm["span"], name)
                if pm["mode"] == "kmeans":
                    codes = streams.read(parts, p, numel, bool(pm["cond"]))
                    parts[p] = _Part("kmeans", codes=codes, codebook=data, support=codes != 0)
                elif pm["mode"] == "dense":
                    if len(data) != 4 * numel:
                        raise CorruptCheckpointError(f"record {name!r} dense part {p} has {len(data)} bytes")
                    parts[p] = _Part("dense", dense=data, support=np.frombuffer(data, "<f4") != 0)
                else:
                    raise CorruptCheckpointError(f"record {name!r} part {p} has unknown mode {pm['mode']!r}")
            if bits != self.config.bits or shape != tuple(rec.shape):
                raise CorruptCheckpointError(f"record {name!r} has bits={bits}, shape={shape}; expected "
                                             f"{self.config.bits}, {tuple(rec.shape)}")
            if tmeta["format"] == TENSOR_FORMAT:  # delta: the shared tensor core decodes it
                w_prev = prev.weights.get(name) if prev is not None else None
                if w_prev is None or pipe[0] != RESIDUAL or set(parts) != set(PARTS):
                    raise CorruptCheckpointError(f"record {name!r} is an ExCP residual; its parent lacks the weights")
                blobs = {}
                for p, part in parts.items():
                    if part.mode == "kmeans":
                        blobs[f"{p}.codes"] = pack_codes(torch.from_numpy(part.codes), bits)
                        blobs[f"{p}.codebook"] = part.codebook
                    else:
                        blobs[f"{p}.dense"] = part.dense
                dw, m, v = decode_tensor(blobs, tmeta, device=ctx.device)
                return _check(name, apply_residual(w_prev.to(ctx.device), dw), rec), (m, v)
            if tmeta["format"] != KEYFRAME_FORMAT or not {"m", "v"} <= set(parts):
                raise CorruptCheckpointError(f"record {name!r} has ExCP format {tmeta['format']!r}")
            m, v = (_part_values(parts[p], numel, cb_dtype, bits, shape, tmeta["dtypes"][p], ctx.device) for p in "mv")
            if pipe[0] == KMEANS and "dw" in parts:
                w = _part_values(parts["dw"], numel, cb_dtype, bits, shape, rec.dtype, ctx.device)
            elif pipe[:1] == EXACT_PIPELINE[:1]:
                w = decode_exact(encoded, name, rec).to(ctx.device)
            else:
                raise CorruptCheckpointError(f"record {name!r} keyframe weight has pipeline {pipe}")
            return _check(name, w, rec), (m, v)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            if isinstance(e, CorruptCheckpointError):
                raise
            raise CorruptCheckpointError(f"record {name!r}: ExCP meta is malformed ({e!r})") from None


__all__ = ["ExcpMethod", "ExcpFixedMethod", "ExcpFixedConfig", "adam_parameters"]
