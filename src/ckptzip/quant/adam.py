"""Adam's update direction as a quality measure, and the normalized exp_avg DynaQuant quantizes.

    err = adam_direction_error(m, v, m_q, v_q, step)        # ||d_q - d|| / ||d||
    u = normalize_exp_avg(m, v, step)                        # quantize u instead of m
    m_q = denormalize_exp_avg(u_q, v_q, step)                # decode v first, then this

(quant/dynaquant.py's module docstring has the measurements behind the recipe.)
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from .base import sqrt_rn

__all__ = ["adam_direction_error", "adam_denominator", "normalize_exp_avg", "denormalize_exp_avg"]


def _cat(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().reshape(-1).to(torch.float64)
    if isinstance(x, Mapping):
        x = [x[k] for k in sorted(x)]
    if isinstance(x, Sequence) and x:
        return torch.cat([t.detach().reshape(-1).to("cpu", torch.float64) for t in x])
    raise TypeError(f"expected a tensor, a list or a dict of tensors, got {type(x).__name__}")


def adam_direction_error(m, v, m_q, v_q, step, betas: tuple[float, float] = (0.9, 0.999),
                         eps: float = 1e-8) -> float:
    """||d_q - d|| / ||d|| with d = m_hat / (sqrt(v_hat) + eps), Adam's bias-corrected update.

    m, v, m_q, v_q: tensors or matching lists/dicts of tensors (concatenated); step: Adam's step
    count (int or the optimizer state's step tensor). Negative v_q (never produced here) is
    clamped to 0 so a bad codec shows up as a large error rather than NaN.
    """
    m, v, m_q, v_q = _cat(m), _cat(v), _cat(m_q), _cat(v_q)
    if not (m.numel() == v.numel() == m_q.numel() == v_q.numel()):
        raise ValueError("adam_direction_error: m, v, m_q, v_q must have the same number of elements")
    t = float(step)
    if t < 1:
        raise ValueError(f"adam_direction_error: step must be >= 1, got {t}")
    b1, b2 = betas
    bc1, bc2 = 1.0 - b1 ** t, 1.0 - b2 ** t
    d = (m / bc1) / ((v / bc2).sqrt() + eps)
    d_q = (m_q / bc1) / ((v_q.clamp_min(0) / bc2).sqrt() + eps)
    den = float(torch.linalg.vector_norm(d))
    num = float(torch.linalg.vector_norm(d_q - d))
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def adam_denominator(v: torch.Tensor, step, betas: tuple[float, float] = (0.9, 0.999),
                     eps: float = 1e-8) -> torch.Tensor:
    """sqrt(v / (1 - beta2^step)) + eps in float32: Adam's per-element update denominator, each step
    correctly rounded (the same bits on every machine: base.sqrt_rn)."""
    t = float(step)
    if t < 1:
        raise ValueError(f"adam_denominator: step must be >= 1, got {t}")
    return sqrt_rn(v.detach().to(torch.float32).clamp_min(0) / (1.0 - betas[1] ** t)).add_(eps)


def normalize_exp_avg(m: torch.Tensor, v: torch.Tensor, step, betas: tuple[float, float] = (0.9, 0.999),
                      eps: float = 1e-8) -> torch.Tensor:
    """u = m / adam_denominator(v): the exp_avg to quantize instead of m (v: the exact exp_avg_sq).

    The decoder rebuilds m_q = u_q * adam_denominator(v_q) from the *dequantized* v_q
    (denormalize_exp_avg), so the restored direction m_q_hat / (sqrt(v_q_hat) + eps) is exactly
    u_q / (1 - beta1^t): only u's quantization error reaches it, v's relative error is absorbed
    into m_q (and decays with beta1 within ~10 steps, while v's own error decays with beta2).
    """
    if m.shape != v.shape:
        raise ValueError(f"normalize_exp_avg: m has shape {tuple(m.shape)}, v {tuple(v.shape)}")
    return m.detach().to(torch.float32) / adam_denominator(v.to(m.device), step, betas, eps)


def denormalize_exp_avg(u_q: torch.Tensor, v_q: torch.Tensor, step, betas: tuple[float, float] = (0.9, 0.999),
                        eps: float = 1e-8, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """m_q = u_q * adam_denominator(v_q), in ``dtype``: decode v first, then this."""
    return (u_q.to(torch.float32) * adam_denominator(v_q.to(u_q.device), step, betas, eps)).to(dtype)
