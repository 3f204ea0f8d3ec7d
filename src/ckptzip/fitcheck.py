"""Does a restored state fit the live model and optimizer? Checked before anything is loaded.

``Compressor.restore`` calls :func:`check_fits` first, so a checkpoint of another architecture
raises one :class:`StateMismatchError` naming the first tensor that differs, and the model,
optimizer, scheduler and RNG stay untouched. The rules follow ``load_state_dict``:

- model, ``strict=True``: the same names, and for each its shape and dtype;
- model, ``strict=False``: missing and unexpected names allowed, shapes must still match (dtypes
  may differ: ``load_state_dict`` copies with a cast);
- optimizer: the same number of parameter groups and of parameters per group (what
  ``Optimizer.load_state_dict`` checks), and each moment (``state.MOMENT_ROLES``: exp_avg,
  momentum_buffer, ...) the shape of the live parameter it will be attached to.
"""
from __future__ import annotations

import torch

from .errors import StateMismatchError
from .state import MOMENT_ROLES

FIX = "restore into the model and optimizer the checkpoint was saved from"


def check_fits(state: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *,
               strict: bool = True, step: int | None = None) -> None:
    """Raise StateMismatchError for the first tensor of ``state`` that does not fit; nothing is changed."""
    what = f"checkpoint step {step}" if step is not None else "the checkpoint"
    problems = model_mismatches(state.get("model", {}), model, strict=strict)
    if not problems and optimizer is not None and "optimizer" in state:
        problems = optimizer_mismatches(state["optimizer"], optimizer, model)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        hint = " (strict=False allows missing and unexpected names)" if strict else ""
        raise StateMismatchError(f"{what} does not fit: {problems[0]}{more}; nothing was loaded; {FIX}{hint}")


def model_mismatches(saved: dict, model: torch.nn.Module, *, strict: bool) -> list[str]:
    """One line per tensor of ``saved`` that ``model.load_state_dict(saved, strict)`` would reject."""
    live = model.state_dict()
    out = []
    for name, t in live.items():
        if name not in saved:
            if strict:
                out.append(f"model tensor {name!r} is missing from the checkpoint")
            continue
        s = saved[name]
        if not (isinstance(t, torch.Tensor) and isinstance(s, torch.Tensor)):
            continue
        if tuple(s.shape) != tuple(t.shape):
            out.append(f"model tensor {name!r} has shape {_shape(s)} in the checkpoint and {_shape(t)} in the model")
        elif strict and s.dtype != t.dtype:
            out.append(f"model tensor {name!r} has dtype {_dtype(s)} in the checkpoint and {_dtype(t)} in the model")
    if strict:
        out += [f"checkpoint tensor {name!r} is not in the model" for name in saved if name not in live]
    return out


def optimizer_mismatches(saved: dict, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> list[str]:
    """One line per group or moment of ``saved`` that does not fit ``optimizer``'s parameters."""
    groups = saved.get("param_groups", [])
    live = optimizer.param_groups
    if len(groups) != len(live):
        return [f"the optimizer has {len(live)} parameter group(s), the checkpoint {len(groups)}"]
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for g, (sg, lg) in enumerate(zip(groups, live)):
        if len(sg["params"]) != len(lg["params"]):
            out.append(f"optimizer group {g} has {len(lg['params'])} parameters, the checkpoint's {len(sg['params'])}")
            continue
        for j, (idx, p) in enumerate(zip(sg["params"], lg["params"])):
            for key, t in saved.get("state", {}).get(idx, {}).items():
                if key in MOMENT_ROLES and isinstance(t, torch.Tensor) and tuple(t.shape) != tuple(p.shape):
                    who = repr(names[id(p)]) if id(p) in names else f"{j} of group {g}"
                    out.append(f"optimizer state {key!r} of parameter {who} has shape {_shape(t)} in the checkpoint "
                               f"and the parameter {_shape(p)}")
    return out


def _shape(t: torch.Tensor) -> str:
    return "(" + ", ".join(map(str, t.shape)) + ")"


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")
