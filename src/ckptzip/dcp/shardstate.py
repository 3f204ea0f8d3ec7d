"""One rank's DCP write items -> a ``FlatState`` a ckptzip method encodes, with roles and links kept.

DCP flattens the state dict to dotted FQNs (``model.wte.weight``, ``optim.state.wte.weight.exp_avg``,
``optim.param_groups.0.betas``) and gives each rank write items: tensor chunks (its DTensor
shards, or whole replicated tensors that DCP's dedup assigned to it) and bytes items (pickled
non-tensor values). Records are named by FQN (the same on every rank, so the shards of one tensor
share a name: dist.shared_sketch keys on it) and typed so every method treats a shard as it treats
a tensor (``FlatState.params()``):

- optimizer entries ``<opt>.state.<param>.<role>`` get their role (exp_avg, exp_avg_sq, step, ...)
  and ``param`` = the parameter FQN (FSDP2's ``get_state_dict`` keys optimizer state by FQN, not by
  index); the skeleton's ``optimizer.state`` lists them per parameter, ``optimizer.param_groups``
  the groups' hyperparameters (betas, eps, lr, ...), read from the planner's state dict;
- the tensor ``<prefix>.<param>`` of a parameter with optimizer state -> a ``weight`` record with
  the same ``param`` (so moments are linked to their weight shards); other float tensors are
  weights too, ``running_mean``/``running_var``/integer tensors buffers;
- layer types from the live model when given, else guessed from the FQN and shape;
- step counters that DCP's dedup gave to another rank are read from the planner's state dict
  (every rank holds them) and kept as *context* records: encoded (Adam's m needs the step), never
  served to a load;
- tensors that share storage (a tied ``lm_head``/``wte``) are stored once, the second as an alias.

``ShardState.chunks`` maps each record to the DCP chunk it holds: (fqn, offsets, sizes).
"""
from __future__ import annotations

import hashlib
import io
import re
from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType

from ..state import MOMENT_ROLES, FlatState, TensorRecord, _guess_layer, layer_types
from ..tensorbytes import dtype_name, to_numpy_bits

_OPT_STATE = re.compile(r"^(?P<opt>.+?)\.state\.(?P<param>.+)\.(?P<role>[A-Za-z_]\w*)$")
_PARAM_GROUP = re.compile(r"^(?P<opt>.+?)\.param_groups\.(?P<group>\d+)\.(?P<key>\w+)$")
_BUFFER_SUFFIXES = ("running_mean", "running_var", "num_batches_tracked")


@dataclass(frozen=True)
class Chunk:
    fqn: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def to_json(self) -> list:
        return [self.fqn, list(self.offsets), list(self.sizes)]


@dataclass
class ShardState:
    flat: FlatState
    chunks: dict[str, Chunk]                            # record name -> the DCP chunk it holds
    aliases: dict[str, str] = field(default_factory=dict)  # alias record -> stored record (same bytes)
    context: list[str] = field(default_factory=list)   # records kept only for the codec (step counters)
    io_items: dict[str, bytes] = field(default_factory=dict)  # bytes item fqn -> bytes (DCP's torch.save)
    chunk_sha256: dict[str, str] = field(default_factory=dict)  # record -> SHA-256 of the exact input bytes

    def raw_bytes(self) -> int:
        """Bytes DCP would store for this rank (its chunks and bytes items, not the context records)."""
        return sum(t.numel() * t.element_size() for n, t in self.flat.tensors.items() if n not in self.context) \
            + sum(len(b) for b in self.io_items.values())

    def layout(self, world_size: int) -> str:
        """Fingerprint of what this rank holds: a delta needs the same layout as its parent."""
        h = hashlib.sha256(str(world_size).encode())
        for name in sorted(self.chunks):
            c = self.chunks[name]
            h.update(repr((name, c.fqn, c.offsets, c.sizes, self.flat.records[name].dtype
                           if name in self.flat.records else "alias")).encode())
        return h.hexdigest()[:32]


