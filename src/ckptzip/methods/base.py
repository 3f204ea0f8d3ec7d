"""The method interface: how a compression method plugs into a chain.

A method turns a flattened training state into an :class:`Encoded` checkpoint *given the reference
it left behind last time* (None for a keyframe), and back. The chain calls, in this order::

    1. m = get_method(name, config)                    # or the descriptor stored in a file
    2. enc, ref = m.encode(flat, reference, ctx=ctx)   # ref: what the next save encodes against
    3. (chain writes enc into a container; parent step = reference.step unless enc.keyframe)
    ... on restore, for each file from the nearest keyframe forward:
    4. tensors, ref = m.decode(records, enc, ref, ctx=dctx)

``Reference.step`` is the step a delta is taken against (its parent in the chain). A method whose
deltas all point at one base (BitSnap) returns the base reference unchanged; one whose deltas
chain (lossless XOR, DynaQuant, ExCP) returns a reference for the step just written.

A worked example is methods/lossless.py (about 80 lines). Every method is registered under a
name; its descriptor ``"name/version"`` goes into each file so the reader rebuilds it from the
file alone, with the config stored beside it.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import typing
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from collections.abc import Iterator, Mapping
from typing import Callable, ClassVar

import numpy as np
import torch

from ..codec import bytegroup
from ..codec import stages as S
from ..configcheck import check_tree, check_value
from ..errors import ConfigError, CorruptCheckpointError, UnknownMethodError
from ..state import FlatState, TensorRecord
from ..tensorbytes import dtype_name, host, same_bits, tensor_from_bytes, to_numpy_bits
from . import groups as groups_mod


@dataclass(frozen=True)
class Reference:
    """What a method needs from earlier checkpoints to encode or decode the next one.

    Each method subclasses it as a frozen dataclass that names its fields (previous codes, the
    reconstructed weights, a base checkpoint...) and lists every tensor it holds in ``tensors()``:
    the chain hands a restoring caller copies of those, so training never mutates a reference.
    """

    step: int

    def tensors(self) -> Iterator[torch.Tensor]:
        return iter(())


@dataclass
class Encoded:
    """One encoded checkpoint: per-record pipelines and metadata, and the blobs they point to."""

    records: dict[str, dict] = field(default_factory=dict)  # name -> {"pipeline", "meta", "blobs"}
    blobs: dict[str, bytes] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)                # method-level JSON (search results, ...)
    keyframe: bool = True
    skeleton: object | None = None                          # stored instead of the state's skeleton (excp)
    # decoding: record -> its code stream's symbols, decoded ahead in one batch (qrecord.predecode)
    ahead: dict = field(default_factory=dict, repr=False, compare=False)
    # blob key -> (checksum name, digest, the blob) an encoder computed while the blob was in cache
    # (format.container_payload takes those of its checksum whose blob is still that object)
    digests: dict[str, tuple[str, str, bytes]] = field(default_factory=dict, repr=False, compare=False)

    def add(self, name: str, pipeline: list[str], meta: dict | None = None, **blobs: bytes) -> dict[str, str]:
        """Add a record; blob keys are made unique as ``<record index>.<part>``. Returns part -> key."""
        i = len(self.records)
        keys = {}
        for part, data in blobs.items():
            key = f"{i}.{part}"
            self.blobs[key] = data
            keys[part] = key
        self.records[name] = {"pipeline": list(pipeline), "meta": meta or {}, "blobs": keys}
        return keys

    def blob(self, name: str, part: str) -> bytes:
        try:
            return self.blobs[self.records[name]["blobs"][part]]
        except KeyError:
            raise CorruptCheckpointError(f"record {name!r} has no blob {part!r}") from None


@dataclass(kw_only=True)
class EncodeContext:
    """Everything beside the state that a method may use. Keyword-only so fields can be added."""

    step: int
    model: torch.nn.Module | None = None          # live model (config search evaluates copies of it)
    eval_fn: Callable[[torch.nn.Module], float | torch.Tensor] | None = None  # score or outputs (search/quality)
    threshold: float = 0.01                       # this checkpoint's relative budget (api.checkpoint_budget)
    higher_is_better: bool = False
    gradients: dict[str, torch.Tensor] | None = None  # param name -> gradient EMA (sensitivity)
    force_keyframe: bool = False
    process_group: object | None = None           # parallel search trials; every rank must call save
    search: dict | None = None                    # a config search already run elsewhere (async saves:
                                                  # the trainer's search thread): {"knobs", "info", "state"}
    base: object | None = None                    # basestate.BaseWeights: keyframes as residuals against it
    reference_spent: bool = False                 # the caller drops the reference after this call: a method
                                                  # may write the next one into its buffers (CheckpointChain)
    recycle: Reference | None = None              # a keyframe's spent predecessor (with reference_spent): a
                                                  # method may write the new reference into its buffers
    checksum: str | None = None                   # the container's blob checksum (format.CHECKSUMS): a method
                                                  # may fill Encoded.digests with it while its blobs are in cache


@dataclass(kw_only=True)
class DecodeContext:
    step: int
    device: str | torch.device = "cpu"            # the chain and DCP decode on the host, then move the result
    base: object | None = None                    # basestate.BaseWeights, for files coded against one


class Method(ABC):
    """Base of every compression method. Subclasses set ``name``, ``version`` and ``config_cls``."""

    name: ClassVar[str]
    version: ClassVar[int] = 1
    config_cls: ClassVar[type | None] = None
    # the optimizer's step counts as records (flatten_state(step_records=True)), not skeleton
    # scalars: ExCP's deltas restore the base checkpoint's
    step_records: ClassVar[bool] = False

    def __init__(self, config=None, **overrides):
        if self.config_cls is None:
            if config or overrides:
                raise ConfigError(f"method {self.name!r} takes no configuration")
            self.config = None
            return
        if isinstance(config, dict):
            config = config_from_dict(self.config_cls, config)
        config = config or self.config_cls()
        if not isinstance(config, self.config_cls):
            raise ConfigError(f"method {self.name!r} takes a {self.config_cls.__name__}, got {type(config).__name__}")
        self.config = merge_config(config, overrides) if overrides else config
        check_tree(self.config)  # nested configs built by hand, whose classes may not check their types

    @classmethod
    def upgrade_config(cls, config: dict, version: int) -> dict:
        """A config dict written by an older ``version`` of this method -> today's layout."""
        return config

    @property
    def descriptor(self) -> str:
        return f"{self.name}/{self.version}"

    def config_dict(self) -> dict:
        """The config as a JSON-able dict, shared between calls: every file's manifest embeds it, and
        ``dataclasses.asdict`` of a nested config cost ~0.2 ms a save. The config is frozen; the dict
        is rebuilt when ``self.config`` is replaced. Callers only serialize it: do not mutate it."""
        if self.config is None:
            return {}
        cached = self.__dict__.get("_config_dict")
        if cached is None or cached[0] is not self.config:
            cached = self._config_dict = (self.config, dataclasses.asdict(self.config))
        return cached[1]

    @abstractmethod
    def encode(self, state: FlatState, reference: Reference | None, *, ctx: EncodeContext) -> tuple[Encoded, Reference]:
        """Encode ``state``; ``reference`` is None for a keyframe. Set ``Encoded.keyframe``."""

    @abstractmethod
    def decode(self, records: dict[str, TensorRecord], encoded: Encoded, reference: Reference | None,
               *, ctx: DecodeContext) -> tuple[dict[str, torch.Tensor], Reference]:
        """Rebuild every record's tensor; return them and the reference for the next file."""

    def resume(self, method_meta: dict) -> None:
        """A writer restarted on an existing chain: take back state kept in the latest file's
        ``Encoded.meta`` (e.g. the config search's previous best). Called after the reference is rebuilt."""

    def close(self) -> None:
        """Release resources (worker pools, process groups)."""


