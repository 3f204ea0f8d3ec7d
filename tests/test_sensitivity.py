import pytest
import torch
from torch import nn

from ckptzip.demo.workloads import DigitsMLP, digits_data
from ckptzip.errors import ConfigError
from ckptzip.sensitivity import GradientRecorder, should_arm


def _train(model, opt, xtr, ytr, g, n_steps, on_step=None):
    """A few real Adam steps on digits; on_step(step, model) sees the gradients before opt.step()."""
    for s in range(n_steps):
        idx = torch.randint(0, len(xtr), (32,), generator=g)
        loss = nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
        opt.zero_grad()
        loss.backward()
        if on_step is not None:
            on_step(s, model)
        opt.step()


def _hook_count(model):
    return sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters())


@pytest.fixture
def digits():
    torch.manual_seed(0)
    xtr, ytr, _, _ = digits_data(0)
    model = DigitsMLP(32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, opt, xtr, ytr, torch.Generator().manual_seed(0)


def test_ema_matches_hand_computed_reference(digits):
    model, opt, xtr, ytr, g = digits
    beta = 0.8
    rec = GradientRecorder(model, beta=beta, window=5)
    ref: dict[str, torch.Tensor] = {}

    def by_hand(step, m):
        for n, p in m.named_parameters():
            gr = p.grad.detach().clone()
            ref[n] = gr if n not in ref else beta * ref[n] + (1 - beta) * gr

    _train(model, opt, xtr, ytr, g, 3)          # disarmed: nothing recorded
    assert rec.gradients() == {} and rec.steps == 0
    rec.arm()
    _train(model, opt, xtr, ytr, g, 5, on_step=by_hand)
    rec.disarm()
    got = rec.gradients()
    assert rec.steps == 5
    assert set(got) == {n for n, _ in model.named_parameters()}
    for n, p in model.named_parameters():
        assert got[n].dtype == torch.float32 and got[n].device.type == "cpu"
        torch.testing.assert_close(got[n], ref[n], rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(rec.sensitivity(n), (p.detach() * ref[n]).abs(), rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(rec.sensitivity(p), rec.sensitivity(n))
    # the EMA is not a plain last gradient (the test would be vacuous otherwise)
    last = {n: p.grad for n, p in model.named_parameters()}
    assert any((got[n] - last[n]).abs().max() > 1e-4 for n in got)
    rec.close()


def test_disarmed_records_nothing_and_close_removes_hooks(digits):
    model, opt, xtr, ytr, g = digits
    base = _hook_count(model)
    rec = GradientRecorder(model, window=4)
    assert _hook_count(model) == base and not rec.armed
    rec.arm()
    assert _hook_count(model) == base + len(list(model.parameters()))
    rec.arm()                                     # idempotent
    assert _hook_count(model) == base + len(list(model.parameters()))
    _train(model, opt, xtr, ytr, g, 2)
    rec.disarm()
    assert _hook_count(model) == base
    before = {n: t.clone() for n, t in rec.gradients().items()}
    _train(model, opt, xtr, ytr, g, 3)            # disarmed: EMAs unchanged
    after = rec.gradients()
    assert rec.steps == 2 and all(torch.equal(before[n], after[n]) for n in before)
    rec.arm()                                     # a new window resets, old dict keeps its values
    assert rec.gradients() == {} and torch.equal(after["fc1.weight"], before["fc1.weight"])
    rec.close()
    assert _hook_count(model) == base and rec.gradients() == {}
    with pytest.raises(RuntimeError):
        rec.arm()


def test_sensitivity_none_without_gradient_and_unknown_name(digits):
    model, *_ = digits
    rec = GradientRecorder(model)
    assert rec.sensitivity("fc1.weight") is None
    with pytest.raises(KeyError):
        rec.sensitivity("nope.weight")
    with pytest.raises(ConfigError, match=r"GradientRecorder beta must be a number in \[0, 1\)"):
        GradientRecorder(model, beta=1.0)
    with pytest.raises(ConfigError, match="GradientRecorder window must be an int >= 1, got '5'"):
        GradientRecorder(model, window="5")


def test_should_arm_window():
    armed = [s for s in range(1, 301) if should_arm(s, 100, 3)]
    assert armed == [98, 99, 100, 198, 199, 200, 298, 299, 300]
    assert all(should_arm(s, 10, 10) for s in range(1, 50))
    assert not any(should_arm(s, 10, 0) for s in range(1, 50))
    with pytest.raises(ConfigError):
        should_arm(1, 0, 5)
