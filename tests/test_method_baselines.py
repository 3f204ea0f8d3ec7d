"""qd / cnr / gobo as chain methods on a real run."""
import copy

import pytest
import torch

from ckptzip import CheckpointChain
from ckptzip.format import decode_container


# GOBO's default is 8 bins (its paper's setting): coarser than the others on an early checkpoint
@pytest.mark.parametrize("method,delta,max_deg", [("qd", True, 0.05), ("cnr", False, 0.15), ("gobo", False, 0.25)])
def test_baseline_chain(tmp_path, digits_snapshots, method, delta, max_deg):
    torch.set_num_threads(1)
    model, opt, snaps, ev = digits_snapshots
    ch = CheckpointChain(tmp_path, method)
    entries = [ch.save({"model": s.model, "optimizer": s.optimizer}, s.step, model=model, optimizer=opt)
               for s in snaps[:4]]
    assert [e.keyframe for e in entries] == ([True, False, False, False] if delta else [True] * 4)
    assert ch.verify() == []
    assert sum(e.raw_bytes for e in entries) / sum(e.nbytes for e in entries) > 3
    m_ref, m_q = copy.deepcopy(model), copy.deepcopy(model)
    for s in snaps[:4]:
        m_ref.load_state_dict(s.model)
        m_q.load_state_dict(ch.load(s.step)["model"])
        assert abs(ev(m_q) - ev(m_ref)) / ev(m_ref) < max_deg
    m = decode_container(ch.storage.read(entries[1].file)).manifest
    piped = [r["pipeline"] for r in m["records"].values() if r["role"] == "weight" and r["pipeline"][0] != "exact/1"]
    assert piped and all(p[0] == f"{method}/1" for p in piped)
    assert all(("cyclic-delta/1" in p) == delta for p in piped)


def test_gobo_outliers_survive_exactly(tmp_path, digits_snapshots):
    model, opt, snaps, ev = digits_snapshots
    sd = {k: v.clone() for k, v in snaps[-1].model.items()}
    sd["fc2.weight"][3, 5] = 50.0  # a far outlier under the fitted Gaussian
    ch = CheckpointChain(tmp_path, "gobo")
    ch.save({"model": sd}, 1, model=model)
    assert ch.load()["model"]["fc2.weight"][3, 5].item() == 50.0
