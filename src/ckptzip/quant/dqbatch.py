"""DynaQuant over many tensors at once: one buffer, three kernel passes, one batched k-means.

The per-tensor calls of quant/dynaquant.py (``fit_layer_thresholds``, ``quantize``) are the
plain-torch reference; ``quantize_tensors`` returns the same plan and the same QuantizedTensors
(codes, codebooks, protected values, meta; tests/test_quant_dqbatch.py checks it) at memory speed::

    plan, qs = quantize_tensors({name: (tensor, layer_type[, role])}, config, grads)

1. pack: the quantizable tensors, in order, into float32 chunks of up to ``CHUNK`` elements with
   segment offsets (a larger tensor is its own chunk, a view when it is float32 already); the
   gradients the same way when a layer type uses sensitivity;
2. sketch pass: ``segment_histograms`` -> every tensor's signed and |x| (and |x g|)
   histograms, inf/NaN checked on the way; merged per layer type -> thresholds
   (``layer_type_plan``, shared with the reference); prune caps by one batched quantile;
3. partition pass: per tensor the histogram of its *quantized* values (neither pruned nor
   protected), and its pruned / protected counts; without gradients, the sketch's signed rows
   trimmed by counts from a compare-only pass (dqkernels.py);
4. k-means: every tensor's histogram in one ``histogram_centers`` call per bins value;
5. assign pass: codes (uint8 when the levels fit, else int16 / int32) and the protected values
   in index order.

Per-tensor Python work is a few slices and a dataclass. On CPU each pass is one numba call per
chunk, and chunks run on ``parallel.thread_map`` (the kernels release the GIL). Elsewhere (CUDA),
or while a distributed sketch hook is active, the reference runs per tensor.
"""
from __future__ import annotations

import math
import threading
from collections.abc import Mapping

import numpy as np
import torch

from ..errors import ConfigError, NonFiniteError
from ..inplace import segment_offsets
from ..logbuckets import HAVE_NUMBA, lookup_table, row_capacity, segment_histograms
from ..parallel import thread_map
from ..sketch import LogSketch
from ..tensorbytes import dtype_name
from . import dynaquant as dq
from .base import QuantizedTensor, flat32, flat_float32
from .dqkernels import assign_kernel, partition_counts_kernel, partition_hist_kernel, trim_rows_kernel
from .levels import from_domain, histogram_centers, level_bounds

__all__ = ["quantize_tensors", "fast_path", "Sketched", "Chunk", "row_quantiles", "CHUNK"]

CHUNK = 1 << 22  # elements per packed chunk: bounds the extra float32 copy, and the unit of threading


# A thread's last packed buffer, handed to its next batch (``_take`` / ``_give``): a fresh buffer's
# pages fault on first touch (~3 us each here: 0.85 ms of a small GPT's 1.9 MB, where the copy into
# warm pages takes 0.2). Taken, not shared: a second batch alive in the thread gets a fresh one.
_spare = threading.local()
SPARE_KEEP = 1 << 24  # bytes: a larger model's chunks stay the call's own memory


def _take(n: int) -> torch.Tensor:
    """A float32 buffer of ``n`` elements: the thread's spare (now this caller's), else a fresh one."""
    buf = getattr(_spare, "buf", None)
    if buf is not None and buf.numel() >= n:
        _spare.buf = None
        return buf[:n]
    return torch.empty(n, dtype=torch.float32)


def _give(buf: torch.Tensor) -> None:
    """Keep ``buf`` (a ``_take`` result nothing reads any more) for the thread's next batch."""
    whole = buf._base if buf._base is not None else buf
    spare = getattr(_spare, "buf", None)
    if whole.numel() * 4 <= SPARE_KEEP and (spare is None or spare.numel() < whole.numel()):
        _spare.buf = whole


