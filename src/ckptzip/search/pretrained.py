"""Quality checks for pretrained encoders: ``eval_fn`` factories for the config search.

A pretrained model is compressed before anyone fine-tunes it, so its check cannot ask the
downstream task. Each factory here takes fixed, tokenized held-out text and returns an
``eval_fn(model)`` for ``EncodeContext`` / ``QualityJudge`` (search/quality.py); ``model`` is a
Hugging Face encoder (``AutoModel``) or a task model around one (its ``base_model`` is used).

    encoder, eval_fn = from_pretrained(folder)            # or: eval_fn = make_check(tokenizer)
    ctx = EncodeContext(step=0, model=encoder, eval_fn=eval_fn, threshold=0.01)
    # ckptzip compress model.pt --method dynaquant --eval pretrained:FOLDER --threshold 0.01

    inputs = tokenizer(texts, padding=True, truncation=True, max_length=64, return_tensors="pt")
    eval_fn = states_check(inputs)                          # the same check on your own text

``make_check`` runs on HELD_OUT_SOURCES' docstrings (stdlib prose, no download). Checks (named
variants; bench/transfer.py measures how well each predicts the test accuracy after fine-tuning,
over fixed configs from mild to destructive, docs/BENCHMARKS.md "Transfer learning (issue 19)"):

    states     (DEFAULT_CHECK) every layer's hidden states (the embedding layer's output
               included) at the real tokens, their mean cosine distance to the exact model's,
               calibrated into points of fine-tuned accuracy: degradation = distance / POINT, so
               0.01 = the token states moved as far as a config that lost one point of test
               accuracy after fine-tuning (POINT measured by bench/transfer.py over its configs:
               where the loss, worst of the milder configs, reaches one point). Grows monotonically
               with the damage, so each threshold picks its own config
    states-raw the same distance uncalibrated (0.01 = states 1 % away in 1 - cos): the first
               study's default, far stricter than its threshold reads (1 % costs ~0.23 points)
    probe      the 2-fold cross-validated loss of a linear probe refit on the mean-pooled states
               (a float, judged by its relative change): does the text keep its separable content?
               Ranks configs as well as ``states`` but sits at or below 0 until the damage is
               destructive, so low thresholds cannot tell mild configs apart
    retrieval  InfoNCE of matching each text's first half to its second half among all of them
               (a float, relative change): the sentence encoder's own training objective, the
               analog of the paper's pretraining loss. Quantization noise often *lowers* it, so the
               search passes destructive configs (kept as the paper-faithful variant)
"""
from __future__ import annotations

import pathlib
import random
import sysconfig
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from ..errors import ConfigError
from .quality import Outputs

CHECKS = ("states", "states-raw", "probe", "retrieval")
DEFAULT_CHECK = "states"  # ranks configs by fine-tuned accuracy (bench/transfer.py) and is graded
# The states' mean cosine distance that costs one point (0.01) of test accuracy after fine-tuning
# MiniLM on the docstring task (bench/transfer.py's calibration over 16 configs x 3 seeds: the
# envelope of the mean loss reaches 1 point at 0.0435 and 5 points at 0.206, about linear; one seed
# alone gives 0.017-0.116, so the constant is a mean, not a guarantee). Another task may tolerate
# more or less: run the bench on it, or use states-raw with a threshold of your own.
POINT = 0.043
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
def hidden_states(model: nn.Module, inputs: Mapping[str, torch.Tensor], pool: str = "tokens") -> list[torch.Tensor]:
    """Per layer (embeddings, then every block): the hidden states at the real tokens, (tokens, d),
    or (``pool="mean"``) each text's mean over its real tokens, (texts, d)."""
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
    layers = [torch.cat([b[layer] for b in per_batch]) for layer in range(len(per_batch[0]))]
    mask = inputs["attention_mask"]
    if pool == "tokens":
        return [h[mask.bool()] for h in layers]
    m = mask.unsqueeze(-1).to(layers[0].dtype)
    return [(h * m).sum(1) / m.sum(1) for h in layers]


