"""Compressor: a real training loop saves, crashes (state discarded), restores, continues."""
import random

import numpy as np
import pytest
import torch

import ckptzip
from ckptzip.demo.workloads import DigitsMLP, digits_data


def train_steps(model, opt, sched, steps, start):
    x, y, _, _ = digits_data(0)
    for step in range(start + 1, start + steps + 1):
        g = torch.Generator().manual_seed(step)
        idx = torch.randint(0, len(x), (32,), generator=g)
        noise = torch.rand(1).item() * 1e-3 + np.random.rand() * 1e-3 + random.random() * 1e-3  # RNG consumers
        loss = torch.nn.functional.cross_entropy(model(x[idx] + noise), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return start + steps


def build(seed):
    torch.manual_seed(seed)
    m = DigitsMLP(32)
    o = torch.optim.Adam(m.parameters(), lr=1e-3)
    return m, o, torch.optim.lr_scheduler.StepLR(o, step_size=7, gamma=0.5)


def test_restore_is_bit_exact_and_resumes_identically(tmp_path):
    torch.set_num_threads(1)
    m, o, s = build(0)
    with ckptzip.Compressor(m, o, tmp_path / "c", scheduler=s) as ck:
        assert ck.restore() is None  # empty chain
        step = train_steps(m, o, s, 10, 0)
        ck.save(step)
        step = train_steps(m, o, s, 10, step)
        ck.save(step)
    reference = {k: v.clone() for k, v in m.state_dict().items()}
    train_steps(m, o, s, 10, step)
    uninterrupted = {k: v.clone() for k, v in m.state_dict().items()}

    m2, o2, s2 = build(99)  # a fresh process: wrong weights, empty optimizer
    torch.manual_seed(12345)
    with ckptzip.Compressor(m2, o2, tmp_path / "c", scheduler=s2) as ck2:
        assert ck2.restore() == 20
        for k, v in reference.items():
            assert torch.equal(m2.state_dict()[k], v)
        assert s2.state_dict() == s.state_dict() or s2.last_epoch == 20
        train_steps(m2, o2, s2, 10, 20)
        ck2.save(30)
        assert ck2.chain.entries()[-1].keyframe is False  # resumed writer continues the delta chain
    for k, v in uninterrupted.items():
        assert torch.equal(m2.state_dict()[k], v), k  # RNG, optimizer, scheduler all restored exactly


def test_checksum_choice_reaches_the_files(tmp_path):
    m, o, s = build(0)
    with ckptzip.Compressor(m, o, tmp_path / "c", checksum="crc32") as ck:
        ck.save(train_steps(m, o, s, 3, 0))
        assert ck.chain.manifest(3)["format_version"] == 2  # CRC-32 blob checksums
    with pytest.raises(ValueError, match="checksum"):
        ckptzip.Compressor(m, o, tmp_path / "d", checksum="md5")


def test_older_step_and_missing_step(tmp_path):
    m, o, s = build(0)
    ck = ckptzip.Compressor(m, o, tmp_path / "c")
    train_steps(m, o, s, 3, 0)
    ck.save(3)
    w3 = m.fc1.weight.detach().clone()
    train_steps(m, o, s, 3, 3)
    ck.save(6)
    assert ck.restore(3) == 3 and torch.equal(m.fc1.weight, w3)
    with pytest.raises(ckptzip.StepNotFoundError):
        ck.restore(4)
    ck.close()


def test_bad_arguments(tmp_path):
    m, o, _ = build(0)
    with pytest.raises(ValueError, match="threshold"):
        ckptzip.Compressor(m, o, tmp_path, threshold=2.0)
    with pytest.raises(ckptzip.UnknownMethodError, match="unknown method 'zip9'"):
        ckptzip.Compressor(m, o, tmp_path, method="zip9")
    with pytest.raises(TypeError, match="torch.nn.Module"):
        ckptzip.Compressor(o, o, tmp_path)


def test_gradient_window_records_before_save_only(tmp_path):
    torch.set_num_threads(1)
    m, o, s = build(0)
    ck = ckptzip.Compressor(m, o, tmp_path / "c", method="dynaquant", config={"quantizer": {"prune_metric": "sensitivity"}},
                            save_every=10, grad_window=3)
    rec = ck._recorder
    step = train_steps(m, o, s, 6, 0)
    assert not rec.rec.armed  # outside the window: no hooks
    step = train_steps(m, o, s, 4, step)
    assert rec.rec.armed and rec.rec.steps == 3  # the 3 passes before the save
    ck.save(step)
    assert not rec.rec.armed
    e = ck.chain.entries()[-1]
    assert e.summary["prune_metric"] == "sensitivity"
    ck.close()
    assert not rec.rec.armed and rec._hook is not None
    assert len(m._forward_pre_hooks) == 0  # close() released the hooks


def test_checkpoint_budget_splits_the_run_budget_over_restores():
    from ckptzip.api import RESTORE_RETENTION, checkpoint_budget
    from ckptzip.errors import ConfigError
    assert checkpoint_budget(0.01, 0) == checkpoint_budget(0.01, 1) == 0.01  # 0.1's per-checkpoint rule
    b = checkpoint_budget(0.01, 10)
    h = RESTORE_RETENTION
    assert b == pytest.approx(0.01 * (1 - h) / (1 - h ** 10)) and b < 0.01
    # what the budget promises: 10 restores, each adding b and keeping h of what came before, end within 1 %
    total = 0.0
    for _ in range(10):
        total = total * h + b
    assert total == pytest.approx(0.01)
    assert checkpoint_budget(0.01, 3) > b  # fewer restores, more per checkpoint
    with pytest.raises(ConfigError, match="checkpoint_budget restores must be an int >= 0"):
        checkpoint_budget(0.01, -1)
