"""Method ``lossless`` (methods/lossless.py) and its byte-grouping codec (codec/bytegroup.py):
bit-exact for every dtype and special value, the XOR delta path on real training deltas, and
corrupt blobs raise CorruptCheckpointError (never another exception).
"""
import dataclasses
import struct

import numpy as np
import pytest
import torch

from ckptzip.codec import bytegroup
from ckptzip.errors import CkptzipError, CorruptCheckpointError
from ckptzip.methods.base import DecodeContext, EncodeContext, Encoded, get_method
from ckptzip.methods.lossless import LosslessConfig, LosslessMethod
from ckptzip.state import flatten_state
from ckptzip.tensorbytes import tensor_to_bytes


@pytest.fixture(autouse=True)
def _one_torch_thread():
    # many tiny ops: intra-op threads only add contention on a shared CPU (conftest restores the count)
    torch.set_num_threads(1)


BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    w = BITS[a.element_size()]
    return torch.equal(a.contiguous().view(w), b.contiguous().view(w))


def special_floats(dtype: torch.dtype) -> torch.Tensor:
    """-0.0, +-inf, NaNs with odd payloads and signs, subnormals, extremes, plus ordinary values."""
    width = torch.finfo(dtype).bits
    ibits = BITS[width // 8]
    fi = torch.finfo(dtype)
    vals = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), fi.max, -fi.max, fi.tiny, -fi.tiny,
                         fi.smallest_normal / 4, -fi.smallest_normal / 2, fi.eps, 1.0, -1.5], dtype=torch.float64)
    vals = vals.to(dtype)
    exp_bits = {64: 11, 32: 8, 16: 5 if dtype == torch.float16 else 8}[width]
    man_bits = width - 1 - exp_bits
    nan_hi = ((1 << exp_bits) - 1) << man_bits  # all-ones exponent
    payloads = [nan_hi | 1, nan_hi | (1 << (man_bits - 1)), nan_hi | ((1 << man_bits) - 1), nan_hi | 0b1010]
    signed = [p - (1 << width) for p in payloads] + [p - (1 << width) + (1 << (width - 1)) for p in payloads]
    nans = torch.tensor([p if p < (1 << (width - 1)) else p - (1 << width) for p in payloads] + signed[4:],
                        dtype=torch.int64).to(ibits).view(dtype)
    subnormals = torch.arange(1, 40, dtype=ibits).view(dtype)  # the smallest subnormal bit patterns
    g = torch.Generator().manual_seed(0)
    ordinary = (torch.randn(500, generator=g, dtype=torch.float64) * 3).to(dtype)
    return torch.cat([vals, nans, subnormals, -subnormals, ordinary])


FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("dtype", FLOATS)
def test_special_values_survive_keyframe_and_delta(dtype, grouped):
    cur = special_floats(dtype)
    assert cur.isnan().sum() >= 8 and (cur == 0).sum() >= 2
    # the delta's parent: some bits changed by an ulp, some NaNs swapped for numbers and back
    prev = cur.clone().view(BITS[cur.element_size()])
    prev[::3] ^= 1
    prev = prev.view(dtype)
    m = LosslessMethod()
    m.group_below = m.group_below if grouped else 0
    s0 = flatten_state({"x": prev.reshape(-1, 1)})
    s1 = flatten_state({"x": cur.reshape(-1, 1)})
    e0, r0 = m.encode(s0, None, ctx=EncodeContext(step=0))
    e1, r1 = m.encode(s1, r0, ctx=EncodeContext(step=1))
    assert e0.keyframe and not e1.keyframe
    assert e1.records["x"]["pipeline"] == ["lossless/1", "xor/1"] + ["group/1"] * grouped + ["bytegroup/1"]
    d0, dr0 = m.decode(s0.records, e0, None, ctx=DecodeContext(step=0))
    d1, _ = m.decode(s1.records, e1, dr0, ctx=DecodeContext(step=1))
    assert bits_equal(d0["x"], prev.reshape(-1, 1)) and bits_equal(d1["x"], cur.reshape(-1, 1))


@pytest.mark.parametrize("checksum", ["blake3", "crc32", None])
def test_encoder_digests_are_its_blobs_checksums(checksum):
    # lossless hashes each own blob in its thread, while it is in cache: each digest is the blob's
    from ckptzip.format import blob_digest

    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(64, 256, generator=g), "b": torch.randn(8, generator=g)}
    enc, _ = LosslessMethod().encode(flatten_state(state), None, ctx=EncodeContext(step=1, checksum=checksum))
    want = {enc.records["w"]["blobs"]["data"]} if checksum else set()
    assert set(enc.digests) == want
    for key in want:
        kind, value, of = enc.digests[key]
        assert (kind, value) == (checksum, blob_digest(checksum, enc.blobs[key])) and of is enc.blobs[key]


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool])
def test_integer_and_bool_tensors_exact(dtype):
    g = torch.Generator().manual_seed(1)
    if dtype == torch.bool:
        a = torch.rand(257, generator=g) > 0.5
    else:
        info = torch.iinfo(dtype)
        a = torch.randint(info.min, info.max, (257,), generator=g, dtype=torch.int64).to(dtype)
        a[:2] = torch.tensor([info.min, info.max], dtype=dtype)
    b = a.clone()
    b[::5] = ~b[::5] if dtype == torch.bool else b[::5] // 2
    m = LosslessMethod()
    sa, sb = flatten_state({"a": a}), flatten_state({"a": b})
    ea, ra = m.encode(sa, None, ctx=EncodeContext(step=0))
    eb, _ = m.encode(sb, ra, ctx=EncodeContext(step=1))
    da, dra = m.decode(sa.records, ea, None, ctx=DecodeContext(step=0))
    db, _ = m.decode(sb.records, eb, dra, ctx=DecodeContext(step=1))
    assert bits_equal(da["a"], a) and bits_equal(db["a"], b)


