"""Golden chains of every method: as ckptzip 0.1 wrote them, and as today's writer writes them.

``golden_methods_v1/`` was written ONCE with the 0.1 tree (commit 47704d1: ``git worktree add
/tmp/v01 47704d1``, then ``python tests/data/make_golden_methods.py`` there with
``PYTHONPATH=/tmp/v01/src``, and the folder copied back). Never regenerate it with newer code: it
proves that files written by 0.1 keep decoding to exactly what 0.1 decoded
(tests/test_golden_methods.py). One deliberate exception: Adam's denominator is decoded with a
correctly rounded sqrt since torch's fp32 sqrt differs by CPU (quant/base.sqrt_rn); the one exp_avg
where 0.1's host rounded otherwise (step 4, ``optimizer/state/0/exp_avg``: 15 values a last bit
apart) now expects the correctly rounded decode (a value added to values.safetensors).

``golden_methods_v2/`` pins today's format (docs/FORMAT.md): ``python tests/data/make_golden_methods.py
--current`` re-encodes the v1 inputs with today's writer (every chain but the searching one, whose
choice depends on the live model) and keeps the chains whose bytes differ from 0.1's, with what
today's reader restores from them (new tensors, if any, in its own values.safetensors) and the
zstd build in versions.json. The test re-encodes the inputs and compares every container byte for
byte with v2's file, or v1's where the format did not change. Regenerate it only after a
deliberate format change (and update FORMAT.md with it); the files it replaces must stay readable,
so move them to a new frozen golden folder first when an old reader path is at stake.

``golden_methods_v2_ans/`` is such a folder: v2's ``dynaquant`` and ``dynaquant-residual`` chains as
written while ``auto`` and the grid moment codec coded with ``ans/1``, before ``rans/1`` replaced it
(their restore is v2's ``expected.json`` entry of the same name). ``golden_methods_v3/`` is another:
four of v2's chains in container format version 3 (a safetensors tensor a blob), before version 4
put the blobs in one tensor. ``golden_methods_v2_blobs/``: v2's ``dynaquant`` and ``dynaquant-residual`` chains as
written before stage ``batch/1`` (each quantized record's parts in blobs of its own).

golden_methods_v1/
    values.safetensors   every distinct tensor below, keyed by the first 16 hex digits of
                         sha256(dtype | shape | bytes): the inputs and what 0.1 decoded
    inputs.json          per step: the FlatState that was saved (records, skeleton, extra,
                         tensors as value keys)
    expected.json        per chain: method, config, and per step the restored skeleton ("input"
                         when it equals the saved one) and tensors (value keys) that 0.1's
                         restore produced
    <chain>/             the chain itself (index.json + one container per step)

The training state is real and small: a digits classifier (scikit-learn's 8x8 digits) with a
LayerNorm, a bf16 linear layer, a class-embedding matrix tied to the output head (an alias in the
skeleton), a frozen parameter outside the optimizer, an int and a partly-changing float buffer, Adam
moments (bf16 for the bf16 layer), a bf16 tensor holding -0.0 / NaN / inf, a numpy array and a few
scalars, saved at three steps. The quantizing methods run with ``min_numel=128`` so that more than
one tensor is quantized at this size; every chain is a keyframe plus two saves (deltas where the
method deltas).
"""
from __future__ import annotations

import copy
import hashlib
import json
import pathlib
import shutil

HERE = pathlib.Path(__file__).resolve().parent
OUT = HERE / "golden_methods_v1"
OUT_CURRENT = HERE / "golden_methods_v2"
STEPS = (4, 8, 12)
_Q = {"min_numel": 128}

# chain name -> (method, config overrides, uses the config search)
CHAINS: dict[str, tuple[str, dict, bool]] = {
    "lossless": ("lossless", {}, False),
    "dynaquant": ("dynaquant", {**_Q}, False),
    "dynaquant-huffman": ("dynaquant", {**_Q, "coder": "huffman", "delta_moments": True}, False),
    "dynaquant-zstd": ("dynaquant", {**_Q, "coder": "zstd", "rearrange": False, "rle": False}, False),
    "dynaquant-search": ("dynaquant", {**_Q}, True),
    "qd": ("qd", {**_Q}, False),
    "cnr": ("cnr", {**_Q}, False),
    "gobo": ("gobo", {**_Q}, False),
    "bitsnap": ("bitsnap", {}, False),
    "bitsnap-zstd": ("bitsnap", {"payload_codec": "zstd", "max_cached_iterations": 1}, False),
    "bitsnap-none": ("bitsnap", {"payload_codec": "none", "adam_guard": False}, False),
    "bitsnap-lossless": ("bitsnap-lossless", {}, False),
    "excp": ("excp", {}, False),
    "excp-fixed": ("excp-fixed", {}, False),
    "excp-fixed-kmeans": ("excp-fixed", {"keyframe_weights": "kmeans", "coders": ["zstd"]}, False),
    "excp-fixed-xz": ("excp-fixed", {"coders": ["xz"], "exact_min_bytes": 0}, False),
    "excp-fixed-huffman": ("excp-fixed", {"coders": ["huffman"]}, False),
    "excp-fixed-ans": ("excp-fixed", {"coders": ["ans"], "exact_min_bytes": 65536}, False),
}
# chains of records 0.1 could not write, in today's config layout (golden_methods_v2 only)
CHAINS_CURRENT: dict[str, tuple[str, dict, bool]] = {
    "dynaquant-residual": ("dynaquant", {"quantizer": {**_Q}, "residual": "always"}, False),  # residual/1 deltas
}


