"""Regenerate the v0.1 ingest chains that tests/test_ingest.py restores with today's code.

    git worktree add /tmp/v01-ingest 47704d1          # ckptzip v0.1
    PYTHONPATH=/tmp/v01-ingest/src python tests/data/make_ingest_v1.py

ingest_v1/torch-file/   ``ckptzip compress``'s ingest of two torch.save files (layout ``torch-file/1``)
ingest_v1/hf-trainer/   two Trainer ``checkpoint-N/`` folders, the second one sharded (``hf-trainer/1``)
ingest_v1/lightning/    two ``CompressedCheckpointIO`` saves: pointer ``.ckpt`` files + ``ckptzip-chain/``
                        (v0.1's unversioned layout ``{"n_optimizers": N}``), plus a two-optimizer one

Every source is built here from fixed numbers (no RNG, no pickled classes), so the test rebuilds
what each restore must give back. Files a Trainer folder keeps byte for byte are fixed bytes, so
the comparison does not depend on the torch or Python version that wrote them. Only regenerate
after a deliberate change of an ingest layout (which then gets a new descriptor version).
"""
from __future__ import annotations

import collections
import json
import pathlib
import shutil
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE / "ingest_v1"
STEPS = (10, 20)


def _weights(i: int) -> "collections.OrderedDict":
    import torch

    base = torch.linspace(-1.0, 1.0, 24, dtype=torch.float32).reshape(4, 6)
    sd = collections.OrderedDict()
    sd["lin.weight"] = base + 1e-3 * i * torch.cos(torch.arange(24.0)).reshape(4, 6)
    sd["lin.bias"] = torch.full((4,), 0.5 - 0.01 * i)
    sd["emb.weight"] = torch.arange(12.0).reshape(3, 4).to(torch.bfloat16) * (1 + i)
    sd._metadata = collections.OrderedDict({"": {"version": 1}, "lin": {"version": 1}})  # as nn.Module writes
    return sd


def _adam(sd: dict, step: int) -> dict:
    import torch

    names = [k for k in sd if sd[k].is_floating_point()]
    return {"state": {j: {"step": torch.tensor(float(step)), "exp_avg": sd[n].float() * 1e-2,
                          "exp_avg_sq": (sd[n].float() * 1e-3) ** 2} for j, n in enumerate(names)},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "params": list(range(len(names)))}]}


def torch_file_sources() -> list[tuple[str, dict]]:
    """(file name, object torch.save wrote) per step."""
    import torch

    out = []
    for i, step in enumerate(STEPS):
        sd = _weights(i)
        out.append((f"ck_{step}.pt", {"model": sd, "optimizer": _adam(sd, step), "step": step, "note": "x",
                                      "ema": {"decay": 0.99, "w": torch.ones(3) * i}}))
    return out


def opaque(name: str, n: int) -> bytes:
    """Fixed bytes standing in for a file the Trainer folder keeps unread (rng_state.pth, ...)."""
    seed = sum(name.encode())
    return bytes((seed + 31 * k + (k * k) % 251) % 256 for k in range(n))


def trainer_sources() -> list[tuple[str, dict[str, bytes], dict, dict]]:
    """(folder name, files kept byte for byte, model weights, optimizer state) per step."""
    out = []
    for i, step in enumerate(STEPS):
        sd = _weights(i)
        files = {"trainer_state.json": json.dumps({"global_step": step, "log_history": [
                     {"loss": 2.0 - k / 64, "step": k} for k in range(40)]}, indent=2).encode(),
                 "config.json": b'{"hidden": 6}\n', "scheduler.pt": opaque("scheduler.pt", 700),
                 "rng_state.pth": opaque("rng_state.pth", 1500), "training_args.bin": opaque("args", 300),
                 "sub/notes.txt": b"n" * 1100}
        out.append((f"checkpoint-{step}", files, dict(sd), _adam(sd, step)))
    return out


def write_trainer_folder(root: pathlib.Path, name: str, files: dict, model: dict, optimizer: dict,
                         *, sharded: bool) -> pathlib.Path:
    import torch
    from safetensors.torch import save_file

    d = root / name
    d.mkdir(parents=True)
    if sharded:
        keys = list(model)
        parts = {"model-00001-of-00002.safetensors": keys[:1], "model-00002-of-00002.safetensors": keys[1:]}
        for f, ks in parts.items():
            save_file({k: model[k] for k in ks}, str(d / f), metadata={"format": "pt"})
    else:
        save_file(dict(model), str(d / "model.safetensors"), metadata={"format": "pt"})
    torch.save(optimizer, d / "optimizer.pt")
    for rel, data in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)
    return d


def lightning_checkpoints(n_optimizers: int = 1) -> list[tuple[str, dict]]:
    """(pointer file name, the checkpoint dict Lightning hands to CheckpointIO.save_checkpoint)."""
    out = []
    for i, step in enumerate(STEPS):
        sd = collections.OrderedDict((f"net.{k}", v) for k, v in _weights(i).items())
        sd._metadata = collections.OrderedDict({"": {"version": 1}, "net": {"version": 1}})
        out.append((f"epoch={i}-step={step}.ckpt", {
            "epoch": i, "global_step": step, "pytorch-lightning_version": "2.6.6", "state_dict": sd,
            "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"completed": i}}}},
            "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_path": "", "dirpath": "ckpts"}},
            "optimizer_states": [_adam(sd, step + j) for j in range(n_optimizers)], "lr_schedulers": [], "hparams_name": None}))
    return out


def main() -> None:
    from ckptzip.chain import CheckpointChain
    from ckptzip.ingest import find_sources, load_source
    from ckptzip.integrations.lightning import CompressedCheckpointIO

    import torch

    shutil.rmtree(ROOT, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        for name, obj in torch_file_sources():
            torch.save(obj, tmp / name)
        chain = CheckpointChain(ROOT / "torch-file", "lossless")
        for src in find_sources([tmp / name for name, _ in torch_file_sources()]):
            chain.save(load_source(src), src.step)

        for k, (name, files, model, opt) in enumerate(trainer_sources()):
            write_trainer_folder(tmp / "run", name, files, model, opt, sharded=k == 1)
        chain = CheckpointChain(ROOT / "hf-trainer", "lossless")
        for src in find_sources([tmp / "run"]):
            chain.save(load_source(src), src.step)

    for folder, n_opt in (("lightning", 1), ("lightning-2opt", 2)):
        io = CompressedCheckpointIO("lossless")
        for name, ckpt in lightning_checkpoints(n_opt)[: 2 if n_opt == 1 else 1]:
            io.save_checkpoint(ckpt, ROOT / folder / name)
        io.teardown()
    print(f"wrote {sorted(str(p.relative_to(HERE)) for p in ROOT.rglob('*') if p.is_file())}")


if __name__ == "__main__":
    main()
