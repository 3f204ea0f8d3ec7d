"""Small real training runs used by the demo, the benchmarks and the tests.

Everything here trains on data that ships with installed packages (scikit-learn's digits,
the Python standard library's source text), so nothing is downloaded.
"""
from __future__ import annotations

import copy
import pathlib
import sysconfig
from dataclasses import dataclass, field

import torch
from torch import nn


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
