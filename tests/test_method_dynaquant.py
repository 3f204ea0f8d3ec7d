"""dynaquant through the chain on a real run: exact codes, deltas, keyframes, resumed writer."""
import copy

import pytest
from helpers import coded_stages, record_part
import torch

from ckptzip import CheckpointChain, KeyframePolicy
from ckptzip.codec.entropy import read_codes_header
from ckptzip.methods.qrecord import ORDER0_CODER
from ckptzip.quant.dynaquant import adam_direction_error
from ckptzip.quant.moments import AdamHP, denominator
from ckptzip.state import flatten_state


def states(snaps):
    return [(s.step, {"model": s.model, "optimizer": s.optimizer, "step": s.step}) for s in snaps]


@pytest.fixture
def chain_and_run(tmp_path, digits_snapshots):
    torch.set_num_threads(1)
    model, opt, snaps, ev = digits_snapshots
    ch = CheckpointChain(tmp_path, "dynaquant", keyframe=KeyframePolicy(every=4))
    entries = [ch.save(st, step, model=model, optimizer=opt) for step, st in states(snaps)]
    return ch, entries, model, opt, snaps, ev


def test_chain_round_trip_quality_and_ratio(chain_and_run):
    ch, entries, model, opt, snaps, ev = chain_and_run
    assert [e.keyframe for e in entries] == [True, False, False, False] * 2 + [True, False]
    assert all(e.parent == entries[i - 1].step for i, e in enumerate(entries) if not e.keyframe)
    assert ch.verify() == []
    total = sum(e.raw_bytes for e in entries) / sum(e.nbytes for e in entries)
    assert total > 4.0
    # deltas beat keyframes on the weights
    assert entries[1].bytes_by_role["weight"][1] < entries[0].bytes_by_role["weight"][1]
    # small exact records (biases, norms, step scalars) share one group blob (methods/groups.py)
    man = ch.manifest(entries[-1].step)
    assert man["records"]["model/fc1.bias"]["pipeline"] == ["exact/1", "group/1", "bytegroup/1"]
    assert "group.4f" in man["blobs"]
    m_ref, m_q = copy.deepcopy(model), copy.deepcopy(model)
    for s in snaps[::3]:
        out = ch.load(s.step)
        m_ref.load_state_dict(s.model)
        m_q.load_state_dict(out["model"])
        assert abs(ev(m_q) - ev(m_ref)) / ev(m_ref) < 0.1
        # scalars exact, biases/norms exact
        assert out["step"] == s.step
        assert torch.equal(out["model"]["fc1.bias"], s.model["fc1.bias"])
        assert torch.equal(out["optimizer"]["state"][0]["step"], s.optimizer["state"][0]["step"])
        st, sq = s.optimizer["state"], out["optimizer"]["state"]
        big = [i for i in st if st[i]["exp_avg"].numel() >= 1024]
        err = adam_direction_error([st[i]["exp_avg"] for i in big], [st[i]["exp_avg_sq"] for i in big],
                                   [sq[i]["exp_avg"] for i in big], [sq[i]["exp_avg_sq"] for i in big],
                                   float(st[0]["step"]))
        # the grid codec's default: ternary m (direction error 0.6-0.85, measured harmless to a resume:
        # bench/resume.py), and Adam denominators within half a level (a factor 2) of the exact ones,
        # never below half (the lowest level is 1: a tiny v is rounded up, never to zero)
        assert err < 0.95
        for i in big:
            hp = AdamHP(float(st[i]["step"]))
            D = denominator(st[i]["exp_avg_sq"], hp)
            ratio = denominator(sq[i]["exp_avg_sq"], hp) / D
            assert float(ratio.min()) >= 0.5 - 1e-4 and float(ratio[D >= 4 * hp.eps].max()) <= 2.0 + 1e-4


def test_decoded_codes_equal_written_codes(chain_and_run):
    ch, entries, model, opt, snaps, ev = chain_and_run
    # the codes the writer produced for the last checkpoint == the codes the reader rebuilds by replay
    flat = flatten_state(states(snaps)[-1][1], model, opt)
    written = ch.method.search_quantize(flat, {})
    (_, _), ref = ch._replay(snaps[-1].step, ch.entries())
    for name, q in written.items():
        assert torch.equal(ref.weights[name].codes.long(), q.codes.long()), name