def value_key(t) -> str:
    from ckptzip.tensorbytes import dtype_name, tensor_to_bytes

    h = hashlib.sha256(f"{dtype_name(t.dtype)}|{list(t.shape)}|".encode())
    h.update(tensor_to_bytes(t))
    return h.hexdigest()[:16]


def build_run():
    """(model, optimizer, train_step(i), eval_fn, extra_state(i)) of the golden training run."""
    import numpy as np
    import torch
    from torch import nn

    from ckptzip.demo.workloads import digits_data

    class TiedDigits(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(64, 4)                        # 256 fp32 weights
            self.norm = nn.LayerNorm(4)
            self.proj = nn.Linear(4, 32).to(torch.bfloat16)    # bf16 layer: bf16 Adam moments
            self.emb = nn.Embedding(12, 32)                    # class embeddings (rows 10, 11 unused) ...
            self.head = nn.Linear(32, 12, bias=False)
            self.head.weight = self.emb.weight                 # ... tied to the output head
            self.gain = nn.Parameter(torch.ones(32), requires_grad=False)  # frozen: no optimizer state
            self.register_buffer("seen", torch.zeros(64))      # changes only where a pixel was ever lit
            self.register_buffer("batches", torch.tensor(0))   # int64

        def forward(self, x):
            if self.training:
                self.seen += (x.sum(0) > 0).float()
                self.batches += 1
            h = torch.relu(self.norm(self.fc1(x)))
            h = self.proj(h.to(torch.bfloat16)).float() * self.gain
            return self.head(h)

    torch.manual_seed(0)
    xtr, ytr, xte, yte = digits_data(0)
    model = TiedDigits()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)  # lr differs at every save
    g = torch.Generator().manual_seed(0)

    def train_step(i):
        idx = torch.randint(0, len(xtr), (32,), generator=g)
        loss = nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()

    @torch.no_grad()
    def eval_fn(m):
        was = m.training
        m.eval()
        out = float(nn.functional.cross_entropy(m(xte), yte))
        m.train(was)
        return out

    def extra_state(i):
        return {"epoch": i, "note": None, "scheduler": sched.state_dict(),
                "bits": torch.tensor([-0.0, float("nan"), float("inf"), 1.5]).to(torch.bfloat16),
                "np_counts": np.arange(5, dtype=np.uint32) * (i + 1)}

    return model, opt, train_step, eval_fn, extra_state


def main() -> None:
    import torch
    from safetensors.torch import save_file

    from ckptzip import CheckpointChain
    from ckptzip.chain import KeyframePolicy
    from ckptzip.methods.base import EncodeContext
    from ckptzip.state import FlatState, flatten_state

    torch.set_num_threads(1)
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir()
    values: dict[str, torch.Tensor] = {}

    def keep(t) -> str:
        k = value_key(t)
        values.setdefault(k, t.detach().cpu().contiguous().clone())
        return k

    model, opt, train_step, eval_fn, extra_state = build_run()
    chains = {name: CheckpointChain(OUT / name, method, cfg, keyframe=KeyframePolicy(every=10))
              for name, (method, cfg, _) in CHAINS.items()}
    inputs = {}
    done = 0
    for i, step in enumerate(STEPS):
        while done < step:
            train_step(done)
            done += 1
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), **extra_state(i)}
        flat = flatten_state(copy.deepcopy(state), model, opt)
        inputs[str(step)] = {"records": {n: r.to_dict() for n, r in flat.records.items()},
                             "skeleton": flat.skeleton, "extra": flat.extra,
                             "tensors": {n: keep(t) for n, t in flat.tensors.items()}}
        for name, chain in chains.items():
            fresh = FlatState({n: t.clone() for n, t in flat.tensors.items()}, dict(flat.records),
                              copy.deepcopy(flat.skeleton), dict(flat.extra))
            search = CHAINS[name][2]
            ctx = EncodeContext(step=step, model=model, eval_fn=eval_fn) if search else None
            chain.save(fresh, step, model=model, ctx=ctx)
    expected = {}
    for name, chain in chains.items():
        method, cfg, search = CHAINS[name]
        steps = {}
        for step in STEPS:
            r = CheckpointChain(OUT / name).restore(step)
            same = r.flat.skeleton == inputs[str(step)]["skeleton"]
            steps[str(step)] = {"keyframe": r.manifest["keyframe"], "skeleton": "input" if same else r.flat.skeleton,
                                "tensors": {n: keep(t) for n, t in r.flat.tensors.items()}}
        expected[name] = {"method": method, "config": cfg, "search": search, "steps": steps}
    save_file(dict(sorted(values.items())), OUT / "values.safetensors")
    (OUT / "inputs.json").write_text(json.dumps(inputs, indent=1) + "\n")
    (OUT / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"wrote {OUT.name}/: {len(CHAINS)} chains, {len(values)} distinct tensors, {total} bytes")


