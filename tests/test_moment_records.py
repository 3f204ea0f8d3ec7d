"""methods/moments.py through real chains: the grid codec's records, deltas, unknown optimizer
state kept exact, typed errors for inconsistent records."""
import pytest
from helpers import coded_stages
import torch

from ckptzip import CheckpointChain, KeyframePolicy
from ckptzip.errors import CorruptCheckpointError
from ckptzip.format import decode_container
from ckptzip.methods.base import DecodeContext, get_method
from ckptzip.methods.qrecord import ORDER0_CODER
from ckptzip.quant import moments as M
from ckptzip.state import flatten_state


def _save_all(ch, model, opt, snaps):
    return [ch.save({"model": s.model, "optimizer": s.optimizer}, s.step, model=model, optimizer=opt) for s in snaps]


def test_grid_chain_decodes_as_the_quantizer_does(tmp_path, digits_snapshots):
    torch.set_num_threads(1)
    model, opt, snaps, _ = digits_snapshots
    ch = CheckpointChain(tmp_path, "dynaquant", keyframe=KeyframePolicy(every=3))
    entries = _save_all(ch, model, opt, snaps[:4])
    assert [e.keyframe for e in entries] == [True, False, False, True]
    for e, s in zip(entries, snaps):
        man = decode_container(ch.storage.read(e.file)).manifest
        v = man["records"]["optimizer/state/0/exp_avg_sq"]
        # v: levels delta against the parent's in delta files, factored residuals in keyframes
        coder = f"{ORDER0_CODER}/1"
        # a keyframe's factored residuals span a few levels: packed (tuple/1) when B <= 5
        keyframe_pipes = (["moment-grid/1", coder], ["moment-grid/1", "tuple/1", coder])
        pipe = coded_stages(v["pipeline"])
        assert pipe in keyframe_pipes if e.keyframe else pipe == ["moment-grid/1", "cyclic-delta/1", coder]
        assert v["meta"]["factored"] is e.keyframe
        out = ch.load(s.step)["optimizer"]["state"][0]
        st = s.optimizer["state"][0]
        hp = M.AdamHP(float(st["step"]))
        m_ref, v_ref = M.decode_pair(*M.encode_pair(st["exp_avg"], st["exp_avg_sq"], hp, M.GridCodec()), hp)
        assert torch.equal(out["exp_avg_sq"], v_ref) and torch.equal(out["exp_avg"], m_ref)
        assert torch.equal(out["step"], st["step"])
    # deltas of v are smaller than its keyframe
    assert entries[1].bytes_by_role["exp_avg_sq"][1] < entries[0].bytes_by_role["exp_avg_sq"][1]
    assert ch.verify() == []


def test_sgd_bf16_and_unknown_optimizer_state(tmp_path):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    net[2].to(torch.bfloat16)
    groups = [{"params": net[0].parameters()}, {"params": net[2].parameters()}]
    opts = {"sgd": torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
            "adam-bf16": torch.optim.Adam(groups, lr=1e-3),
            "amsgrad": torch.optim.Adam(net.parameters(), lr=1e-3, amsgrad=True),
            "adagrad": torch.optim.Adagrad(net.parameters(), lr=1e-2)}
    for kind, opt in opts.items():
        x = torch.randn(32, 64)
        for _ in range(3):
            net[2](net[1](net[0](x)).bfloat16()).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        ch = CheckpointChain(tmp_path / kind, "dynaquant")
        state = {"model": net.state_dict(), "optimizer": opt.state_dict()}
        ch.save(state, 1, model=net, optimizer=opt)
        out = ch.load()["optimizer"]["state"]
        man = decode_container(ch.storage.read(ch.entry().file)).manifest["records"]
        for i, st in opt.state_dict()["state"].items():
            for key, t in st.items():
                assert out[i][key].dtype == t.dtype, (kind, key)
                if key == "step" and t.dim() == 0:  # a skeleton scalar (state.py), exact
                    assert f"optimizer/state/{i}/step" not in man and torch.equal(out[i][key], t), kind
                    continue
                first = man[f"optimizer/state/{i}/{key}"]["pipeline"][0]
                if kind == "adagrad" or key in ("max_exp_avg_sq", "step") or t.numel() < 128:
                    assert first == "exact/1" and torch.equal(out[i][key], t), (kind, key)  # never loses state
                else:
                    assert first.startswith("moment-"), (kind, key)
        if kind in ("adagrad", "amsgrad"):  # `ckptzip inspect` lists what was kept exact
            from ckptzip.tables import exact_optimizer_state, record_rows

            listed = exact_optimizer_state(record_rows(decode_container(ch.storage.read(ch.entry().file)).manifest))
            assert ("sum x4" if kind == "adagrad" else "max_exp_avg_sq x4") in listed
        if kind == "sgd":
            mb, ref = out[0]["momentum_buffer"], opt.state_dict()["state"][0]["momentum_buffer"]
            assert float((mb - ref).norm() / ref.norm()) < 0.3  # 3 bits
        if kind == "adam-bf16":
            assert man["optimizer/state/2/exp_avg"]["pipeline"][0] == "moment-direction/1"  # a bf16 moment