def test_code_streams_decoded_ahead_restore_what_one_at_a_time_does(chain_and_run, monkeypatch):
    """A restore decodes each file's code streams in one batch first (qrecord.predecode), and every
    record's load takes its stream from there: the same tensors as decoding each at its load."""
    from ckptzip.methods import qrecord

    ch, entries, *_ = chain_and_run
    batched, seen = qrecord.predecode, []

    def spy(enc, names):
        batched(enc, names)
        assert enc.ahead, "no code stream was decoded ahead"
        seen.append(enc)

    monkeypatch.setattr(qrecord, "predecode", spy)
    ahead = CheckpointChain(ch.url).restore(entries[-1].step).flat.tensors
    assert len(seen) == 2 and all(not enc.ahead for enc in seen)  # keyframe + 1 delta; every stream used
    monkeypatch.setattr(qrecord, "predecode", lambda enc, names: None)
    alone = CheckpointChain(ch.url).restore(entries[-1].step).flat.tensors
    assert ahead.keys() == alone.keys()
    assert all(torch.equal(ahead[n].view(-1).view(torch.uint8), alone[n].view(-1).view(torch.uint8)) for n in ahead)


def test_delta_records_and_resumed_writer(chain_and_run, tmp_path):
    ch, entries, model, opt, snaps, ev = chain_and_run
    data = ch.storage.read(entries[1].file)
    from ckptzip.format import decode_container

    c = decode_container(data)
    recs = c.manifest["records"]
    wq = [n for n, r in recs.items() if r["pipeline"][0] == "dynaquant/1" and r["role"] == "weight"]
    assert wq and all("cyclic-delta/1" in recs[n]["pipeline"] for n in wq)
    for n in wq:  # coder="auto": the paper's rearranged RLE + Huffman, or the order-0 coder on the plain delta
        h = read_codes_header(record_part(c, n, "codes"))
        assert h["delta"]
        assert (h["rearrange"] and h["rle"] and h["coder"] == "huffman") or \
            (h["coder"] == ORDER0_CODER and not h["rle"])
    # a new writer on the same folder continues with a delta against the last step
    ch2 = CheckpointChain(tmp_path, "dynaquant", keyframe=KeyframePolicy(every=4))
    st = {"model": snaps[-1].model, "optimizer": snaps[-1].optimizer, "step": 999}
    e = ch2.save(st, 999, model=model, optimizer=opt)
    assert not e.keyframe and e.parent == snaps[-1].step
    assert ch2.verify() == []


def test_bf16_model_and_sgd_momentum(tmp_path):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).to(torch.bfloat16)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    ch = CheckpointChain(tmp_path, "dynaquant")
    for step in range(1, 4):
        net(torch.randn(16, 64, dtype=torch.bfloat16)).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        ch.save({"model": net.state_dict(), "optimizer": opt.state_dict()}, step, model=net, optimizer=opt)
    out = ch.load()
    w = out["model"]["0.weight"]
    assert w.dtype == torch.bfloat16 and w.shape == (128, 64)
    rel = (w.float() - net[0].weight.float()).norm() / net[0].weight.float().norm()
    assert rel < 0.2
    mb = out["optimizer"]["state"][0]["momentum_buffer"]
    assert mb.dtype == torch.bfloat16
    assert ch.verify() == []


def test_corrupt_delta_is_detected(chain_and_run):
    ch, entries, *_ = chain_and_run
    path = ch.storage.path(entries[2].file)
    raw = bytearray(open(path, "rb").read())
    raw[-50] ^= 0xFF
    open(path, "wb").write(bytes(raw))
    problems = ch.verify()
    assert problems and entries[2].file in str(problems[0]) and problems[0].step == entries[2].step


