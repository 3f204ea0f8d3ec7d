"""CUDA: the same files as the CPU for the same input, restores onto the GPU, and a training run on
the GPU that saves (sync and async) and resumes (issue 15, item 5). Skipped without a CUDA device;
CI has none, so these run on a lent GPU machine (docs/BENCHMARKS.md, "CUDA")."""
from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch

import ckptzip
from ckptzip import CheckpointChain

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

DATA = Path(__file__).resolve().parent / "data"
V1, V2 = DATA / "golden_methods_v1", DATA / "golden_methods_v2"
_spec = importlib.util.spec_from_file_location("make_golden_methods", DATA / "make_golden_methods.py")
golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(golden)
INPUTS = json.loads((V1 / "inputs.json").read_text())
EXPECTED = {**json.loads((V1 / "expected.json").read_text()), **json.loads((V2 / "expected.json").read_text())}
FIXED = sorted(n for n, (_, _, search) in {**golden.CHAINS, **golden.CHAINS_CURRENT}.items() if not search)


@pytest.fixture(scope="module")
def values():
    return golden.all_values()


@pytest.mark.parametrize("name", FIXED)
def test_cuda_input_writes_the_cpu_bytes(name, tmp_path, values):
    """Every method and variant, fed the golden inputs as CUDA tensors, writes the golden files."""
    pinned = json.loads((V2 / "versions.json").read_text())["zstd"]
    if golden.zstd_version() != pinned:
        pytest.skip(f"golden bytes were written with zstd {pinned}, this is {golden.zstd_version()}")
    golden.encode_chain(name, tmp_path / name, INPUTS, {k: v.cuda() for k, v in values.items()})
    ref = V2 / name if (V2 / name).exists() else V1 / name
    files = sorted(f.name for f in ref.glob("*.ckz"))
    assert files == sorted(f.name for f in (tmp_path / name).glob("*.ckz"))
    for f in files:
        assert (tmp_path / name / f).read_bytes() == (ref / f).read_bytes(), f"{name}/{f}: CUDA wrote other bytes"


@pytest.mark.parametrize("name", FIXED)
def test_restore_onto_cuda(name, values):
    folder = V2 / name if (V2 / name).exists() else V1 / name
    exp = EXPECTED[name]
    for step, want in exp["steps"].items():
        r = CheckpointChain(folder).restore(int(step), device="cuda")
        assert sorted(r.flat.tensors) == sorted(want["tensors"])
        for rec, key in want["tensors"].items():
            t = r.flat.tensors[rec]
            assert t.is_cuda, f"{name} step {step} {rec} restored on {t.device}"
            assert t.dtype == values[key].dtype and t.shape == values[key].shape
            assert torch.equal(t.cpu().view(-1).view(torch.uint8), values[key].view(-1).view(torch.uint8)), \
                f"{name} step {step} {rec}"


def _cuda_state(snap) -> dict:
    return {"model": _to(snap.model, "cuda"), "optimizer": _to(copy.deepcopy(snap.optimizer), "cuda")}


def _to(obj, device, fresh=False):
    """``obj`` with its tensors on ``device`` (``fresh``: as zeros, a load target of its shapes)."""
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj, device=device) if fresh else obj.to(device)
    if isinstance(obj, dict):
        return {k: _to(v, device, fresh) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to(v, device, fresh) for v in obj]
    return obj


@pytest.mark.parametrize("method", ["dynaquant", "lossless", "excp", "excp-fixed", "bitsnap", "qd", "cnr", "gobo"])
def test_training_state_on_cuda_writes_the_cpu_bytes(method, digits_snapshots, tmp_path):
    """A real Adam run's nested state dict (default configs), saved from the GPU and from the CPU."""
    _, _, snaps, _ = digits_snapshots
    cpu, gpu = CheckpointChain(tmp_path / "cpu", method), CheckpointChain(tmp_path / "gpu", method)
    for s in snaps[:4]:
        cpu.save({"model": s.model, "optimizer": s.optimizer}, s.step)
        gpu.save(_cuda_state(s), s.step)
    for e in cpu.entries():
        assert (tmp_path / "gpu" / e.file).read_bytes() == (tmp_path / "cpu" / e.file).read_bytes(), \
            f"{method} step {e.step}: CUDA wrote other bytes"
    r = gpu.restore(snaps[3].step, device="cuda")
    assert all(t.is_cuda for t in r.flat.tensors.values())