def _file(tmp_path, digits_snapshots, **config):
    model, opt, snaps, _ = digits_snapshots
    m = get_method("dynaquant", {"moments": config} if config else None)
    flat = flatten_state({"model": snaps[-1].model, "optimizer": snaps[-1].optimizer}, model, opt)
    from ckptzip.methods.base import EncodeContext

    enc, _ = m.encode(flat, None, ctx=EncodeContext(step=1))
    return m, flat, enc


def test_inconsistent_or_corrupt_moment_records_are_named(tmp_path, digits_snapshots):
    torch.set_num_threads(1)
    m, flat, enc = _file(tmp_path, digits_snapshots)
    ctx = DecodeContext(step=1)
    recs = dict(flat.records)
    name = "optimizer/state/0/exp_avg"
    from dataclasses import replace

    bad = {**recs, name: replace(recs[name], shape=(64, 256))}  # m's shape disagrees with its weight
    with pytest.raises(CorruptCheckpointError, match=f"{name}.*its weight 'fc1.weight'"):
        m.decode(bad, enc, None, ctx=ctx)
    vname = "optimizer/state/0/exp_avg_sq"
    meta = enc.records[vname]["meta"]
    meta["adam"] = {"step": "x"}
    with pytest.raises(CorruptCheckpointError, match=f"{vname}.*malformed moment metadata"):
        m.decode(recs, enc, None, ctx=ctx)
    m, flat, enc = _file(tmp_path, digits_snapshots)
    enc.records[name]["meta"]["v"] = "optimizer/state/9/exp_avg_sq"
    with pytest.raises(CorruptCheckpointError, match=f"{name}.*needs its exp_avg_sq"):
        m.decode(recs, enc, None, ctx=ctx)
    m, flat, enc = _file(tmp_path, digits_snapshots)
    enc.records[name]["meta"]["batch"][2] -= 2  # the record's parts, packed: its span of the shared blob short
    with pytest.raises(CorruptCheckpointError, match=f"{name}.*its data blob"):
        m.decode(recs, enc, None, ctx=ctx)
    for bad, why in (([0, 0], "malformed meta.batch"), (["batch", -1, 4], "malformed meta.batch"),
                     (["batch", 1 << 40, 4], "outside the file's blobs"), (["nowhere", 0, 4], "outside the file's blobs")):
        m, flat, enc = _file(tmp_path, digits_snapshots)
        enc.records[name]["meta"]["batch"] = bad
        with pytest.raises(CorruptCheckpointError, match=f"{name}.*{why}"):
            m.decode(recs, enc, None, ctx=ctx)
    m, flat, enc = _file(tmp_path, digits_snapshots)
    parts = enc.records[name]["meta"]["parts"]
    parts[-1][1] -= 2  # the scale part two bytes short, the codes part two bytes long
    parts[0][1] += 2
    with pytest.raises(CorruptCheckpointError, match=name):
        m.decode(recs, enc, None, ctx=ctx)


def test_m_not_stored(tmp_path, digits_snapshots):
    torch.set_num_threads(1)
    m, flat, enc = _file(tmp_path, digits_snapshots, grid={"m_bits": 0})
    name = "optimizer/state/0/exp_avg"
    assert enc.records[name]["pipeline"] == ["moment-direction/1"] and not enc.records[name]["blobs"]
    out, _ = m.decode(flat.records, enc, None, ctx=DecodeContext(step=1))
    assert not bool(out[name].any()) and bool(out["optimizer/state/0/exp_avg_sq"].any())


