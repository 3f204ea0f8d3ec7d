"""The ckptzip command line on a real 20-checkpoint run: compress, ls, inspect, verify, restore, bad input."""
from __future__ import annotations

import json
import pickle
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from ckptzip.chain import CheckpointChain
from ckptzip.cli import app, main
from helpers import assert_same

runner = CliRunner()


def cli(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """20 real checkpoints as ckpt_{step}.pt files, compressed once into a chain."""
    from ckptzip.demo.workloads import digits_run

    root = tmp_path_factory.mktemp("cli")
    _, _, snaps, _ = digits_run(n_checkpoints=20, steps_between=5)
    ckpts = root / "ckpts"
    ckpts.mkdir()
    files = []
    for s in snaps:
        f = ckpts / f"ckpt_{s.step}.pt"
        torch.save({"model": s.model, "optimizer": s.optimizer, "step": s.step}, f)
        files.append(f)
    chain = root / "chain"
    r = cli("compress", *reversed(files), "--out", chain, "--keyframe-every", 8)  # order comes from the steps
    assert r.exit_code == 0, r.output
    assert "compressed 20 checkpoint(s) (steps 5..100)" in r.stdout
    return {"root": root, "files": files, "chain": chain, "steps": [s.step for s in snaps], "snaps": snaps}


def test_verify_ok(run):
    r = cli("verify", run["chain"])
    assert r.exit_code == 0, r.output
    assert r.stdout.strip().endswith("OK: 20 checkpoints verified")


def test_restore_every_fifth_step_bit_exact(run, tmp_path):
    for f, step in list(zip(run["files"], run["steps"]))[4::5]:
        out = tmp_path / f"r{step}.pt"
        r = cli("restore", run["chain"], "--step", step, "--out", out)
        assert r.exit_code == 0, r.output
        got, want = torch.load(out, weights_only=True), torch.load(f, weights_only=True)
        assert list(got) == ["model", "optimizer", "step"] and got["step"] == step
        assert_same(got, want)
    assert not list(tmp_path.glob(".*"))  # no temporary leftovers


def test_restore_safetensors_latest(run, tmp_path):
    r = cli("restore", run["chain"], "--out", tmp_path / "w.safetensors")
    assert r.exit_code == 0, r.output
    assert "restored step 100" in r.stdout
    w = load_file(str(tmp_path / "w.safetensors"))
    want = run["snaps"][-1].model
    assert set(w) == set(want) and all(torch.equal(w[k], want[k]) for k in want)


def test_ls_and_inspect(run):
    r = cli("ls", run["chain"])
    assert r.exit_code == 0, r.output
    rows = [line for line in r.stdout.splitlines() if "lossless/1" in line]
    assert len(rows) == 20
    for step, line in zip(run["steps"], rows):
        assert line.split("│")[1].strip() == str(step)
    assert sum("keyframe" in line for line in rows) == 3  # steps 5, 45, 85 with --keyframe-every 8
    j = json.loads(cli("ls", run["chain"], "--json").stdout)
    assert [e["step"] for e in j] == run["steps"] and j[1]["parent"] == 5

    r = cli("inspect", run["chain"], "--step", 50)
    assert r.exit_code == 0, r.output
    assert "step 50: delta of step 45" in r.stdout and "ckpt_50.pt" in r.stdout
    for needle in ("model/fc1.weight", "optimizer/state/0/exp_avg_sq", "linear", "128x64", "xor/1"):
        assert needle in r.stdout
    recs = json.loads(cli("inspect", run["chain"], "--step", 50, "--json").stdout)["records"]
    fc1 = next(x for x in recs if x["name"] == "model/fc1.weight")
    assert fc1["role"] == "weight" and fc1["shape"] == [128, 64] and 0 < fc1["stored_bytes"] < 128 * 64 * 4


class Custom:  # a class that weights_only loading refuses
    pass


@pytest.fixture
def bad_files(run, tmp_path):
    torch.save({"model": {"w": torch.ones(2)}, "obj": Custom()}, tmp_path / "custom_9999.pt")
    (tmp_path / "notes_9999.pt").write_text("not a checkpoint\n")
    return tmp_path


BAD = {  # args -> words the one-line message must contain
    "missing_src": (["compress", "{tmp}/missing_9999.pt", "--out", "{chain}"], "no such file"),
    "not_checkpoint": (["compress", "{tmp}/notes_9999.pt", "--out", "{chain}"], "not a checkpoint"),
    "unsafe_pickle": (["compress", "{tmp}/custom_9999.pt", "--out", "{chain}"], "needs arbitrary code to load"),
    "unknown_method": (["compress", "{ckpt}", "--out", "{chain}", "--method", "nope"], "unknown method 'nope'"),
    "step_not_after": (["compress", "{ckpt}", "--out", "{chain}"], "not after the chain's latest step 100"),
    "restore_step": (["restore", "{chain}", "--step", "7", "--out", "{tmp}/x.pt"], "step 7 is not in the chain"),
    "inspect_step": (["inspect", "{chain}", "--step", "7"], "step 7 is not in the chain"),
    "out_under_file": (["restore", "{chain}", "--out", "{ckpt}/x.pt"], "is a file"),
    "out_no_parent": (["restore", "{chain}", "--out", "{tmp}/nope/x.pt"], "does not exist"),
    "out_exists": (["restore", "{chain}", "--out", "{ckpt}"], "--force"),
    "folder_from_file": (["restore", "{chain}", "--out", "{tmp}/folder"], "not ingested from a Trainer folder"),
    "ls_not_chain": (["ls", "{ckpts}"], "not a ckptzip chain"),
    "verify_not_chain": (["verify", "{ckpts}"], "not a ckptzip chain"),
    "restore_no_chain": (["restore", "{tmp}/nochain", "--out", "{tmp}/x.pt"], "no such chain"),
    "out_not_chain": (["compress", "{ckpt}", "--out", "{ckpts}"], "not a chain"),
    "threshold_no_eval": (["compress", "{ckpt}", "--out", "{tmp}/c2", "--threshold", "0.1"], "need --eval"),
    "bad_eval_spec": (["compress", "{ckpt}", "--out", "{tmp}/c2", "--eval", "nomodule_xyz:f"], "cannot import"),
    "config_type": (["compress", "{ckpt}", "--out", "{tmp}/c2", "--config", '{{"zstd_level": "x"}}'],
                    "LosslessConfig.zstd_level must be an int in [1, 22], got 'x'"),
    "config_range": (["compress", "{ckpt}", "--out", "{tmp}/c2", "--config", '{{"zstd_level": 99}}'],
                     "LosslessConfig.zstd_level must be an int in [1, 22], got 99"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_exit_2_one_line_chain_untouched(run, bad_files, case):
    args, words = BAD[case]
    chain = run["chain"]
    fmt = {"tmp": bad_files, "chain": chain, "ckpt": run["files"][0], "ckpts": run["files"][0].parent}
    index_before = (chain / "index.json").read_bytes()
    listing_before = sorted(p.name for p in chain.iterdir())
    r = cli(*[a.format(**fmt) for a in args])
    assert r.exit_code == 2, r.output
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], r.stderr
    assert "Traceback" not in r.output
    assert (chain / "index.json").read_bytes() == index_before
    assert sorted(p.name for p in chain.iterdir()) == listing_before
    assert not (bad_files / "c2").exists() and not (bad_files / "x.pt").exists()


def test_verify_names_damaged_file_and_record(run, tmp_path):
    chain = tmp_path / "chain"
    shutil.copytree(run["chain"], chain)
    target = chain / "step-000000000050.ckz"
    data = bytearray(target.read_bytes())
    data[-20] ^= 0x01  # a byte in the last blob
    target.write_bytes(bytes(data))
    r = cli("verify", chain)
    assert r.exit_code == 1, r.output
    assert "step-000000000050.ckz" in r.stdout and "record '" in r.stdout
    assert "FAILED" in r.stdout and "OK:" not in r.stdout
    assert all("step-000000000050.ckz" in line for line in r.stdout.splitlines()[:-1])

    (chain / "index.json").write_bytes((chain / "index.json").read_bytes()[:-30])  # a torn index
    r = cli("verify", chain)
    assert r.exit_code == 1 and "index.json" in r.stdout and "corrupt" in r.stdout, r.output


def test_eval_spec_passes_model_through(run, tmp_path):
    mod = tmp_path / "evalmod.py"
    mod.write_text(
        "from ckptzip.demo.workloads import DigitsMLP\n"
        "CALLS = []\n"
        "def make():\n"
        "    return DigitsMLP(128), lambda m: CALLS.append(1) or 0.0\n"
        "def wrong():\n"
        "    return DigitsMLP(64), lambda m: 0.0\n")
    r = cli("compress", *run["files"][:2], "--out", tmp_path / "c", "--eval", f"{mod}:make", "--threshold", "0.02")
    assert r.exit_code == 0, r.output
    r = cli("compress", *run["files"][:2], "--out", tmp_path / "c3", "--eval", f"{mod}:wrong")
    assert r.exit_code == 2 and "do not fit the --eval model" in r.stderr
    assert not (tmp_path / "c3" / "index.json").exists()


def make_trainer_folder(root, model_sd, opt_sd, step):
    d = root / f"checkpoint-{step}"
    d.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model_sd.items()}, str(d / "model.safetensors"), metadata={"format": "pt"})
    torch.save(opt_sd, d / "optimizer.pt")
    torch.save({"last_epoch": step, "_step_count": step + 1}, d / "scheduler.pt")
    torch.save({"numpy": np.random.get_state(), "cpu": torch.get_rng_state()}, d / "rng_state.pth")
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": [{"loss": 1.5}]}))
    (d / "training_args.bin").write_bytes(pickle.dumps(Custom()))  # a pickled custom class
    (d / "config.json").write_text('{"hidden": 128}')
    return d


