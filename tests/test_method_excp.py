"""Methods ``excp`` and ``excp-fixed`` (methods/excp.py) on a real 10-checkpoint digits run.

Every step restores; the weights a restore gives are bit-equal to an independent one-step
re-implementation from the previous restore (the encoder's reference and the decoder stay in
lockstep); the faithful method's optimizer scalars come from the base, the fixed one's from the
checkpoint; everything without Adam state is exact; bf16 weights work; a resumed writer keeps
writing deltas; damage raises CorruptCheckpointError.
"""
import copy
import dataclasses
import math

import pytest
import torch

from ckptzip.chain import CheckpointChain
from ckptzip.errors import ConfigError, CorruptCheckpointError
from ckptzip.methods.base import DecodeContext, EncodeContext, get_method
from ckptzip.methods.excp_fixed import ExcpFixedConfig
from ckptzip.methods.excp_records import adam_parameters
from ckptzip.quant.excp import EXCP_FAITHFUL, decode_tensor, encode_tensor
from ckptzip.state import flatten_state

METHODS = [("excp", None), ("excp-fixed", None), ("excp-fixed", {"keyframe_weights": "kmeans"})]
IDS = ["excp", "excp-fixed", "excp-fixed-kmeans-keyframe"]
@pytest.fixture(autouse=True)
def _one_thread():
    # on a busy 2-core machine torch's intra-op threads make small ops ~100x slower; conftest
    # restores the thread count afterwards
    torch.set_num_threads(1)


PARAMS = ["fc1.weight", "fc1.bias", "norm.weight", "norm.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"]


def states(snaps, weight_dtype=None):
    out = []
    for s in snaps:
        model = {k: v.to(weight_dtype) if weight_dtype else v for k, v in s.model.items()}
        out.append((s.step, {"model": model, "optimizer": s.optimizer}))
    return out


def save_all(chain, items, model, opt):
    return [chain.save(st, step, model=model, optimizer=opt) for step, st in items]


def tensor_config(method):
    return EXCP_FAITHFUL if method.name == "excp" else method.config.tensor_config()


def one_step(w_prev_hat, w, m, v, cfg):
    """An independent ExCP step: residual in fp32, the core's encode/decode, W~ back in the weight dtype."""
    blobs, meta = encode_tensor(w.float() - w_prev_hat.float(), m, v, cfg)
    dw, m_hat, v_hat = decode_tensor(blobs, meta)
    return (w_prev_hat.float() + dw).to(w.dtype), m_hat, v_hat, meta, dw