def test_restarted_writer_resumes_the_search(tmp_path, digits_snapshots):
    from ckptzip.methods.base import EncodeContext

    torch.set_num_threads(1)
    model, opt, snaps, ev = digits_snapshots
    scratch = copy.deepcopy(model)

    def save(chain, s):
        scratch.load_state_dict(s.model)
        ctx = EncodeContext(step=s.step, model=scratch, eval_fn=ev, threshold=0.02)
        return chain.save({"model": s.model, "optimizer": s.optimizer}, s.step, model=model, optimizer=opt, ctx=ctx)

    paper = {"residual": "never"}  # a restarted writer re-quantizes the weights (tests/test_residual.py: residuals)
    first = save(CheckpointChain(tmp_path, "dynaquant", paper), snaps[5])
    assert first.summary["search"] == "exhaustive"
    # a crash: a new process (new method object) on the same chain continues the steady-state search
    again = save(CheckpointChain(tmp_path, "dynaquant", paper), snaps[6])
    assert again.summary["search"] in ("neighbourhood", "fallback") and not again.keyframe
    assert again.summary["evals"] < first.summary["evals"]


def test_paper_encoder_is_selectable(tmp_path, digits_snapshots):
    model, opt, snaps, ev = digits_snapshots
    ch = CheckpointChain(tmp_path, "dynaquant", {"codes": {"coder": "huffman"}})
    for s in snaps[:2]:
        e = ch.save({"model": s.model, "optimizer": s.optimizer}, s.step, model=model, optimizer=opt)
    from ckptzip.format import decode_container

    recs = decode_container(ch.storage.read(e.file)).manifest["records"]
    w = [r for r in recs.values() if r["role"] == "weight" and r["pipeline"][0] == "dynaquant/1"]
    assert w and all(coded_stages(r["pipeline"])[1:] == ["cyclic-delta/1", "rearrange/1", "rle/1", "huffman/1"]
               for r in w)


@pytest.mark.parametrize("residual", ["never", "always"])
def test_a_non_finite_weight_stays_exact_and_the_others_are_quantized(tmp_path, digits_snapshots, monkeypatch, residual):
    """A save quantizes the weights without checking each finite first (the sketch pass sees every
    value); on its NonFiniteError the weights holding inf/NaN stay exact, bit for bit, and the files
    are those of a writer that checks every weight first."""
    from ckptzip.methods import quantizing
    from ckptzip.methods.dynaquant import DynaQuantMethod

    torch.set_num_threads(1)
    model, opt, snaps, _ = digits_snapshots
    sts = [copy.deepcopy(s) for _, s in states(snaps)[:3]]
    name = next(k for k, v in sts[1]["model"].items() if v.dim() == 2)
    sts[1]["model"][name].view(-1)[[3, 7]] = torch.tensor([float("nan"), float("inf")])
    checks = []
    real = quantizing.all_finite
    monkeypatch.setattr(quantizing, "all_finite", lambda t: checks.append(1) or real(t))

    def run(root):
        ch, out = CheckpointChain(root, "dynaquant", {"residual": residual}), []
        for i, s in enumerate(sts):
            n = len(checks)
            ch.save(s, i + 1, model=model, optimizer=opt)
            out.append(len(checks) > n)
        return ch, out

    fast, checked_fast = run(tmp_path / "fast")
    assert checked_fast == [False, True, False]  # only the save holding inf/NaN checks each weight
    assert fast.manifest(2)["records"][f"model/{name}"]["pipeline"][0] != "dynaquant/1"
    assert torch.equal(fast.load(2)["model"][name].view(torch.int32), sts[1]["model"][name].view(torch.int32))
    monkeypatch.setattr(DynaQuantMethod, "finds_nonfinite", False)  # every save checks each weight first
    slow, checked_slow = run(tmp_path / "slow")
    assert all(checked_slow)
    for a, b in zip(fast.entries(), slow.entries()):
        assert fast.storage.read(a.file) == slow.storage.read(b.file)