def _encode_run(snaps, level=3, **config):
    m = LosslessMethod(LosslessConfig(zstd_level=level, **config))
    ref, out = None, []
    for i, s in enumerate(snaps):
        flat = flatten_state({"model": s.model, "optimizer": s.optimizer})
        enc, ref = m.encode(flat, ref, ctx=EncodeContext(step=i))
        out.append((flat, enc))
    return m, out


def test_real_run_xor_deltas_exact_and_smaller(digits_snapshots):
    _, _, snaps, _ = digits_snapshots
    m, run = _encode_run(snaps[:4])
    ref = None
    for i, (flat, enc) in enumerate(run):
        assert enc.keyframe == (i == 0)
        tensors, ref = m.decode(flat.records, enc, ref, ctx=DecodeContext(step=i))
        assert set(tensors) == set(flat.tensors)
        for n, t in flat.tensors.items():
            assert bits_equal(tensors[n], t), (i, n)
    raw = sum(t.numel() * t.element_size() for t in run[0][0].tensors.values())
    key_bytes = sum(len(b) for b in run[0][1].blobs.values())
    delta_bytes = sum(len(b) for b in run[2][1].blobs.values())
    # float weights and moments do not compress much alone; an XOR delta of 20 Adam steps does better
    assert key_bytes < raw and delta_bytes < key_bytes
    w = "model/fc2.weight"
    xor = run[2][1].blob(w, "data")
    plain = bytegroup.compress(tensor_to_bytes(run[2][0].tensors[w]), 4)
    assert len(xor) < len(plain)


def test_plane_frames_decode_as_the_plain_level_and_are_no_larger(digits_snapshots):
    """The plane-tuned zstd frames (the default) and the plain level-3 reference are both standard
    frames the one reader decodes to the same bits; on real weights, moments and their XOR deltas
    the tuned ones are no larger."""
    _, _, snaps, _ = digits_snapshots
    tuned = plain = 0
    for prev, cur in zip(snaps[:3], snaps[1:4]):
        for old, new in ((prev.optimizer, cur.optimizer), (prev.model, cur.model)):
            a, b = flatten_state(old).tensors, flatten_state(new).tensors
            for n, t in b.items():
                if not t.is_floating_point():
                    continue
                raw, ref = tensor_to_bytes(t), tensor_to_bytes(a[n])
                for p in (None, ref):
                    x = bytegroup.compress(raw, t.element_size(), prev=p)
                    y = bytegroup.compress(raw, t.element_size(), prev=p, plane=False)
                    want = raw if p is None else (np.frombuffer(raw, np.uint8) ^ np.frombuffer(ref, np.uint8)).tobytes()
                    assert bytegroup.decompress(x) == bytegroup.decompress(y) == want
                    tuned, plain = tuned + len(x), plain + len(y)
    assert tuned <= plain


def test_grouped_small_records_decode_as_the_per_record_layout(digits_snapshots, tmp_path):
    """Small records share one group blob per width and kind (one set of frames, one checksum);
    the files decode to the same bits as the per-record layout (group_below=0), a flipped byte
    in a group blob is found and named, and a malformed meta.group is a typed error."""
    from ckptzip.chain import CheckpointChain, checkpoint_file
    from ckptzip.errors import CorruptCheckpointError as Corrupt

    _, _, snaps, _ = digits_snapshots
    states = [{"model": s.model, "optimizer": s.optimizer, "n": torch.arange(7)} for s in snaps[:3]]
    chains = {}
    for label, below in (("grouped", LosslessMethod.group_below), ("plain", 0)):
        m = LosslessMethod()
        m.group_below = below
        chains[label] = CheckpointChain(tmp_path / label, m)
        for i, s in enumerate(states):
            chains[label].save(s, i + 1)
    man = chains["grouped"].manifest(3)
    grouped = [n for n, r in man["records"].items() if "group/1" in r["pipeline"]]
    assert len(grouped) >= 4 and {"group.4f", "group.8i"} <= set(man["blobs"])
    assert any("xor/1" in man["records"][n]["pipeline"] for n in grouped)
    assert not any("group/1" in r["pipeline"] for r in chains["plain"].manifest(3)["records"].values())
    # a group blob's bytes are split over its records' roles (the demo's weights-only ratio needs them)
    for e in chains["grouped"].entries():
        roles = e.bytes_by_role
        assert "shared" not in roles and roles["weight"][1] > 0
        assert abs(sum(v[1] for v in roles.values()) - sum(b["nbytes"] for b in
                                                            chains["grouped"].manifest(e.step)["blobs"].values())) <= 4
    for step in (1, 2, 3):
        a, b = chains["grouped"].restore(step).flat.tensors, chains["plain"].restore(step).flat.tensors
        assert set(a) == set(b) and all(bits_equal(a[n], b[n]) for n in a)
    # a byte flipped inside the float group blob of the keyframe
    path = tmp_path / "grouped" / checkpoint_file(1)
    data = bytearray(path.read_bytes())
    manifest = chains["grouped"].manifest(1)
    keys = sorted(manifest["blobs"])
    start = len(data) - sum(manifest["blobs"][k]["nbytes"] for k in keys)
    off = start + sum(manifest["blobs"][k]["nbytes"] for k in keys[:keys.index("group.4f")])
    data[off + 20] ^= 0x01
    path.write_bytes(bytes(data))
    problems = list(map(str, chains["grouped"].verify(deep=False)))
    assert any("more record(s) sharing blob 'group.4f' are damaged" in p for p in problems), problems
    with pytest.raises(Corrupt, match="group.4f"):
        CheckpointChain(tmp_path / "grouped").load(2)
    # meta.group pointing outside its blob, or at no blob
    flat = flatten_state(states[0])
    m = LosslessMethod()
    enc, _ = m.encode(flat, None, ctx=EncodeContext(step=1))
    name = next(n for n, r in enc.records.items() if "group/1" in r["pipeline"])
    for bad in (["group.4f", 10**6, 3], ["nope", 0, 1], ["group.4f", -1, 1], "x"):
        enc.records[name]["meta"]["group"] = bad
        with pytest.raises(Corrupt, match="meta.group|outside"):
            m.decode(flat.records, enc, None, ctx=DecodeContext(step=1))