def test_on_host_copies_a_cuda_state_once(digits_snapshots):
    """A save's one copy of a GPU state: every tensor in host memory with the GPU's values, marked as
    the save's own so methods keep it (exact parents, BitSnap's base) without a second copy."""
    from ckptzip.state import flatten_state, on_host

    snap = digits_snapshots[2][-1]
    flat = flatten_state(_cuda_state(snap))
    h = on_host(flat)
    assert h.copied == set(flat.tensors)
    for n, t in h.tensors.items():
        assert t.is_cpu and t.is_contiguous() and torch.equal(t, flat.tensors[n].cpu()), n
        assert h.own(n) is t


@pytest.mark.parametrize("async_save", [False, True])
def test_training_on_cuda_saves_and_resumes(async_save, tmp_path):
    """Train on the GPU, save every 20 steps (the async engine stages through pinned memory), restore
    into a fresh model on the GPU and go on training."""
    from ckptzip.demo.workloads import DigitsMLP, digits_data

    xtr, ytr, _, _ = digits_data(0)
    x, y = xtr.cuda(), ytr.cuda()
    torch.manual_seed(0)
    m = DigitsMLP(64).cuda()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)

    def step():
        idx = torch.randint(0, len(x), (64,), generator=g).cuda()
        loss = torch.nn.functional.cross_entropy(m(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()

    with ckptzip.Compressor(m, opt, tmp_path / "c", "dynaquant", async_save=async_save) as ck:
        for i in range(1, 61):
            step()
            if i % 20 == 0:
                ck.save(i)
        ck.wait()
    want = CheckpointChain(tmp_path / "c").restore(60).state["model"]  # the CPU's decode
    m2 = DigitsMLP(64).cuda()
    opt2 = torch.optim.Adam(m2.parameters(), lr=1e-3)
    with ckptzip.Compressor(m2, opt2, tmp_path / "c", "dynaquant") as ck:
        assert ck.restore() == 60
    for k, v in m2.state_dict().items():
        assert v.is_cuda and torch.equal(v.cpu(), want[k]), k
    assert all(t.is_cuda for st in opt2.state.values() for t in st.values() if isinstance(t, torch.Tensor)
               and t.dim() > 0)
    m, opt = m2, opt2
    for _ in range(5):
        step()  # training goes on from the restored state



@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_saves_from_cuda_and_loads_onto_cuda(digits_snapshots, tmp_path):
    """ckptzip.dcp: a CUDA state dict saves as its CPU copy does, and loads into CUDA tensors
    (``CompressedReader(device="cuda")``) with the CPU's values."""
    import torch.distributed.checkpoint as dcp

    from ckptzip.dcp import CompressedReader, CompressedWriter, forget
    from ckptzip.dcp.tools import flat_tensors

    _, _, snaps, _ = digits_snapshots
    loaded = {}
    try:
        for where, device in (("cpu", "cpu"), ("gpu", "cuda")):
            for s in snaps[:3]:
                state = {"model": _to(s.model, device), "optim": _to(copy.deepcopy(s.optimizer), device)}
                dcp.save(state, storage_writer=CompressedWriter(tmp_path / where, step=s.step, method="dynaquant"))
            target = _to(state, device, fresh=True)
            dcp.load(target, storage_reader=CompressedReader(tmp_path / where, device=device))
            loaded[where] = target
    finally:
        forget()
    cpu, gpu = dict(flat_tensors(loaded["cpu"])), dict(flat_tensors(loaded["gpu"]))
    assert cpu and cpu.keys() == gpu.keys()
    for k, a in cpu.items():
        assert gpu[k].is_cuda and torch.equal(a, gpu[k].cpu()), k
