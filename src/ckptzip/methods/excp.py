"""Method ``excp``: ExCP residual checkpoints as the paper publishes them (Li et al., 2024; paper 003).

Each parameter that has Adam state is stored as a residual against the *reconstructed* previous
weights, jointly pruned with its moments and 4-bit k-means quantized; the tensor core (eq. 5/6
masks, k-means) is quant/excp.py, the shared payload and joint records methods/excp_records.py.
Per parameter ``P`` at checkpoint t::

    dW = W_t - W~_{t-1}                          float32 (quant/excp.residual)
    blobs, meta = encode_tensor(dW, m_t, v_t)    masks, k-means, packed codes, codebooks
    W~_t = W~_{t-1} + dequant(dW^)               back in the weight dtype; m^, v^ = dequant (0 if pruned)

The encoder decodes its own residual to get W~_t, so encoder and decoder stay in lockstep bit for
bit. Everything without Adam state (buffers, step tensors, ints, RNG states, weights without
optimizer state, a parameter new since the reference) is stored exactly. Deltas chain
(``Reference.step`` = the previous step): restoring step t replays every file from the nearest
keyframe (the paper's Algorithm 3); the chain's KeyframePolicy starts a new base every K saves.
``excp-fixed`` (methods/excp_fixed.py) is our variant beside it.

Faithful, quirks included:

- keyframe (reference None): the full state, uncompressed -- raw bytes inside the xz payload
  (the paper starts from an uncompressed base checkpoint; only deltas are compressed).
- codebooks fp16 (``EXCP_FAITHFUL``: small exp_avg_sq centers flush to 0, see quant/excp.py).
- the optimizer's step counts and hyper-parameters (lr, ...) on restore are the BASE's: the
  authors rebuild the optimizer from the base checkpoint and load only the moments. Deltas store
  no ``step`` tensors (``excp-base/1``: the keyframe's values, kept in the reference), and the
  delta's optimizer ``param_groups`` (lr, betas, weight decay, ...) are replaced by the keyframe's
  in the file's skeleton (``Encoded.skeleton``: the chain stores it instead of the state's; the
  input state is never modified).
- final stage: xz (LZMA2, preset 9 | extreme) over the whole checkpoint payload: ONE shared blob
  ``"payload"``; records have no blobs and carry spans into it (methods/excp_records.py).

Record pipelines (the first entry says how to decode)::

    keyframe record            exact/1, span/1                      meta {"span"}
    weight (delta)             excp-residual/1, excp-tensor/2, span/1
                               meta {"excp": tensor meta, "spans": {"dw.codes": span, ...}}
    its exp_avg / exp_avg_sq   joint/1                              meta {"of": weight record, "part"}
    optimizer step (delta)     excp-base/1                          no bytes: the keyframe's value
    anything else (delta)      exact/1, span/1

Files of ``excp/1`` (ckptzip 0.1) wrote ``raw/1, xz/1``, ``..., excp-tensor/1, xz/1`` (codes packed
MSB first) and ``excp-tensor/1, xz/1`` for the moments; they decode as before.
"""
from __future__ import annotations

import copy

import torch

from ..codec import stages as S
from ..errors import CorruptCheckpointError
from ..quant.excp import ExcpConfig, apply_residual, decode_tensor, encode_tensor, residual
from ..state import FlatState, TensorRecord
from ..tensorbytes import tensor_from_bytes, tensor_to_bytes
from . import excp_records as R
from .base import DecodeContext, EncodeContext, Encoded, Method, Reference, register

RESIDUAL = S.pipeline(S.EXCP_RESIDUAL, S.EXCP_TENSOR, S.SPAN)
FROM_BASE = S.EXCP_BASE.descriptor


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