def test_bf16_copy_of_a_real_run_exact(digits_snapshots):
    _, _, snaps, _ = digits_snapshots
    bf = [type(s)(s.step, {k: v.to(torch.bfloat16) for k, v in s.model.items()}, s.optimizer) for s in snaps[:3]]
    m, run = _encode_run(bf)
    ref = None
    for i, (flat, enc) in enumerate(run):
        tensors, ref = m.decode(flat.records, enc, ref, ctx=DecodeContext(step=i))
        assert all(bits_equal(tensors[n], t) for n, t in flat.tensors.items())


def test_small_records_of_one_width_and_mixed_dtypes_round_trip():
    """fp16 and bf16, int8, uint8 and bool small records share a group blob: their words are joined as
    integers (numpy promoted the values to a wider type before, and they were restored wrong), in
    lossless and in a quantizing method's exact groups, keyframe and deltas."""
    from ckptzip.chain import CheckpointChain

    g = torch.Generator().manual_seed(0)

    def state(k):
        return {"model": {"h": torch.randn(50, generator=g).half(), "b": torch.randn(50, generator=g).bfloat16(),
                          "i": torch.randint(-100, 100, (30,), generator=g, dtype=torch.int8),
                          "u": torch.randint(0, 255, (30,), generator=g, dtype=torch.uint8),
                          "m": torch.rand(30, generator=g) > 0.5, "k": torch.tensor(k)}}

    states = [state(k) for k in range(3)]
    for method in ("lossless", "dynaquant"):
        url = f"memory://mixed-widths-{method}"
        ch = CheckpointChain(url, method)
        for i, s in enumerate(states):
            ch.save(s, i + 1)
        for i, s in enumerate(states):
            out = CheckpointChain(url).load(i + 1)["model"]
            assert all(bits_equal(out[k], v) for k, v in s["model"].items()), (method, i)


def test_keyframe_writes_its_reference_into_the_spent_one(digits_snapshots):
    """A chain's keyframe after deltas copies the state into its spent predecessor reference's
    buffers (``EncodeContext.recycle``) where dtype and shape match, a fresh copy where not; every
    step restores exactly, and the deltas after it are taken against the keyframe's bits."""
    from ckptzip.chain import CheckpointChain, KeyframePolicy

    _, _, snaps, _ = digits_snapshots
    states = [{"model": dict(s.model), "optimizer": s.optimizer} for s in snaps[:5]]
    grown = next(k for k, v in states[0]["model"].items() if v.numel() * v.element_size() >= 16384)
    states[2]["model"][grown] = torch.cat([states[2]["model"][grown]] * 2)  # the keyframe's shape differs
    states[3]["model"][grown] = states[2]["model"][grown] + 1
    url = "memory://recycle-keyframe"
    ch = CheckpointChain(url, "lossless", keyframe=KeyframePolicy(every=2))
    held = {}
    for i, s in enumerate(states):
        ch.save(s, i + 1)
        own = ch._ref.exact._own
        if i == 2:  # the second keyframe: the same buffers as the delta before it, but the grown one
            same = {n for n, t in own.items() if n in held and t.data_ptr() == held[n]}
            assert ch.entries()[-1].keyframe and same == set(held) - {f"model/{grown}"} and same
        held = {n: t.data_ptr() for n, t in own.items()}
    for i, s in enumerate(states):
        out = CheckpointChain(url).load(i + 1)
        assert all(bits_equal(out["model"][k], v) for k, v in s["model"].items()), i


def test_writer_reference_gives_the_delta_a_decoded_reference_gives(digits_snapshots):
    """A writer XORs each group blob with its parent group's words whole; a reference decoded from
    the files (a restart) XORs record by record: the same blobs. The planes of a delta that did not
    shrink are the next delta's prediction (``raw_planes``), each blob's raw planes."""
    _, _, snaps, _ = digits_snapshots
    m = LosslessMethod()
    flats = [flatten_state({"model": s.model, "optimizer": s.optimizer}) for s in snaps[:5]]
    ref = dref = None
    predicted = 0
    for i, flat in enumerate(flats):
        enc, new = m.encode(flat, ref, ctx=EncodeContext(step=i))
        if dref is not None:
            twin, _ = m.encode(flat, dataclasses.replace(dref, raw_planes=ref.raw_planes), ctx=EncodeContext(step=i))
            assert twin.blobs == enc.blobs and twin.records == enc.records
            for k, planes in new.raw_planes.items():
                assert planes == bytegroup.raw_planes(enc.blobs[k] if k in enc.blobs else enc.blob(k, "data")), k
                predicted += len(ref.raw_planes.get(k, ()))
        tensors, dref = m.decode(flat.records, enc, dref, ctx=DecodeContext(step=i))
        assert all(bits_equal(tensors[n], t) for n, t in flat.tensors.items())
        assert all(bits_equal(new.exact[n], t) for n, t in flat.tensors.items())  # incl. views of group words
        ref = new
    assert predicted > 0


