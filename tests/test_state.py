"""flatten_state / unflatten_state (state.py): exact round trips of real training states, the
records' roles, layer types and parameter links, and errors that name the offending path.

Every round trip goes the way a checkpoint does: the skeleton inside a container's manifest and every
tensor as a blob of its raw bytes (format.encode_container / decode_container, tensorbytes), so
nothing survives by object identity. Dict key order survives too (state_dict order matters to
param-link inference on a re-saved state).
"""
import copy
import json
import math
import random

import numpy as np
import pytest
import torch
from torch import nn

from ckptzip.errors import CorruptCheckpointError, UnsupportedStateError
from ckptzip.format import decode_container, encode_container
from ckptzip.state import (MOMENT_ROLES, FlatState, TensorRecord, flatten_state, layer_types, on_host, skeleton_refs,
                           unflatten_state)
from ckptzip.tensorbytes import tensor_from_bytes, tensor_to_bytes


@pytest.fixture(autouse=True)
def _one_torch_thread():
    # many tiny ops: intra-op threads only add contention on a shared CPU (conftest restores the count)
    torch.set_num_threads(1)


BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def roundtrip(state, model=None, optimizer=None):
    flat = flatten_state(state, model, optimizer)
    manifest = {"skeleton": flat.skeleton, "records": {n: r.to_dict() for n, r in flat.records.items()}}
    data = encode_container(manifest, {n: tensor_to_bytes(t) for n, t in flat.tensors.items()})
    c = decode_container(data)
    skeleton = c.manifest["skeleton"]
    assert sorted(skeleton_refs(skeleton)) == sorted(flat.records)
    tensors = {}
    for name, rec in flat.records.items():
        t = flat.tensors[name]
        assert (rec.dtype, rec.shape) == (str(t.dtype).removeprefix("torch."), tuple(t.shape))
        assert TensorRecord.from_dict(name, c.manifest["records"][name]) == rec
        tensors[name] = tensor_from_bytes(c.blobs[name], rec.dtype, rec.shape)
    return unflatten_state(skeleton, tensors), flat


def assert_same(a, b, path="<root>"):
    """Deep equality: same types, tensors bit-identical with dtype and shape, NaN == NaN, same key order.

    An OrderedDict (a state_dict) comes back as a plain dict with the same key order.
    """
    same_type = type(a) is type(b) or (isinstance(a, dict) and type(b) is dict)
    assert same_type, f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, \
            f"{path}: {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"
        if a.dtype == torch.bool:
            assert torch.equal(a, b), path
        else:
            bits = BITS[a.element_size()]
            assert torch.equal(a.contiguous().view(bits), b.contiguous().view(bits)), f"{path}: values differ"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert a.tobytes() == b.tobytes(), f"{path}: values differ"
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert type(k) is type(next(kk for kk in b if kk == k)), f"{path}: key {k!r} changed type"
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}/{i}")
    elif isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b)), \
            f"{path}: {a!r} != {b!r}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _train(model, opt, x, steps=3, loss_fn=None):
    for _ in range(steps):
        out = model(x)
        loss = loss_fn(out) if loss_fn else out.float().pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


# --- real states round trip exactly ---------------------------------------------------------

def test_digits_adam_round_trip_and_load(digits_snapshots):
    model, opt, snaps, _ = digits_snapshots
    snap = snaps[-1]
    state = {"model": snap.model, "optimizer": snap.optimizer, "step": snap.step}
    back, flat = roundtrip(state, model, opt)
    assert_same(state, back)
    assert flat.extra["param_link"] == "live"
    # 4 linear/norm layers x (weight, bias) + Adam's exp_avg, exp_avg_sq for each of the 8 params; each
    # one's step a skeleton scalar, not a record, read into its parameter view
    assert len(flat.by_role("weight")) == 8 and len(flat.by_role("exp_avg", "exp_avg_sq")) == 16
    assert not flat.by_role("step")
    steps = [e["step"] for _, e in flat.skeleton["optimizer"]["state"]["items"]]
    assert steps == [{"__t": "scalar", "dtype": "float32", "v": float(st["step"])}
                     for st in snap.optimizer["state"].values()]
    assert all(v.step == float(snap.optimizer["state"][v.index]["step"]) for v in flat.params().values())
    m2 = type(model)(128)
    m2.load_state_dict(back["model"])
    o2 = torch.optim.Adam(m2.parameters(), lr=1e-3)
    o2.load_state_dict(back["optimizer"])
    assert o2.state_dict()["param_groups"] == snap.optimizer["param_groups"]
    for i, st in snap.optimizer["state"].items():
        for k, v in st.items():
            assert torch.equal(o2.state_dict()["state"][i][k], v)