@pytest.mark.parametrize("name,config", METHODS, ids=IDS)
def test_every_step_restores_in_lockstep(tmp_path, digits_snapshots, name, config):
    model, opt, snaps, eval_fn = digits_snapshots
    if config:  # the keyframe variant only changes the base: a short chain is enough
        snaps = snaps[:4]
    chain = CheckpointChain(tmp_path, name, config)
    entries = save_all(chain, states(snaps), model, opt)
    assert entries[0].keyframe and all(not e.keyframe for e in entries[1:])
    assert [e.parent for e in entries[1:]] == [e.step for e in entries[:-1]]  # deltas chain
    cfg = tensor_config(chain.method)
    probe = copy.deepcopy(model)
    prev = chain.load(snaps[0].step)
    for i, s in enumerate(snaps[1:], start=1):
        got = chain.load(s.step)
        for j, p in enumerate(PARAMS):
            st = s.optimizer["state"][j]
            w_hat, m_hat, v_hat, meta, dw_hat = one_step(prev["model"][p], s.model[p], st["exp_avg"],
                                                         st["exp_avg_sq"], cfg)
            assert torch.equal(got["model"][p], w_hat), (s.step, p)
            assert torch.equal(got["optimizer"]["state"][j]["exp_avg"], m_hat), (s.step, p)
            assert torch.equal(got["optimizer"]["state"][j]["exp_avg_sq"], v_hat), (s.step, p)
            # the masks, re-derived here from eq. 5/6 (not through the core)
            dw = s.model[p].float() - prev["model"][p].float()
            f = min(2.5, 5e-5 / math.sqrt(float(st["exp_avg_sq"].mean())))
            w_mask = dw.abs() > dw.abs().reshape(-1).median() * f
            m_mask = (st["exp_avg"].abs() > 2.0 * st["exp_avg"].abs().mean()) & w_mask
            assert torch.equal(dw_hat != 0, w_mask) or meta["parts"]["dw"]["mode"] == "dense"
            assert torch.equal(got["optimizer"]["state"][j]["exp_avg"] != 0, m_mask)
            if name == "excp-fixed" and meta["parts"]["dw"]["mode"] == "kmeans":
                # <= 15 fp32 centers, each kept residual on its nearest one
                centers = torch.unique(dw_hat[w_mask])
                assert centers.numel() <= 15
                best = (dw[w_mask].unsqueeze(1) - centers).abs().min(dim=1).values
                assert torch.equal((dw[w_mask] - dw_hat[w_mask]).abs(), best)
        # quality: held-out loss of the restored model within 2% of the true checkpoint's
        probe.load_state_dict(s.model)
        true = eval_fn(probe)
        probe.load_state_dict(got["model"])
        assert abs(eval_fn(probe) - true) <= 0.02 * true, s.step
        prev = got
    assert chain.verify() == []
    if not config:
        raw, stored = sum(e.raw_bytes for e in entries), sum(e.nbytes for e in entries)
        assert raw / stored > (3.5 if name == "excp" else 4.5), raw / stored  # keyframe included
        assert all(e.ratio > 6 for e in entries[1:]), [e.ratio for e in entries]  # every delta


@pytest.mark.parametrize("name,config", METHODS, ids=IDS)
def test_encoder_reference_equals_decoder_reference(digits_snapshots, name, config):
    model, opt, snaps, _ = digits_snapshots
    enc_m, dec_m = get_method(name, config), get_method(name, config)
    ref_e = ref_d = None
    for step, st in states(snaps[:5]):
        flat = flatten_state(st, model, opt)
        enc, ref_e = enc_m.encode(flat, ref_e, ctx=EncodeContext(step=step))
        out, ref_d = dec_m.decode(flat.records, enc, ref_d, ctx=DecodeContext(step=step))
        assert set(ref_e.weights) == set(ref_d.weights) == {f"model/{p}" for p in PARAMS}
        for n, w in ref_e.weights.items():
            assert torch.equal(w, ref_d.weights[n]) and torch.equal(out[n], w), (step, n)
        assert all(not r["blobs"] for r in enc.records.values()) or name == "excp-fixed"
    if name == "excp":
        assert set(enc.blobs) == {"payload"}  # one LZMA payload, records only point into it


def test_step_and_lr_come_from_the_base_in_excp_only(tmp_path, digits_snapshots):
    model, opt, snaps, _ = digits_snapshots
    items = []
    for i, (step, st) in enumerate(states(snaps[:4])):
        st = {**st, "optimizer": copy.deepcopy(st["optimizer"])}
        st["optimizer"]["param_groups"][0]["lr"] = 1e-3 * (i + 1)  # a schedule the base does not know
        items.append((step, st))
    for name in ("excp", "excp-fixed"):
        chain = CheckpointChain(tmp_path / name, name)
        save_all(chain, items, model, opt)
        for i, (step, st) in enumerate(items):
            got = chain.load(step)["optimizer"]
            src = items[0][1]["optimizer"] if name == "excp" else st["optimizer"]  # faithful: the base's
            assert got["param_groups"][0]["lr"] == src["param_groups"][0]["lr"]
            for j in range(len(PARAMS)):
                assert torch.equal(got["state"][j]["step"], src["state"][j]["step"])
            fresh = torch.optim.Adam(copy.deepcopy(model).parameters())
            fresh.load_state_dict(got)  # what a resumed run does
        if name == "excp":
            base_step = snaps[0].optimizer["state"][0]["step"]
            assert got["state"][0]["step"] == base_step != st["optimizer"]["state"][0]["step"]