def test_descriptor_and_registry():
    m = get_method("lossless", {"zstd_level": 5})
    assert isinstance(m, LosslessMethod) and m.descriptor == "lossless/1" and m.config.zstd_level == 5
    assert get_method("lossless/1").config == LosslessConfig()


def test_delta_without_parent_is_corrupt():
    m = LosslessMethod()
    s0, s1 = flatten_state({"x": torch.ones(4)}), flatten_state({"x": torch.zeros(4)})
    _, r0 = m.encode(s0, None, ctx=EncodeContext(step=0))
    e1, _ = m.encode(s1, r0, ctx=EncodeContext(step=1))
    with pytest.raises(CorruptCheckpointError, match="XOR delta"):
        m.decode(s1.records, e1, None, ctx=DecodeContext(step=1))
    with pytest.raises(CorruptCheckpointError, match="has no blob"):
        m.decode(s1.records, Encoded(records={"x": {"pipeline": ["lossless/1"], "meta": {}, "blobs": {}}}), None,
                 ctx=DecodeContext(step=1))


def test_shape_change_falls_back_to_keyframe_record():
    m = LosslessMethod()
    _, r0 = m.encode(flatten_state({"x": torch.ones(4)}), None, ctx=EncodeContext(step=0))
    s1 = flatten_state({"x": torch.ones(2, 3), "new": torch.arange(3)})
    e1, _ = m.encode(s1, r0, ctx=EncodeContext(step=1))
    assert "xor/1" not in e1.records["x"]["pipeline"] and "xor/1" not in e1.records["new"]["pipeline"]
    out, _ = m.decode(s1.records, e1, None, ctx=DecodeContext(step=1))
    assert bits_equal(out["x"], torch.ones(2, 3)) and bits_equal(out["new"], torch.arange(3))


# --- bytegroup codec ---------------------------------------------------------------------------

