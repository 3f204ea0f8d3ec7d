"""BitSnap methods on a real digits run: lossless model states, cluster8 optimizer states, bases."""
from __future__ import annotations

import pytest
import torch

from ckptzip.chain import CheckpointChain, KeyframePolicy, RetentionPolicy
from ckptzip.errors import ConfigError, CorruptCheckpointError
from ckptzip.methods.base import DecodeContext, EncodeContext, get_method
from ckptzip.methods.bitsnap import SECOND_MOMENT_ROLES, BitSnapConfig, is_model_state, is_optimizer_state
from ckptzip.quant import cluster8 as c8
from ckptzip.state import flatten_state

NO_CHAIN_KEYFRAMES = KeyframePolicy(every=1000)  # let the method's own base policy decide


@pytest.fixture(autouse=True)
def _one_thread():
    # tiny tensors: extra threads only add overhead on a shared box (conftest restores the count)
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def digits_snapshots():
    """conftest's 10-checkpoint digits run, trained on one thread (several times faster on a busy box)."""
    from ckptzip.demo.workloads import digits_run

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):  # digits_run seeds the global RNG
            return digits_run(n_checkpoints=10, steps_between=20)
    finally:
        torch.set_num_threads(threads)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous().reshape(-1)
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bit_exact(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(_bits(a), _bits(b)), f"{what} differs"


def states(snaps, bf16: bool = False, master: bool = False):
    """(step, state dict) per snapshot; bf16: model copies in bf16 (mixed precision), optionally with
    the fp32 master weights kept in the optimizer state as ``master_weight``."""
    for s in snaps:
        model = {k: v.to(torch.bfloat16) if bf16 and v.is_floating_point() else v for k, v in s.model.items()}
        opt = s.optimizer
        if master:
            keys = list(s.model)
            opt = {"state": {i: {**st, "master_weight": s.model[keys[i]]} for i, st in opt["state"].items()},
                   "param_groups": opt["param_groups"]}
        yield s.step, {"model": model, "optimizer": opt, "step": s.step}


def save_all(chain, snaps, **kw):
    saved = dict(states(snaps, **kw))
    for step, st in saved.items():
        chain.save(st, step)
    return saved


def check_restores(chain, saved, *, lossless: bool):
    for step, st in saved.items():
        got = chain.restore(step)
        want = flatten_state(st)
        assert set(got.flat.tensors) == set(want.tensors)
        for name, rec in want.records.items():
            a, b = got.flat.tensors[name], want.tensors[name]
            if is_optimizer_state(rec) and not lossless:
                check_moment(got.flat.tensors, want.tensors, want.records, name, f"{name}@{step}")
                assert got.manifest["records"][name]["pipeline"][:2] == ["bitsnap/1", "cluster8/1"], name
            else:
                assert_bit_exact(a, b, f"{name}@{step}")
        assert got.state["optimizer"]["param_groups"] == st["optimizer"]["param_groups"]
        assert got.state["step"] == step


def check_moment(got: dict, want: dict, records: dict, name: str, what: str) -> None:
    """An optimizer state restored by bitsnap (Adam guard on) against the exact one."""
    a, b = got[name], want[name]
    assert a.dtype == b.dtype and a.shape == b.shape, what
    step = float(b.max() - b.min()) / 255 * (1 + 1e-5) + 1e-30  # every cluster's step is at most this
    role = records[name].role
    if role in SECOND_MOMENT_ROLES:  # rounded up: v <= v' < v + scale
        assert bool((a >= b * (1 - 1e-6)).all()), f"{what} rounded below the exact value"
        assert float((a - b).max()) <= step, f"{what} beyond one uint8 step"
        return
    ref = c8.dequantize(c8.quantize(b))
    keep = torch.ones_like(b, dtype=torch.bool)
    v_name = name.rpartition("/")[0] + "/exp_avg_sq"
    if role == "exp_avg" and v_name in got:
        keep = got[v_name] != 0
        assert bool((want[v_name][~keep] == 0).all()), f"{what}: v' is 0 where v was not"
        assert bool((a[~keep] == 0).all()), f"{what} not zeroed where v' is 0"
    assert torch.equal(a[keep], ref[keep]), f"{what} is not cluster8's reconstruction"
    assert float((a - b).abs().masked_fill(~keep, 0).max()) <= step / 2, f"{what} beyond half a uint8 step"


def adam_direction(state: dict, i: int) -> torch.Tensor:
    st = state["optimizer"]["state"][i]
    t = float(st["step"])
    (b1, b2), eps = state["optimizer"]["param_groups"][0]["betas"], state["optimizer"]["param_groups"][0]["eps"]
    return (st["exp_avg"].double() / (1 - b1 ** t)) / ((st["exp_avg_sq"].double() / (1 - b2 ** t)).sqrt() + eps)


@pytest.mark.parametrize("guard", [True, False])
def test_adam_guard_bounds_the_rebuilt_step(tmp_path, digits_snapshots, guard):
    """Round-to-nearest (the paper) blows Adam's step up where v rounds to 0; the guard keeps it bounded."""
    _, _, snaps, _ = digits_snapshots
    chain = CheckpointChain(tmp_path, "bitsnap", {"adam_guard": guard})
    saved = save_all(chain, snaps[:1])
    step, st = next(iter(saved.items()))
    got = chain.load(step)
    worst = max(float(adam_direction(got, i).abs().max() / adam_direction(st, i).abs().max())
                for i in st["optimizer"]["state"])
    if guard:
        assert worst <= 1.05  # |m'| / sqrt(v') never exceeds the exact largest step by more than rounding
    else:
        assert worst > 100


@pytest.mark.parametrize("method", ["bitsnap", "bitsnap-lossless"])
def test_digits_chain_exact_weights_and_bases(tmp_path, digits_snapshots, method):
    _, _, snaps, _ = digits_snapshots
    chain = CheckpointChain(tmp_path, method, {"max_cached_iterations": 3}, keyframe=NO_CHAIN_KEYFRAMES)
    saved = save_all(chain, snaps)
    entries = chain.entries(refresh=True)
    steps = [e.step for e in entries]
    # a base, 3 deltas against it, a new base, ...
    assert [e.keyframe for e in entries] == [i % 4 == 0 for i in range(len(entries))]
    for i, e in enumerate(entries):
        base = steps[i - i % 4]
        assert e.parent == (None if e.keyframe else base)
        assert e.summary["base_step"] == base and e.summary["delta_index"] == i % 4
    check_restores(chain, saved, lossless=method == "bitsnap-lossless")
    assert chain.verify() == []
    # optimizer states: about 1.5 bytes per element quantized (2.67x), exact (< 1.3x) without
    m = entries[1].bytes_by_role["exp_avg"]
    assert (m[0] / m[1] > 2.5) if method == "bitsnap" else (m[0] / m[1] < 1.3)


def test_bf16_weights_choose_bitmask_and_fp32_master_quantized(tmp_path, digits_snapshots):
    _, _, snaps, _ = digits_snapshots
    chain = CheckpointChain(tmp_path, "bitsnap", {"max_cached_iterations": 3}, keyframe=NO_CHAIN_KEYFRAMES)
    saved = save_all(chain, snaps, bf16=True, master=True)
    entries = chain.entries()
    assert sum(e.summary.get("bitmask", 0) for e in entries) > 0
    # a delta picking the bitmask is smaller than that record stored dense
    man = chain.restore(entries[5].step).manifest
    picked = {n: r for n, r in man["records"].items() if r["meta"].get("kind") == "bitmask"}
    assert picked and all(r["pipeline"] == ["bitsnap/1", "bitmask/1", "bytegroup/1"] for r in picked.values())
    for r in picked.values():
        n = 1
        for d in r["shape"]:
            n *= d
        assert r["meta"]["n_changed"] < 0.9375 * n  # below the bf16 break-even
    masters = [n for n, r in man["records"].items() if r["role"] == "master_weight"]
    assert masters and all(man["records"][n]["pipeline"] == ["bitsnap/1", "cluster8/1"] for n in masters)
    check_restores(chain, saved, lossless=False)
    assert chain.verify() == []


@pytest.mark.parametrize("codec", ["zstd", "none"])
def test_payload_codecs_round_trip(tmp_path, digits_snapshots, codec):
    _, _, snaps, _ = digits_snapshots
    chain = CheckpointChain(tmp_path, "bitsnap-lossless", {"payload_codec": codec}, keyframe=NO_CHAIN_KEYFRAMES)
    saved = save_all(chain, snaps[5:9], bf16=True)
    man = chain.restore(max(saved)).manifest
    pipes = {tuple(r["pipeline"]) for r in man["records"].values() if r["role"] == "weight"}
    assert pipes <= {("bitsnap/1", "bitmask/1", "zstd-frame/1"), ("bitsnap/1", "bitmask/1")}
    if codec == "none":
        assert pipes == {("bitsnap/1", "bitmask/1")}
    check_restores(chain, saved, lossless=True)


def test_resumed_writer_continues_count(tmp_path, digits_snapshots):
    _, _, snaps, _ = digits_snapshots
    cfg = {"max_cached_iterations": 4}
    all_states = dict(states(snaps))
    steps = sorted(all_states)
    chain = CheckpointChain(tmp_path, "bitsnap", cfg, keyframe=NO_CHAIN_KEYFRAMES)
    for s in steps[:3]:
        chain.save(all_states[s], s)
    chain.close()
    resumed = CheckpointChain(tmp_path, "bitsnap", cfg, keyframe=NO_CHAIN_KEYFRAMES)  # fresh process
    for s in steps[3:]:
        resumed.save(all_states[s], s)
    entries = resumed.entries()
    assert [e.summary["delta_index"] for e in entries] == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]
    assert entries[3].parent == steps[0] and entries[5].keyframe and entries[6].parent == steps[5]
    check_restores(resumed, all_states, lossless=False)


