"""Checks for pretrained weights (search/pretrained.py) and the transfer-learning demo path.

The checks run on a small BERT built from config (random weights: what is judged is the distance
to the exact model, which needs no training); the demo path runs end to end on the real pretrained
MiniLM with a tiny setting (one fine-tuning step, 32 test docstrings, only the embedding table
quantized, two-point search space)."""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from ckptzip.errors import ConfigError
from ckptzip.methods.base import get_method
from ckptzip.methods.dynaquant import quantize_weights
from ckptzip.quant.dynaquant import dequantize
from ckptzip.search import pretrained as P
from ckptzip.search.quality import Outputs, QualityJudge
from ckptzip.state import flatten_state


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # small matmuls; conftest restores the thread count after each test


@pytest.fixture(scope="module")
def bert():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=200, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=128, max_position_embeddings=32)).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 200, (12, 16), generator=g)
    mask = torch.ones_like(ids)
    mask[::3, 10:] = 0  # some padded texts: only real tokens are judged
    return model, {"input_ids": ids, "attention_mask": mask}


def _degradation(model, eval_fn, bins: int) -> float:
    flat = flatten_state({"model": model.state_dict()}, model)
    cfg = get_method("dynaquant").config.quantizer(bins=bins, embedding_bins=bins, prune_fraction=0.0,
                                                   protect_fraction=0.0, min_numel=256)
    q = quantize_weights(flat, cfg)
    judge = QualityJudge(model, eval_fn, flat)
    try:
        return judge.check({n: dequantize(x) for n, x in q.items()}).degradation
    finally:
        judge.close()


def test_states_check_grows_with_damage(bert):
    model, inputs = bert
    eval_fn = P.states_check(inputs)
    out = eval_fn(model)
    assert isinstance(out, Outputs) and out.distance == "cosine" and len(out.tensors) == 2  # the 2 blocks
    assert all(t.shape == (int(inputs["attention_mask"].sum()), 64) for t in out.tensors)
    d = [_degradation(model, eval_fn, b) for b in (4, 8, 32, 256)]
    assert d == sorted(d, reverse=True) and d[-1] < 0.01 < d[0]  # fewer bins, farther from the exact states
    rel = P.states_check(inputs, distance="relative", layers=[-1])
    assert _degradation(model, rel, 8) > _degradation(model, rel, 32) > 0


def test_probe_and_retrieval_checks_score_the_exact_model(bert):
    model, inputs = bert
    labels = torch.arange(12) % 3
    probe = P.probe_check(inputs, labels)
    assert 0 < probe(model) < 10 and probe(model) == probe(model)  # deterministic: the same score twice
    first = {k: v[:, :8] for k, v in inputs.items()}
    second = {k: v[:, 8:].clone() for k, v in inputs.items()}
    second["attention_mask"][:, 0] = 1
    retrieval = P.retrieval_check(first, second)
    assert retrieval(model) > 0
    assert _degradation(model, probe, 4) != 0.0  # a float score, judged by its relative change


def test_checks_refuse_bad_input_in_one_line(bert):
    model, inputs = bert
    bad = [
        (lambda: P.states_check({"input_ids": inputs["input_ids"]}), "input_ids and attention_mask"),
        (lambda: P.states_check({"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"][:, :4]}),
         "one shape"),
        (lambda: P.states_check({**inputs, "attention_mask": inputs["attention_mask"] * 2}), "0/1"),
        (lambda: P.states_check(inputs, distance="l1"), "distance"),
        (lambda: P.probe_check(inputs, [0, 1]), "class indices"),
        (lambda: P.probe_check(inputs, [0] * 12), "at least 2 classes"),
        (lambda: P.retrieval_check(inputs, {k: v[:5] for k, v in inputs.items()}), "pairs rows"),
        (lambda: Outputs(()), "non-empty tensors"),
    ]
    for make, msg in bad:
        with pytest.raises(ConfigError, match=msg) as e:
            make()
        assert "\n" not in str(e.value)
    flat = flatten_state({"model": model.state_dict()}, model)
    calls = []

    def changing(m):  # the cosine outputs of the exact state, then relative ones: not comparable
        calls.append(1)
        return Outputs((torch.ones(3),), "cosine" if len(calls) == 1 else "relative")

    judge = QualityJudge(model, changing, flat)
    with pytest.raises(ConfigError, match="same outputs every call"):
        judge.check({})


def test_transfer_demo_end_to_end(tmp_path):
    """ckptzip demo --transfer's path on a tiny setting: transfer.json's schema, and a threshold of 0
    (nothing passes: the least aggressive config) and of 0.9 (the coarse one passes) choose differently."""
    from ckptzip.demo import transfer as T

    wl = T.task(steps=1, split=(0.7, 0.27))  # 32 test docstrings
    space = {"bins": (32,), "embedding_bins": (2, 32), "prune_fractions": (0.0,), "protect_fractions": (0.005,)}
    rows = T.run_transfer(tmp_path, thresholds=(0.0, 0.9), wl=wl, n_texts=8, progress=lambda m: None,
                          method_config={"min_numel": 10 ** 6, "search_space": space})
    data = json.loads((tmp_path / "transfer.json").read_text())
    assert data["rows"] == rows and data["check"] == "states"
    assert [r["threshold"] for r in rows] == [None, 0.0, 0.9]
    for r in rows:
        assert {"weights", "threshold", "ratio", "test_accuracy"} <= set(r)
        assert 0.0 <= r["test_accuracy"] <= 1.0 and r["ratio"] >= 1.0
    orig, strict, loose = rows
    assert orig["weights"] == "original" and orig["ratio"] == 1.0
    assert strict["infeasible"] and strict["config"]["embedding_bins"] == 32
    assert not loose["infeasible"] and loose["config"]["embedding_bins"] == 2 and loose["degradation"] <= 0.9
    assert loose["ratio"] > strict["ratio"] > 1.0


def test_compress_cli_takes_the_pretrained_check(tmp_path):
    """`ckptzip compress minilm.pt --eval ckptzip.demo.transfer:minilm_check` judges the states."""
    from ckptzip.chain import CheckpointChain
    from ckptzip.cli import app
    from ckptzip.demo.transfer import pretrained

    encoder, _ = pretrained()
    torch.save({"model": encoder.state_dict()}, tmp_path / "minilm.pt")
    cfg = {"min_numel": 10 ** 6, "search_space": {"bins": (32,), "embedding_bins": (2,), "prune_fractions": (0.0,),
                                                  "protect_fractions": (0.005,)}}
    r = CliRunner().invoke(app, ["compress", str(tmp_path / "minilm.pt"), "--out", str(tmp_path / "c"),
                                 "--method", "dynaquant", "--config", json.dumps(cfg),
                                 "--eval", "ckptzip.demo.transfer:minilm_check", "--threshold", "0.9"])
    assert r.exit_code == 0, r.output
    (e,) = CheckpointChain(str(tmp_path / "c"), "dynaquant").entries()
    assert e.summary["judge"] == "outputs" and 0 < e.summary["degradation"] <= 0.9 and not e.summary["infeasible"]