# --- today's writer -------------------------------------------------------------------------------
def load_inputs() -> tuple[dict, dict]:
    """(inputs.json, every tensor of values.safetensors) of golden_methods_v1."""
    from safetensors.torch import load_file

    return json.loads((OUT / "inputs.json").read_text()), load_file(OUT / "values.safetensors")


def all_values() -> dict:
    """Every tensor a golden test compares against: v1's values.safetensors and v2's additions."""
    from safetensors.torch import load_file

    out = load_file(OUT / "values.safetensors")
    if (OUT_CURRENT / "values.safetensors").exists():
        out.update(load_file(OUT_CURRENT / "values.safetensors"))
    return out


def input_state(step: int, inputs: dict, values: dict):
    """The FlatState saved at ``step`` (a fresh copy: methods may not alias their input)."""
    from ckptzip.state import FlatState, TensorRecord

    x = inputs[str(step)]
    return FlatState({n: values[k].clone() for n, k in x["tensors"].items()},
                     {n: TensorRecord.from_dict(n, r) for n, r in x["records"].items()},
                     copy.deepcopy(x["skeleton"]), dict(x["extra"]))


def encode_chain(name: str, url, inputs: dict, values: dict) -> None:
    """Save chain ``name``'s steps of the golden inputs at ``url`` with today's writer."""
    from ckptzip import CheckpointChain
    from ckptzip.chain import KeyframePolicy
    from ckptzip.methods.base import get_method, method_for_file

    method, cfg, search = {**CHAINS, **CHAINS_CURRENT}[name]
    assert not search, f"{name} searches against the live model: its bytes are not reproducible from inputs"
    # CHAINS holds 0.1's configs: today's method reads them as a version-1 file's
    m = get_method(method, cfg) if name in CHAINS_CURRENT else method_for_file(f"{method}/1", cfg)
    chain = CheckpointChain(url, m, keyframe=KeyframePolicy(every=10))
    for step in STEPS:
        chain.save(input_state(step, inputs, values), step)


def zstd_version() -> str:
    import zstandard

    return ".".join(map(str, zstandard.ZSTD_VERSION))


def main_current() -> None:
    from safetensors.torch import save_file

    from ckptzip import CheckpointChain

    inputs, values = load_inputs()
    shutil.rmtree(OUT_CURRENT, ignore_errors=True)
    OUT_CURRENT.mkdir()
    new_values, expected = {}, {}
    for name, (method, cfg, search) in {**CHAINS, **CHAINS_CURRENT}.items():
        if search:
            continue
        d = OUT_CURRENT / name
        encode_chain(name, d, inputs, values)
        if name in CHAINS and all(f.read_bytes() == (OUT / name / f.name).read_bytes() for f in d.glob("*.ckz")):
            shutil.rmtree(d)  # the format of this chain did not change: v1 pins it
            continue
        steps = {}
        for step in STEPS:
            r = CheckpointChain(d).restore(step)
            keys = {}
            for n, t in r.flat.tensors.items():
                keys[n] = value_key(t)
                if keys[n] not in values:
                    new_values.setdefault(keys[n], t.contiguous().clone())
            same = r.flat.skeleton == inputs[str(step)]["skeleton"]
            steps[str(step)] = {"keyframe": r.manifest["keyframe"], "skeleton": "input" if same else r.flat.skeleton,
                                "tensors": keys}
        expected[name] = {"method": method, "config": cfg, "search": search, "steps": steps}
    if new_values:
        save_file(dict(sorted(new_values.items())), OUT_CURRENT / "values.safetensors")
    (OUT_CURRENT / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    (OUT_CURRENT / "versions.json").write_text(json.dumps({"zstd": zstd_version()}) + "\n")
    total = sum(p.stat().st_size for p in OUT_CURRENT.rglob("*") if p.is_file())
    print(f"wrote {OUT_CURRENT.name}/: {len(expected)} chains whose bytes changed since 0.1 "
          f"({', '.join(expected)}), {len(new_values)} new tensors, {total} bytes")


if __name__ == "__main__":
    import sys

    main_current() if sys.argv[1:] == ["--current"] else main()