def test_chain_keyframe_policy_and_retention_keep_bases(tmp_path, digits_snapshots):
    _, _, snaps, _ = digits_snapshots
    chain = CheckpointChain(tmp_path, "bitsnap-lossless", {"max_cached_iterations": 10},
                            keyframe=KeyframePolicy(every=3), retention=RetentionPolicy(keep_last=2))
    saved = save_all(chain, snaps)
    # the chain forces a base every 3 saves (reference None) although the method would allow 10 deltas;
    # keep_last=2 keeps the last delta's base as well
    entries = chain.entries(refresh=True)
    steps = [s.step for s in snaps]
    assert [e.step for e in entries] == [steps[6], steps[8], steps[9]]
    assert [e.keyframe for e in entries] == [True, False, True] and entries[1].parent == steps[6]
    kept = [e.step for e in entries]
    check_restores(chain, {s: saved[s] for s in kept}, lossless=True)
    assert chain.verify() == []


def test_direct_encode_decode_and_wrong_base(digits_snapshots):
    _, _, snaps, _ = digits_snapshots
    m = get_method("bitsnap", BitSnapConfig(max_cached_iterations=1))
    flats = [flatten_state(st) for _, st in states(snaps[:3])]
    enc0, ref0 = m.encode(flats[0], None, ctx=EncodeContext(step=1))
    enc1, ref1 = m.encode(flats[1], ref0, ctx=EncodeContext(step=2))
    enc2, ref2 = m.encode(flats[2], ref1, ctx=EncodeContext(step=3))
    assert enc0.keyframe and not enc1.keyframe and enc2.keyframe  # one delta, then a new base
    assert ref1.step == 1 and ref1.base is ref0.base and ref2.step == 3
    # the reference holds CPU copies of the base model states only, not aliases of the input
    assert set(ref0.base) == {n for n, r in flats[0].records.items() if is_model_state(r)}
    assert all(t.data_ptr() != flats[0].tensors[n].data_ptr() for n, t in ref0.base.items())
    out0, dref0 = m.decode(flats[0].records, enc0, None, ctx=DecodeContext(step=1))
    out1, dref1 = m.decode(flats[1].records, enc1, dref0, ctx=DecodeContext(step=2))
    assert dref1.step == 1 and dref1.count == 1
    for n, r in flats[1].records.items():
        if is_model_state(r):
            assert_bit_exact(out1[n], flats[1].tensors[n], n)
    wrong = type(dref0)(7, dref0.base, dref0.count)
    with pytest.raises(CorruptCheckpointError, match="needs base step 1"):
        m.decode(flats[1].records, enc1, wrong, ctx=DecodeContext(step=2))
    with pytest.raises(CorruptCheckpointError, match="needs base step 1"):
        m.decode(flats[1].records, enc1, None, ctx=DecodeContext(step=2))


