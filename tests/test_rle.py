"""Run-length encoding with the sign trick (codec/rle.py)."""
from __future__ import annotations

import pytest
import torch

from ckptzip.codec.rle import HAVE_NUMBA, rle_decode, rle_encode, run_count
from ckptzip.errors import CorruptCheckpointError

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
BACKENDS = ["torch"] + (["numba"] if HAVE_NUMBA else [])


def rle_reference(values: list[int]) -> list[int]:
    """Loop-by-loop reference of the paper's scheme: -v, then L only when L > 1."""
    out: list[int] = []
    i = 0
    while i < len(values):
        j = i
        while j < len(values) and values[j] == values[i]:
            j += 1
        out.append(-values[i])
        if j - i > 1:
            out.append(j - i)
        i = j
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_paper_example_and_zero_values(backend):
    x = torch.tensor([0, 0, 0, 3, 1, 1])
    s = rle_encode(x, backend=backend)
    assert s.tolist() == [0, 3, -3, -1, 2]                      # -0 == 0 is a value, 3 a length
    assert s.dtype == torch.int64
    assert torch.equal(rle_decode(s, backend=backend), x)
    assert rle_encode(torch.tensor([0]), backend=backend).tolist() == [0]
    assert rle_encode(torch.tensor([5, 5]), backend=backend).tolist() == [-5, 2]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_random_round_trip_matches_reference(seed, device, backend):
    if device != "cpu" and backend == "numba":
        pytest.skip("numba runs on CPU tensors only")
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 3000, (1,), generator=g))
    n_values = [1, 2, 3, 16, 1000, 1 << 40][seed]
    # runs of geometric length so both short and long runs occur
    vals = torch.randint(0, min(n_values, 1 << 62), (n,), generator=g)
    reps = torch.randint(1, [2, 3, 8, 50, 2, 5][seed] + 1, (n,), generator=g)
    x = torch.repeat_interleave(vals, reps)
    s = rle_encode(x.to(device), backend=backend)
    assert s.device.type == device
    assert s.cpu().tolist() == rle_reference(x.tolist())
    assert torch.equal(rle_decode(s, x.numel(), backend=backend).cpu(), x)
    assert torch.equal(rle_decode(s, backend=backend).cpu(), x)
    runs = run_count(x)
    assert s.numel() == runs + int((torch.unique_consecutive(x, return_counts=True)[1] > 1).sum())


def test_stream_is_shorter_than_pairs_when_runs_are_short():
    # the point of the sign trick: length-1 runs cost one entry, not two
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, 1000, (10_000,), generator=g)          # almost all runs have length 1
    s = rle_encode(x)
    assert s.numel() < 1.01 * x.numel()
    assert s.numel() == run_count(x) + int((torch.unique_consecutive(x, return_counts=True)[1] > 1).sum())


@pytest.mark.parametrize("backend", BACKENDS)
def test_group_sizes_cut_runs_and_decode_as_concatenation(backend):
    x = torch.tensor([0, 0, 0, 0, 2, 2, 0, 0])
    whole = rle_encode(x, backend=backend)
    grouped = rle_encode(x, group_sizes=torch.tensor([0, 2, 3, 0, 3]), backend=backend)
    assert whole.tolist() == [0, 4, -2, 2, 0, 2]
    assert grouped.tolist() == [0, 2, 0, 2, -2, -2, 0, 2]
    per_group = torch.cat([rle_decode(rle_encode(p)) for p in torch.split(x, [2, 3, 0, 3]) if p.numel()])
    assert torch.equal(rle_decode(grouped, backend=backend), x) and torch.equal(per_group, x)
    with pytest.raises(ValueError, match="sum"):
        rle_encode(x, group_sizes=torch.tensor([2, 2]))


def test_empty_and_dtypes():
    assert rle_encode(torch.zeros(0, dtype=torch.int32)).numel() == 0
    assert rle_decode(torch.zeros(0, dtype=torch.int64)).numel() == 0
    assert rle_decode(torch.zeros(0, dtype=torch.int64), 0).numel() == 0
    x = torch.tensor([1, 1, 2], dtype=torch.int32)
    assert torch.equal(rle_decode(rle_encode(x)), x.long())
    with pytest.raises(ValueError, match=">= 0"):
        rle_encode(torch.tensor([1, -1]))
    with pytest.raises(TypeError):
        rle_encode(torch.tensor([1.0]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32])
def test_narrow_input_encodes_as_int64(backend, dtype):
    # read as they are (no int64 copy); 200 and 255 catch a negation in the narrow type
    hi = 256 if dtype == torch.uint8 else 128
    x = torch.tensor([200, 200, 255, 0, 0, 0, 127, 3] if hi == 256 else [100, 100, 127, 0, 0, 0, 5, 3])
    x = torch.cat([x, torch.randint(0, hi, (3000,), generator=torch.Generator().manual_seed(4)).repeat_interleave(3)])
    got = rle_encode(x.to(dtype), backend=backend)
    assert got.dtype == torch.int64 and torch.equal(got, rle_encode(x, backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("stream,n,match", [
    ([3, 0], None, "starts with a run length"),
    ([0, 3, 2], None, "two run lengths"),
    ([0, 1], None, "length of 1"),
    ([0, 5], 4, "exceeds"),
    ([0, 3, -1], 5, "decodes to 4"),
    ([], 3, "empty"),
    ([-(2**63)], None, "negated"),
])
def test_corrupt_streams_raise(stream, n, match, backend):
    with pytest.raises(CorruptCheckpointError, match=match):
        rle_decode(torch.tensor(stream, dtype=torch.int64), n, backend=backend)


def test_large_stream_backends_agree():
    # 2M values with long zero runs: a Python loop would take seconds, these are milliseconds
    g = torch.Generator().manual_seed(8)
    x = torch.zeros(2_000_000, dtype=torch.int64)
    hits = torch.randint(0, x.numel(), (20_000,), generator=g)
    x[hits] = torch.randint(1, 16, (20_000,), generator=g)
    streams = [rle_encode(x, backend=b) for b in BACKENDS]
    assert all(torch.equal(s, streams[0]) for s in streams)
    assert streams[0].numel() < 0.03 * x.numel()
    for b in BACKENDS:
        assert torch.equal(rle_decode(streams[0], x.numel(), backend=b), x)
