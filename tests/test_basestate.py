"""Base keyframes (basestate.py): with the weights a run started from as its base, a quantizing
method's keyframe codes ``w - base`` as a residual; a restore needs that same base."""
import pytest
import torch

from ckptzip import CheckpointChain, Compressor
from ckptzip.basestate import BaseWeights
from ckptzip.errors import BaseMismatchError, ConfigError

CFG = {"quantizer": {"bins": 8, "prune_fraction": 0.0}, "residual": "restored"}


def _state(s):
    return {"model": s.model, "optimizer": s.optimizer, "step": s.step}


def _weights_error(ch, snaps):
    """Mean relative error of the decoded quantized weights, per saved snapshot."""
    out = []
    for s in snaps:
        got = CheckpointChain(ch.url, base=ch.base).load(s.step)["model"]
        out.append(max(float((got[n] - s.model[n]).norm() / s.model[n].norm())
                       for n in ("fc1.weight", "fc2.weight")))
    return out


def test_base_keyframe_is_a_residual_and_decodes_what_the_writer_holds(tmp_path, digits_snapshots):
    model, opt, snaps, _ = digits_snapshots
    base = snaps[0].model  # the run "started" here; the chain saves later snapshots
    ch = CheckpointChain(tmp_path / "b", "dynaquant", CFG, base=base)
    plain = CheckpointChain(tmp_path / "p", "dynaquant", CFG)
    for s in snaps[1:4]:
        ch.save(_state(s), s.step, model=model, optimizer=opt)
        plain.save(_state(s), s.step, model=model, optimizer=opt)
    first = ch.manifest(snaps[1].step)
    assert first["keyframe"] and first["method_meta"]["base"] == BaseWeights.from_model(base).digest
    pipes = [r["pipeline"] for r in first["records"].values() if r["pipeline"][0] == "dynaquant/1"]
    assert pipes and all(p[1] == "residual/1" for p in pipes)
    later = ch.manifest(snaps[3].step)["records"]["model/fc2.weight"]["pipeline"]
    assert later[:2] == ["dynaquant/1", "residual/1"]  # the deltas after a base keyframe are residuals too
    decoded = CheckpointChain(tmp_path / "b", base=base).restore(snaps[3].step).flat.tensors
    for n, t in ch._ref.recon.items():
        assert torch.equal(t, decoded[n]), n
    # 8 bins of the drift since the base, against 8 bins of the weights: measured 1.8-2.8 % vs 16-17 %
    assert max(_weights_error(ch, snaps[1:4])) < 0.5 * min(_weights_error(plain, snaps[1:4]))
    assert ch.verify() == []


def test_restore_needs_the_same_base(tmp_path, digits_snapshots):
    model, opt, snaps, _ = digits_snapshots
    ch = CheckpointChain(tmp_path, "dynaquant", CFG, base=snaps[0].model)
    ch.save(_state(snaps[1]), snaps[1].step, model=model, optimizer=opt)
    with pytest.raises(BaseMismatchError, match=r"coded against base weights [0-9a-f]{16}; pass the state_dict .* as base="):
        CheckpointChain(tmp_path).restore()
    with pytest.raises(BaseMismatchError, match="but the base given is"):
        CheckpointChain(tmp_path, base=snaps[2].model).restore()
    assert CheckpointChain(tmp_path, base=snaps[0].model).restore().step == snaps[1].step


def test_without_residuals_a_base_is_not_used(tmp_path, digits_snapshots):
    """``residual="never"`` is the paper: keyframes quantize the weights, whatever base is given."""
    model, opt, snaps, _ = digits_snapshots
    ch = CheckpointChain(tmp_path, "dynaquant", {**CFG, "residual": "never"}, base=snaps[0].model)
    ch.save(_state(snaps[1]), snaps[1].step, model=model, optimizer=opt)
    m = ch.manifest(snaps[1].step)
    assert "base" not in m["method_meta"]
    assert all("residual/1" not in r["pipeline"] for r in m["records"].values())
    CheckpointChain(tmp_path).restore()  # no base needed


def test_bad_base_arguments(tmp_path, digits_snapshots):
    model, opt, _, _ = digits_snapshots
    with pytest.raises(ConfigError, match="state_dict"):
        CheckpointChain(tmp_path, "dynaquant", base=[1, 2])
    with pytest.raises(ConfigError, match="--base"):
        BaseWeights.from_file(tmp_path / "missing.safetensors")