@pytest.mark.parametrize("name", ["excp", "excp-fixed"])
def test_state_without_adam_state_is_exact(tmp_path, digits_snapshots, name):
    model, _, snaps, _ = digits_snapshots
    model2 = copy.deepcopy(model)
    opt2 = torch.optim.Adam(model2.parameters())  # the same parameter order as the run's optimizer
    model2.frozen = torch.nn.Parameter(torch.randn(7, 3), requires_grad=False)  # weight, no optimizer state
    model2.register_buffer("running", torch.zeros(130))
    g = torch.Generator().manual_seed(3)
    items = []
    for i, s in enumerate(snaps[:4]):
        sd = {**s.model, "frozen": torch.randn(7, 3, generator=g), "running": torch.randn(130, generator=g) * 1e-3,
              "counter": torch.tensor(i * 977, dtype=torch.int64),
              "tied": s.model["fc1.weight"]}  # the same memory, as GPT-2's lm_head.weight is wte.weight
        items.append((s.step, {"model": sd, "optimizer": s.optimizer, "epoch": i, "rng": torch.get_rng_state()}))
    chain = CheckpointChain(tmp_path, name)
    entries = save_all(chain, items, model2, opt2)
    flat = flatten_state(items[0][1], model2, opt2)
    assert flat.records["model/frozen"].role == "weight" and flat.records["model/running"].role == "buffer"
    assert "model/frozen" not in adam_parameters(flat) and len(adam_parameters(flat)) == len(PARAMS)
    for (step, st), e in zip(items, entries):
        got = chain.load(step)
        for k in ("frozen", "running", "counter"):
            assert torch.equal(got["model"][k], st["model"][k]) and got["model"][k].dtype == st["model"][k].dtype
        assert got["epoch"] == st["epoch"] and torch.equal(got["rng"], st["rng"])
        # a tied tensor (flatten_state keeps one record) restores as the parameter's decoded value
        assert torch.equal(got["model"]["tied"], got["model"]["fc1.weight"])
        assert "model/tied" not in chain.restore(step).manifest["records"]


@pytest.mark.parametrize("name", ["excp", "excp-fixed"])
def test_bf16_weights(tmp_path, digits_snapshots, name):
    model, opt, snaps, eval_fn = digits_snapshots
    items = states(snaps[:5], torch.bfloat16)
    chain = CheckpointChain(tmp_path, name)
    save_all(chain, items, model, opt)
    cfg = tensor_config(chain.method)
    prev = chain.load(items[0][0])
    for step, st in items[1:]:
        got = chain.load(step)
        for j, p in enumerate(PARAMS):
            w = st["model"][p]
            assert got["model"][p].dtype == torch.bfloat16
            s = st["optimizer"]["state"][j]
            w_hat = one_step(prev["model"][p], w, s["exp_avg"], s["exp_avg_sq"], cfg)[0]
            assert torch.equal(got["model"][p], w_hat), (step, p)
            # the residual is taken against bf16 W~, so rounding is fed back: error stays near one delta's
            err = float((got["model"][p].float() - w.float()).norm() / w.float().norm())
            assert err < 0.03, (step, p, err)
        prev = got


def test_fixed_codes_are_smaller_than_faithful(tmp_path, digits_snapshots):
    model, opt, snaps, _ = digits_snapshots
    sizes = {}
    for name in ("excp", "excp-fixed"):
        entries = save_all(CheckpointChain(tmp_path / name, name), states(snaps[:4]), model, opt)
        sizes[name] = [e.nbytes for e in entries]
    assert sizes["excp-fixed"][0] < 0.5 * sizes["excp"][0]   # compressed vs uncompressed base
    assert sum(sizes["excp-fixed"][1:]) < sum(sizes["excp"][1:])


