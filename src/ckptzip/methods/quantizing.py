"""The quantizing methods' template: ``dynaquant``, ``qd``, ``cnr`` and ``gobo`` share this loop.

A quantizing method says only how it quantizes weights and how it dequantizes one; this module
runs everything else. Per checkpoint::

    1. knobs = the config search's choice (search/, when the caller gives eval_fn) or {}
    2. weights: method.quantize_weights(state, records, replace(config.quantizer, **knobs), gradients)
    3. moments: methods/moments.py, the same recipe for all four methods
    4. codes: methods/qrecord.py, a cyclic delta against the previous save's codes where the method
       deltas (``delta_weights``: dynaquant, qd), coded as ``config.codes`` says
    5. every other record exact (methods/base.encode_exact; those under 16 KiB share group blobs,
       stage ``group/1``, methods/groups.py, all at once: base.ExactGroups)

Decode: exact records; weights (``dequantize_weight``, against the reference's codes); moments
(moments.decode_moments). The reference is a ``QuantizedReference``: the weights' codes (and the
moments' when they delta), so the next save codes only what changed, and the weights'
reconstructions where a residual may follow.

Residual weights (``config.residual``). Weights restored from a k-level checkpoint sit on its
centers; the few steps until the next save move most of them less than half a level, so quantizing
them again (the paper) snaps them back onto the same centers and undoes those steps
(docs/BENCHMARKS.md, issue 14). A residual record instead quantizes ``w - recon_prev``, the weight
minus the parent's reconstruction, and decodes to ``recon_prev + dequantize(q)`` (stage
``residual/1``; ExCP's residual, with the method's own quantizer and search)::

    "never"     the paper: every save quantizes the weights themselves
    "restored"  residuals once this writer's reference came from a decoded file (a restore, or a
                replay after a restart) -- the weights then descend from a reconstruction -- for
                every delta from then on, keyframes excepted
    "always"    residuals in every delta

The search judges ``recon_prev + dequantize(q)`` and estimates a residual's codes as a keyframe's.

Base keyframes (``EncodeContext.base``, basestate.py: the weights a fine-tuning run started from).
Unless ``residual="never"``, a keyframe given a base quantizes ``w - base`` (stage ``residual/1``,
the base's digest in the method meta) and the deltas after it are residuals too; decoding it needs
``DecodeContext.base`` with that digest (``BaseMismatchError`` otherwise). Without a base, keyframes
quantize the weights (the paper).

Every config nests its quantizer's config, so every knob reaches a chain::

    get_method("dynaquant", {"quantizer": {"bins": 8, "domain": "sqrt"}, "moments": {"bins": 32},
                             "codes": {"coder": "huffman"}, "search": {"policy": "free"}})

Search hooks (search/strategies.py): ``space()``, ``search_records``, ``search_quantize``,
``search_dequantize``, ``search_coding`` (how the codes are coded, for the ratio estimate).
"""
from __future__ import annotations

import time
from abc import abstractmethod
from contextlib import contextmanager
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import ClassVar

import torch

from ..codec import stages as S
from ..codec.entropy import CODERS
from ..configcheck import OneOf, check_fields
from .. import basestate
from ..errors import ConfigError, CorruptCheckpointError, NonFiniteError
from ..quant import dynaquant as dq
from ..quant.base import QuantizedTensor, all_finite
from ..search.config import SearchConfig
from ..search.spaces import Space
from ..state import FlatState, TensorRecord
from . import moments, qrecord
from .base import (DecodeContext, EncodeContext, Encoded, ExactGroups, Method, Reference, decode_exact, encode_exact,
                   is_exact)
from .groups import GROUP_BELOW, EncoderTensors, GroupWriter, exact_groups

CODER_CHOICES = ("auto", *CODERS)


@dataclass(frozen=True)
class CodesConfig:
    """How the integer codes are coded (Inshrinkerator section 6)."""

    coder: str = "auto"       # "auto" (qrecord.ORDER0_CODER on the plain delta) | "huffman" | "ans" | "zstd" | "rans"
    rearrange: bool = True    # group deltas by source bucket before RLE (section 6.3); fixed coders only
    rle: bool = True          # fixed coders only; coder="huffman" with both is the paper's encoder

    def __post_init__(self):
        check_fields(self, coder=OneOf(CODER_CHOICES))