def test_sgd_momentum_round_trip():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
    _train(model, opt, torch.randn(5, 8))
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    back, flat = roundtrip(state, model, opt)
    assert_same(state, back)
    mom = flat.by_role("momentum_buffer")
    assert sorted(r.param for r in mom) == sorted(n for n, _ in model.named_parameters())
    assert all(r.role in MOMENT_ROLES for r in mom)
    o2 = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.1)
    o2.load_state_dict(back["optimizer"])
    assert o2.param_groups[0]["momentum"] == 0.9 and o2.param_groups[0]["nesterov"] is True


def test_adamw_two_param_groups_links_every_param():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() == 2)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0, "lr": 3e-4}], lr=1e-3, amsgrad=True)
    _train(model, opt, torch.randn(5, 8))
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    back, flat = roundtrip(state, model, opt)
    assert_same(state, back)
    # the optimizer numbers params group by group, so the index order differs from the model's
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in opt.param_groups for p in g["params"]]
    for i, pname in enumerate(order):
        for role in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            rec = flat.records[f"optimizer/state/{i}/{role}"]
            assert rec.param == pname and rec.role == role
            assert rec.shape == tuple(model.state_dict()[pname].shape)
    o2 = torch.optim.AdamW([{"params": decay}, {"params": no_decay}], lr=1.0)
    o2.load_state_dict(back["optimizer"])
    assert [g["weight_decay"] for g in o2.param_groups] == [0.1, 0.0]
    assert o2.param_groups[1]["lr"] == 3e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_transformer_block_round_trip(dtype):
    torch.manual_seed(0)
    block = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    opt = torch.optim.AdamW(block.parameters(), lr=1e-3)
    _train(block, opt, torch.randn(2, 6, 32))
    block = block.to(dtype)  # a half-precision copy, as mixed-precision training keeps beside fp32
    state = {"model": block.state_dict(), "optimizer": opt.state_dict(), "dtype": dtype}
    back, flat = roundtrip(state, block, None)
    assert_same(state, back)
    assert back["dtype"] is dtype
    assert {r.dtype for r in flat.by_role("weight")} == {str(dtype).removeprefix("torch.")}
    b2 = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True).to(dtype)
    b2.load_state_dict(back["model"])
    x = torch.randn(2, 6, 32).to(dtype)
    assert torch.equal(b2(x), block(x))


def test_int_bool_and_odd_shaped_tensors():
    state = {
        "i64": torch.tensor([-(2**63), 2**63 - 1, 0]), "i32": torch.arange(-5, 5, dtype=torch.int32).reshape(2, 5),
        "i16": torch.tensor([-32768, 32767], dtype=torch.int16), "i8": torch.tensor([-128, 127], dtype=torch.int8),
        "u8": torch.arange(256, dtype=torch.uint8), "bool": torch.tensor([True, False, True]),
        "f64": torch.tensor([1 / 3, -0.0, float("inf")], dtype=torch.float64),
        "scalar": torch.tensor(7), "empty": torch.zeros(0, 3), "five_d": torch.randn(1, 2, 1, 3, 2),
        "noncontig": torch.arange(12.0).reshape(3, 4).t(),
    }
    back, flat = roundtrip(state)
    assert_same({k: v.contiguous() for k, v in state.items()}, back)
    assert flat.records["scalar"].shape == () and flat.records["empty"].numel == 0
    assert all(r.role == "tensor" for r in flat.records.values())


def test_schedulers_round_trip_and_load():
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step_lr = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(5):
        opt.step()
        step_lr.step()
    opt2 = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    one_cycle = torch.optim.lr_scheduler.OneCycleLR(opt2, max_lr=0.1, total_steps=20)
    for _ in range(7):
        opt2.step()
        one_cycle.step()
    state = {"step_lr": step_lr.state_dict(), "one_cycle": one_cycle.state_dict(), "optimizer": opt2.state_dict()}
    back, _ = roundtrip(state)
    assert_same(state, back)
    s2 = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=0.1), step_size=9)
    s2.load_state_dict(back["step_lr"])
    assert s2.get_last_lr() == step_lr.get_last_lr() and s2.last_epoch == 5
    o3 = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    c2 = torch.optim.lr_scheduler.OneCycleLR(o3, max_lr=0.1, total_steps=20)
    o3.load_state_dict(back["optimizer"])
    c2.load_state_dict(back["one_cycle"])
    for _ in range(5):  # the restored schedule continues exactly where the original is
        o3.step(), opt2.step()
        c2.step(), one_cycle.step()
        assert c2.get_last_lr() == one_cycle.get_last_lr()


