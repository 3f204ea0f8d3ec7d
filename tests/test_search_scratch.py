"""The search's scratch copies kept between saves (search/scratch.py): reused only where a deep copy
now would be the same, values taken from the state and the live model, parameters freed between
searches; and a searched chain makes the same choices, to the bit, with the copy kept as with a fresh one."""
import threading

import torch
from torch import nn

from ckptzip.chain import CheckpointChain
from ckptzip.demo.workloads import DigitsMLP, digits_data
from ckptzip.methods.base import EncodeContext
from ckptzip.search import scratch as S
from ckptzip.search.quality import QualityJudge
from ckptzip.state import flatten_state


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.1)
        self.register_buffer("mask", torch.ones(8), persistent=False)
        self.config = type("Cfg", (), {})()
        self.config.scale = 1.0
        self.config.names = {"a": [1, 2]}

    def forward(self, x):
        return self.drop(self.fc(x)) * self.mask * self.config.scale


def _kept_then_taken(model):
    first = S.take(model)
    S.give(model, first)
    return first, S.take(model)


def test_reused_when_unchanged_and_freed_between_searches():
    model = Net()
    first = S.take(model)
    S.give(model, first)
    assert all(p.numel() == 0 for p in first.parameters())  # no parameter memory while idle
    model.eval()
    model.mask.fill_(3.0)  # a non-persistent buffer: not in the state, taken from the live model
    again = S.take(model)
    assert again is first
    assert [p.shape for p in again.parameters()] == [p.shape for p in model.parameters()]
    assert not again.training and torch.equal(again.mask, model.mask)
    assert again.mask.data_ptr() != model.mask.data_ptr()


def test_a_change_a_deep_copy_would_carry_makes_a_fresh_copy():
    changes = [lambda m: setattr(m.drop, "p", 0.5),                     # a plain attribute
               lambda m: setattr(m.config, "scale", 2.0),                # one level into an object
               lambda m: m.config.names["a"].append(3),                  # inside its dict
               lambda m: m.fc.register_forward_hook(lambda *a: None),    # a hook
               lambda m: setattr(m, "fc", nn.Linear(8, 4)),              # a shape
               lambda m: m.fc.weight.requires_grad_(False),
               lambda m: setattr(m, "extra", nn.ReLU()),                 # a module
               lambda m: setattr(m, "fn", lambda x: x)]                  # equality not told: fresh
    for change in changes:
        model = Net()
        first = S.take(model)
        S.give(model, first)
        change(model)
        assert S.take(model) is not first, change
    model = Net()  # what eval_fn did to the kept copy counts too
    first, _ = _kept_then_taken(model)
    first.drop.p = 0.7
    S.give(model, first)
    assert S.take(model) is not first


def test_one_search_at_a_time_has_the_kept_copy():
    model = Net()
    first = S.take(model)
    S.give(model, first)
    got = []
    threads = [threading.Thread(target=lambda: got.append(S.take(model))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(g) for g in got}) == 2 and sum(g is first for g in got) == 1


def test_judge_scores_on_a_kept_copy_as_on_a_fresh_one():
    torch.manual_seed(0)
    model = DigitsMLP()
    x, y = digits_data()[:2]

    @torch.no_grad()
    def eval_fn(m):
        m.eval()
        return float(nn.functional.cross_entropy(m(x[:200]), y[:200]))

    flat = flatten_state({"model": model.state_dict()})
    name = next(n for n in flat.records if n.endswith("weight"))
    w = flat.tensors[name] * 0.9
    scores = []
    for _ in range(3):  # the first judge deep-copies; the next two take its copy
        judge = QualityJudge(model, eval_fn, flat, threshold=0.01)
        scores.append((judge.baseline, judge.score({name: w})))
        judge.close()
    assert scores[0] == scores[1] == scores[2]
    assert model.training  # the live model untouched


def test_searched_chain_writes_the_same_files_with_the_copy_kept(monkeypatch):
    """A searched chain over a real digits run: the same choices and tensors whether each save
    deep-copies the model or takes the copy kept since the last."""
    x, y = digits_data()[:2]
    torch.manual_seed(1)
    model = DigitsMLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    states = []
    for step in range(3):
        for _ in range(5):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        states.append({"model": {k: v.clone() for k, v in model.state_dict().items()},
                       "optimizer": {"state": {i: {k: v.clone() for k, v in s.items()} for i, s in
                                               opt.state_dict()["state"].items()},
                                     "param_groups": opt.state_dict()["param_groups"]}})

    @torch.no_grad()
    def eval_fn(m):
        m.eval()
        return float(nn.functional.cross_entropy(m(x), y))

    def saved(url):
        """Each step's search summary (but its seconds) and restored tensors: a searched file
        records how long its search took, so the bytes differ from run to run."""
        ch = CheckpointChain(url, "dynaquant")
        for i, s in enumerate(states):
            model.load_state_dict(s["model"])
            ch.save(s, i + 1, ctx=EncodeContext(step=i + 1, model=model, eval_fn=eval_fn, threshold=0.02))
        out = []
        for step in ch.steps():
            summary = dict(ch.manifest(step)["method_meta"]["summary"])
            summary.pop("search_s")
            out.append((summary, flatten_state(ch.load(step)).tensors))
        return out

    def same(a, b):
        return all(sa == sb and sorted(ta) == sorted(tb) and all(torch.equal(ta[n], tb[n]) for n in ta)
                   for (sa, ta), (sb, tb) in zip(a, b)) and len(a) == len(b)

    taken = []
    real_take = S.take
    monkeypatch.setattr(S, "take", lambda m: taken.append(m in S._kept) or real_take(m))
    kept = saved("memory://scratch-kept")
    assert taken == [False, True, True] and kept[1][0]["evals"] >= 1
    monkeypatch.setattr(S, "take", S.scratch_copy)  # a fresh deep copy every save
    assert same(saved("memory://scratch-fresh"), kept)


def test_copies_kept_for_the_models_searched_last():
    models = [Net() for _ in range(S.KEEP_MODELS + 1)]
    for m in models:
        S.give(m, S.take(m))
    assert models[0] not in S._kept and all(m in S._kept for m in models[1:])
    del models[1]  # a model gone: its copy goes with it
    assert len(S._kept) == S.KEEP_MODELS - 1
