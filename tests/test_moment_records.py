"""methods/momentgrid.py: the grid moment codec as chain records (delta v levels, typed errors)."""
import pytest
import torch

from ckptzip.errors import CorruptCheckpointError
from ckptzip.methods import momentgrid as G
from ckptzip.methods.base import Encoded
from ckptzip.quant import moments as M


@pytest.fixture(scope="module")
def pairs(digits_snapshots):
    """[(m, v, hp)] of the digits MLP's first layer at two consecutive checkpoints (20 steps apart)."""
    _, _, snaps, _ = digits_snapshots
    out = []
    for s in snaps[-2:]:
        st = s.optimizer["state"][0]
        out.append((st["exp_avg"], st["exp_avg_sq"], M.AdamHP(float(st["step"]))))
    return out


def _roundtrip(codec, m, v, hp, prev=None, prev_dec=None):
    enc = Encoded()
    ref = G.store_adam(enc, "m", "v", m, v, hp, codec, prev)
    v_q, dv, ref_dec = G.load_v(enc, "v", v.shape, "float32", prev_dec)
    m_q = G.load_direction(enc, "m", m.shape, "float32", dv)
    return enc, ref, ref_dec, m_q, v_q


@pytest.mark.parametrize("codec", [M.GridCodec(1.0), M.GridCodec(0.5, factored=True, m_bits=2),
                                   M.GridCodec(1.0, m_bits=0)])
def test_chain_of_two(pairs, codec):
    (m0, v0, hp0), (m1, v1, hp1) = pairs
    enc0, ref0, dref0, _, _ = _roundtrip(codec, m0, v0, hp0)
    assert torch.equal(ref0[0], dref0[0])  # the decoder rebuilds the encoder's reference
    enc1, ref1, dref1, m_q, v_q = _roundtrip(codec, m1, v1, hp1, ref0, dref0)
    assert enc1.records["v"]["meta"]["delta"] and not enc1.records["v"]["meta"]["factored"]
    assert torch.equal(ref1[0], dref1[0])
    # the decoded pair is what the tensor-level codec gives
    qm, qv = M.encode_pair(m1, v1, hp1, codec)
    m_ref, v_ref = M.decode_pair(qm, qv, hp1)
    assert torch.equal(v_q, v_ref) and torch.equal(m_q, m_ref)
    # the delta is smaller than the keyframe of the same step
    key, _, _, _, _ = _roundtrip(codec, m1, v1, hp1)
    assert len(enc1.blobs[enc1.records["v"]["blobs"]["codes"]]) < len(key.blobs[key.records["v"]["blobs"]["codes"]])


def test_bad_records_name_themselves(pairs):
    m, v, hp = pairs[0]
    enc = Encoded()
    G.store_adam(enc, "opt/0/exp_avg", "opt/0/exp_avg_sq", m, v, hp, M.GridCodec(), None)
    with pytest.raises(CorruptCheckpointError, match="opt/0/exp_avg'.*needs its exp_avg_sq"):
        G.load_direction(enc, "opt/0/exp_avg", m.shape, "float32", None)
    with pytest.raises(CorruptCheckpointError, match="opt/0/exp_avg_sq.*codes for a tensor"):
        G.load_v(enc, "opt/0/exp_avg_sq", (3, 5), "float32", None)
    enc.records["opt/0/exp_avg_sq"]["meta"]["adam"] = {"step": "x"}
    with pytest.raises(CorruptCheckpointError, match="opt/0/exp_avg_sq.*malformed"):
        G.load_v(enc, "opt/0/exp_avg_sq", v.shape, "float32", None)
    _, dv, _ = G.load_v(_fresh(m, v, hp), "opt/0/exp_avg_sq", v.shape, "float32", None)
    enc2 = _fresh(m, v, hp)
    key = enc2.records["opt/0/exp_avg"]["blobs"]["side.scale"]
    enc2.blobs[key] = enc2.blobs[key][:-2]
    with pytest.raises(CorruptCheckpointError, match="opt/0/exp_avg"):
        G.load_direction(enc2, "opt/0/exp_avg", m.shape, "float32", dv)


def _fresh(m, v, hp):
    enc = Encoded()
    G.store_adam(enc, "opt/0/exp_avg", "opt/0/exp_avg_sq", m, v, hp, M.GridCodec(), None)
    return enc
