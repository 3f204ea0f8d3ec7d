"""Quality checks for pretrained encoders: ``eval_fn`` factories for the config search.

A pretrained model is compressed before anyone fine-tunes it, so its check cannot ask the
downstream task. Each factory here takes fixed, tokenized held-out text and returns an
``eval_fn(model)`` for ``EncodeContext`` / ``QualityJudge`` (search/quality.py); ``model`` is a
Hugging Face encoder (``AutoModel``) or a task model around one (its ``base_model`` is used).

    inputs = tokenizer(texts, padding=True, truncation=True, max_length=64, return_tensors="pt")
    eval_fn = states_check(inputs)               # the default for pretrained weights
    ctx = EncodeContext(step=0, model=encoder, eval_fn=eval_fn, threshold=0.01)

Checks (named variants; bench/transfer.py measures how well each predicts the test accuracy after
fine-tuning, over fixed configs from mild to destructive):

    states     every layer's hidden states at the real tokens, judged by their mean cosine distance
               to the exact model's (``Outputs(..., "cosine")``): 0.01 = the compressed encoder's
               token states point on average 1 % (in 1 - cos) away from the original's
    probe      the 2-fold cross-validated loss of a linear probe refit on the mean-pooled states
               (a float, judged by its relative change): does the text keep its separable content?
    retrieval  InfoNCE of matching each text's first half to its second half among all of them
               (a float, relative change): the sentence encoder's own training objective, the
               analog of the paper's pretraining loss. Quantization noise often *lowers* it, so the
               search passes destructive configs (kept as the paper-faithful variant)
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from ..errors import ConfigError
from .quality import Outputs

CHECKS = ("states", "probe", "retrieval")
BATCH = 64  # rows per forward pass


def check_inputs(inputs: Mapping[str, torch.Tensor], what: str = "inputs") -> dict[str, torch.Tensor]:
    """The tokenizer output a check runs on: input_ids and attention_mask of the same 2-D shape
    (other keys, e.g. token_type_ids, are passed through)."""
    if not isinstance(inputs, Mapping) or not {"input_ids", "attention_mask"} <= set(inputs):
        raise ConfigError(f"{what} must be a tokenizer's output with input_ids and attention_mask "
                          "(tokenizer(texts, padding=True, return_tensors='pt'))")
    out = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    ids, mask = out.get("input_ids"), out.get("attention_mask")
    if ids is None or mask is None or ids.dim() != 2 or ids.shape != mask.shape or len(ids) < 2:
        raise ConfigError(f"{what}: input_ids and attention_mask must be tensors of one shape (texts, tokens) "
                          "with at least 2 texts; tokenize with return_tensors='pt' and padding=True")
    if not bool(((mask == 0) | (mask == 1)).all()) or bool((mask.sum(1) == 0).any()):
        raise ConfigError(f"{what}: attention_mask must be 0/1 with at least one token per text")
    return {k: v for k, v in out.items() if v.shape == ids.shape}


def _encoder(model: nn.Module) -> nn.Module:
    return getattr(model, "base_model", model)


@torch.no_grad()
def hidden_states(model: nn.Module, inputs: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """Per layer (embeddings, then every block): the hidden states at the real tokens, (tokens, d)."""
    enc = _encoder(model)
    was = enc.training
    enc.eval()
    try:
        n = len(inputs["input_ids"])
        per_batch = [enc(**{k: v[i:i + BATCH] for k, v in inputs.items()}, output_hidden_states=True).hidden_states
                     for i in range(0, n, BATCH)]
    finally:
        enc.train(was)
    if not per_batch[0]:
        raise ConfigError(f"{type(enc).__name__} returned no hidden states; the check needs a Hugging Face encoder "
                          "that supports output_hidden_states=True")
    mask = inputs["attention_mask"].bool()
    return [torch.cat([b[layer] for b in per_batch])[mask] for layer in range(len(per_batch[0]))]


def _mean_pooled(model: nn.Module, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    enc = _encoder(model)
    was = enc.training
    enc.eval()
    try:
        outs = [enc(**{k: v[i:i + BATCH] for k, v in inputs.items()}).last_hidden_state
                for i in range(0, len(inputs["input_ids"]), BATCH)]
    finally:
        enc.train(was)
    mask = inputs["attention_mask"].unsqueeze(-1).to(outs[0].dtype)
    return (torch.cat(outs) * mask).sum(1) / mask.sum(1)


def states_check(inputs: Mapping[str, torch.Tensor], *, distance: str = "cosine",
                 layers: Sequence[int] | None = None) -> Callable[[nn.Module], Outputs]:
    """eval_fn -> ``Outputs`` of the hidden states of ``layers`` (default: every block's output,
    not the embedding layer's) at the real tokens of ``inputs``, compared by ``distance``."""
    inputs = check_inputs(inputs)
    Outputs((torch.ones(1),), distance)  # validates the distance now, not at the first save

    def eval_fn(model: nn.Module) -> Outputs:
        hs = hidden_states(model, inputs)
        chosen = hs[1:] if layers is None else [hs[i] for i in layers]
        return Outputs(tuple(chosen), distance)

    return eval_fn


def probe_check(inputs: Mapping[str, torch.Tensor], labels, *, l2: float = 1e-2) -> Callable[[nn.Module], float]:
    """eval_fn -> the 2-fold cross-validated cross-entropy of an L2-regularised linear probe refit
    on the mean-pooled final states (lower is better)."""
    inputs = check_inputs(inputs)
    y = torch.as_tensor(labels, dtype=torch.int64)
    if y.dim() != 1 or len(y) != len(inputs["input_ids"]) or int(y.min()) < 0 or len(y.unique()) < 2:
        raise ConfigError(f"probe labels must be {len(inputs['input_ids'])} class indices >= 0 (one per text, "
                          "at least 2 classes)")
    k = int(y.max()) + 1
    half = len(y) // 2
    folds = ((slice(0, half), slice(half, None)), (slice(half, None), slice(0, half)))

    def fit_and_score(x: torch.Tensor, tr: slice, te: slice) -> float:
        mu, sd = x[tr].mean(0), x[tr].std(0) + 1e-6
        xtr, xte = (x[tr] - mu) / sd, (x[te] - mu) / sd
        w = torch.zeros(x.shape[1], k, dtype=torch.float64, requires_grad=True)
        b = torch.zeros(k, dtype=torch.float64, requires_grad=True)
        opt = torch.optim.LBFGS([w, b], max_iter=200, line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            loss = nn.functional.cross_entropy(xtr @ w + b, y[tr]) + l2 * (w ** 2).sum()
            loss.backward()
            return loss

        opt.step(closure)
        with torch.no_grad():
            return float(nn.functional.cross_entropy(xte @ w + b, y[te]))

    def eval_fn(model: nn.Module) -> float:
        with torch.no_grad():
            x = _mean_pooled(model, inputs).to(torch.float64)
        if not bool(torch.isfinite(x).all()):
            return float("inf")
        with torch.enable_grad():
            return sum(fit_and_score(x, tr, te) for tr, te in folds) / 2

    return eval_fn


def retrieval_check(first: Mapping[str, torch.Tensor], second: Mapping[str, torch.Tensor], *,
                    temperature: float = 0.05) -> Callable[[nn.Module], float]:
    """eval_fn -> InfoNCE of matching row i of ``first`` to row i of ``second`` among all rows
    (cosine similarity of mean-pooled states / ``temperature``; lower is better)."""
    first, second = check_inputs(first, "first"), check_inputs(second, "second")
    if len(first["input_ids"]) != len(second["input_ids"]):
        raise ConfigError(f"retrieval_check pairs rows: first has {len(first['input_ids'])} texts, "
                          f"second {len(second['input_ids'])}")

    @torch.no_grad()
    def eval_fn(model: nn.Module) -> float:
        a = nn.functional.normalize(_mean_pooled(model, first), dim=-1)
        b = nn.functional.normalize(_mean_pooled(model, second), dim=-1)
        return float(nn.functional.cross_entropy(a @ b.T / temperature, torch.arange(len(a))))

    return eval_fn
