"""Small exact records written all at once (methods/base.ExactGroups): the records and group blobs
encode_exact writes one by one, a repeat found against the parent's group words whole or record by
record, and a reference of its own copies."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ckptzip.methods.base import Encoded, ExactGroups, encode_exact
from ckptzip.methods.groups import GROUP_BELOW, EncoderTensors, GroupWriter


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {
        "w.bias": torch.randn(96, generator=g),                          # trained: changes every save
        "frozen": torch.linspace(-1, 1, 50),                             # repeats
        "half": torch.randn(7, generator=g).half(),                      # fp16 and bf16 share group.2f
        "bf": torch.full((3, 2), 0.5 + step, dtype=torch.bfloat16),
        "steps": torch.tensor(float(step)),                              # a scalar
        "ids": torch.arange(5, dtype=torch.int64) * (step >= 2),         # changes once, at step 2
        "mask": torch.ones(9, dtype=torch.uint8),                        # repeats, alone in group.1i
        "empty": torch.zeros(0),
        "big": torch.randn(GROUP_BELOW // 4 + 1, generator=g),           # too large for a group
    }


def _one_by_one(state, parents):
    enc, groups, own = Encoded(keyframe=parents is None), GroupWriter(), {}
    for name, t in state.items():
        own[name] = t.clone()
        encode_exact(enc, name, own[name], parent=None if parents is None else parents.get(name), groups=groups)
    groups.flush(enc)
    return enc, own


def _at_once(state, parents):
    enc, groups, small, own, names = Encoded(keyframe=parents is None), GroupWriter(), None, {}, []
    small = ExactGroups(enc)
    for name, t in state.items():
        names.append(name)
        if t.numel() * t.element_size() < GROUP_BELOW:
            small.add(name, t)
        else:
            own[name] = t.clone()
            encode_exact(enc, name, own[name], parent=None if parents is None else parents.get(name))
    pg = parents.groups if isinstance(parents, EncoderTensors) else {}
    kept = small.flush(groups, parents, pg)
    groups.flush(enc)
    return enc, EncoderTensors(names, own, kept)


def _same(a: Encoded, b: Encoded) -> None:
    assert list(a.records) == list(b.records) and a.records == b.records  # the blob keys follow the order
    assert a.blobs == b.blobs


@pytest.mark.parametrize("parent", ["encoder", "decoded"])
def test_written_at_once_as_encode_exact_writes_them(parent):
    """Keyframe, then deltas against the encoder's reference (its group words compared whole) or a
    decoded one (a plain dict: record by record): the same records, metas and blobs."""
    ref_a = ref_b = None
    for step in range(4):
        state = _state(step)
        a, own = _one_by_one(state, ref_a)
        b, ref = _at_once(state, ref_b)
        _same(a, b)
        ref_a, ref_b = own, ref if parent == "encoder" else {n: ref[n].clone() for n in ref}
        if step:
            pipes = {n: r["pipeline"][1] for n, r in b.records.items()}
            assert pipes["frozen"] == pipes["mask"] == "same/1" and pipes["w.bias"] == "group/1"
            assert pipes["ids"] == ("group/1" if step == 2 else "same/1")
    assert "group.1i" not in b.blobs  # its one record repeats: no blob, as encode_exact writes none


def test_a_group_of_other_records_is_compared_record_by_record():
    """A parent group whose records differ (one gone) is not compared whole."""
    first = _state(1)
    _, ref = _at_once(first, None)
    state = {k: v for k, v in _state(1).items() if k != "half"}
    a, _ = _one_by_one(state, {n: ref[n] for n in ref})
    b, _ = _at_once(state, ref)
    _same(a, b)
    assert b.records["frozen"]["pipeline"] == ["exact/1", "same/1"]


def test_the_reference_is_a_copy_and_views_of_one_buffer_per_group():
    state = _state(2)
    _, ref = _at_once(state, None)
    for name, t in state.items():
        assert ref[name].dtype == t.dtype and torch.equal(ref[name].view(-1).view(torch.uint8),
                                                          t.view(-1).view(torch.uint8))
    state["w.bias"].add_(1.0)  # training moves the live tensor
    assert not torch.equal(ref["w.bias"], state["w.bias"])
    assert set(ref.groups) == {"group.4f", "group.2f", "group.8i", "group.1i"}
    assert ref.groups["group.2f"].names == ("half", "bf")


def test_a_group_takes_its_words_whole_or_record_by_record_not_both():
    g = GroupWriter()
    g.add_words("group.4f", np.zeros(3, dtype=np.uint32))
    with pytest.raises(ValueError, match="given its words whole"):
        g.add(torch.zeros(2))
    g = GroupWriter()
    g.add(torch.zeros(2))
    with pytest.raises(ValueError, match="already has records"):
        g.add_words("group.4f", np.zeros(3, dtype=np.uint32))
