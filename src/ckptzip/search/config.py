"""``SearchConfig``: the config search's knobs, nested as ``search`` in every quantizing method's config.

    get_method("dynaquant", {"search": {"policy": "free", "space": {"bins": [8, 16]}}})

``space`` narrows the method's search space (search/spaces.py: a dict of that space's fields, each
a list of the values its knob may take, or the name of one of the space's presets, e.g. dynaquant's
``"wide"``); None is the paper's table for the method.
``residual_space``: the space of saves that quantize residuals against the parent's reconstruction
(``residual`` in the method's config); None is the space class's ``for_residuals()``.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..configcheck import OneOf, Range, check_fields
from ..errors import ConfigError

SEARCH_POLICIES = ("monotone", "free")
KEYFRAME_SEARCHES = ("history", "fresh")


@dataclass(frozen=True)
class SearchConfig:
    enabled: bool = True             # search when the caller gives eval_fn (and model); False: fixed config
    policy: str = "monotone"         # "monotone": never more aggressive than the previous best; "free"
    neighbourhood: int = 1           # e: axis steps from the previous best in the steady state
    space: dict | str | None = None  # fields of the method's space class, or a preset name; None: the paper's table
    residual_space: dict | None = None  # the same for residual saves (methods/quantizing.py); None:
                                        # the space class's ``for_residuals()``
    residual_policy: str = "free"    # the policy of residual saves: what a residual costs is the drift
                                     # of one interval, which does not grow as training goes on
    keyframe_search: str = "fresh"   # a keyframe after residual saves (once restored): "history" searches
                                     # the neighbourhood of the weights' best of the previous keyframe;
                                     # "fresh" searches exhaustively, that best being a keyframe interval
                                     # old (digits demo: 16 -> 4 bins, 30.5x -> 31.3x; docs/BENCHMARKS.md)

    def __post_init__(self):
        if isinstance(self.space, str):
            from .spaces import preset_names  # spaces imports the quantizers: late, to keep this module light

            if self.space not in preset_names():
                raise ConfigError(f"SearchConfig.space must be a dict of the space's fields or a preset name "
                                  f"({', '.join(sorted(preset_names()))}), got {self.space!r}")
        check_fields(self, policy=OneOf(SEARCH_POLICIES), residual_policy=OneOf(SEARCH_POLICIES),
                     keyframe_search=OneOf(KEYFRAME_SEARCHES),
                     neighbourhood=Range(ge=0))