def _mean_pooled(model: nn.Module, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return hidden_states(model, inputs, pool="mean")[-1]


POOLS = ("tokens", "mean")


def states_check(inputs: Mapping[str, torch.Tensor], *, distance: str = "cosine",
                 layers: Sequence[int] | None = None, pool: str = "tokens",
                 scale: float = 1.0) -> Callable[[nn.Module], Outputs]:
    """eval_fn -> ``Outputs`` of the hidden states of ``layers`` (default: every layer, the embedding
    layer's output included) at the real tokens of ``inputs`` (or mean-pooled per text,
    ``pool="mean"``), compared by ``distance`` times ``scale`` (``0.01 / POINT``: in points of
    fine-tuned accuracy)."""
    inputs = check_inputs(inputs)
    Outputs((torch.ones(1),), distance, scale)  # validates distance and scale now, not at the first save
    if pool not in POOLS:
        raise ConfigError(f"states_check pool must be one of {POOLS}, got {pool!r}")

    def eval_fn(model: nn.Module) -> Outputs:
        hs = hidden_states(model, inputs, pool)
        chosen = hs if layers is None else [hs[i] for i in layers]
        return Outputs(tuple(chosen), distance, scale)

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


# --- held-out text and the ready-made checks ------------------------------------------------------
# Text for judging a pretrained encoder without its downstream task: docstrings of stdlib sources
# (real prose about code, shipped with every Python; the demo's docstring task never shows these
# packages). The label of a text is its source, for the probe.
HELD_OUT_SOURCES = ("importlib", "idlelib", "lib2to3", "urllib", "turtle", "_pydecimal", "mailbox", "tarfile")


def package_docstrings(pkg: str, min_chars: int = 20) -> list[str]:
    """The docstrings (whitespace-normalised, at most 400 characters) of every function and class
    in the stdlib package or module ``pkg`` outside its tests, in file order."""
    import ast

    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    found = []
    files = sorted((root / pkg).rglob("*.py")) if (root / pkg).is_dir() else [root / f"{pkg}.py"]
    for p in files:
        if "test" in p.parts or not p.is_file():
            continue
        try:
            tree = ast.parse(p.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) > min_chars:
                    found.append(" ".join(doc.split())[:400])
    return found


def held_out_texts(per_source: int = 40, seed: int = 0) -> tuple[list[str], list[int]]:
    """(texts, source labels): ``per_source`` docstrings (>= 40 characters) of each of
    HELD_OUT_SOURCES, shuffled together with ``seed``."""
    pairs = []
    for label, src in enumerate(HELD_OUT_SOURCES):
        found = package_docstrings(src, min_chars=40)
        random.Random(seed + label).shuffle(found)
        pairs += [(t, label) for t in found[:per_source]]
    random.Random(seed).shuffle(pairs)
    return [t for t, _ in pairs], [lab for _, lab in pairs]


def make_check(tokenizer, kind: str = DEFAULT_CHECK, n_texts: int = 64) -> Callable:
    """The eval_fn of check ``kind`` (one of CHECKS) on about ``n_texts`` held-out docstrings,
    tokenized with the model's own ``tokenizer``."""
    if kind not in CHECKS:
        raise ConfigError(f"unknown pretrained check {kind!r}; choose from {', '.join(CHECKS)}")
    per = len(HELD_OUT_SOURCES)

    def tok(texts, max_length):
        return tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")

    if kind == "probe":  # a probe needs more texts than the states do: five per source is too few
        texts, labels = held_out_texts(per_source=max(4, 5 * n_texts // per))
        return probe_check(tok(texts, 48), labels)
    if kind == "retrieval":  # each text's first half against its second half
        texts, _ = held_out_texts(per_source=max(1, 2 * n_texts // per), seed=99)
        words = [t.split() for t in texts if len(t.split()) >= 8]
        return retrieval_check(tok([" ".join(w[:len(w) // 2]) for w in words], 48),
                               tok([" ".join(w[len(w) // 2:]) for w in words], 48))
    texts, _ = held_out_texts(per_source=max(1, n_texts // per))
    return states_check(tok(texts, 64), scale=0.01 / POINT if kind == "states" else 1.0)


def from_pretrained(path: str, kind: str = DEFAULT_CHECK) -> tuple[nn.Module, Callable]:
    """(encoder, eval_fn) for a Hugging Face model folder (``AutoModel`` / ``AutoTokenizer``): what
    ``ckptzip compress --eval pretrained:PATH`` (``pretrained-KIND:PATH`` for another check) uses."""
    from transformers import AutoModel, AutoTokenizer

    if not pathlib.Path(path).is_dir():
        raise FileNotFoundError(f"pretrained check: no model folder {path}; give a Hugging Face model folder "
                                "(config.json, weights, tokenizer)")
    return AutoModel.from_pretrained(path), make_check(AutoTokenizer.from_pretrained(path), kind)