def test_moment_batches_do_not_change_the_records(digits_snapshots, monkeypatch):
    """plan_moments encodes the Adam pairs in batches of up to BATCH_NUMEL elements: any split of
    the parameters into batches plans the same records."""
    from ckptzip.methods import moments as MM

    torch.set_num_threads(1)
    model, opt, snaps, _ = digits_snapshots
    flat = flatten_state({"model": snaps[-1].model, "optimizer": snaps[-1].optimizer}, model, opt)
    cfg = get_method("dynaquant").config

    def plan():
        return MM.plan_moments(flat, cfg.moments, None, marker="dynaquant/1", codes=cfg.codes)

    whole = plan()
    monkeypatch.setattr(MM, "BATCH_NUMEL", 1000)  # every tensor of this model in a batch of its own or two
    split = plan()
    assert list(whole) == list(split) and len(whole) >= 4
    for name, a in whole.items():
        b = split[name]
        assert a.meta == b.meta and torch.equal(a.q.codes, b.q.codes)
        assert all(torch.equal(a.q.side[k], b.q.side[k]) for k in a.q.side)


def test_a_non_finite_moment_stays_exact_and_its_batch_is_coded(tmp_path, digits_snapshots):
    """Adam's moments are checked finite once a batch: a NaN in one exp_avg keeps that parameter's
    moments exact (restored bit for bit) and codes the others of its batch as they are coded alone."""
    from ckptzip.methods import moments as MM

    torch.set_num_threads(1)
    model, opt, snaps, _ = digits_snapshots
    state = {"model": snaps[-1].model, "optimizer": snaps[-1].optimizer}
    bad = {**state, "optimizer": {**state["optimizer"], "state": dict(state["optimizer"]["state"])}}
    st0 = bad["optimizer"]["state"][0] = dict(bad["optimizer"]["state"][0])
    st0["exp_avg"] = st0["exp_avg"].clone()
    st0["exp_avg"].view(-1)[3] = float("nan")
    cfg = get_method("dynaquant").config
    plans = [MM.plan_moments(flatten_state(s, model, opt), cfg.moments, None, marker="dynaquant/1", codes=cfg.codes)
             for s in (state, bad)]
    assert "optimizer/state/0/exp_avg" in plans[0] and "optimizer/state/0/exp_avg" not in plans[1]
    assert "optimizer/state/0/exp_avg_sq" not in plans[1]
    assert set(plans[1]) == set(plans[0]) - {"optimizer/state/0/exp_avg", "optimizer/state/0/exp_avg_sq"}
    for name, item in plans[1].items():
        assert torch.equal(item.q.codes, plans[0][name].q.codes)
    ch = CheckpointChain(tmp_path, "dynaquant")
    ch.save(bad, 1, model=model, optimizer=opt)
    out = ch.load(1)["optimizer"]["state"][0]
    assert torch.equal(out["exp_avg"].view(torch.int32), st0["exp_avg"].view(torch.int32))
    assert torch.equal(out["exp_avg_sq"], st0["exp_avg_sq"])


def test_each_denominator_is_released_after_its_direction(tmp_path, digits_snapshots, monkeypatch):
    """A restore keeps a v's float32 denominator only until the m that scales by it is decoded (m
    comes first in Adam's state): when a v is decoded, no earlier v's denominator is alive. (With
    decode tables, the CPU's default, a restore holds no tensor of D at all: here they are off.)"""
    import gc
    import weakref

    torch.set_num_threads(1)
    monkeypatch.setattr(M, "_TABLE_LEVELS", 0)
    m, flat, enc = _file(tmp_path, digits_snapshots)
    alive, seen = [], []
    real = M.decode_denominator

    def tracked(*a, **k):
        gc.collect()
        alive.append(sum(r() is not None for r in seen))
        D = real(*a, **k)
        seen.append(weakref.ref(D))
        return D

    monkeypatch.setattr(M, "decode_denominator", tracked)
    out, _ = m.decode(flat.records, enc, None, ctx=DecodeContext(step=1))
    assert len(seen) >= 2 and alive == [0] * len(seen)
    monkeypatch.setattr(M, "decode_denominator", real)
    ref_out, _ = m.decode(flat.records, enc, None, ctx=DecodeContext(step=1))
    assert list(out) == list(ref_out) and all(torch.equal(out[n], ref_out[n]) for n in out)
