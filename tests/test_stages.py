"""The stage registry (codec/stages.py), the one bit-packer (codec/bitpack.py) and the bounded
compressor frames (codec/frames.py)."""
import numpy as np
import pytest
import torch
import zstandard

from ckptzip import CheckpointChain
from ckptzip.codec import bitpack, frames
from ckptzip.codec import stages as S
from ckptzip.errors import CorruptCheckpointError, FormatVersionError, UnknownStageError
from ckptzip.methods import base
from ckptzip.methods.base import Encoded, Method, Reference
from ckptzip.tensorbytes import tensor_from_bytes, tensor_to_bytes


# --- registry ---------------------------------------------------------------------------------
def test_every_descriptor_is_defined_once_with_a_layout():
    assert len({s.descriptor for s in S.STAGES.values()}) == len(S.STAGES)
    for d, s in S.STAGES.items():
        assert d == f"{s.name}/{s.version}" and s.layout
        assert (s.takes in (S.BYTES, S.CODES)) == bool(s.codec), d
    assert S.pipeline(S.EXACT, S.RAW) == ["exact/1", "raw/1"]


def test_unknown_stage_or_version_is_a_typed_error_naming_the_record_and_the_fix():
    with pytest.raises(UnknownStageError, match=r"'model/w'.*'bitsnap'.*bitmask/7.*reads bitmask/1.*upgrade ckptzip"):
        S.check_pipeline(["bitsnap/1", "bitmask/7"], record="model/w", method="bitsnap")
    with pytest.raises(UnknownStageError, match="unknown stage 'brotli/1'.*upgrade ckptzip"):
        S.check_pipeline(["exact/1", "brotli/1"], record="x", method="lossless")
    assert issubclass(UnknownStageError, FormatVersionError) and issubclass(UnknownStageError, ValueError)
    with pytest.raises(CorruptCheckpointError):
        S.check_pipeline([], record="x", method="lossless")


def test_v01_descriptors_are_read_only_in_the_methods_that_wrote_them():
    assert S.check_pipeline(["bitsnap/1", "bitmask/1", "zstd/1"], record="w", method="bitsnap")[-1] is S.ZSTD_LEGACY
    for method in ("lossless", "excp"):
        with pytest.raises(UnknownStageError):
            S.get("zstd/1", record="w", method=method)
    assert S.get("excp-tensor/1", record="w", method="excp") is S.EXCP_TENSOR_V1
    with pytest.raises(UnknownStageError, match="reads excp-tensor/2 there"):
        S.get("excp-tensor/1", record="w", method="dynaquant")


@pytest.mark.parametrize("stages", [[S.HUFFMAN], [S.ANS], [S.ZSTD_INTS], [S.BITPACK, S.XZ], [S.BITPACK, S.ZSTD_FRAME]],
                         ids=lambda st: "+".join(s.name for s in st))
def test_code_stage_lists_round_trip_and_bound_their_frames(stages):
    if S.ANS in stages:
        pytest.importorskip("constriction")
    codes = np.random.default_rng(0).integers(0, 16, 1001).astype(np.uint8)
    buf = S.encode(stages, codes, bits=4)
    assert np.array_equal(S.decode(stages, buf, n=1001, bits=4, what="t"), codes)
    if stages[0] is S.BITPACK:  # the frame may not hold more than the packed codes
        with pytest.raises(CorruptCheckpointError):
            S.decode(stages, buf, n=1000, bits=4, what="t")


class _StageTestMethod(Method):
    """Writes an exact record with a stage this reader does not know (a file from the future)."""

    name = "stage-test"

    def encode(self, state, reference, *, ctx):
        enc = Encoded()
        for n, t in state.tensors.items():
            enc.add(n, ["exact/1", "raw/2"], {}, data=tensor_to_bytes(t))
        return enc, Reference(ctx.step)

    def decode(self, records, encoded, reference, *, ctx):  # pragma: no cover - never reached
        return {n: tensor_from_bytes(encoded.blob(n, "data"), r.dtype, r.shape) for n, r in records.items()}, None


