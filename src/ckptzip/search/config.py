"""``SearchConfig``: the config search's knobs, nested as ``search`` in every quantizing method's config.

    get_method("dynaquant", {"search": {"policy": "free", "space": {"bins": [8, 16]}}})

``space`` narrows the method's search space (search/spaces.py: a dict of that space's fields, each
a list of the values its knob may take); None is the paper's table for the method.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

SEARCH_POLICIES = ("monotone", "free")


@dataclass(frozen=True)
class SearchConfig:
    enabled: bool = True             # search when the caller gives eval_fn (and model); False: fixed config
    policy: str = "monotone"         # "monotone": never more aggressive than the previous best; "free"
    neighbourhood: int = 1           # e: axis steps from the previous best in the steady state
    space: dict | None = None        # fields of the method's space class; None: the paper's table

    def __post_init__(self):
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"SearchConfig.enabled must be True or False, got {self.enabled!r}")
        if self.policy not in SEARCH_POLICIES:
            raise ConfigError(f"SearchConfig.policy must be one of {SEARCH_POLICIES}, got {self.policy!r}")
        if isinstance(self.neighbourhood, bool) or not isinstance(self.neighbourhood, int) or self.neighbourhood < 0:
            raise ConfigError(f"SearchConfig.neighbourhood must be an int >= 0, got {self.neighbourhood!r}")
        if self.space is not None and not isinstance(self.space, dict):
            raise ConfigError(f"SearchConfig.space must be a dict of the space's fields or None, "
                              f"got {type(self.space).__name__}")
