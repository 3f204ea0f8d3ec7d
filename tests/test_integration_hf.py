"""transformers.Trainer: saves go into a chain through CkptzipCallback; train() resumes from a chain step."""
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ckptzip import CheckpointChain  # noqa: E402
from ckptzip.demo.workloads import stdlib_text  # noqa: E402
from ckptzip.integrations.hf import CkptzipCallback, restore_checkpoint  # noqa: E402


class Bytes(torch.utils.data.Dataset):
    def __init__(self, n=64, seq=32):
        data = torch.frombuffer(bytearray(stdlib_text(n * seq)), dtype=torch.uint8).long()
        self.x = data[: n * seq].view(n, seq)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def make_trainer(out, max_steps, callbacks=()):
    cfg = transformers.GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    args = transformers.TrainingArguments(output_dir=str(out), max_steps=max_steps, save_steps=2,
                                          per_device_train_batch_size=8, learning_rate=1e-3, use_cpu=True,
                                          report_to=[], logging_strategy="no", disable_tqdm=True, seed=0,
                                          dataloader_num_workers=0)
    return transformers.Trainer(model=model, args=args, train_dataset=Bytes(), callbacks=list(callbacks))


def test_trainer_saves_into_chain_and_resumes(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cb = CkptzipCallback(tmp_path / "chain", method="lossless", delete_folders=True)
    t = make_trainer(tmp_path / "run", 6, [cb])
    t.train()
    final = {k: v.clone() for k, v in t.model.state_dict().items()}
    chain = CheckpointChain(tmp_path / "chain")
    assert chain.steps() == [2, 4, 6]
    assert chain.verify() == []
    assert not any(p.name.startswith("checkpoint-") for p in (tmp_path / "run").iterdir())  # folders deleted

    folder = restore_checkpoint(tmp_path / "chain", step=4, out_dir=tmp_path / "resume")
    assert os.path.isfile(os.path.join(folder, "optimizer.pt"))
    assert os.path.isfile(os.path.join(folder, "trainer_state.json"))
    t2 = make_trainer(tmp_path / "run2", 6)
    t2.train(resume_from_checkpoint=folder)
    assert t2.state.global_step == 6
    for k, v in final.items():
        torch.testing.assert_close(t2.model.state_dict()[k], v, rtol=0, atol=1e-6, msg=k)


def test_resume_from_an_older_step_refuses_or_truncates(tmp_path, monkeypatch):
    """A second trajectory never lands silently beside the first: an error by default, the chain
    continued from the resumed step with rewind='truncate'."""
    from ckptzip.errors import StepOrderError
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    make_trainer(tmp_path / "run", 6, [CkptzipCallback(tmp_path / "chain", delete_folders=True)]).train()
    folder = restore_checkpoint(tmp_path / "chain", step=2, out_dir=tmp_path / "resume")
    t = make_trainer(tmp_path / "run2", 6, [CkptzipCallback(tmp_path / "chain")])
    with pytest.raises(StepOrderError, match="rewind='truncate'"):
        t.train(resume_from_checkpoint=folder)
    assert CheckpointChain(tmp_path / "chain").steps() == [2, 4, 6]  # nothing dropped
    t = make_trainer(tmp_path / "run3", 6, [CkptzipCallback(tmp_path / "chain", rewind="truncate")])
    t.train(resume_from_checkpoint=folder)
    chain = CheckpointChain(tmp_path / "chain")
    assert chain.steps() == [2, 4, 6]
    restored, live = chain.restore(6).state["model"], t.model.state_dict()
    assert restored
    for k, v in restored.items():  # the continued chain restores (lm_head is tied to wte: not stored)
        torch.testing.assert_close(v, live[k], rtol=0, atol=0, msg=k)