def test_chain_checks_every_stage_before_decoding(tmp_path, monkeypatch):
    monkeypatch.setitem(base._REGISTRY, _StageTestMethod.name, _StageTestMethod)  # gone after the test
    chain = CheckpointChain(tmp_path, "stage-test")
    chain.save({"w": torch.arange(4.0)}, step=1)
    with pytest.raises(UnknownStageError, match="record 'w'.*raw/2.*reads raw/1"):
        CheckpointChain(tmp_path).restore(1)


# --- the bit-packer ---------------------------------------------------------------------------
def test_bitpack_is_lsb_first():
    assert bitpack.pack(torch.tensor([1, 2, 3, 15, 10]), 4).tolist() == [0x21, 0xF3, 0x0A]  # odd tail: high nibble 0
    assert bitpack.pack(torch.tensor([1, 2, 3, 0, 3]), 2).tolist() == [0b00111001, 0b00000011]
    mask = torch.rand(1003, generator=torch.Generator().manual_seed(0)) < 0.3
    assert np.array_equal(bitpack.pack(mask, 1).numpy(), np.packbits(mask.numpy(), bitorder="little"))
    g = torch.Generator().manual_seed(1)
    for bits in bitpack.WIDTHS:
        for n in range(19):
            c = torch.randint(0, 2 ** bits, (n,), generator=g, dtype=torch.uint8)
            packed = bitpack.pack(c, bits)
            assert packed.numel() == bitpack.packed_nbytes(n, bits) == -(-n * bits // 8)
            assert torch.equal(bitpack.unpack(packed, n, bits), c)
            assert torch.equal(bitpack.unpack(packed.numpy().tobytes(), n, bits), c)


def test_bitpack_refuses_bad_input():
    with pytest.raises(ValueError):
        bitpack.pack(torch.tensor([16]), 4)
    with pytest.raises(CorruptCheckpointError, match="padding"):
        bitpack.unpack(bytes([0x21, 0xF3, 0xAA]), 5, 4)  # the pad nibble is set
    with pytest.raises(CorruptCheckpointError, match="expected 3"):
        bitpack.unpack(b"\x21\xf3", 5, 4)
    assert bitpack.unpack_msb_first(bytes([0x12, 0x3F, 0xA0]), 5, 4).tolist() == [1, 2, 3, 15, 10]


# --- frames -----------------------------------------------------------------------------------
def test_zstd_frames_are_bounded_before_allocating():
    data = bytes(range(256)) * 64
    frame = frames.zstd_compress(data, 3)
    assert frames.zstd_decompress(frame, max_bytes=len(data), what="f") == data
    with pytest.raises(CorruptCheckpointError, match="promises 16384 bytes, at most 100"):
        frames.zstd_decompress(frame, max_bytes=100, what="f")
    with pytest.raises(CorruptCheckpointError, match="expected 20000"):
        frames.zstd_decompress(frame, max_bytes=20000, what="f", exact=True)
    with pytest.raises(CorruptCheckpointError, match="does not decompress"):
        frames.zstd_decompress(frame + b"junk", max_bytes=len(data), what="f")  # nothing may follow a frame
    with pytest.raises(CorruptCheckpointError, match="not a zstd frame"):
        frames.zstd_decompress(b"", max_bytes=10, what="f")
    # a frame without its content size is still bounded by the output limit
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(data)
    with pytest.raises(CorruptCheckpointError):
        frames.zstd_decompress(unsized, max_bytes=100, what="f")


def test_xz_streams_are_bounded_and_whole():
    data = b"ckptzip " * 1000
    blob = frames.xz_compress(data)
    assert frames.xz_decompress(blob, max_bytes=len(data)) == data
    for bad, msg in ((blob[:-3], "truncated|damaged"), (blob + b"x", "stray"), (blob, "max_bytes")):
        with pytest.raises(CorruptCheckpointError, match=msg):
            frames.xz_decompress(bad, max_bytes=len(data) - (msg == "max_bytes"))
