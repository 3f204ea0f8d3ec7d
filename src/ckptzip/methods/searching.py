"""What a method needs so the config search (search/) can choose its quantizer knobs per checkpoint.

``dynaquant`` and the paper's baselines (``qd``, ``cnr``, ``gobo``) all search: the paper extends
Inshrinkerator's search to every baseline, each with its own space (Tables 9-12). A searching
method's config inherits ``SearchConfig`` (the search knobs and which space class its
``search_space`` dict fills) and the method inherits ``SearchingMethod``::

    knobs, info = self.choose_knobs(state, reference, ctx)   # {} and {"search": "off"} without eval_fn
    cfg = dataclasses.replace(self.config, **knobs)          # this checkpoint's config

The search's memory between saves (the previous best) is ``search_state``; it goes into each
file's method meta, so a writer restarted on an existing chain resumes the steady-state search.
"""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import ConfigError
from ..quant.base import QuantizedTensor
from ..search.spaces import Space
from ..state import FlatState, TensorRecord
from .base import EncodeContext, Method

SEARCH_POLICIES = ("monotone", "free")


@dataclass(frozen=True)
class SearchConfig:
    """The search knobs every searching method's config carries (used only when eval_fn is given)."""

    search: bool = True
    search_policy: str = "monotone"  # "monotone": never more aggressive than the previous best; "free"
    search_neighbourhood: int = 1    # e: steps from the previous best in the steady state
    search_space: dict | None = None # fields of ``space_cls`` (search/spaces.py); None: the paper's table

    space_cls: ClassVar[type[Space]]

    def __post_init__(self):
        if self.search_policy not in SEARCH_POLICIES:
            raise ConfigError(f"search_policy must be one of {SEARCH_POLICIES}, got {self.search_policy!r}")
        if not isinstance(self.search_neighbourhood, int) or self.search_neighbourhood < 0:
            raise ConfigError(f"search_neighbourhood must be an int >= 0, got {self.search_neighbourhood!r}")
        self.space()  # validates search_space now rather than at the first save

    def space(self) -> Space:
        return self.space_cls.from_any(self.search_space)


class SearchingMethod(Method):
    """A method whose quantizer knobs the config search may choose (see the module docstring)."""

    search_coding: ClassVar[str] = "conditional"  # how the encoder codes codes (search.strategies.estimate_bits)

    def __init__(self, config=None, **overrides):
        super().__init__(config, **overrides)
        self.search_state = None  # the config search's memory between saves (previous best, ...)

    @abstractmethod
    def search_records(self, state: FlatState) -> dict[str, TensorRecord]:
        """The weights the quantizer covers (the ones a trial replaces before eval_fn)."""

    @abstractmethod
    def search_quantize(self, state: FlatState, knobs: dict, gradients) -> dict[str, QuantizedTensor]:
        """Quantize every ``search_records`` weight under the config with ``knobs`` replaced."""

    @abstractmethod
    def search_dequantize(self, q: QuantizedTensor) -> torch.Tensor:
        """The inverse the decoder applies to one weight."""

    def choose_knobs(self, state: FlatState, reference, ctx: EncodeContext) -> tuple[dict, dict]:
        """This checkpoint's knob overrides and the search info for the manifest summary."""
        if not (self.config.search and ctx.eval_fn is not None and ctx.model is not None):
            return {}, {"search": "off"}
        from ..search.strategies import search_config  # search/ imports methods lazily too

        knobs, info, self.search_state = search_config(self, state, reference, ctx, self.search_state)
        return knobs, info

    def remember_search(self, meta: dict) -> None:
        """Put the search state into the file's method meta (read back by ``resume``)."""
        if self.search_state is not None:
            meta["search_state"] = self.search_state

    def resume(self, method_meta: dict) -> None:
        if self.search_state is None and isinstance(method_meta.get("search_state"), dict):
            self.search_state = method_meta["search_state"]