@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 7, 4099])
@pytest.mark.parametrize("float_bits", [True, False])
def test_bytegroup_round_trip(width, n, float_bits):
    rng = np.random.default_rng(width * 100 + n)
    raw = rng.integers(0, 256, n * width, dtype=np.uint8)
    raw[: n * width // 2] = 0  # a compressible half, so both raw and zstd planes occur
    raw = raw.tobytes()
    blob = bytegroup.compress(raw, width, float_bits=float_bits)
    assert bytegroup.decompress(blob) == raw
    w, flags, count = struct.unpack_from("<BBQ", blob)
    assert (w, count, flags) == (width, n, int(float_bits and width > 1))


def test_bytegroup_groups_planes_msb_first_and_stores_incompressible_raw():
    # a word's top byte is constant, its low byte random: plane 0 (MSB) compresses, plane 1 stays raw
    rng = np.random.default_rng(0)
    words = (0x3C00 | rng.integers(0, 256, 4096)).astype("<u2")
    blob = bytegroup.compress(words.tobytes(), 2, float_bits=False)
    lens = struct.unpack_from("<2I", blob, 10)
    assert lens[0] < 100 and lens[1] == 4096 | (1 << 31)
    assert blob[-4096:] == words.astype("<u2").view(np.uint8)[0::2].tobytes()  # raw low bytes, in order
    assert bytegroup.decompress(blob) == words.tobytes()


def test_bytegroup_blobs_outlive_the_planes_buffer_and_store_raw_is_probed(monkeypatch):
    """Planes are split into one reused buffer per thread: a blob's raw planes are copied out of it, so
    an earlier blob still decodes after later calls. A ``store_raw`` plane is compressed whole only
    when the byte histogram of its first PROBE_BYTES promises a gain: a near-random one costs no zstd
    call, a compressible one is caught, and one whose first bytes are random stays raw (the probe's
    limit)."""
    rng = np.random.default_rng(0)
    a, b = (rng.integers(0, 2**32, 1000, dtype=np.uint32).tobytes() for _ in range(2))
    blob_a = bytegroup.compress(a, 4)
    assert bytegroup.raw_planes(blob_a) == (0, 1, 2, 3)
    bytegroup.compress(b, 4)
    assert bytegroup.decompress(blob_a) == a
    zeros = bytes(4000)
    assert bytegroup.raw_planes(bytegroup.compress(zeros, 4, store_raw=(0, 2))) == ()
    assert bytegroup.raw_planes(bytegroup.compress(zeros, 4)) == ()
    n = 4 * bytegroup.PROBE_BYTES
    noise = rng.integers(0, 256, (n, 1), dtype=np.uint8)
    words = np.concatenate([noise, np.zeros((n, 3), np.uint8)], axis=1)  # LE bytes: plane 3 (LSB) random
    head_noise = words.copy()
    head_noise[bytegroup.PROBE_BYTES:, 0] = 0  # plane 3: random at its start, zeros after
    sizes = []
    real = bytegroup.zstd_compress
    monkeypatch.setattr(bytegroup, "zstd_compress", lambda d, *a, **k: sizes.append(len(d)) or real(d, *a, **k))
    blob = bytegroup.compress(words.tobytes(), 4, float_bits=False, store_raw=(0, 3))
    assert bytegroup.raw_planes(blob) == (3,) and bytegroup.decompress(blob) == words.tobytes()
    assert sorted(sizes) == [n] * 3  # both probed by their histograms; the random one not compressed
    blob = bytegroup.compress(head_noise.tobytes(), 4, float_bits=False, store_raw=(3,))
    assert bytegroup.raw_planes(blob) == (3,) and bytegroup.decompress(blob) == head_noise.tobytes()
    assert bytegroup.raw_planes(bytegroup.compress(head_noise.tobytes(), 4, float_bits=False)) == ()


def test_probe_gain_kernel_equals_reference_and_tracks_zstd():
    # the probe's histogram estimate: the numba kernel and the reference agree bit for bit; on byte
    # planes of float deltas it never promises much less than zstd's plane frames save (a compressible
    # plane is not left raw) nor 10 points more; near-random bytes promise under the 1 % floor
    rng = np.random.default_rng(3)
    samples = [rng.integers(0, 256, 4096, dtype=np.uint8), np.zeros(4096, np.uint8),
               np.minimum(rng.geometric(0.2, 4096), 255).astype(np.uint8)]
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    y = x + 1e-3 * torch.randn(4096, generator=torch.Generator().manual_seed(2))
    xor = (x.view(torch.int32) ^ y.view(torch.int32)).numpy().view(np.uint8).reshape(-1, 4)
    samples += [np.ascontiguousarray(xor[:, j]) for j in range(4)]
    planes = np.stack([np.resize(smp, 4096) for smp in samples])  # one (planes, bytes) array, as compress probes
    rows = list(range(len(samples)))
    want = bytegroup.sample_gains(planes, rows, 4096, backend="numpy")
    if bytegroup._numba is not None:
        assert bytegroup.sample_gains(planes, rows, 4096, backend="numba") == want
        assert bytegroup.sample_gains(planes, rows[::-2], 1000, backend="numba") == \
            bytegroup.sample_gains(planes, rows[::-2], 1000, backend="numpy")
    for smp, got in zip(samples, want):
        zstd_gain = 1 - len(bytegroup.zstd_compress(smp.tobytes(), 3, plane=True)) / smp.size
        assert zstd_gain - 0.01 < got < zstd_gain + 0.1, (got, zstd_gain)
    assert want[0] < bytegroup._PROBE_GAIN
    assert bytegroup.sample_gains(planes[:, :0], [0, 1], 4096) == [0.0, 0.0]


def test_bytegroup_rotation_puts_exponent_in_top_plane():
    # the documented layout: after rotl1 the most significant plane is the 8 exponent bits of fp32
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5000, generator=g)
    blob = bytegroup.compress(tensor_to_bytes(x), 4, float_bits=True)
    assert blob[1] == 1  # flags: rotated
    n0 = struct.unpack_from("<4I", blob, 10)[0]
    import zstandard

    plane0 = zstandard.ZstdDecompressor().decompress(blob[26:26 + n0])
    exponent = ((x.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    assert plane0 == exponent.numpy().tobytes()
    assert bytegroup.decompress(blob) == tensor_to_bytes(x)


def test_bytegroup_rejects_bad_arguments():
    with pytest.raises(ValueError, match="width"):
        bytegroup.compress(b"abc", 2)
    with pytest.raises(ValueError, match="width"):
        bytegroup.compress(b"abc", 3)


def _float_blob():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, generator=g)
    x[:100] = 0.0
    return tensor_to_bytes(x), bytegroup.compress(tensor_to_bytes(x), 4)


def test_bytegroup_corruption_only_typed_errors():
    raw, blob = _float_blob()
    for cut in range(len(blob)):  # every truncation is detected
        with pytest.raises(CorruptCheckpointError):
            bytegroup.decompress(blob[:cut])
    with pytest.raises(CorruptCheckpointError, match="trailing"):
        bytegroup.decompress(blob + b"\0")
    header_end = 10 + 4 * 4
    for pos, x, out in _flips(blob, range(len(blob)), (0x01, 0x20, 0x80, 0xFF)):
        if out is not None:
            # a flip inside a zstd payload, or of the rotation flag alone, can decode to other bytes
            # (the container's SHA-256 catches it); any other header flip never passes
            assert pos >= header_end or out == raw or (pos, x) == (1, 0x01), (pos, x)
            assert len(out) == len(raw)


def _flips(blob: bytes, positions, masks):
    """(position, mask, what decompress gave: its bytes, or None for a CorruptCheckpointError) for each
    flip of one byte of ``blob`` (any other exception fails the test)."""
    for pos in positions:
        for x in masks:
            bad = bytearray(blob)
            bad[pos] ^= x
            try:
                yield pos, x, bytegroup.decompress(bytes(bad))
            except CorruptCheckpointError:
                yield pos, x, None


@pytest.mark.parametrize("patch", [
    lambda b: b"\x03" + b[1:],                                           # width 3
    lambda b: b[:2] + struct.pack("<Q", 2**62) + b[10:],                 # absurd word count
    lambda b: b[:2] + struct.pack("<Q", 299) + b[10:],                   # one word short
    lambda b: b[:10] + struct.pack("<I", 0xFFFFFFFF) + b[14:],           # plane length beyond the blob
    lambda b: b[:1] + b"\x05" + b[2:],                                   # unknown flag bits
    lambda b: b[:1] + b"\x03" + b[2:],                                   # sparse planes, no marks byte
    lambda b: b"",
    lambda b: b[:5],
])
def test_bytegroup_malformed_headers(patch):
    _, blob = _float_blob()
    with pytest.raises(CorruptCheckpointError):
        bytegroup.decompress(patch(blob))


def test_bytegroup_errors_are_ckptzip_errors():
    with pytest.raises(CkptzipError):
        bytegroup.decompress(b"\x04\x00" + b"\xff" * 40)
    rotated_bytes = bytegroup.compress(b"\x01\x02", 1)  # width 1 is never rotated
    with pytest.raises(CorruptCheckpointError, match="malformed header"):
        bytegroup.decompress(rotated_bytes[:1] + b"\x01" + rotated_bytes[2:])


@pytest.mark.parametrize("width,dtype", [(1, np.uint8), (2, np.uint16), (4, np.uint32), (8, np.uint64)])
def test_bytegroup_kernels_equal_the_numpy_reference(width, dtype):
    rng = np.random.default_rng(width)
    words = rng.integers(0, 2**63, size=5000, dtype=np.uint64).view(dtype)[:5000].copy()
    prev = rng.integers(0, 2**63, size=5000, dtype=np.uint64).view(dtype)[:5000].copy()
    for rotate in (False, True) if width > 1 else (False,):
        for p in (None, prev):
            planes = bytegroup.split_planes(words, rotate, p)
            assert np.array_equal(planes, bytegroup.split_planes(words, rotate, p, backend="numpy"))
            for backend in ("auto", "numpy"):  # advance: the same planes, and prev then holds the words
                held = prev.copy()
                got = bytegroup.split_planes(words, rotate, held if p is not None else None, backend=backend,
                                             advance=True)
                assert np.array_equal(got, planes)
                assert np.array_equal(held, words if p is not None else prev)
        planes = bytegroup.split_planes(words, rotate)
        for backend in ("auto", "numpy"):  # and with a parent's words XORed in as they merge
            assert np.array_equal(bytegroup.merge_planes(planes, rotate, dtype, backend=backend), words)
            assert np.array_equal(bytegroup.merge_planes(planes, rotate, dtype, backend=backend, prev=prev),
                                  words ^ prev)
    # the fused XOR writes what XOR-then-compress wrote
    raw, old = words.tobytes(), prev.tobytes()
    assert bytegroup.compress(raw, width, prev=old) == bytegroup.compress((words ^ prev).tobytes(), width)
    # advance: the parent's words become the new words once XORed, the blob unchanged
    p = bytearray(old)
    assert bytegroup.compress(raw, width, prev=p, advance=True) == bytegroup.compress(raw, width, prev=old)
    assert bytes(p) == raw
    # decompress_words: the words, or with the parent's XORed back in, a delta's new words
    delta = bytegroup.compress(raw, width, prev=old)
    assert np.array_equal(bytegroup.decompress_words(bytegroup.compress(raw, width)), words)
    assert np.array_equal(bytegroup.decompress_words(delta, prev), words)
    with pytest.raises(CorruptCheckpointError, match="parent"):
        bytegroup.decompress_words(delta, prev[1:])


def test_spent_writer_reference_is_advanced_in_place(digits_snapshots):
    """A writer whose reference is spent (CheckpointChain.save) overwrites the parent's copies of its
    large records with the new bits instead of copying the state: the same blobs, and the next
    delta codes against the right parent."""
    _, _, snaps, _ = digits_snapshots
    flats = [flatten_state({"model": s.model, "optimizer": s.optimizer}) for s in snaps[:4]]
    m = LosslessMethod()
    ref = spent = None
    for i, flat in enumerate(flats):
        enc, ref_next = m.encode(flat, ref, ctx=EncodeContext(step=i))
        enc2, spent_next = m.encode(flat, spent, ctx=EncodeContext(step=i, reference_spent=True))
        assert enc2.blobs == enc.blobs
        large = [n for n in flat.records if "group/1" not in enc.records[n]["pipeline"]]
        assert large and all(bits_equal(spent_next.exact[n], flat.tensors[n]) for n in flat.records)
        if i:
            assert all(spent_next.exact[n] is spent.exact[n] for n in large)  # advanced, not copied
            assert all(flat.tensors[n] is not spent_next.exact[n] for n in large)
        ref, spent = ref_next, spent_next


def _sparse_delta(n: int = 20000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(words, parent words) of a float32 tensor and its parent a small update apart: the XOR's
    exponent plane is mostly zeros (~10 % of the exponents changed here)."""
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(n, generator=g)
    new = old * (1 + 0.02 * torch.randn(n, generator=g))
    return new.numpy().view(np.uint32), old.numpy().view(np.uint32)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 17, 4099, 10007])
@pytest.mark.parametrize("density", [0.0, 0.3, 1.0])
def test_sparse_split_and_merge_kernels_equal_the_numpy_reference(n, density):
    rng = np.random.default_rng(n)
    plane = (rng.integers(1, 256, n) * (rng.random(n) < density)).astype(np.uint8)
    mask, nonzero = bytegroup.sparse_split(plane, backend="numpy")
    assert np.array_equal(mask, np.packbits(plane != 0)) and np.array_equal(nonzero, plane[plane != 0])
    got = bytegroup.sparse_split(plane)
    assert np.array_equal(got[0], mask) and np.array_equal(got[1], nonzero)
    for backend in ("auto", "numpy"):
        out = np.full(n, 7, np.uint8)
        bytegroup.sparse_merge(mask, nonzero, out, backend=backend)
        assert np.array_equal(out, plane)
        if nonzero.size:  # a mask that marks other than the bytes given: typed errors, both backends
            with pytest.raises(CorruptCheckpointError, match="marks other"):
                bytegroup.sparse_merge(mask, nonzero[:-1], out, backend=backend)
            with pytest.raises(CorruptCheckpointError, match="marks other"):
                bytegroup.sparse_merge(mask, np.concatenate([nonzero, nonzero[:1]]), out, backend=backend)
        if n & 7:
            pad = mask.copy()
            pad[-1] |= 1  # a bit past the plane's end
            with pytest.raises(CorruptCheckpointError, match="does not fit"):
                bytegroup.sparse_merge(pad, nonzero, out, backend=backend)


def test_sparse_planes_layout_and_when_a_plane_is_sparse():
    """With ``sparse=True`` an XOR delta's exponent plane (mostly zeros) is stored as a mask frame and
    a frame of its nonzero bytes: flags bit 1, a marks byte after the lengths, plane 0 marked; the
    blob is smaller and decodes to the same words. Without it, or for a plane under SPARSE_MIN bytes
    or more than half nonzero, the blob is bytegroup/1's, byte for byte."""
    words, prev = _sparse_delta()
    dense = bytegroup.compress(words, 4, prev=prev, store_raw=(1, 2, 3), min_gain=0.1)
    blob = bytegroup.compress(words, 4, prev=prev, store_raw=(1, 2, 3), min_gain=0.1, sparse=True)
    assert bytegroup.stage(dense) == "bytegroup/1" and bytegroup.stage(blob) == "bytegroup/2"
    assert blob[1] == 1 | 2 and blob[26] == 0b0001 and len(blob) < len(dense)
    assert bytegroup.raw_planes(blob) == bytegroup.raw_planes(dense)
    assert np.array_equal(bytegroup.decompress_words(blob, prev), words)
    assert bytegroup.decompress(blob) == bytegroup.decompress(dense)
    # plane 0 as written: u32 m | mask frame | nonzero bytes' frame
    import zstandard

    n0 = struct.unpack_from("<I", blob, 10)[0]
    plane = blob[27:27 + n0]
    m = struct.unpack_from("<I", plane)[0]
    mask = np.frombuffer(zstandard.ZstdDecompressor().decompress(plane[4:4 + m]), np.uint8)
    nonzero = np.frombuffer(zstandard.ZstdDecompressor().decompress(plane[4 + m:]), np.uint8)
    want = bytegroup.split_planes(words, True, prev)[0]
    assert np.array_equal(mask, np.packbits(want != 0)) and np.array_equal(nonzero, want[want != 0])
    assert nonzero.size < 0.5 * words.size
    # not sparse: a keyframe's exponents (no zeros), a short plane, a plane half nonzero
    assert bytegroup.stage(bytegroup.compress(words, 4, sparse=True)) == "bytegroup/1"
    short = bytegroup.SPARSE_MIN - 1
    assert bytegroup.compress(words[:short], 4, prev=prev[:short], sparse=True) == \
        bytegroup.compress(words[:short], 4, prev=prev[:short])
    half = np.zeros(8192, np.uint8)
    half[::2] = 1
    half[1:64:2] = 3  # a little over half nonzero
    assert bytegroup.stage(bytegroup.compress(half.tobytes(), 1, sparse=True)) == "bytegroup/1"
    assert bytegroup.stage(bytegroup.compress(half[:-64].tobytes() + bytes(64), 1, sparse=True)) == "bytegroup/2"
    assert bytegroup.compress_sparse(words, 4, prev=prev) == bytegroup.compress(words, 4, prev=prev, sparse=True)


def test_sparse_blob_corruption_only_typed_errors():
    """Every truncation of a blob with a sparse plane, and every flip in its header, marks byte and
    the plane's mask length, is a CorruptCheckpointError or decodes to words of the same length."""
    words, prev = _sparse_delta(6000)
    blob = bytegroup.compress(words, 4, prev=prev, store_raw=(1, 2, 3), sparse=True)
    raw = bytegroup.decompress(blob)
    for cut in range(0, len(blob), 7):
        with pytest.raises(CorruptCheckpointError):
            bytegroup.decompress(blob[:cut])
    for pos, x, out in _flips(blob, range(31), (0x01, 0x02, 0x10, 0x80, 0xFF)):  # header, marks, the u32 m
        assert out is None or len(out) == len(raw), (pos, x)
    lens = list(struct.unpack_from("<4I", blob, 10))
    for patch in (lambda b: b[:26] + b"\x00" + b[27:],       # marks nothing
                  lambda b: b[:26] + b"\x11" + b[27:],       # marks a fifth plane of four
                  lambda b: b[:10] + struct.pack("<4I", lens[0] | 1 << 31, *lens[1:]) + b[26:]):  # sparse and raw
        with pytest.raises(CorruptCheckpointError, match="malformed header"):
            bytegroup.decompress(patch(blob))
    with pytest.raises(CorruptCheckpointError, match="mask's length"):
        bytegroup.decompress(blob[:27] + struct.pack("<I", lens[0]) + blob[31:])


def test_sparse_blob_is_pinned():
    """A bytegroup/2 blob as written when the layout was made (tests/data/bytegroup_sparse_v2.bin):
    it decodes to the same words, and today's writer writes it byte for byte (with that zstd)."""
    import json
    from pathlib import Path

    data = Path(__file__).resolve().parent / "data"
    words, prev = _sparse_delta(9000, seed=5)
    pinned = (data / "bytegroup_sparse_v2.bin").read_bytes()
    assert bytegroup.stage(pinned) == "bytegroup/2"
    assert np.array_equal(bytegroup.decompress_words(pinned, prev), words)
    import zstandard

    pinned_zstd, this = json.loads((data / "golden_methods_v2" / "versions.json").read_text())["zstd"], \
        ".".join(map(str, zstandard.ZSTD_VERSION))
    if this != pinned_zstd:
        pytest.skip(f"pinned with zstd {pinned_zstd}, this is {this}")
    assert bytegroup.compress(words, 4, prev=prev, store_raw=(1, 2, 3), min_gain=0.1, sparse=True) == pinned


def test_lossless_writes_bytegroup_2_only_where_a_blob_is_sparse(digits_snapshots):
    """A real run's deltas: records whose blob (own or group) has sparse planes say bytegroup/2, the
    rest bytegroup/1; every step restores bit for bit; ``sparse_planes=False`` writes bytegroup/1
    only, larger, restoring the same bits."""
    _, _, snaps, _ = digits_snapshots
    out = {}
    for sparse in (True, False):
        m, run = _encode_run(snaps[:4], sparse_planes=sparse)
        ref, stages = None, set()
        for i, (flat, enc) in enumerate(run):
            for name, r in enc.records.items():
                stage = r["pipeline"][-1]
                key = r["meta"]["group"][0] if "group" in r["meta"] else r["blobs"]["data"]
                assert stage == bytegroup.stage(enc.blobs[key]), name
                stages.add(stage)
            tensors, ref = m.decode(flat.records, enc, ref, ctx=DecodeContext(step=i))
            assert all(bits_equal(tensors[n], t) for n, t in flat.tensors.items()), i
        out[sparse] = (stages, sum(len(b) for _, enc in run[1:] for b in enc.blobs.values()))
    assert out[True][0] == {"bytegroup/1", "bytegroup/2"} and out[False][0] == {"bytegroup/1"}
    assert out[True][1] < out[False][1]


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_segments_round_trip_with_parent_advance_and_sparse_planes(width, monkeypatch):
    """A tensor of more than SEGMENT_WORDS words is stored as segments (here 1,000 words each; in
    use 2**30, where a plane's u32 length would overflow): every segment's words decode, XORed with
    the matching slice of the parent, ``advance`` moves the whole parent, and the blob is
    bytegroup/2 (each segment but the last flags another)."""
    monkeypatch.setattr(bytegroup, "SEGMENT_WORDS", 1000)
    dtype = bytegroup._UINT[width]
    rng = np.random.default_rng(width)
    prev = rng.integers(0, 2**63, 2500, dtype=np.uint64).view(dtype)[:2500].copy()
    words = prev.copy()
    words[::7] ^= dtype(1)  # a delta: a few low bits changed
    for kw in ({}, {"sparse": True}, {"store_raw": (1,), "min_gain": 0.1}):
        blob = bytegroup.compress(words, width, prev=prev, float_bits=width > 1, **kw)
        assert bytegroup.stage(blob) == "bytegroup/2"
        assert np.array_equal(bytegroup.decompress_words(blob, prev), words)
        assert bytegroup.decompress(bytegroup.compress(words, width)) == words.astype(bytegroup._LE[width]).tobytes()
        flags, pos = [], 0
        while pos < len(blob):  # walk the segments by their headers
            w, f, n = struct.unpack_from("<BBQ", blob, pos)
            lens = struct.unpack_from(f"<{w}I", blob, pos + 10)
            flags.append(f & 4)
            pos += 10 + 4 * w + (1 if f & 2 else 0) + sum(ln & ~(1 << 31) for ln in lens)
        assert flags == [4, 4, 0] and pos == len(blob)
    held = bytearray(prev.tobytes())
    blob = bytegroup.compress(words, width, prev=held, advance=True, float_bits=width > 1)
    assert bytes(held) == words.tobytes() and np.array_equal(bytegroup.decompress_words(blob, prev), words)
    with pytest.raises(CorruptCheckpointError, match="parent"):
        bytegroup.decompress_words(blob, prev[:-1])
    with pytest.raises(CorruptCheckpointError, match="parent"):
        bytegroup.decompress_words(blob, np.concatenate([prev, prev[:1]]))


def test_segment_corruption_only_typed_errors(monkeypatch):
    monkeypatch.setattr(bytegroup, "SEGMENT_WORDS", 1000)
    words, prev = _sparse_delta(2500)
    blob = bytegroup.compress(words, 4, prev=prev, sparse=True)
    for cut in range(0, len(blob), 11):
        with pytest.raises(CorruptCheckpointError):
            bytegroup.decompress(blob[:cut])
    with pytest.raises(CorruptCheckpointError, match="trailing"):
        bytegroup.decompress(blob + b"\0" * 30)
    first = bytegroup.compress(words[:1000], 4, prev=prev[:1000], sparse=True)
    assert blob[1] & 4 and not first[1] & 4 and blob[2:len(first)] == first[2:]  # the first segment, flagged
    with pytest.raises(CorruptCheckpointError, match="trailing"):
        bytegroup.decompress(first[:1] + bytes((first[1],)) + first[2:] + blob[len(first):])  # no "more" flag
    other = bytegroup.compress(np.zeros(1500, np.uint16), 2, float_bits=False)  # another width follows
    with pytest.raises(CorruptCheckpointError, match="disagree"):
        bytegroup.decompress(blob[:len(first)] + other)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        bytegroup.decompress(blob[:len(first)])  # flagged, and nothing follows
    # a later segment that claims more words than its planes hold: refused before the words of all
    # segments are allocated (here 2**40 words, 4 TiB)
    huge = blob[:len(first) + 2] + struct.pack("<Q", 1 << 40) + blob[len(first) + 10:]
    with pytest.raises(CorruptCheckpointError, match="promises|holds"):
        bytegroup.decompress(huge)


def test_a_chain_of_tensors_in_segments_restores_exactly(digits_snapshots, monkeypatch, tmp_path):
    """A lossless chain and a dynaquant one storing every tensor exact (``min_numel`` above them all)
    whose tensors span several segments (SEGMENT_WORDS lowered to 3,000 words): every step restores
    bit for bit, and the records of segments say bytegroup/2."""
    from ckptzip import CheckpointChain

    monkeypatch.setattr(bytegroup, "SEGMENT_WORDS", 3000)
    _, _, snaps, _ = digits_snapshots
    for method, config in (("lossless", None), ("dynaquant", {"quantizer": {"min_numel": 10**9}})):
        chain = CheckpointChain(tmp_path / method, method, config)
        for i, s in enumerate(snaps[:3]):
            chain.save({"model": s.model, "optimizer": s.optimizer}, i + 1)
        for i, s in enumerate(snaps[:3]):
            got = chain.restore(i + 1).state
            assert all(bits_equal(got["model"][k], v) for k, v in s.model.items()), (method, i)
        stages = {tuple(r["pipeline"]) for r in chain.manifest(1)["records"].values()}
        assert (("lossless/1", "bytegroup/2") if method == "lossless" else ("exact/1", "bytegroup/2")) in stages