def test_the_agent_reads_the_staged_base_and_checks_its_digest(tmp_path, digits_snapshots):
    from ckptzip.engine.agent import _Agent

    base = BaseWeights.from_model(digits_snapshots[2][0].model)
    base.to_file(tmp_path / "base.safetensors")
    staged = {"file": str(tmp_path / "base.safetensors"), "digest": base.digest}
    assert _Agent._base(staged).digest == base.digest
    with pytest.raises(BaseMismatchError, match="do not modify that file"):
        _Agent._base({**staged, "digest": "0" * 64})


def test_compressor_restores_a_base_chain_into_a_new_model(tmp_path, digits_snapshots):
    """The training-loop API: the base given to Compressor reaches saves and restores; the Python,
    NumPy and torch RNG states come back (stored once, then ``same/1``)."""
    import random

    from ckptzip.demo.workloads import DigitsMLP

    _, _, snaps, _ = digits_snapshots
    model = DigitsMLP(128)
    model.load_state_dict(snaps[0].model)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ck = Compressor(model, opt, tmp_path, "dynaquant", config=CFG, base=base)
    random.seed(5)
    for step in (1, 2):
        model.load_state_dict(snaps[step].model)
        ck.save(step)
    expected = random.random()
    ck.close()
    assert ck.chain.manifest(2)["records"]["rng/python/1"]["pipeline"] == ["exact/1", "same/1"]
    fresh = DigitsMLP(128)
    random.seed(0)
    assert Compressor(fresh, torch.optim.Adam(fresh.parameters()), tmp_path, base=base).restore() == 2
    assert random.random() == expected
    assert float((fresh.fc2.weight.detach() - snaps[2].model["fc2.weight"]).norm() / snaps[2].model["fc2.weight"].norm()) < 0.05


def test_cli_restore_and_verify_take_the_base_file(tmp_path, digits_snapshots):
    from safetensors.torch import load_file, save_file
    from typer.testing import CliRunner

    from ckptzip.cli import app

    model, opt, snaps, _ = digits_snapshots
    ch = CheckpointChain(tmp_path / "chain", "dynaquant", CFG, base=snaps[0].model)
    for s in snaps[1:3]:
        ch.save(_state(s), s.step, model=model, optimizer=opt)
    save_file({k: v.contiguous() for k, v in snaps[0].model.items()}, tmp_path / "base.safetensors")
    torch.save(snaps[1].model, tmp_path / "other.pt")

    def cli(*args):
        return CliRunner().invoke(app, [str(a) for a in args])

    r = cli("verify", tmp_path / "chain")
    assert r.exit_code == 1 and "--base FILE" in r.output
    r = cli("restore", tmp_path / "chain", "--out", tmp_path / "x.safetensors", "--base", tmp_path / "other.pt")
    assert r.exit_code == 2 and "but the base given is" in r.output
    r = cli("verify", tmp_path / "chain", "--base", tmp_path / "base.safetensors")
    assert r.exit_code == 0 and "OK: 2 checkpoints verified" in r.output, r.output
    r = cli("restore", tmp_path / "chain", "--out", tmp_path / "x.safetensors", "--base", tmp_path / "base.safetensors")
    assert r.exit_code == 0, r.output
    got = load_file(tmp_path / "x.safetensors")
    assert torch.equal(got["fc2.weight"], ch.restore(snaps[2].step).state["model"]["fc2.weight"])

    # ckptzip compress --base: an existing torch.save checkpoint ingested against the same base
    torch.save(_state(snaps[3]), tmp_path / "ck.pt")
    r = cli("compress", tmp_path / "ck.pt", "--out", tmp_path / "ingested", "--method", "dynaquant",
            "--config", '{"quantizer": {"bins": 8, "prune_fraction": 0.0}}', "--base", tmp_path / "base.safetensors")
    assert r.exit_code == 0, r.output
    ingested = CheckpointChain(str(tmp_path / "ingested"), base=snaps[0].model)
    assert ingested.manifest(snaps[3].step)["method_meta"]["base"] == ch.base.digest
    assert ingested.verify() == []
    r = cli("compress", tmp_path / "ck.pt", "--out", tmp_path / "nobase", "--base", tmp_path / "nope.pt")
    assert r.exit_code == 2 and "nope.pt" in r.output and not (tmp_path / "nobase").exists()