def test_config_dict_is_built_once_per_config():
    # every manifest embeds the config: its dict is kept between saves, and rebuilt for a new config
    import dataclasses

    from ckptzip.methods.base import get_method

    m = get_method("dynaquant")
    first = m.config_dict()
    assert first == dataclasses.asdict(m.config) and m.config_dict() is first
    m.config = dataclasses.replace(m.config, residual="never")
    assert m.config_dict()["residual"] == "never" and first["residual"] != "never"
    assert get_method("bitsnap").config_dict() == dataclasses.asdict(get_method("bitsnap").config)


def test_small_quantized_records_share_one_blob(tmp_path, digits_snapshots, monkeypatch):
    """Quantized records under qrecord.BATCH_BELOW codes keep no blob of their own (batch/1): their
    packed parts are spans of the blob ``batch``. The files restore the bits of files where every
    record has its own blob; the shared bytes are split over the records' roles and rows; a flipped
    byte in the shared blob is found and every record in it named."""
    from ckptzip.chain import checkpoint_file
    from ckptzip.errors import CorruptCheckpointError
    from ckptzip.methods import qrecord
    from ckptzip.tables import record_rows

    torch.set_num_threads(1)
    model, opt, snaps, _ = digits_snapshots
    chains = {}
    for label, below in (("mixed", 2048), ("own", 0)):  # the digits MLP's fc1 (8192 codes) keeps its own
        monkeypatch.setattr(qrecord, "BATCH_BELOW", below)
        chains[label] = CheckpointChain(tmp_path / label, "dynaquant")
        for step, st in states(snaps[:3]):
            chains[label].save(st, step, model=model, optimizer=opt)
    ch = chains["mixed"]
    for e in ch.entries():
        man = ch.manifest(e.step)
        recs = man["records"]
        batched = [n for n, r in recs.items() if r["pipeline"][-1] == "batch/1"]
        own = [n for n, r in recs.items() if r["pipeline"][0] == "dynaquant/1" and n not in batched]
        assert len(batched) >= 4 and own and all(not recs[n]["blobs"] for n in batched)
        assert all(set(recs[n]["blobs"]) == {"data"} for n in own)  # packed (meta.parts) in a blob of its own
        spans = sorted(recs[n]["meta"]["batch"][1:] for n in batched)
        assert spans[0][0] == 0 and all(a[0] + a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert spans[-1][0] + spans[-1][1] == man["blobs"]["batch"]["nbytes"]
        roles = e.bytes_by_role
        assert "shared" not in roles
        assert abs(sum(v[1] for v in roles.values()) - sum(b["nbytes"] for b in man["blobs"].values())) <= 4
        assert sum(r["stored_bytes"] for r in record_rows(man)) == sum(b["nbytes"] for b in man["blobs"].values()) - \
            sum(b["nbytes"] for k, b in man["blobs"].items() if k.startswith("group."))
        assert not any(r["pipeline"][-1] == "batch/1" for r in chains["own"].manifest(e.step)["records"].values())
        a, b = ch.restore(e.step).flat.tensors, chains["own"].restore(e.step).flat.tensors
        assert set(a) == set(b) and all(torch.equal(a[n].view(-1).view(torch.uint8), b[n].view(-1).view(torch.uint8))
                                        for n in a)
    assert sum(e.nbytes for e in ch.entries()) < sum(e.nbytes for e in chains["own"].entries())
    # a byte flipped inside the shared blob of the last file
    last = ch.entries()[-1]
    path = tmp_path / "mixed" / checkpoint_file(last.step)
    data, man = bytearray(path.read_bytes()), ch.manifest(last.step)
    keys = sorted(man["blobs"])
    off = len(data) - sum(man["blobs"][k]["nbytes"] for k in keys[keys.index("batch"):])
    data[off + 3] ^= 0x01
    path.write_bytes(bytes(data))
    n = sum(r["pipeline"][-1] == "batch/1" for r in man["records"].values())
    problems = list(map(str, ch.verify(deep=False)))
    assert any(f"and {n - 1} more record(s) sharing blob 'batch' are damaged" in p for p in problems), problems
    with pytest.raises(CorruptCheckpointError, match="batch"):
        CheckpointChain(tmp_path / "mixed").load(last.step)