def test_trainer_folder_compress_restore(run, tmp_path):
    s1, s2 = run["snaps"][5], run["snaps"][11]
    runs = tmp_path / "out"
    d1 = make_trainer_folder(runs, s1.model, s1.optimizer, s1.step)
    d2 = make_trainer_folder(runs, s2.model, s2.optimizer, s2.step)
    chain = tmp_path / "chain"
    r = cli("compress", d2, d1, "--out", chain)
    assert r.exit_code == 0, r.output
    assert [e["step"] for e in json.loads(cli("ls", chain, "--json").stdout)] == [s1.step, s2.step]
    for d, snap in ((d1, s1), (d2, s2)):
        out = tmp_path / f"restored-{snap.step}"
        r = cli("restore", chain, "--step", snap.step, "--out", out)
        assert r.exit_code == 0, r.output
        assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in d.iterdir())
        for name in ("trainer_state.json", "rng_state.pth", "training_args.bin", "scheduler.pt", "config.json"):
            assert (out / name).read_bytes() == (d / name).read_bytes(), name
        w = load_file(str(out / "model.safetensors"))
        assert set(w) == set(snap.model) and all(torch.equal(w[k], snap.model[k]) for k in w)
        assert_same(torch.load(out / "optimizer.pt", weights_only=True), snap.optimizer)
    r = cli("restore", chain, "--out", tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert full["step"] == s2.step and full["files"]["config.json"] == b'{"hidden": 128}'
    crc = tmp_path / "crc"
    assert cli("compress", d1, "--out", crc, "--checksum", "crc32").exit_code == 0
    assert CheckpointChain(str(crc)).manifest(s1.step)["format_version"] == 2
    r = cli("compress", d1, "--out", tmp_path / "md5", "--checksum", "md5")
    assert r.exit_code == 2 and "--checksum must be one of sha256, crc32, blake3" in r.stderr
    assert CheckpointChain(str(chain)).manifest(s1.step)["format_version"] == 4  # the default: BLAKE3, one tensor
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "md5").exists()


def test_demo_bad_arguments_and_entry_point(capsys):
    r = cli("demo", "--workload", "nope")
    assert r.exit_code == 2 and "unknown workload 'nope'" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = cli("demo", "--workload", "digits", "--methods", "zip9")
    assert r.exit_code == 2 and "unknown method 'zip9'" in r.stderr
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("compress", "ls", "inspect", "verify", "restore", "demo"):
        assert cmd in out
