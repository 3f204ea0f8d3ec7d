"""Restoring into a model or optimizer that does not fit the checkpoint (fitcheck.py via
Compressor.restore): one StateMismatchError naming the first differing tensor, raised before
anything is loaded (model, optimizer and RNG untouched); strict=False as load_state_dict."""
import copy

import pytest
import torch
from torch import nn

from ckptzip.api import Compressor
from ckptzip.demo.workloads import DigitsMLP
from ckptzip.errors import StateMismatchError
from helpers import assert_same


@pytest.fixture(scope="module")
def saved(tmp_path_factory, digits_snapshots):
    """A chain holding a real digits run's state (DigitsMLP(128) + Adam after training)."""
    model, opt, snaps, _ = digits_snapshots
    url = tmp_path_factory.mktemp("fit") / "ckpt"
    m = DigitsMLP()
    m.load_state_dict(snaps[-1].model)
    o = torch.optim.Adam(m.parameters(), lr=1e-3)
    o.load_state_dict(snaps[-1].optimizer)
    with Compressor(m, o, url) as ck:
        ck.save(7)
    return url, m


def untouched_restore(url, model, opt, **kw):
    """Compressor.restore on (model, opt): the error, after checking nothing changed."""
    before = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()) if opt else None,
              torch.get_rng_state())
    with pytest.raises(StateMismatchError) as ei:
        Compressor(model, opt, url).restore(**kw)
    assert_same(before[0], model.state_dict())
    if opt is not None:
        assert_same(before[1], opt.state_dict())
    assert torch.equal(before[2], torch.get_rng_state())
    msg = str(ei.value)
    assert "\n" not in msg and "nothing was loaded" in msg and msg.startswith("checkpoint step 7 does not fit")
    assert isinstance(ei.value, RuntimeError)  # what load_state_dict raises for the same fault
    return msg


def test_shape_mismatch_names_the_first_tensor(saved):
    url, _ = saved
    small = DigitsMLP(hidden=64)
    msg = untouched_restore(url, small, torch.optim.Adam(small.parameters()))
    assert "'fc1.weight' has shape (128, 64) in the checkpoint and (64, 64) in the model" in msg
    assert "more" in msg
    with pytest.raises(StateMismatchError):  # shapes must match even when names may differ
        Compressor(small, None, url).restore(strict=False)


def test_dtype_mismatch_strict_only(saved):
    url, trained = saved
    m = DigitsMLP().double()
    msg = untouched_restore(url, m, None)
    assert "'fc1.weight' has dtype float32 in the checkpoint and float64 in the model" in msg
    assert Compressor(m, None, url).restore(strict=False) == 7  # cast, as load_state_dict does
    assert torch.equal(m.fc1.weight, trained.fc1.weight.double())


class Wider(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = DigitsMLP()
        self.head = nn.Linear(10, 3)


def test_missing_and_unexpected_names(saved):
    url, trained = saved
    wrapped = Wider()  # every name gains a prefix: nothing matches
    msg = untouched_restore(url, wrapped, None)
    assert "model tensor 'body.fc1.weight' is missing from the checkpoint" in msg and "strict=False" in msg

    class Extra(DigitsMLP):
        def __init__(self):
            super().__init__()
            self.extra = nn.Linear(2, 2)
    m = Extra()
    msg = untouched_restore(url, m, torch.optim.Adam(m.parameters()))
    assert "'extra.weight' is missing" in msg
    assert Compressor(m, None, url).restore(strict=False) == 7  # missing allowed
    assert torch.equal(m.fc2.weight, trained.fc2.weight)
    # an optimizer over more parameters than saved never fits, strict or not
    with pytest.raises(StateMismatchError, match="optimizer group 0 has 10 parameters, the checkpoint's 8"):
        Compressor(m, torch.optim.Adam(m.parameters()), url).restore(strict=False)


def test_optimizer_built_in_another_order(saved):
    url, _ = saved
    m = DigitsMLP()
    opt = torch.optim.Adam(list(m.parameters())[::-1])  # moments would land on the wrong tensors
    msg = untouched_restore(url, m, opt)
    assert "optimizer state 'exp_avg' of parameter 'fc3.bias' has shape (128, 64) in the checkpoint" in msg
    two_groups = torch.optim.Adam([{"params": list(m.parameters())[:2]}, {"params": list(m.parameters())[2:]}])
    assert "the optimizer has 2 parameter group(s), the checkpoint 1" in untouched_restore(url, m, two_groups)
    m2 = DigitsMLP()
    assert Compressor(m2, torch.optim.Adam(m2.parameters()), url).restore() == 7  # and the right one fits