def test_rng_states_round_trip_and_replay():
    torch_rng = torch.get_rng_state()
    np_rng = np.random.get_state()
    py_rng = random.getstate()
    state = {"torch": torch_rng, "numpy": np_rng, "python": py_rng}
    back, flat = roundtrip(state)
    assert_same(state, back)
    assert isinstance(back["numpy"], tuple) and back["numpy"][1].dtype == np.uint32
    assert isinstance(back["python"][1], tuple) and len(back["python"][1]) == 625
    want = (torch.rand(3), np.random.rand(3), random.random())
    try:
        torch.set_rng_state(back["torch"])
        np.random.set_state(back["numpy"])
        random.setstate(back["python"])
        got = (torch.rand(3), np.random.rand(3), random.random())
    finally:
        np.random.set_state(np_rng)
        random.setstate(py_rng)
    assert torch.equal(want[0], got[0]) and np.array_equal(want[1], got[1]) and want[2] == got[2]
    assert flat.records["numpy/1"].dtype == "int32"  # uint32 bits carried in a same-width torch dtype


def test_python_values_round_trip():
    state = {
        "ints": [0, -1, 2**70, True, False], "s": "héllo \u2603 \x00", "none": None,
        "floats": [float("inf"), float("-inf"), float("nan"), -0.0, 1e-310, 0.1, 1.7976931348623157e308],
        "bytes": b"\x00\x01\xff" * 3, "empty_bytes": b"", "tup": (1, ("a", None), ()),
        "int_keys": {0: "a", 7: [1, 2], -3: {"x": 1}}, "mixed_keys": {"a": 1, 2: "b", 2.5: 3, None: 4, True: 5},
        "tricky": {"__t": "tensor", "ref": "nothing"}, "nested": [[{"a": (torch.ones(2),)}]],
        "size": torch.Size([2, 3]), "np_scalar_int": np.int64(3),
        "np_f16": np.array([1.5, -0.0, np.inf], dtype=np.float16), "np_i8": np.array([[-1, 2]], dtype=np.int8),
        "np_f64": np.array([np.nan, 2.0]), "np_bool": np.array([True, False]),
    }
    back, _ = roundtrip(state)
    want = dict(state, np_scalar_int=3)  # numpy scalars come back as the Python number they hold
    assert_same(want, back)
    assert back["tricky"] == {"__t": "tensor", "ref": "nothing"}  # a user dict that looks like a tag


# --- roles, layer types, parameter links ------------------------------------------------------