@register
class ExcpMethod(Method):
    """ExCP as published: uncompressed base, fp16 codebooks, optimizer scalars from the base, xz."""

    name = "excp"
    step_records = True  # a delta restores the base's steps (FROM_BASE records)
    version = 2  # 2: exact/1, span/1, joint/1 and excp-tensor/2 (LSB-first codes); 1 is read
    config_cls = ExcpConfig

    def encode(self, state: FlatState, reference: Reference | None, *, ctx: EncodeContext) -> tuple[Encoded, Reference]:
        prev = R.checked_reference(reference, self.name)
        enc = Encoded(keyframe=prev is None)
        spans = R.SpanWriter()
        weights = R.weight_records(state.records)
        if prev is None:
            for name, t in state.tensors.items():
                enc.add(name, R.SPAN, {"span": spans.add(tensor_to_bytes(t))})
            groups = copy.deepcopy(_param_groups(state.skeleton))
            enc.meta["excp"] = {"base_param_groups": groups}
            ref = R.ExcpReference(ctx.step, {n: R.clone(state.tensors[n]) for n in weights},
                                  {n: R.clone(t) for n, t in state.tensors.items() if state.records[n].role == "step"},
                                  groups)
        else:
            new_w, facts = {}, []
            for wname, (mname, vname) in R.adam_parameters(state).items():
                w = state.tensors[wname]
                w_prev = prev.weights.get(wname)
                if w_prev is None or w_prev.shape != w.shape or w_prev.dtype != w.dtype:
                    continue  # no reconstructed weights to take a residual from: exact below
                blobs, tmeta = encode_tensor(residual(w, w_prev.to(w.device)), state.tensors[mname],
                                             state.tensors[vname], self.config)
                enc.add(wname, RESIDUAL, {"excp": R.stored(tmeta),
                                          "spans": {k: spans.add(b) for k, b in blobs.items()}})
                R.add_joint(enc, wname, mname, vname)
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
                    enc.add(name, R.SPAN, {"span": spans.add(tensor_to_bytes(t))})
                    if name in weights:
                        new_w[name] = R.clone(t)
            enc.skeleton, patched = _with_base_groups(state.skeleton, prev.groups)
            enc.meta["excp"] = {"param_groups_from_base": patched}
            enc.meta["summary"] = R.summary(facts)
            ref = R.ExcpReference(ctx.step, {n: new_w[n] for n in weights}, base, prev.groups)
        R.write_payload(enc, spans.getvalue(), S.XZ)
        return enc, ref

    def decode(self, records: dict[str, TensorRecord], encoded: Encoded, reference: Reference | None,
               *, ctx: DecodeContext) -> tuple[dict[str, torch.Tensor], Reference]:
        raw, prev = R.open_file(encoded, reference, self.name)
        out: dict[str, torch.Tensor] = {}
        moments: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        later = []
        for name, rec in records.items():
            pipe, meta = R.record_meta(encoded, name)
            if R.is_span(pipe):
                out[name] = tensor_from_bytes(R.cut(raw, meta.get("span"), name), rec.dtype, rec.shape).to(ctx.device)
            elif pipe[0] == S.EXCP_RESIDUAL.descriptor and prev is not None:
                w_prev = prev.weights.get(name)
                spans = meta.get("spans")
                if w_prev is None or not isinstance(spans, dict):
                    raise CorruptCheckpointError(f"record {name!r} is an ExCP residual; its parent lacks the weights")
                blobs = {k: R.cut(raw, s, name) for k, s in spans.items()}
                dw, m, v = decode_tensor(blobs, meta.get("excp"), device=ctx.device)
                out[name] = R.add_residual(name, w_prev, dw, rec)
                moments[name] = (m, v)
            elif pipe[0] == FROM_BASE and prev is not None:
                b = prev.base.get(name)
                if b is None:
                    raise CorruptCheckpointError(f"record {name!r} takes the keyframe's value; the keyframe lacks it")
                out[name] = R.check(name, b.clone().to(ctx.device), rec)
            elif R.is_joint(pipe, meta):
                later.append((name, rec, meta))
            else:
                raise CorruptCheckpointError(f"record {name!r} has pipeline {pipe} that excp cannot decode here")
        R.assign_joint(later, moments, out)
        weights = R.weight_records(records)
        if prev is None:
            groups = (encoded.meta.get("excp") or {}).get("base_param_groups")
            return out, R.ExcpReference(ctx.step, {n: out[n] for n in weights},
                                        {n: out[n] for n, r in records.items() if r.role == "step"}, groups)
        return out, R.ExcpReference(ctx.step, {n: out[n] for n in weights}, prev.base, prev.groups)


__all__ = ["ExcpMethod"]