PAPER_BASELINE_CODES = CodesConfig("huffman", rearrange=False, rle=False)  # the baselines' own encoders


RESIDUAL_CHOICES = ("never", "restored", "always")


@dataclass(frozen=True)
class QuantizingMethodConfig:
    """Base of the four methods' configs; each subclass gives ``quantizer`` its quantizer's config class."""

    quantizer: object = None   # e.g. quant.dynaquant.DynaQuantConfig (set by the subclass)
    moments: moments.MomentConfig = field(default_factory=moments.MomentConfig)
    codes: CodesConfig = field(default_factory=CodesConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    residual: str = "never"    # weight deltas as residuals against the parent's reconstruction (module docstring)

    def __post_init__(self):
        check_fields(self, residual=OneOf(RESIDUAL_CHOICES))


@dataclass(frozen=True)
class QuantizedReference(Reference):
    """The previous save's codes: weights' (delta methods) and moments' (``MomentConfig.delta``);
    ``recon``: the quantized weights as decoded (what a residual record is added to); ``exact``: the
    exact records as decoded (a record that repeats is stored as ``same/1``; an encoder's are an
    EncoderTensors: the small ones views of their group's words, base.ExactGroups)."""

    weights: Mapping[str, qrecord.Codes] = field(default_factory=dict)
    moments: moments.MomentReference | None = None
    recon: Mapping[str, torch.Tensor] = field(default_factory=dict)
    exact: Mapping[str, torch.Tensor] = field(default_factory=dict)

    def tensors(self) -> Iterator[torch.Tensor]:
        yield from (c.codes for c in self.weights.values())
        yield from self.recon.values()
        yield from self.exact.values()
        if self.moments is not None:
            yield from self.moments.tensors()


class QuantizingMethod(Method):
    """The template (see the module docstring); subclasses set the class attributes and two hooks."""

    space_cls: ClassVar[type[Space]]   # the method's search space (search/spaces.py)
    delta_weights: ClassVar[bool]      # weight codes are cyclic deltas against the previous save's
    uses_gradients: ClassVar[bool] = False
    # quantize_weights raises NonFiniteError on an inf/NaN weight (its sketch pass sees every value):
    # a save tries it unchecked, and checks each weight only after a refusal
    finds_nonfinite: ClassVar[bool] = False

    def __init__(self, config=None, **overrides):
        super().__init__(config, **overrides)
        self.search_state = None  # the config search's memory between saves (previous best, ...)
        self.restored = False     # a decoded reference reached this writer: its weights descend from one
        self._bases: dict[str, torch.Tensor] = {}  # this save's residual bases (parent reconstructions)
        self._base_chain = False  # the last keyframe was coded against base weights: its deltas are residuals
        self._targets_of: tuple | None = None      # (state, its tensors with residuals in place)
        self._trial: tuple | None = None           # the search's last quantization: (state, qcfg, gradients, out)
        self.space()  # validates config.search.space now rather than at the first save
        if self.config.search.residual_space is not None:
            self.space_cls.from_any(self.config.search.residual_space)

    # --- what a method supplies ---------------------------------------------------------------
    @abstractmethod
    def quantize_weights(self, state: FlatState, records: Mapping[str, TensorRecord], qconfig,
                         gradients: Mapping[str, torch.Tensor] | None) -> Iterator[tuple[str, QuantizedTensor]]:
        """Quantize ``records`` of ``state`` under ``qconfig``, one (name, QuantizedTensor) at a time.
        ``gradients``: parameter name -> gradient EMA (sensitivity), or None."""

    @abstractmethod
    def dequantize_weight(self, q: QuantizedTensor) -> torch.Tensor:
        """The inverse the decoder applies to one weight."""

    def dequantize_weight_into(self, q: QuantizedTensor, out: torch.Tensor) -> None:
        """``dequantize_weight(q)`` written into ``out`` (q's shape); a method whose decoder writes in
        place overrides it (no temporary of the weight's size per search trial)."""
        out.copy_(self.dequantize_weight(q))

    # --- search hooks -------------------------------------------------------------------------
    def space(self) -> Space:
        """The search space of this save: ``search.residual_space`` while residuals are quantized."""
        s = self.config.search
        if self._bases:
            return self.space_cls.from_any(s.residual_space) if s.residual_space is not None \
                else self.space_cls.for_residuals()
        return self.space_cls.from_any(s.space)

    @property
    def search_policy(self) -> str:
        """The search policy of this save: ``search.residual_policy`` while residuals are quantized."""
        return self.config.search.residual_policy if self._bases else self.config.search.policy

    @property
    def search_coding(self) -> str:
        """How the codes are coded, for the search's ratio estimate (search.strategies.estimate_bits)."""
        if not self.delta_weights:
            return "plain"
        c = self.config.codes
        return "conditional" if c.rearrange or c.coder == "auto" else "delta"

    def search_records(self, state: FlatState, *, finite: bool = True) -> dict[str, TensorRecord]:
        """The weights the quantizer covers: float, of a quantizable layer type, large enough, finite
        (``finite=False``: not checked)."""
        min_numel = self.config.quantizer.min_numel
        return {n: r for n, r in state.records.items()
                if r.role == "weight" and r.is_float
                and dq.is_quantizable(r.layer_type, "weight", r.numel, min_numel=min_numel)
                and (not finite or all_finite(state.tensors[n]))}

    def search_quantize(self, state: FlatState, knobs: dict, gradients=None) -> dict[str, QuantizedTensor]:
        """Quantize every ``search_records`` weight under the quantizer config with ``knobs`` replaced.
        Inside ``encode`` the last result is kept: when the search chooses what it evaluated last
        (the usual case), the save stores it instead of quantizing the weights again."""
        out = self._quantize(state, self._qconfig(knobs), gradients)
        self.remember_trial(state, knobs, gradients, out)
        return out

    def remember_trial(self, state: FlatState, knobs: dict, gradients, quantized: dict[str, QuantizedTensor]) -> None:
        """Keep the search's last quantization of ``state`` (inside ``encode`` only): a search that
        quantizes through its own prepared batch (``search_prepare``) hands it here."""
        if self._trial is not None:
            self._trial = (state, self._qconfig(knobs), gradients, quantized)

    def _qconfig(self, knobs: dict):
        return replace(self.config.quantizer, **knobs) if knobs else self.config.quantizer

    def search_dequantize(self, q: QuantizedTensor, name: str | None = None,
                          out: torch.Tensor | None = None) -> torch.Tensor:
        """What the decoder rebuilds from ``q``, record ``name``'s quantization in this save; written
        into ``out`` when given (and returned)."""
        base = self._bases.get(name) if name is not None else None
        if out is None:
            return self._reconstruct(q, base)
        if base is None:
            self.dequantize_weight_into(q, out)
        else:
            out.copy_(self._reconstruct(q, base))
        return out

    def choose_knobs(self, state: FlatState, reference, ctx: EncodeContext) -> tuple[dict, dict]:
        """This checkpoint's quantizer knob overrides and the search info for the manifest summary."""
        if ctx.search is not None:  # chosen by the trainer's search thread (asyncsearch.py)
            self.search_state = ctx.search.get("state", self.search_state)
            return dict(ctx.search["knobs"]), dict(ctx.search["info"])
        if not (self.config.search.enabled and ctx.eval_fn is not None and ctx.model is not None):
            return {}, {"search": "off"}
        from ..search.strategies import search_config  # search/ imports methods lazily too

        # residual saves search their own space and keep their own history (a residual is far more
        # compressible than the weights: the weights' monotone history would hold it back)
        st = dict(self.search_state or {})
        mine = st.pop("residual", None) if self._bases else {k: v for k, v in st.items() if k != "residual"} or None
        if reference is None and self.restored and not self._bases and self.config.search.keyframe_search == "fresh":
            mine = None  # the weights' history is the previous keyframe's: residual saves came between
        knobs, info, new = search_config(self, state, reference, ctx, mine)
        self.search_state = {**st, "residual": new} if self._bases else \
            {**new, **({"residual": st["residual"]} if "residual" in st else {})}
        return knobs, info

    def search_knobs(self, state: FlatState, reference, ctx: EncodeContext) -> tuple[dict, dict]:
        """``choose_knobs`` for a save against ``reference`` made outside ``encode`` (async saves,
        asyncsearch.py): residual-aware, as ``encode``'s own search is."""
        prev = reference if isinstance(reference, QuantizedReference) else None
        with self._against(state, prev, ctx.base) as bases:
            if prev is None:
                self._base_chain = bool(bases)
            return self.choose_knobs(state, self._estimate_reference(prev, reference), ctx)

    def search_reference(self, state: FlatState, knobs: dict, gradients, step: int,
                         reference=None, base=None) -> "QuantizedReference":
        """What ``encode`` under ``knobs`` against ``reference`` (``base``: the chain's BaseWeights) hands
        the next save -- the weights' codes and, where residuals follow, their reconstructions -- for a
        search that runs apart from the encoder (async saves, asyncsearch.py)."""
        prev = reference if isinstance(reference, QuantizedReference) else None
        with self._against(state, prev, base) as bases:
            qs = self.search_quantize(state, knobs, gradients) if self.delta_weights or self._keeps_recon() else {}
            recon = {n: self._reconstruct(q, bases.get(n)) for n, q in qs.items()} if self._keeps_recon() else {}
        codes = {n: qrecord.Codes(qrecord.compact(q.codes, q.n_levels), q.n_levels) for n, q in qs.items()} \
            if self.delta_weights else {}
        return QuantizedReference(step, codes, None, recon)

    def resume(self, method_meta: dict) -> None:
        if self.search_state is None and isinstance(method_meta.get("search_state"), dict):
            self.search_state = method_meta["search_state"]

    # --- the loop -----------------------------------------------------------------------------
    def _quantize(self, state: FlatState, qcfg, gradients) -> dict[str, QuantizedTensor]:
        targets = self.targets(state)
        if self.finds_nonfinite:
            try:
                return self._quantized(self.quantize_weights(targets, self.search_records(state, finite=False), qcfg,
                                                             gradients))
            except NonFiniteError:  # rare: the weights that hold inf/NaN stay exact, the rest are quantized
                pass
        return self._quantized(self.quantize_weights(targets, self.search_records(state), qcfg, gradients))

    @staticmethod
    def _quantized(pairs: Iterator[tuple[str, QuantizedTensor]]) -> dict[str, QuantizedTensor]:
        out = {}
        for name, q in pairs:
            # narrow codes at once: int64 codes of the whole state would peak at 2x its size
            q.codes = qrecord.compact(q.codes, q.n_levels)
            out[name] = q
        return out

    # --- residual weights ---------------------------------------------------------------------
    def targets(self, state: FlatState) -> FlatState:
        """``state`` with each weight that has a residual base in this save replaced by its residual."""
        if not self._bases:
            return state
        if self._targets_of is None or self._targets_of[0] is not state:
            tensors = dict(state.tensors)
            for n, base in self._bases.items():
                tensors[n] = state.tensors[n].detach().float() - base.float()
            self._targets_of = (state, FlatState(tensors, state.records, state.skeleton, state.extra))
        return self._targets_of[1]

    @contextmanager
    def _against(self, state: FlatState, prev: "QuantizedReference | None", base=None):
        """This save's residual bases in place (``targets``, ``search_dequantize`` and the search
        read them) for the block; yields them. ``base``: BaseWeights for a keyframe (``prev`` None)."""
        self._bases = self._residual_bases(state, prev, base)
        try:
            yield self._bases
        finally:
            self._bases, self._targets_of = {}, None

    def _estimate_reference(self, prev: "QuantizedReference | None", reference):
        """The search's reference: a residual's codes are estimated as a keyframe's (they are not
        deltas of the parent's codes)."""
        if not self._bases or prev is None:
            return reference
        return replace(prev, weights={n: c for n, c in prev.weights.items() if n not in self._bases})

    def _residual_bases(self, state: FlatState, prev: "QuantizedReference | None",
                        base=None) -> dict[str, torch.Tensor]:
        """Record -> the parent's reconstruction (or, for a keyframe, the base weights), for the
        weights this save codes as residuals."""
        if self.config.residual == "never":
            return {}
        if prev is None:
            if base is None:
                return {}
            quantized = self.search_records(state)
            return {n: b for n, b in base.matching(state.tensors).items() if n in quantized}
        self.restored = self.restored or bool(prev.recon)
        return {n: b for n, b in prev.recon.items()
                if n in state.tensors and tuple(b.shape) == tuple(state.tensors[n].shape)}

    def _keeps_recon(self) -> bool:
        r = self.config.residual
        return r == "always" or (r == "restored" and (self.restored or self._base_chain))

    def _reconstruct(self, q: QuantizedTensor, base: torch.Tensor | None) -> torch.Tensor:
        """The weight the decoder rebuilds: ``dequantize(q)``, plus ``base`` for a residual."""
        if base is None:
            return self.dequantize_weight(q)
        return (base.float() + self.dequantize_weight(replace(q, dtype="float32"))).to(base.dtype)

    def encode(self, state: FlatState, reference: Reference | None, *, ctx: EncodeContext) -> tuple[Encoded, Reference]:
        cfg = self.config
        prev = reference if isinstance(reference, QuantizedReference) else None
        if reference is not None and prev is None:
            raise ConfigError(f"{self.name} was given a reference it did not make; pass the Reference its "
                              "encode/decode returned, or None for a keyframe")
        with self._against(state, prev, ctx.base) as bases:
            if prev is None:
                self._base_chain = bool(bases)
            t0 = time.perf_counter()
            self._trial = ()  # search_quantize keeps its last result from here on
            try:
                knobs, search_info = self.choose_knobs(state, self._estimate_reference(prev, reference), ctx)
                search_s = time.perf_counter() - t0
                qcfg = self._qconfig(knobs)
                trial, self._trial = self._trial, None
                if trial and trial[0] is state and trial[1] == qcfg and trial[2] is ctx.gradients:
                    quantized = trial[3]  # what the search evaluated last: the same quantization
                    for q in quantized.values():
                        q.codes = qrecord.compact(q.codes, q.n_levels)
                else:
                    quantized = self._quantize(state, qcfg, ctx.gradients)
            finally:
                self._trial = None
        recon = {} if not self._keeps_recon() else \
            {n: self._reconstruct(q, bases.get(n)) for n, q in quantized.items()}
        enc = Encoded(keyframe=prev is None or not (self.delta_weights or self._moment_deltas))
        stage = S.QUANTIZED_RECORD[self.name].descriptor  # the qrecord layout, unchanged since v0.1
        planned = moments.plan_moments(state, cfg.moments, None if enc.keyframe else prev.moments,
                                       marker=stage, codes=cfg.codes)
        codes_w, codes_m, exact, exact_names = {}, {}, {}, []
        groups, small, batch = GroupWriter(), ExactGroups(enc), qrecord.RecordBatch(enc, share=True)
        for name, rec in state.records.items():
            q = quantized.get(name)
            if name in planned:
                c = moments.store_moment(batch, name, planned[name])
                if c is not None:
                    codes_m[name] = c
            elif q is None:
                exact_names.append(name)
                t = state.tensors[name]
                if t.numel() * t.element_size() < GROUP_BELOW:
                    small.add(name, t)  # joined into one copy per group at flush
                    continue
                t = exact[name] = state.own(name)  # training moves the live one
                encode_exact(enc, name, t, parent=None if enc.keyframe else prev.exact.get(name))
            else:
                p = None if enc.keyframe else prev.weights.get(name)
                meta = {k: v for k, v in q.meta.items() if k in qrecord.RECORD_META}
                codes_w[name] = batch.store(name, q, p, method=stage, coder=cfg.codes.coder,
                                            rearrange=cfg.codes.rearrange, rle=cfg.codes.rle, meta=meta,
                                            residual=name in bases)
        batch.flush()
        kept = small.flush(groups, None if enc.keyframe else prev.exact,
                           {} if prev is None else exact_groups(prev.exact))
        groups.flush(enc)
        # an async save's search ran in the trainer (asyncsearch.py): its info carries its own search_s
        enc.meta["summary"] = {**{k: getattr(qcfg, k) for k in self._knob_names()}, "search_s": round(search_s, 3),
                               **search_info, **({"residual": True} if bases else {})}
        if self.search_state is not None:
            enc.meta["search_state"] = self.search_state  # read back by resume() after a restart
        if enc.keyframe and bases:
            enc.meta["base"] = ctx.base.digest  # a restore needs the same base (basestate.require)
        return enc, self._reference(ctx.step, codes_w, codes_m, recon, EncoderTensors(exact_names, exact, kept))

    def decode(self, records: dict[str, TensorRecord], encoded: Encoded, reference: Reference | None,
               *, ctx: DecodeContext) -> tuple[dict[str, torch.Tensor], Reference]:
        prev = reference if isinstance(reference, QuantizedReference) else None
        if prev is not None:
            bases = prev.recon
        else:  # a keyframe: residuals only against the base weights it names
            digest = encoded.meta.get("base")
            bases = {} if digest is None else basestate.require(ctx.base, str(digest), ctx.step).tensors
        out: dict[str, torch.Tensor] = {}
        codes_w, moment_records, groups = {}, {}, {}
        qrecord.predecode(encoded, records)  # the quantized ones: exact records carry no n_levels
        for name, rec in records.items():
            if is_exact(encoded, name):
                out[name] = decode_exact(encoded, name, rec, prev.exact.get(name) if prev else None, groups)
            elif rec.role != "weight":
                moment_records[name] = rec
            else:
                q = qrecord.load(encoded, name, rec.shape, rec.dtype, prev.weights.get(name) if prev else None)
                base = None
                if qrecord.is_residual(encoded, name):
                    base = bases.get(name)
                    if base is None or tuple(base.shape) != tuple(rec.shape):
                        raise CorruptCheckpointError(f"record {name!r} is a residual but its parent checkpoint "
                                                     "(or base) has no reconstruction of that shape for it")
                try:
                    out[name] = self._reconstruct(q, base)
                except ValueError as e:
                    raise CorruptCheckpointError(f"record {name!r}: {e}") from None
                codes_w[name] = qrecord.Codes(qrecord.compact(q.codes, q.n_levels), q.n_levels)
        weight_shapes = {r.param: r.shape for r in records.values() if r.role == "weight" and r.param is not None}
        mref = moments.decode_moments(encoded, moment_records, prev.moments if prev else None, out,
                                      self._moment_deltas, weight_shapes)
        # every decoded weight stays a possible residual base: the writer that takes this reference over
        # decides (its config.residual), and a residual record's parent may be of another config
        ref = self._reference(ctx.step, codes_w, mref.codes if mref is not None else {},
                              {n: out[n] for n in codes_w}, {n: out[n] for n in records if is_exact(encoded, n)})
        return {n: t.to(ctx.device) for n, t in out.items()}, ref

    def _reference(self, step: int, codes_w: dict, codes_m: dict, recon: dict, exact: Mapping) -> QuantizedReference:
        return QuantizedReference(step, codes_w if self.delta_weights else {},
                                  moments.MomentReference(codes_m) if self._moment_deltas else None, recon, exact)

    @property
    def _moment_deltas(self) -> bool:
        return self.config.moments.deltas(self.delta_weights)

    def _knob_names(self) -> tuple[str, ...]:
        """The quantizer knobs the search chooses (what ``ckptzip ls`` shows as the chosen config)."""
        space = self.space_cls()
        return ((space.group_knob,) if space.group_knob else ()) + tuple(a.knob for a in space.axes())



def upgrade_v1_config(d: dict) -> dict:
    """A v0.1 (flat) dynaquant / qd / cnr / gobo config dict -> the nested layout of version 2."""
    renames = {"n_bins": "bins", "n_step_bins": "step_bins", "n_bins_embedding": "embedding_bins",
               "prune_fractions": "prune_fraction", "protect_fractions": "protect_fraction",
               "prune_metrics": "prune_metric"}
    d = dict(d)
    space = d.pop("search_space", None)
    out = {"search": {"enabled": d.pop("search", True), "policy": d.pop("search_policy", "monotone"),
                      "neighbourhood": d.pop("search_neighbourhood", 1),
                      "space": {renames.get(k, k): v for k, v in space.items()} if isinstance(space, dict) else None},
           "moments": {"codec": "normalized" if d.pop("optimizer", "quantize") == "quantize" else "exact",
                       "bins": d.pop("moment_bins", 16), "delta": d.pop("delta_moments", False),
                       "min_numel": d.get("min_numel", 1024)}}
    codes = {k: d.pop(k) for k in [f.name for f in fields(CodesConfig)] if k in d}
    if codes:
        out["codes"] = codes
    out["quantizer"] = {renames.get(k, k): v for k, v in d.items()}
    return out
