"""Gradient EMAs for sensitivity scores, recorded only in a window of batches before each save.

DynaQuant ranks parameters by magnitude |theta| and by first-order sensitivity |theta * g|, where g
is an exponential moving average of the gradient over the last few batches before a checkpoint
(paper §4.5: recording ~50 batches is enough). Recording every step would cost a device->host copy
per parameter per step, so hooks are installed only while the recorder is *armed*:

    rec = GradientRecorder(model, beta=0.9, window=50)
    for step in range(1, n_steps + 1):
        if should_arm(step, save_every, rec.window):
            rec.arm()                    # idempotent; resets the EMAs when it starts a new window
        loss.backward(); opt.step(); opt.zero_grad()
        if step % save_every == 0:
            grads = rec.gradients()      # name -> g_ema (float32, CPU)
            ...save with grads...
            rec.disarm()                 # removes the hooks: zero cost until the next window
    rec.close()

EMA convention: ``g_ema = beta * g_ema + (1 - beta) * grad``; the first gradient of a window
initialises ``g_ema`` (no zero-init bias, so a short window is still on the gradients' scale).
The paper's HTML text writes EMA_t = beta*g_t + (1-beta)*EMA_{t-1} with beta=0.9 "to emphasize
the recent gradients"; that is our ``beta=0.1``. Our default 0.9 averages over ~10 batches, which
is what makes a 50-batch window meaningful; pass beta=0.1 for the paper's literal weighting.

On CUDA each hook starts a non_blocking copy into a pinned CPU buffer and records an event; the
copy is folded into the EMA lazily (at that parameter's next hook, or when the EMAs are read),
so the transfer overlaps the optimizer step and the next forward pass as in the paper.
Gradient accumulation: every backward pass counts as one EMA step (the hook fires after each
accumulation into ``.grad``).
"""
from __future__ import annotations

import torch
from torch import nn

from .configcheck import Range, check_arg
from .errors import ConfigError


def should_arm(step: int, save_every: int, window: int) -> bool:
    """Whether the batch that becomes step ``step`` (1-based) should record gradients.

    True for the last ``window`` steps up to and including every multiple of ``save_every``
    (e.g. save_every=100, window=50: steps 51..100, 151..200, ...).
    """
    if save_every < 1:
        raise ConfigError(f"save_every must be >= 1, got {save_every}")
    if window < 0:
        raise ConfigError(f"window must be >= 0 batches, got {window}")
    return (-step) % save_every < window


class GradientRecorder:
    """Exponential moving averages of each parameter's gradient, kept on the CPU in float32."""

    def __init__(self, model: nn.Module, *, beta: float = 0.9, window: int = 50):
        check_arg("GradientRecorder beta", beta, float, Range(ge=0, lt=1, note=" (the weight of the old EMA)"))
        check_arg("GradientRecorder window", window, int, Range(ge=1))
        self.beta = float(beta)
        self.window = int(window)
        # named_parameters() deduplicates tied weights, so each tensor gets one hook and one name
        self._params: dict[str, nn.Parameter] = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self._name_of = {id(p): n for n, p in self._params.items()}
        self._ema: dict[str, torch.Tensor] = {}
        self._count: dict[str, int] = {}
        self._pending: dict[str, tuple[torch.Tensor, torch.cuda.Event]] = {}  # CUDA staging buffers
        self._pinned: dict[str, torch.Tensor] = {}
        self._handles: list = []
        self._closed = False

    # -- window control ----------------------------------------------------------------------
    @property
    def armed(self) -> bool:
        return bool(self._handles)

    @property
    def steps(self) -> int:
        """Most gradients folded into any parameter's EMA in the current window."""
        return max(self._count.values(), default=0)

    def arm(self, *, reset: bool = True) -> None:
        """Start recording (install the hooks). No-op while already armed.

        reset=True starts fresh EMAs (new tensors, so dicts returned earlier by gradients() keep
        their values); reset=False continues the previous window's EMAs.
        """
        if self._closed:
            raise RuntimeError("GradientRecorder is closed; create a new one")
        if self.armed:
            return
        if reset:
            self._ema, self._count = {}, {}
        for name, p in self._params.items():
            self._handles.append(p.register_post_accumulate_grad_hook(self._make_hook(name)))

    def disarm(self) -> None:
        """Stop recording: remove the hooks (the EMAs are kept for gradients()/sensitivity())."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def close(self) -> None:
        """Remove the hooks and drop every buffer."""
        self.disarm()
        self._flush()
        self._ema, self._count, self._pending, self._pinned = {}, {}, {}, {}
        self._closed = True

    # -- reading -----------------------------------------------------------------------------
    def gradients(self) -> dict[str, torch.Tensor]:
        """name -> g_ema (float32, CPU, parameter's shape) for every parameter seen this window."""
        self._flush()
        return dict(self._ema)

    def sensitivity(self, name_or_param: str | torch.Tensor) -> torch.Tensor | None:
        """|theta * g_ema| (float32, CPU), or None when no gradient was recorded for it."""
        name = name_or_param if isinstance(name_or_param, str) else self._name_of.get(id(name_or_param))
        if name is None or name not in self._params:
            raise KeyError(f"{name_or_param!r} is not a trainable parameter of the recorded model")
        self._flush(name)
        g = self._ema.get(name)
        if g is None:
            return None
        theta = self._params[name].detach().to("cpu", torch.float32)
        return (theta * g).abs_()

    # -- internals ---------------------------------------------------------------------------
    def _make_hook(self, name: str):
        def hook(p: torch.Tensor) -> None:
            g = p.grad
            if g is None:
                return
            if g.is_cuda:
                self._fold_pending(name)  # the previous copy finished long ago: fold it first
                buf = self._pinned.get(name)
                if buf is None or buf.shape != g.shape or buf.dtype != g.dtype:
                    buf = self._pinned[name] = torch.empty(g.shape, dtype=g.dtype, pin_memory=True)
                buf.copy_(g.detach(), non_blocking=True)
                ev = torch.cuda.Event()
                ev.record()
                self._pending[name] = (buf, ev)
            else:
                self._fold(name, g.detach())
        return hook

    def _fold(self, name: str, g: torch.Tensor) -> None:
        g = g.to("cpu", torch.float32)
        ema = self._ema.get(name)
        if ema is None:
            self._ema[name] = g.clone()  # first gradient of the window initialises the EMA
        else:
            ema.mul_(self.beta).add_(g, alpha=1.0 - self.beta)
        self._count[name] = self._count.get(name, 0) + 1

    def _fold_pending(self, name: str) -> None:
        item = self._pending.pop(name, None)
        if item is not None:
            buf, ev = item
            ev.synchronize()
            self._fold(name, buf)

    def _flush(self, name: str | None = None) -> None:
        for n in ([name] if name is not None else list(self._pending)):
            self._fold_pending(n)

    def __del__(self):  # hooks hold a reference to self; drop them with the recorder
        try:
            self.disarm()
        except Exception:
            pass