class _Links:
    """Parameter FQNs and their index, roles and layer types, from the planner's flattened state dict."""

    def __init__(self, sd: dict, model: torch.nn.Module | None):
        self.sd = sd
        self.params: list[str] = []          # optimizer parameters in param_groups order
        self.groups: dict[tuple[str, int], dict] = {}
        seen = set()
        for fqn, v in sd.items():
            m = _PARAM_GROUP.match(fqn)
            if m:
                self.groups.setdefault((m["opt"], int(m["group"])), {})[m["key"]] = v
        for (_, _), g in sorted(self.groups.items()):
            for p in map(str, g.get("params", []) or []):  # FQNs (FSDP2) or indices (DCP keys them "0", ...)
                if p not in seen:
                    seen.add(p)
                    self.params.append(p)
        for fqn in sd:  # optimizers whose param_groups do not name parameters (index keys)
            m = _OPT_STATE.match(fqn)
            if m and m["param"] not in seen:
                seen.add(m["param"])
                self.params.append(m["param"])
        self.index = {p: i for i, p in enumerate(self.params)}
        self.ltypes = layer_types(model) if model is not None else {}
        self.steps = {}  # param -> (fqn, its step counter): every rank's planner holds all of them
        for fqn, v in sd.items():
            m = _OPT_STATE.match(fqn)
            if m and m["role"] == "step" and isinstance(v, torch.Tensor):
                self.steps[m["param"]] = (fqn, v)

    def param_of(self, fqn: str) -> str | None:
        """The longest parameter FQN that ``fqn`` ends with (``model.wte.weight`` -> ``wte.weight``)."""
        parts = fqn.split(".")
        for i in range(len(parts)):
            p = ".".join(parts[i:])
            if p in self.index:
                return p
        return None

    def layer_type(self, param: str, t: torch.Tensor) -> str:
        return self.ltypes.get(param) or _guess_layer(param, t)

    def skeleton(self, records: dict[str, TensorRecord]) -> dict:
        """flatten_state's skeleton shape for the optimizer: per parameter its moment and step
        records, per param_group the hyperparameters (what ``FlatState.params()`` reads)."""
        state: dict = {}
        for name, rec in records.items():
            if rec.param is not None and (rec.role in MOMENT_ROLES or rec.role == "step"):
                state.setdefault(rec.param, {})[rec.role] = {"__t": "tensor", "ref": name}
        groups = []
        for (_, _), g in sorted(self.groups.items()):
            entry: dict = {"params": [str(p) for p in g.get("params", []) or []]}
            betas = g.get("betas")
            if isinstance(betas, tuple | list) and len(betas) == 2:
                entry["betas"] = {"__t": "tuple", "v": [float(b) for b in betas]}
            for k in ("eps", "lr", "weight_decay", "momentum"):
                if isinstance(g.get(k), int | float) and not isinstance(g.get(k), bool):
                    entry[k] = float(g[k])
            groups.append(entry)
        return {"optimizer": {"state": state, "param_groups": groups}} if state or groups else {}


def _role(fqn: str, t: torch.Tensor, links: _Links) -> tuple[str, str | None]:
    """(role, param) of a tensor FQN."""
    m = _OPT_STATE.match(fqn)
    if m:
        known = m["param"] in links.index and (m["role"] in MOMENT_ROLES or m["role"] == "step")
        return m["role"], m["param"] if known else None
    weight = t.is_floating_point() and not fqn.endswith(_BUFFER_SUFFIXES)
    return "weight" if weight else "buffer", links.param_of(fqn) or fqn.split(".", 1)[-1]


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def build_shard_state(items: list[WriteItem], planner: SavePlanner, *,
                      model: torch.nn.Module | None = None, checksums: bool = False) -> ShardState:
    """The rank's FlatState (see the module docstring). Tensors are detached CPU views/copies.
    ``checksums``: hash every chunk's exact bytes too (``verify --deep`` then checks lossless decodes
    against them; one more pass over the data at save time)."""
    sd = getattr(planner, "state_dict", None) or {}
    links = _Links(sd, model)
    tensors: dict[str, torch.Tensor] = {}
    records: dict[str, TensorRecord] = {}
    chunks: dict[str, Chunk] = {}
    aliases: dict[str, str] = {}
    io_items: dict[str, bytes] = {}
    sums: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for item in items:
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO:
            buf = planner.resolve_data(item)
            io_items[fqn] = buf.getvalue() if isinstance(buf, io.BytesIO) else bytes(buf)
            continue
        t = planner.resolve_data(item).detach()
        td = item.tensor_data
        chunk = Chunk(fqn, tuple(int(o) for o in td.chunk.offsets), tuple(int(s) for s in td.chunk.sizes))
        name = fqn
        role, param = _role(fqn, t, links)
        if name in chunks:  # several chunks of one FQN on this rank (ShardedTensor layouts)
            name = f"{name}@{','.join(map(str, chunk.offsets))}"
        chunks[name] = chunk
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype) \
            if t.numel() else None
        if key is not None and key in seen:
            aliases[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        t = t.cpu()
        ltype = links.layer_type(param, t) if param is not None and role != "step" else "other"
        records[name] = TensorRecord(name, role, dtype_name(t.dtype), tuple(t.shape), ltype, param)
        tensors[name] = t
        if checksums:
            sums[name] = hashlib.sha256(to_numpy_bits(t).data).hexdigest()
    context = _context_steps(records, tensors, links)
    flat = FlatState(tensors, records, links.skeleton(records), {"param_link": "dcp"})
    return ShardState(flat, chunks, aliases, context, io_items, sums)


def _context_steps(records: dict, tensors: dict, links: _Links) -> list[str]:
    """Step counters of the moments this rank holds, from the planner's state dict where DCP gave
    the step items to another rank (a moment codec needs them; a load never reads them from here)."""
    added = []
    for rec in list(records.values()):
        if rec.role not in MOMENT_ROLES or rec.param is None:
            continue
        name, v = links.steps.get(rec.param, (None, None))
        if v is None or name in records:
            continue
        t = _local(v).detach().cpu().clone()
        records[name] = TensorRecord(name, "step", dtype_name(t.dtype), tuple(t.shape), "other", rec.param)
        tensors[name] = t
        added.append(name)
    return added
