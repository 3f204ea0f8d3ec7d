"""An ``--eval`` spec for ``ckptzip compress`` (see the README).

``ckptzip compress ckpt_*.pt --out chain --method dynaquant --threshold 0.01 --eval examples/digits_eval.py:build``
imports this file, calls ``build()`` once, loads each checkpoint's weights into the returned model
and keeps every checkpoint's reconstructed model within 1 % of its uncompressed eval loss.
"""
import torch

from ckptzip.demo.workloads import DigitsMLP, digits_data


def build():
    """Return (model of the checkpoints' architecture, eval_fn(model) -> float, lower is better)."""
    _, _, x_val, y_val = digits_data(0)

    @torch.no_grad()
    def eval_fn(model):
        return float(torch.nn.functional.cross_entropy(model(x_val), y_val))

    return DigitsMLP(128), eval_fn