def test_non_finite_moment_falls_back_to_exact(digits_snapshots):
    _, _, snaps, _ = digits_snapshots
    flat = flatten_state(next(states(snaps[:1]))[1])
    name = next(n for n, r in flat.records.items() if r.role == "exp_avg_sq")
    flat.tensors[name] = flat.tensors[name].clone()
    flat.tensors[name][0] = float("inf")
    m = get_method("bitsnap")
    enc, _ = m.encode(flat, None, ctx=EncodeContext(step=1))
    assert enc.records[name]["pipeline"][0] == "exact/1"
    out, _ = m.decode(flat.records, enc, None, ctx=DecodeContext(step=1))
    assert_bit_exact(out[name], flat.tensors[name], name)


def test_config_validation():
    with pytest.raises(ConfigError, match="max_cached_iterations"):
        BitSnapConfig(max_cached_iterations=-1)
    with pytest.raises(ConfigError, match="n_clusters"):
        BitSnapConfig(n_clusters=17)
    with pytest.raises(ConfigError, match="payload_codec"):
        BitSnapConfig(payload_codec="lz4")
    with pytest.raises(ConfigError, match="bitsnap-lossless keeps optimizer states exact"):
        get_method("bitsnap-lossless", BitSnapConfig())
    assert get_method("bitsnap-lossless").config.quantize_optimizer is False
    assert get_method("bitsnap-lossless", {"max_cached_iterations": 2}).config.quantize_optimizer is False