class Zoo(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.conv = nn.Conv2d(1, 3, 3)
        self.bn = nn.BatchNorm2d(3)
        self.head = nn.Linear(4 + 3, 5)

    def forward(self, tok, img):  # (B,), (B, 1, 5, 5) -> (B, 5)
        e = self.embed(tok)
        c = self.bn(self.conv(img)).mean((2, 3))
        return self.head(torch.cat([e, c], 1))


def _zoo_state():
    torch.manual_seed(0)
    model = Zoo()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    tok, img = torch.randint(0, 10, (4,)), torch.randn(4, 1, 5, 5)
    for _ in range(2):
        loss = model(tok, img).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, opt, {"model": model.state_dict(), "optimizer": opt.state_dict()}


ZOO_TYPES = {
    "embed.weight": "embedding", "conv.weight": "conv", "conv.bias": "bias", "bn.weight": "norm",
    "bn.bias": "norm", "bn.running_mean": "norm", "bn.running_var": "norm", "bn.num_batches_tracked": "norm",
    "head.weight": "linear", "head.bias": "bias",
}


def test_layer_types_from_module_tree():
    model, _, _ = _zoo_state()
    assert layer_types(model) == ZOO_TYPES


def test_roles_layer_types_and_links_live():
    model, opt, state = _zoo_state()
    back, flat = roundtrip(state, model, opt)
    assert_same(state, back)
    assert flat.extra["param_link"] == "live"
    params = [n for n, _ in model.named_parameters()]
    for key, ltype in ZOO_TYPES.items():
        rec = flat.records[f"model/{key}"]
        assert rec.layer_type == ltype, key
        assert rec.role == ("weight" if key in params else "buffer"), key
        assert rec.param == key
    assert flat.records["model/bn.num_batches_tracked"].dtype == "int64"
    for i, pname in enumerate(params):
        for role in ("exp_avg", "exp_avg_sq"):
            rec = flat.records[f"optimizer/state/{i}/{role}"]
            assert (rec.role, rec.param, rec.layer_type) == (role, pname, ZOO_TYPES[pname])
        assert f"optimizer/state/{i}/step" not in flat.records  # a skeleton scalar
    m2 = Zoo()
    m2.load_state_dict(back["model"])
    torch.optim.Adam(m2.parameters()).load_state_dict(back["optimizer"])


def test_links_inferred_without_live_objects():
    model, opt, state = _zoo_state()
    live = flatten_state(state, model, opt)
    inferred = flatten_state(copy.deepcopy(state))  # only the dicts, as read back from a torch.save file
    assert inferred.extra["param_link"] == "inferred"
    for name, rec in live.records.items():
        got = inferred.records[name]
        assert (got.role, got.param) == (rec.role, rec.param), name
    # without the module tree the layer type is guessed from the key and shape; these are unambiguous
    for key in ("embed.weight", "conv.weight", "conv.bias", "head.weight", "head.bias", "bn.running_mean"):
        assert inferred.records[f"model/{key}"].layer_type == ZOO_TYPES[key], key
    assert inferred.records["optimizer/state/0/exp_avg"].layer_type == "embedding"


def test_digits_links_inferred(digits_snapshots):
    model, opt, snaps, _ = digits_snapshots
    state = {"model": snaps[0].model, "optimizer": snaps[0].optimizer}
    live, inferred = flatten_state(state, model, opt), flatten_state(state)
    assert inferred.extra["param_link"] == "inferred"
    assert {n: r.param for n, r in inferred.records.items()} == {n: r.param for n, r in live.records.items()}
    assert inferred.records["optimizer/state/0/exp_avg"].param == "fc1.weight"
    assert inferred.records["optimizer/state/2/exp_avg_sq"].param == "norm.weight"


def test_inference_refuses_a_mismatch():
    # the optimizer covers only part of the model: order-and-shape matching cannot be trusted
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.Adam(model[1].parameters())
    model(torch.randn(1, 4)).sum().backward()
    opt.step()
    flat = flatten_state({"model": model.state_dict(), "optimizer": opt.state_dict()})
    assert flat.extra["param_link"] == "none"
    assert all(r.param is None for r in flat.by_role("exp_avg", "exp_avg_sq"))
    live = flatten_state({"model": model.state_dict(), "optimizer": opt.state_dict()}, model, opt)
    assert live.records["optimizer/state/0/exp_avg"].param == "1.weight"


# --- errors name the path --------------------------------------------------------------------

class Custom:
    pass


@pytest.mark.parametrize("state, where", [
    ({"model": {"w": torch.ones(1)}, "extra": {"cb": [1, Custom()]}}, "extra/cb/1"),
    ({"a": (1, {"b": Custom()})}, "a/1/b"),
    ({"fn": len}, "fn"),
    ({"obj": {3: object()}}, "obj/3"),
])
def test_unsupported_object_names_its_path(state, where):
    with pytest.raises(UnsupportedStateError) as ei:  # a TypeError too
        flatten_state(state)
    assert where in str(ei.value) and "without pickle" in str(ei.value)


def test_other_input_errors():
    with pytest.raises(TypeError, match="must be a dict"):
        flatten_state([torch.ones(1)])
    for bad, words in [({"z": torch.ones(2, dtype=torch.complex64)}, r"complex64"),
                       ({"z": np.array(["a"])}, r"at z"), ({"d": {(1, 2): 3}}, r"dict key .* at d")]:
        with pytest.raises(UnsupportedStateError, match=words):  # a TypeError: a type with no pickle-free form
            flatten_state(bad)
    with pytest.raises(UnsupportedStateError, match="record name 'a/b/c'") as ei:
        flatten_state({"a": {"b/c": torch.ones(1)}, "a/b": {"c": torch.ones(1)}})
    assert isinstance(ei.value, ValueError)
    with pytest.raises(CorruptCheckpointError, match="unknown skeleton tag"):
        unflatten_state({"__t": "pickle", "v": ""}, {})
    with pytest.raises(CorruptCheckpointError, match="unknown dtype name 'float8'"):
        tensor_from_bytes(b"\0", "float8", [1])


def test_tied_weights_are_stored_once_and_stay_tied():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=256, n_embd=32, n_layer=1, n_head=2, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randint(0, 256, (2, 8)), labels=torch.randint(0, 256, (2, 8))).loss.backward()
    opt.step()
    sd = model.state_dict()
    flat = flatten_state({"model": sd, "optimizer": opt.state_dict()})  # no live objects: inferred links
    assert "model/lm_head.weight" not in flat.records and "model/transformer.wte.weight" in flat.records
    assert flat.extra["param_link"] == "inferred"
    assert flat.records["optimizer/state/0/exp_avg"].param == "transformer.wte.weight"
    out = unflatten_state(flat.skeleton, flat.tensors)
    assert out["model"]["lm_head.weight"] is out["model"]["transformer.wte.weight"]
    fresh = transformers.GPT2LMHeadModel(cfg)
    fresh.load_state_dict(out["model"])
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)