class Chunk:
    """Consecutive quantizable tensors packed into one float32 buffer (or one large tensor's view)."""

    def __init__(self, names: list[str], flats: list[torch.Tensor], grads: list[torch.Tensor | None]):
        self.names = names
        sizes = [f.numel() for f in flats]
        self.offsets = segment_offsets(sizes)
        self.packed = len(flats) > 1 and all(f.is_cpu for f in flats)  # x: a _take buffer of its own
        self.x = torch.cat(flats, out=_take(sum(sizes))) if self.packed else \
            flats[0] if len(flats) == 1 else torch.cat(flats)
        self.g = None
        if any(g is not None for g in grads):
            self.g = torch.cat([g if g is not None else torch.zeros(n) for g, n in zip(grads, sizes)]) \
                if len(grads) > 1 else grads[0]

    def seg(self, i: int) -> slice:
        return slice(int(self.offsets[i]), int(self.offsets[i + 1]))


def _pack(order: list[str], tensors: Mapping, grads_of: dict[str, torch.Tensor | None]) -> list[Chunk]:
    chunks, cur, size = [], [], 0
    for name in order:
        n = tensors[name].numel()
        if cur and size + n > CHUNK:
            chunks.append(cur)
            cur, size = [], 0
        cur.append(name)
        size += n
    if cur:
        chunks.append(cur)
    return [Chunk(c, [flat32(tensors[n]) for n in c],
                   [None if grads_of.get(n) is None else flat32(grads_of[n]) for n in c]) for c in chunks]


def quantize_tensors(tensors: Mapping[str, tuple], config: dq.DynaQuantConfig = dq.DynaQuantConfig(),
                     grads: Mapping[str, torch.Tensor] | None = None, *, threads: int | None = None
                     ) -> tuple[dq.DynaQuantPlan, dict[str, QuantizedTensor]]:
    """``fit_layer_thresholds`` then ``quantize`` of every quantizable tensor, batched (module
    docstring). Same arguments; returns (plan, {name: QuantizedTensor}) with narrow codes (uint8
    when the levels fit). ``threads``: chunks in parallel (default torch.get_num_threads())."""
    if not fast_path(t for t, *_ in (dq._unpack(s) for s in tensors.values())):
        plan = dq.fit_layer_thresholds(tensors, config, grads)
        return plan, {n: dq.quantize(dq._unpack(tensors[n])[0], n, plan) for n in plan.tensors}
    sk = Sketched(tensors, config, grads, threads=threads)
    plan = sk.plan(config)
    out = sk.quantize(plan)
    sk.release()
    return plan, out


def fast_path(tensors) -> bool:
    """Whether the kernels run here: numba installed, CPU tensors, no distributed sketch hook."""
    return HAVE_NUMBA and all(t.device.type == "cpu" for t in tensors) and not _sharing()