def config_from_dict(cls: type, d: dict):
    """Build a frozen config (nested configs from nested dicts) from a manifest or user dict,
    refusing unknown keys with a fix-it message."""
    if not isinstance(d, dict):
        raise ConfigError(f"{cls.__name__} wants a dict of its fields, got {type(d).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(d) - set(names))
    if unknown:
        where = {k: f"{n}.{k}" for n in names if dataclasses.is_dataclass(hints[n])
                 for k in (f.name for f in dataclasses.fields(hints[n])) if k in unknown}
        hint = "; ".join(f"{k!r} belongs in {w}: pass {{{w.split('.')[0]!r}: {{{k!r}: ...}}}}" for k, w in where.items())
        raise ConfigError(f"{cls.__name__} has no field(s) {unknown}; valid: {sorted(names)}"
                          + (f" ({hint})" if hint else ""))
    kwargs = {}
    for k, v in d.items():
        if dataclasses.is_dataclass(hints[k]) and isinstance(v, dict):
            v = config_from_dict(hints[k], v)
        kwargs[k] = tuple(v) if isinstance(v, list) else v
    return _build(cls, kwargs, lambda: cls(**kwargs))


def merge_config(config, overrides: dict):
    """``config`` with ``overrides`` replaced; a dict given for a nested config merges into it."""
    kw = {}
    for k, v in overrides.items():
        cur = getattr(config, k, None)
        if dataclasses.is_dataclass(cur) and isinstance(v, dict):
            v = merge_config(cur, v)
        kw[k] = v
    if set(kw) - {f.name for f in dataclasses.fields(config)}:
        config_from_dict(type(config), kw)  # raises the message a config dict with an unknown key gets
    return _build(type(config), kw, lambda: dataclasses.replace(config, **kw))


def _build(cls: type, kwargs: dict, make: Callable):
    """``make()``: the config's own checks speak first (they name the valid range); a class that
    compares a value before checking its type gets the field named here instead of a TypeError."""
    try:
        return make()
    except TypeError as e:
        for k, v in kwargs.items():
            check_value(cls, k, v)
        raise ConfigError(f"{cls.__name__}: {e}") from None


def method_for_file(descriptor: str, config: dict | None) -> Method:
    """The method that decodes a file written as ``descriptor`` with ``config`` (older versions'
    configs upgraded to today's layout)."""
    cls = method_class(descriptor)
    ver = descriptor.partition("/")[2]
    if config and ver and int(ver) < cls.version:
        config = cls.upgrade_config(config, int(ver))
    return cls(config or None)


# --- registry --------------------------------------------------------------------------------

_REGISTRY: dict[str, type[Method]] = {}
# built-in methods are imported on first use, so importing ckptzip stays cheap
_BUILTIN = {
    "lossless": "ckptzip.methods.lossless",
    "dynaquant": "ckptzip.methods.dynaquant",
    "excp": "ckptzip.methods.excp",
    "excp-fixed": "ckptzip.methods.excp_fixed",
    "bitsnap": "ckptzip.methods.bitsnap",
    "bitsnap-lossless": "ckptzip.methods.bitsnap",
    "qd": "ckptzip.methods.baselines",
    "cnr": "ckptzip.methods.baselines",
    "gobo": "ckptzip.methods.baselines",
}


def register(cls: type[Method]) -> type[Method]:
    _REGISTRY[cls.name] = cls
    return cls


def method_class(name_or_descriptor: str) -> type[Method]:
    if not isinstance(name_or_descriptor, str):
        raise ConfigError(f"a method is named by a string such as 'lossless', got {name_or_descriptor!r} "
                          f"({type(name_or_descriptor).__name__}); available: {', '.join(available_methods())}")
    name, _, ver = name_or_descriptor.partition("/")
    if ver and not ver.isdecimal():
        raise UnknownMethodError(f"method descriptor {name_or_descriptor!r} has no integer version; "
                                 f"expected 'name' or 'name/<version>', e.g. 'lossless/1'")
    if name not in _REGISTRY and name in _BUILTIN:
        try:
            importlib.import_module(_BUILTIN[name])
        except ModuleNotFoundError as e:
            if not e.name or not e.name.startswith("ckptzip"):
                raise
    cls = _REGISTRY.get(name)
    if cls is None:
        raise UnknownMethodError(f"unknown method {name!r}; available: {', '.join(available_methods())}")
    if ver and int(ver) > cls.version:
        raise UnknownMethodError(f"method {name!r} version {ver} is newer than this ckptzip reads "
                                 f"({cls.version}); upgrade ckptzip")
    return cls


def get_method(name_or_descriptor: str, config=None, **overrides) -> Method:
    return method_class(name_or_descriptor)(config, **overrides)


def searches(method: Method) -> bool:
    """Whether ``method`` runs a config search when given eval_fn (the quantizing methods, search on)."""
    cfg = getattr(method, "config", None)
    return hasattr(method, "choose_knobs") and bool(getattr(getattr(cfg, "search", None), "enabled", False))


def builtin(name: str) -> bool:
    """Whether ``name`` is one of ckptzip's own methods (a child process can make it by name)."""
    return name in _BUILTIN


def available_methods() -> list[str]:
    names = set(_REGISTRY)
    for name, mod in _BUILTIN.items():
        if importlib.util.find_spec(mod) is not None:
            names.add(name)
    return sorted(names)


# --- exact storage shared by every method (scalars, ints, small tensors, tensors a lossy method skips)

EXACT_GROUPED = S.pipeline(S.EXACT, S.GROUP, S.BYTEGROUP)  # no blob: meta.group (methods/groups.py)
EXACT_SAME = S.pipeline(S.EXACT, S.SAME)                    # no blob: the parent's record
EXACT_RAW = S.pipeline(S.EXACT, S.RAW)
_RAW_BELOW_BYTES = 256  # byte-group headers and zstd frames cost more than they save on tiny tensors


def encode_exact(enc: Encoded, name: str, t: torch.Tensor, *, level: int = 3, parent: torch.Tensor | None = None,
                 groups: groups_mod.GroupWriter | None = None) -> None:
    """Store ``t`` bit for bit; as ``same/1`` (no blob) when it equals ``parent``, the parent checkpoint's
    decoded record (RNG states and frozen tensors repeat from save to save). ``groups``: a tensor
    under ``GROUP_BELOW`` bytes joins its group blob (stage ``group/1``, methods/groups.py; the
    caller flushes ``groups`` into ``enc`` after its last record)."""
    t = host(t)
    bits = to_numpy_bits(t)  # a view
    if _repeats(bits, t, parent):
        enc.add(name, EXACT_SAME, {})
        return
    if groups is not None and bits.nbytes < groups_mod.GROUP_BELOW:
        enc.add(name, EXACT_GROUPED, groups.add(t))
        return
    if bits.nbytes < _RAW_BELOW_BYTES:
        enc.add(name, EXACT_RAW, {}, data=bits.tobytes())
        return
    data = bytegroup.compress(bits, t.element_size(), float_bits=t.is_floating_point(), level=level)
    enc.add(name, [S.EXACT.descriptor, bytegroup.stage(data)], {}, data=data)  # bytegroup/1, or /2 in segments


def _repeats(bits, t: torch.Tensor, parent: torch.Tensor | None) -> bool:
    """Whether ``t`` (``bits``: its to_numpy_bits) is ``parent`` bit for bit, dtype and shape included."""
    return parent is not None and parent.dtype == t.dtype and parent.shape == t.shape and \
        same_bits(bits, to_numpy_bits(parent))


class ExactGroups:
    """encode_exact(..., groups=) of the small tensors of a save (each under ``GROUP_BELOW`` bytes)
    all at once: the same records and group blobs, but each group's words joined once -- the group
    blob's words and the reference's copy of its tensors -- and a repeat of the parent's group of the
    same records (``same/1``) found by one comparison of their words, not record by record::

        eg = ExactGroups(enc)
        eg.add(name, t)        # in record order, where encode_exact would run: reserves the record
        kept = eg.flush(groups, parents, parent_groups)  # before groups.flush(enc): {key: GroupWords}
    """

    def __init__(self, enc: Encoded):
        self.enc = enc
        self._members: dict[str, list[tuple[str, torch.Tensor]]] = {}  # group key -> records, in order

    def add(self, name: str, t: torch.Tensor) -> None:
        t = host(t)
        key = groups_mod.group_key(t)
        m = self._members.get(key)
        if m is None:
            m = self._members[key] = []
        m.append((name, t))
        self.enc.add(name, EXACT_GROUPED)  # its meta (or same/1) at flush: the records keep their order

    def flush(self, groups: groups_mod.GroupWriter, parents: Mapping[str, torch.Tensor] | None,
              parent_groups: Mapping[str, groups_mod.GroupWords]) -> dict[str, groups_mod.GroupWords]:
        """Each record's meta, each group's words into ``groups`` (a group whose every record repeats
        has none, as with encode_exact); ``parents``: the parent's exact tensors (None: a keyframe)."""
        kept, records = {}, self.enc.records
        for key, items in self._members.items():
            words = groups_mod.join_words([t for _, t in items])  # a copy: training moves the live tensors
            g = kept[key] = groups_mod.GroupWords(words, tuple(n for n, _ in items),
                                                  tuple((t.dtype, t.shape) for _, t in items))
            counts = np.fromiter((t.numel() for _, t in items), np.int64, len(items))
            same = np.zeros(len(items), dtype=bool) if parents is None else \
                self._same_mask(g, counts, items, parents, parent_groups.get(key))
            off = 0
            for (name, _), n, s in zip(items, counts.tolist(), same.tolist()):
                if s:
                    records[name]["pipeline"] = list(EXACT_SAME)
                else:
                    records[name]["meta"] = {"group": [key, off, n]}
                    off += n
            if not same.all():
                groups.add_words(key, words[np.repeat(~same, counts)] if same.any() else words)
        self._members.clear()
        return kept

    @staticmethod
    def _same_mask(g: groups_mod.GroupWords, counts: np.ndarray, items: list, parents: Mapping[str, torch.Tensor],
                 pg: groups_mod.GroupWords | None) -> np.ndarray:
        """Whether each record's bits equal its parent's (same dtype and shape)."""
        if pg is not None and pg.names == g.names and pg.specs == g.specs:  # the parent's group of these records
            changed = np.concatenate(([0], np.cumsum(g.words != pg.words)))
            ends = np.cumsum(counts)
            return changed[ends] == changed[ends - counts]
        return np.array([_repeats(to_numpy_bits(t), t, parents.get(name)) for name, t in items], dtype=bool)


def decode_exact(enc: Encoded, name: str, rec: TensorRecord, parent: torch.Tensor | None = None,
                 groups: dict | None = None) -> torch.Tensor:
    """``parent``: the parent checkpoint's decoded record of this name, for ``same/1``; ``groups``: the
    file's decompressed group blobs, one dict per file (group_words fills it)."""
    pipeline = enc.records[name]["pipeline"]
    if S.SAME.descriptor in pipeline:
        if parent is None or dtype_name(parent.dtype) != rec.dtype or tuple(parent.shape) != tuple(rec.shape):
            raise CorruptCheckpointError(f"record {name!r} is stored as its parent's, but the parent checkpoint "
                                         "has no such record of that dtype and shape")
        return parent.clone()
    if S.GROUP.descriptor in pipeline:
        raw = groups_mod.group_words(enc, name, {} if groups is None else groups)
    else:
        data = enc.blob(name, "data")
        raw = data if S.RAW.descriptor in pipeline else bytegroup.decompress(data)
    return tensor_from_bytes(raw, rec.dtype, rec.shape)


def is_exact(enc: Encoded, name: str) -> bool:
    return enc.records[name]["pipeline"][:1] == [S.EXACT.descriptor]