@pytest.mark.parametrize("name", ["excp", "excp-fixed"])
def test_resumed_writer_continues_with_deltas(tmp_path, digits_snapshots, name):
    model, opt, snaps, _ = digits_snapshots
    items = states(snaps[:4])
    straight = CheckpointChain(tmp_path / "straight", name)
    save_all(straight, items, model, opt)
    first = CheckpointChain(tmp_path / "resumed", name)
    save_all(first, items[:2], model, opt)
    again = CheckpointChain(tmp_path / "resumed", name)  # a new process on the same folder
    entries = save_all(again, items[2:], model, opt)
    assert all(not e.keyframe for e in entries) and entries[0].parent == items[1][0]
    for step, _ in items:
        a, b = straight.load(step), again.load(step)
        for p in PARAMS:
            assert torch.equal(a["model"][p], b["model"][p]), (step, p)
    assert again.verify() == []


def test_damaged_payload_raises_corrupt(digits_snapshots):
    model, opt, snaps, _ = digits_snapshots
    for name in ("excp", "excp-fixed"):
        m = get_method(name)
        flats = [flatten_state(st, model, opt) for _, st in states(snaps[:2])]
        e0, r0 = m.encode(flats[0], None, ctx=EncodeContext(step=0))
        e1, _ = m.encode(flats[1], r0, ctx=EncodeContext(step=1))
        _, d0 = m.decode(flats[0].records, e0, None, ctx=DecodeContext(step=0))
        for key in ("payload", "codes") if name == "excp-fixed" else ("payload",):
            bad = copy.copy(e1)
            blob = bytearray(e1.blobs[key])
            blob[len(blob) // 2] ^= 0xFF
            bad.blobs = {**e1.blobs, key: bytes(blob[: len(blob) - 7])}
            with pytest.raises(CorruptCheckpointError):
                m.decode(flats[1].records, bad, d0, ctx=DecodeContext(step=1))
        with pytest.raises(CorruptCheckpointError):  # a delta without its parent
            m.decode(flats[1].records, e1, None, ctx=DecodeContext(step=1))
        w = "model/fc1.weight"
        odd = dataclasses.replace(d0, weights={**d0.weights, w: d0.weights[w][:1]})
        with pytest.raises(CorruptCheckpointError, match=f"'{w}' is an ExCP residual"):  # parent of another shape
            m.decode(flats[1].records, e1, odd, ctx=DecodeContext(step=1))


def test_config_validation():
    with pytest.raises(ConfigError, match="keyframe_weights"):
        ExcpFixedConfig(keyframe_weights="fp8")
    with pytest.raises(ConfigError, match="coders"):
        ExcpFixedConfig(coders=("brotli",))
    with pytest.raises(ConfigError, match="alpha"):
        ExcpFixedConfig(alpha=-1.0)
    assert get_method("excp").config == EXCP_FAITHFUL and get_method("excp-fixed").config.codebook_dtype == "float32"


@pytest.mark.parametrize("name", ["excp", "excp-fixed"])
def test_odd_sizes(tmp_path, name):
    # odd element counts (nibble tails), a bias of 17 (> 15 non-zeros: k-means) and one of 9 (dense)
    from ckptzip.demo.workloads import digits_data

    torch.manual_seed(0)
    xtr, ytr, _, _ = digits_data()
    model = torch.nn.Sequential(torch.nn.Linear(64, 17), torch.nn.ReLU(), torch.nn.Linear(17, 9), torch.nn.ReLU(),
                                torch.nn.Linear(9, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    chain = CheckpointChain(tmp_path, name)
    cfg = tensor_config(chain.method)
    prev = None
    for k in range(3):
        for i in range(5):
            idx = slice(64 * (5 * k + i), 64 * (5 * k + i + 1))
            loss = torch.nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        st = {"model": copy.deepcopy(model.state_dict()), "optimizer": copy.deepcopy(opt.state_dict())}
        chain.save(st, k + 1, model=model, optimizer=opt)
        got = chain.load(k + 1)
        for j, (p, w) in enumerate(st["model"].items()):
            if prev is None:
                assert torch.equal(got["model"][p], w)
                continue
            s = st["optimizer"]["state"][j]
            assert torch.equal(got["model"][p], one_step(prev["model"][p], w, s["exp_avg"], s["exp_avg_sq"], cfg)[0])
        prev = got
    assert chain.verify() == []
