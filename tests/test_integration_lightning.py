"""Lightning: ModelCheckpoint saves go through CompressedCheckpointIO; fit(ckpt_path=...) resumes."""
import json

import pytest
import torch

L = pytest.importorskip("lightning.pytorch")

from ckptzip import CheckpointChain  # noqa: E402
from ckptzip.demo.workloads import DigitsMLP, digits_data  # noqa: E402
from ckptzip.integrations.lightning import CHAIN_DIR, CompressedCheckpointIO, SensitivityCallback  # noqa: E402


class LitDigits(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = DigitsMLP(64)

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def loader():
    x, y, _, _ = digits_data(0)
    ds = torch.utils.data.TensorDataset(x[:640], y[:640])
    return torch.utils.data.DataLoader(ds, batch_size=64, shuffle=False)


def trainer(tmp_path, max_steps, io):
    ckpt = L.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=5, save_top_k=-1)
    return L.Trainer(max_steps=max_steps, plugins=[io] if io else [], callbacks=[ckpt, SensitivityCallback(window=3)],
                     logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                     devices=1)


def test_lightning_saves_into_chain_and_resumes(tmp_path):
    torch.manual_seed(0)
    model = LitDigits()
    plugin = CompressedCheckpointIO("lossless")
    t = trainer(tmp_path, 20, plugin)
    t.fit(model, loader())
    # the save interval is learned from the saves (no private Lightning attribute): the last save had
    # gradient EMAs recorded in its window
    assert plugin.gradients is not None and set(plugin.gradients) <= set(dict(model.named_parameters()))
    chain = CheckpointChain(tmp_path / "ckpts" / CHAIN_DIR)
    assert chain.steps() == [5, 10, 15, 20]
    assert chain.verify() == []
    assert [e.keyframe for e in chain.entries()] == [True, False, False, False]
    pointers = sorted((tmp_path / "ckpts").glob("*.ckpt"))
    assert len(pointers) == 4
    assert json.loads(pointers[0].read_text())["ckptzip"] == 1
    # pointer files are tiny; the data is in the chain
    assert all(p.stat().st_size < 200 for p in pointers)

    # the state loaded back equals what Lightning held at step 20 (lossless)
    io = CompressedCheckpointIO("lossless")
    last = next(p for p in pointers if "step=20" in p.name)
    ck = io.load_checkpoint(last)
    assert ck["global_step"] == 20
    for k, v in model.state_dict().items():
        assert torch.equal(ck["state_dict"][k], v), k
    assert torch.equal(ck["optimizer_states"][0]["state"][0]["exp_avg"],
                       t.optimizers[0].state_dict()["state"][0]["exp_avg"])

    # resume from step 10 and train to 20: bit-identical to the uninterrupted run
    torch.manual_seed(123)
    resumed = LitDigits()
    mid = next(p for p in pointers if "step=10" in p.name)
    t2 = trainer(tmp_path / "second", 20, CompressedCheckpointIO("lossless"))
    t2.fit(resumed, loader(), ckpt_path=str(mid))
    assert t2.global_step == 20
    for k, v in model.state_dict().items():
        assert torch.equal(resumed.state_dict()[k], v), k

    # `ckptzip restore` writes a .ckpt that plain Lightning (no plugin) resumes from
    from ckptzip.ingest import write_restored

    write_restored(chain.load(10), tmp_path / "plain.ckpt")
    torch.manual_seed(7)
    plain = LitDigits()
    t3 = trainer(tmp_path / "third", 20, None)
    t3.fit(plain, loader(), ckpt_path=str(tmp_path / "plain.ckpt"))
    for k, v in model.state_dict().items():
        assert torch.equal(plain.state_dict()[k], v), k


def test_load_rejects_foreign_pointer(tmp_path):
    from ckptzip.errors import CorruptCheckpointError

    p = tmp_path / "x.ckpt"
    torch.save({"state_dict": {}}, p)
    with pytest.raises(CorruptCheckpointError, match="not a ckptzip pointer"):
        CompressedCheckpointIO().load_checkpoint(p)


def test_bad_arguments_are_refused_before_training():
    from ckptzip.errors import ConfigError

    with pytest.raises(ConfigError, match=r"LosslessConfig.zstd_level must be an int in \[1, 22\], got 0"):
        CompressedCheckpointIO("lossless", {"zstd_level": 0})  # not at the first save, mid-run
    with pytest.raises(ConfigError, match="CompressedCheckpointIO threshold"):
        CompressedCheckpointIO(threshold="0.1")
    with pytest.raises(ConfigError, match="SensitivityCallback every_n_train_steps must be an int >= 1 or None"):
        SensitivityCallback(every_n_train_steps=0)