def test_a_host_state_is_saved_as_it_is_and_own_copies_it(digits_snapshots):
    """on_host leaves a CPU state alone (a save reads it in place), so a tensor a method keeps past the
    save (an exact parent, BitSnap's base) must be a fresh copy: training mutates the live one."""
    snap = digits_snapshots[2][-1]
    flat = flatten_state({"model": snap.model, "optimizer": snap.optimizer})
    assert on_host(flat) is flat and not flat.copied
    name = next(iter(flat.tensors))
    own = flat.own(name)
    assert torch.equal(own, flat.tensors[name]) and own.untyped_storage().data_ptr() != \
        flat.tensors[name].untyped_storage().data_ptr()


# --- an optimizer's step counts as skeleton scalars ----------------------------------------------

def test_step_scalars_round_trip_exactly_without_records():
    values = [torch.tensor(7.0), torch.tensor(2.0 ** 24 + 2, dtype=torch.float64), torch.tensor(3.5, dtype=torch.bfloat16),
              torch.tensor(2 ** 62 + 1), torch.tensor(True), torch.tensor(float("inf")), torch.tensor(float("nan"))]
    state = {"optimizer": {"state": {i: {"step": v, "exp_avg": torch.ones(3)} for i, v in enumerate(values)},
                           "param_groups": [{"params": list(range(len(values)))}]},
             "other": {"step": torch.tensor(5.0)}}  # not an optimizer's: a record
    flat = flatten_state(state)
    assert sorted(flat.records) == sorted([f"optimizer/state/{i}/exp_avg" for i in range(len(values))] + ["other/step"])
    back = unflatten_state(json.loads(json.dumps(flat.skeleton, allow_nan=False)), flat.tensors)  # as a file holds it
    for i, v in enumerate(values):
        got = back["optimizer"]["state"][i]["step"]
        assert got.dtype == v.dtype and got.dim() == 0 and got.device.type == "cpu"
        assert torch.equal(got, v) or (got.isnan() and v.isnan())
    assert unflatten_state(flat.skeleton, flat.tensors, "meta")["optimizer"]["state"][0]["step"].device.type == "meta"
    kept = flatten_state(state, step_records=True)  # excp's: every step a record, as before
    assert len(kept.by_role("step")) == len(values)


def test_a_step_that_is_not_a_scalar_stays_a_record():
    state = {"optimizer": {"state": {0: {"step": torch.tensor([3.0])}, 1: {"step": torch.tensor(2.0, requires_grad=True)}},
                           "param_groups": [{"params": [0, 1]}]}}
    assert sorted(flatten_state(state).records) == ["optimizer/state/0/step", "optimizer/state/1/step"]


@pytest.mark.parametrize("leaf", [{"__t": "scalar", "dtype": "float8", "v": 1.0}, {"__t": "scalar", "dtype": "int8", "v": 999},
                                  {"__t": "scalar", "dtype": "float32", "v": "many"}, {"__t": "scalar", "dtype": "int64"},
                                  {"__t": "scalar", "dtype": "float32", "v": [1.0]}])
def test_a_malformed_step_scalar_is_a_corrupt_file(leaf):
    with pytest.raises(CorruptCheckpointError, match="skeleton scalar"):
        unflatten_state({"optimizer": {"state": {"__t": "dict", "items": [[0, {"step": leaf}]]}}}, {})


def test_a_malformed_step_scalar_is_named_when_its_parameter_is_read():
    leaf = {"__t": "scalar", "dtype": "float32", "v": "many"}
    flat = FlatState({}, {}, {"optimizer": {"state": {"__t": "dict", "items": [[0, {"step": leaf}]]}}})
    with pytest.raises(CorruptCheckpointError, match="skeleton scalar"):
        flat.params()