class Sketched:
    """The config-independent half of quantizing a set of tensors: which are quantizable, their
    packed chunks, and (on the first ``plan``) every tensor's |x| and |x g| histograms. Build it
    once per checkpoint, then ``plan`` / ``quantize`` under any config with the same alpha and
    min_numel (the config search does, per candidate)."""

    def __init__(self, tensors: Mapping[str, tuple], config: dq.DynaQuantConfig,
                 grads: Mapping[str, torch.Tensor] | None = None, *, threads: int | None = None,
                 quantizable: bool | None = None):
        self.alpha, self.min_numel, self.grads, self.threads = config.alpha, config.min_numel, grads, threads
        self.specs = {n: dq._unpack(spec) for n, spec in tensors.items()}
        self.groups: dict[str, list[str]] = {}
        self.skipped = []
        for name, (t, lt, role) in self.specs.items():
            if not t.is_floating_point():
                raise TypeError(f"{name}: DynaQuant quantizes float tensors, got {t.dtype}")
            if quantizable or (quantizable is None and dq.is_quantizable(lt, role, t.numel(), min_numel=self.min_numel)):
                self.groups.setdefault(lt, []).append(name)
            else:
                self.skipped.append(name)
        self.order = [n for items in self.groups.values() for n in items]
        self.layer_of = {n: lt for lt, items in self.groups.items() for n in items}
        self.fallback = {lt: grads is None or any(n not in grads for n in items) for lt, items in self.groups.items()}
        grads_of = {n: grads[n] for n in self.order if not self.fallback[self.layer_of[n]]}
        for n, g in grads_of.items():
            if g.numel() != self.specs[n][0].numel():
                raise ConfigError(f"{n}: gradient has {g.numel()} elements, tensor has {self.specs[n][0].numel()}")
        self.chunks = _pack(self.order, {n: self.specs[n][0] for n in self.order}, grads_of)
        self.has_grad = set(grads_of)
        self._rows = None  # name -> (|x| row, |x g| row | None), from the sketch pass
        self._signed = None  # per chunk: its signed rows (numpy CSR), which the partition trims

    def rows(self) -> dict:
        """The sketch pass (once): name -> (|x| row, |x g| row or None, signed row), histogram rows
        (ords, counts) of LogSketch(alpha); checks inf/NaN."""
        if self._rows is None:
            def sketch(c: Chunk):
                signed, mag = segment_histograms(c.x, c.offsets, alpha=self.alpha, names=c.names,
                                                 kinds=("signed", "abs"))
                sens = None
                if c.g is not None:
                    sens, = segment_histograms(c.x * c.g, c.offsets, alpha=self.alpha, names=c.names, kinds=("abs",))
                return mag, sens, signed

            rows, self._signed = {}, []
            for c, (mag, sens, signed) in zip(self.chunks, thread_map(sketch, self.chunks, self.threads)):
                sens_rows = _rows(sens) if sens is not None else [None] * len(c.names)
                for n, m_row, s_row, sg_row in zip(c.names, _rows(mag), sens_rows, _rows(signed)):
                    rows[n] = (m_row, s_row if n in self.has_grad else None, sg_row)
                self._signed.append(tuple(t.numpy() for t in signed))
            self._rows = rows
        return self._rows

    def plan(self, cfg: dq.DynaQuantConfig) -> dq.DynaQuantPlan:
        """``fit_layer_thresholds`` under ``cfg`` from the stored histograms."""
        self._check(cfg)
        if cfg.domain == "log":
            for c in self.chunks:
                for i, n in enumerate(c.names):
                    dq._check_domain(c.x[c.seg(i)], n, "log")
        rows = self.rows()
        cap_q = dq.prune_cap_quantile(cfg)
        tensor_prune: dict[str, float] = {}
        plans: dict[str, dq.LayerTypePlan] = {}
        for lt, items in self.groups.items():
            mag_sk = _merged([rows[n][0] for n in items], cfg.alpha)
            sens_sk = None if self.fallback[lt] else _merged([rows[n][1] for n in items], cfg.alpha)
            numel = sum(self.specs[n][0].numel() for n in items)
            plans[lt] = dq.layer_type_plan(lt, numel, mag_sk, sens_sk, cfg)
            if cap_q is not None and lt != "embedding":
                use_sens = cfg.prune_metric == "sensitivity" and not self.fallback[lt]
                caps = row_quantiles([rows[n][1 if use_sens else 0] for n in items], cap_q, cfg.alpha)
                tensor_prune.update(zip(items, caps))
        plan = dq.DynaQuantPlan(cfg, plans, dict(self.layer_of), tuple(self.skipped), self.grads, tensor_prune)
        if cfg.center_scope == "layer_type":
            hist, _, _ = self._partition(plan)
            plan = dq.replace(plan, layer_types={
                lt: dq.replace(p, centers=_type_centers([hist[n] for n in self.groups[lt]], p.bins, cfg))
                for lt, p in plan.layer_types.items()})
        return plan

    def quantize(self, plan: dq.DynaQuantPlan) -> dict[str, QuantizedTensor]:
        """Every quantizable tensor under ``plan`` (one fitted on these tensors, e.g. ``plan()``)."""
        cfg = plan.config
        self._check(cfg)
        hist, n_pruned, n_prot = self._partition(plan)
        centers = self._centers(plan, hist, n_pruned, n_prot)
        params = {n: _partition_params(n, plan) for n in self.order}
        ordered = [centers[n] for n in self.order]
        padded = _batched(ordered, cfg.domain)
        bounds = dict(zip(self.order, _bounds(ordered, cfg.domain, padded)))
        books = dict(zip(self.order, _codebooks(ordered, cfg.domain, padded)))

        def assign(c: Chunk):
            ks = [int(centers[n].numel()) for n in c.names]
            return _assign(c, [params[n] for n in c.names], [bounds[n] for n in c.names], ks,
                           [n_prot[n] for n in c.names])

        out: dict[str, QuantizedTensor] = {}
        for c, (codes, prot, prot_off) in zip(self.chunks, thread_map(assign, self.chunks, self.threads)):
            prot, at = prot.to(torch.bfloat16), prot_off.tolist()
            for i, n in enumerate(c.names):
                out[n] = _quantized(n, self.specs[n][0], plan, books[n], codes[c.seg(i)], prot[at[i]:at[i + 1]],
                                    n_pruned[n], n_prot[n])
        return {n: out[n] for n in self.order}

    def release(self) -> None:
        """Done with this batch: its packed buffers go to the thread's next one (``_give``)."""
        for c in self.chunks:
            if c.packed:
                _give(c.x)
        self.chunks = []

    def _check(self, cfg: dq.DynaQuantConfig) -> None:
        if cfg.alpha != self.alpha or cfg.min_numel != self.min_numel:
            raise ConfigError("a Sketched batch serves configs of its own alpha and min_numel only; build another")

    def _partition(self, plan):
        """Partition pass: each tensor's quantized-value histogram, pruned and protected counts."""
        params = {n: _partition_params(n, plan) for n in self.order}

        def partition(job):
            c, signed = job
            return _partition_hist(c, [params[n] for n in c.names], plan.config.alpha, signed)

        hist, n_pruned, n_prot = {}, {}, {}
        jobs = list(zip(self.chunks, self._signed or [None] * len(self.chunks)))
        for c, (h, npr, npt) in zip(self.chunks, thread_map(partition, jobs, self.threads)):
            for n, row, a, b in zip(c.names, _rows(h), npr.tolist(), npt.tolist()):
                hist[n], n_pruned[n], n_prot[n] = row, a, b
        return hist, n_pruned, n_prot

    def _centers(self, plan, hist, n_pruned, n_prot) -> dict[str, torch.Tensor]:
        """Domain centers (float32) of every tensor: the plan's per layer type, else one batched
        k-means per bins value."""
        cfg = plan.config
        out: dict[str, torch.Tensor] = {}
        by_bins: dict[int, list[str]] = {}
        for n in self.order:
            ltp = plan.layer_types[plan.tensors[n]]
            x = self.specs[n][0]
            if ltp.centers is not None:
                out[n] = ltp.centers.cpu()
            elif x.numel() - n_pruned[n] - n_prot[n] <= ltp.bins:  # every value its own center, exactly
                xf = flat_float32(x, f"DynaQuant ({n})")
                out[n] = dq._fit_centers(xf[dq._partition(xf, n, plan) == 1], ltp.bins, cfg).cpu()
            else:
                by_bins.setdefault(ltp.bins, []).append(n)
        for k, names in by_bins.items():
            ords = torch.cat([hist[n][0] for n in names])
            counts = torch.cat([hist[n][1] for n in names])
            ptr = torch.tensor([0] + [hist[n][0].numel() for n in names]).cumsum(0)
            out.update(zip(names, histogram_centers(ords, counts, ptr, k, cfg)))
        return out


def _type_centers(rows, k: int, cfg) -> torch.Tensor:
    sk = _merged(rows, cfg.alpha)
    c = torch.empty(0) if sk.count == 0 else dq._sketch_centers(sk, k, cfg)
    return torch.as_tensor(c, dtype=torch.float32).reshape(-1)


def _sharing() -> bool:
    try:
        from ..dist import sharing
    except ImportError:
        return False
    return bool(sharing())


def _rows(csr) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every row (ords, counts) of a CSR histogram (ords, counts, ptr; ptr[-1] == ords.numel()), as
    views (one ``split`` each: half the time of a slice a row)."""
    ords, counts, ptr = csr
    sizes = ptr.diff().tolist()
    return list(zip(ords.split(sizes), counts.split(sizes)))


# The two below work on the rows' host arrays with numpy (the rows are the CPU kernels' output): a
# save calls them once a layer type, where each torch call costs more than its few thousand values.

def _merged(rows, alpha: float) -> LogSketch:
    """``LogSketch.from_counts`` of the rows concatenated (their union: the counts of equal ordinals
    added), by one ``bincount``."""
    ords, counts = _joined(rows)
    if not ords.size:
        return LogSketch(alpha)
    lo = int(ords.min())
    dense = np.bincount(ords - lo, weights=counts)  # float64: exact below 2**53 values
    nz = np.flatnonzero(dense)
    return LogSketch.from_counts(torch.from_numpy(nz + lo), torch.from_numpy(dense[nz].astype(np.int64)), alpha,
                                 sorted_unique=True)


def row_quantiles(rows, q: float, alpha: float) -> list[float]:
    """``LogSketch.quantile(q)`` of every row at once (same ranks, same search; NaN for an empty row)."""
    ords, counts = _joined(rows)
    sizes = np.fromiter((r[0].numel() for r in rows), np.int64, len(rows))
    cum = np.concatenate([[0], np.cumsum(counts)])
    end = np.cumsum(sizes)
    start = end - sizes
    n = (cum[end] - cum[start]).tolist()
    rank = np.array([math.floor(q * (v - 1)) for v in n], dtype=np.int64)
    pos = np.minimum(np.searchsorted(cum[1:], cum[start] + rank, side="right"), end - 1)
    vals = LogSketch(alpha).ordinal_values(torch.from_numpy(ords[pos])).tolist()
    return [v if m else math.nan for v, m in zip(vals, n)]


def _joined(rows) -> tuple[np.ndarray, np.ndarray]:
    if not rows:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate([r[0].numpy() for r in rows]), np.concatenate([r[1].numpy() for r in rows])


def _partition_params(name: str, plan: dq.DynaQuantPlan) -> tuple:
    """(prune below, prune on sensitivity, protect |x| above, protect |x g| above, uses g) as the
    reference's float32 compares see them (a Python float against a float32 tensor rounds to
    nearest float32)."""
    ltp = plan.layer_types[plan.tensors[name]]
    has_g = not ltp.sensitivity_fallback and plan.grads is not None and name in plan.grads
    prune = -math.inf
    if ltp.prune_threshold is not None:
        prune = min(ltp.prune_threshold, plan.tensor_prune.get(name, math.inf))
    pm = math.inf if ltp.protect_magnitude is None else ltp.protect_magnitude
    ps = math.inf if (ltp.protect_sensitivity is None or not has_g) else ltp.protect_sensitivity
    on_sens = plan.config.prune_metric == "sensitivity" and has_g
    return (float(np.float32(prune)), on_sens, float(np.float32(pm)), float(np.float32(ps)), has_g)


def _param_arrays(params):
    p = list(zip(*params))
    return (np.array(p[0], np.float32), np.array(p[1], np.bool_), np.array(p[2], np.float32),
            np.array(p[3], np.float32), np.array(p[4], np.bool_))


def _views(c: Chunk):
    x = c.x.numpy()
    g = c.g.numpy() if c.g is not None else np.zeros(0, np.float32)
    return x.view(np.int32), x, g


def _partition_hist(c: Chunk, params, alpha: float, signed=None):
    t = lookup_table(float(alpha), 1e-30)
    M = int(t.key.max())
    bits, x, g = _views(c)
    T = len(c.names)
    # without gradients, and no value both pruned and protected: the sketch's rows, trimmed
    if signed is not None and all(not p[4] and p[2] >= max(p[0], 0.0) for p in params):
        prune, _, pm, _, _ = _param_arrays(params)
        cnt = np.empty((T, 6), np.int64)
        partition_counts_kernel(bits, x, c.offsets, prune, pm, t.zero_bound, cnt)
        ords, counts, ptr = signed
        q_ords, q_counts, q_ptr = np.empty(ords.size, np.int64), np.empty(ords.size, np.int64), np.zeros(T + 1, np.int64)
        trim_rows_kernel(ords, counts, ptr, cnt, q_ords, q_counts, q_ptr)
        n = int(q_ptr[-1])
        return (torch.from_numpy(q_ords[:n]), torch.from_numpy(q_counts[:n]), torch.from_numpy(q_ptr)), \
            cnt[:, 0], cnt[:, 2]
    cap = row_capacity(c.offsets, M)
    ords, counts = np.empty(cap, np.int64), np.empty(cap, np.int64)
    ptr = np.zeros(T + 1, np.int64)
    n_pruned, n_prot = np.zeros(T, np.int64), np.zeros(T, np.int64)
    bad = partition_hist_kernel(bits, x, g, c.offsets, *_param_arrays(params), t.shift, t.key, t.bound, M,
                            ords, counts, ptr, n_pruned, n_prot)
    if bad >= 0:
        raise NonFiniteError(f"{c.names[bad]}: tensor holds inf/NaN; DynaQuant needs finite values (store it exact)")
    n = int(ptr[-1])
    return (torch.from_numpy(ords[:n]), torch.from_numpy(counts[:n]), torch.from_numpy(ptr)), n_pruned, n_prot


def _assign(c: Chunk, params, bounds, ks, n_prot):
    _, x, g = _views(c)
    T = len(c.names)
    kb = max([b.numel() for b in bounds] + [1])
    kb = next((w for w in (3, 7, 15, 31, 63) if kb <= w), kb)  # the kernels' fixed widths
    B = np.full((T, kb), np.inf, np.float32)
    for i, b in enumerate(bounds):
        B[i, :b.numel()] = b.numpy()
    nb = np.array([b.numel() for b in bounds], np.int64)
    top = max(ks) + 1
    codes = np.empty(x.size, np.uint8 if top < 256 else np.int16 if top < 32768 else np.int32)
    prot_off = np.concatenate([[0], np.cumsum(n_prot)]).astype(np.int64)
    prot = np.empty(int(prot_off[-1]), np.float32)
    assign_kernel(x, g, c.offsets, *_param_arrays(params), B, nb, np.array(ks, np.int64), codes, prot, prot_off)
    return torch.from_numpy(codes), torch.from_numpy(prot), prot_off


def _padded(centers: list[torch.Tensor]) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(centers, batch_first=True, padding_value=math.inf)


# Both below give each tensor's result in one call over all of them (~40 us of torch calls a tensor
# otherwise), the same bits: their ops are IEEE add/mul, whose result does not depend on where a
# value sits in the batch. The log domain's exp does (torch's vectorized and scalar loops differ in
# the last bit), so there it stays one call a tensor.

def _batched(centers: list[torch.Tensor], domain: str) -> torch.Tensor | None:
    """The centers padded into one (R, k) batch for ``_bounds`` and ``_codebooks``, or None where
    they go one tensor at a time."""
    return None if domain == "log" or len(centers) < 2 else _padded(centers)


def _bounds(centers: list[torch.Tensor], domain: str, padded: torch.Tensor | None) -> list[torch.Tensor]:
    """``[level_bounds(c, domain) for c in centers]`` (``padded``: ``_batched(centers, domain)``)."""
    if padded is None:
        return [level_bounds(c, domain) for c in centers]
    rows = level_bounds(padded, domain)  # a +inf center gives +inf boundaries
    return [row[:max(c.numel() - 1, 0)] for row, c in zip(rows, centers)]


def _codebooks(centers: list[torch.Tensor], domain: str, padded: torch.Tensor | None) -> list[torch.Tensor]:
    """Each record's codebook: [0, f^-1(domain centers), NaN] (float32)."""
    if padded is None:
        vals = [from_domain(c.to(torch.float64), domain).to(torch.float32).numpy() for c in centers]
    else:
        vals = from_domain(padded.to(torch.float64), domain).to(torch.float32).numpy()
    out = []
    for row, c in zip(vals, centers):
        k = c.numel()
        book = np.empty(k + 2, np.float32)
        book[0], book[1:k + 1], book[k + 1] = 0.0, row[:k], np.nan
        out.append(torch.from_numpy(book))
    return out


def _quantized(name, x, plan, codebook, codes, prot, n_pruned, n_prot) -> QuantizedTensor:
    cfg = plan.config
    ltp = plan.layer_types[plan.tensors[name]]
    k = codebook.numel() - 2
    meta = {"descriptor": dq.DESCRIPTOR, "domain": cfg.domain, "k": k, "center_scope": cfg.center_scope,
            "prune_metric": cfg.prune_metric, "n_pruned": n_pruned, "n_protected": n_prot, **ltp.to_meta()}
    return QuantizedTensor(codes=codes, n_levels=k + 2, codebook=codebook, shape=tuple(x.shape),
                           dtype=dtype_name(x.dtype), side={"protected": prot}, meta=meta)
