"""Config checks: every config dataclass refuses a bad field at construction, in one line.

A config calls, first thing in its ``__post_init__``::

    check_fields(self, zstd_level=Range(ge=1, le=22), payload_codec=OneOf(PAYLOAD_CODECS))

which checks every field's type against its annotation and the named fields against their rule;
a failure is one ``ConfigError`` naming ``Class.field``, what is valid and the value given:
``LosslessConfig.zstd_level must be an int in [1, 22], got 99``. Checks between fields follow
the call, on values whose types are known by then.

Types come from the annotations: ``int`` (a bool is not one), ``float`` (an int is one), ``bool``,
``str``, ``dict``, ``tuple[X, ...]`` (a list is accepted and kept as a tuple), a nested config
class, ``X | None`` (None skips the rule); a field annotated ``object`` is left to its class.
A method (methods/base.py) runs :func:`check_tree` on the config it is given, and names the field
(:func:`check_value`) where building a config from a dict raised a TypeError, so a config class
that does not call ``check_fields`` itself still refuses a wrong type there, by field name.
Function arguments: :func:`check_arg` (one) and :func:`check_args` (a spec of several), e.g.
``Compressor threshold must be a number in [0, 1), got 2``.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import functools
import types
import typing
from dataclasses import dataclass

from .errors import ConfigError

_NAMES = {int: "an int", float: "a number", bool: "True or False", str: "a string", dict: "a dict",
          type(None): "None"}


@dataclass(frozen=True)
class Range:
    """Bounds on a number: ``Range(ge=1, le=22)`` is [1, 22], ``Range(gt=0)`` is > 0 (NaN is in none)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    note: str = ""  # appended to the message, e.g. " (paper: 5e-5)"

    def fits(self, v) -> bool:
        return ((self.ge is None or v >= self.ge) and (self.gt is None or v > self.gt)
                and (self.le is None or v <= self.le) and (self.lt is None or v < self.lt))

    def text(self, kind: str) -> str:
        lo = f"[{self.ge}" if self.ge is not None else f"({self.gt}" if self.gt is not None else ""
        hi = f"{self.le}]" if self.le is not None else f"{self.lt})" if self.lt is not None else ""
        if lo and hi:
            return f"{kind} in {lo}, {hi}"
        if lo:
            return f"{kind} {'>=' if self.ge is not None else '>'} {lo[1:]}"
        return f"{kind} {'<=' if self.le is not None else '<'} {hi[:-1]}"


@dataclass(frozen=True)
class OneOf:
    """The value is one of ``choices``."""

    choices: tuple
    note: str = ""

    def fits(self, v) -> bool:
        return v in tuple(self.choices)

    def text(self, kind: str) -> str:
        return f"one of {tuple(self.choices)}"


@functools.cache
def field_types(cls: type) -> dict[str, object]:
    """Field name -> resolved annotation, for a dataclass."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _union_parts(tp) -> tuple:
    return typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)


def describe(tp) -> str:
    """What a value of annotation ``tp`` is, for a message: ``int | None`` -> 'an int or None'."""
    if len(_union_parts(tp)) > 1:
        return " or ".join(describe(a) for a in _union_parts(tp))
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        return f"a tuple (each {describe(args[0])})" if args else "a tuple"
    if tp in _NAMES:
        return _NAMES[tp]
    if collections.abc.Callable in (tp, typing.get_origin(tp)):
        return "a callable"
    return f"a {getattr(tp, '__name__', tp)}"


def _conform(tp, v) -> tuple[bool, object]:
    """(whether ``v`` is a ``tp``, ``v`` as the field keeps it)."""
    if len(_union_parts(tp)) > 1:
        for arg in _union_parts(tp):
            ok, w = _conform(arg, v)
            if ok:
                return True, w
        return False, v
    origin = typing.get_origin(tp)
    if tp is object or tp is typing.Any:
        return True, v
    if tp is int:
        return isinstance(v, int) and not isinstance(v, bool), v
    if tp is float:
        return isinstance(v, int | float) and not isinstance(v, bool), v
    if tp is type(None):
        return v is None, v
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(v, tuple | list):
            return False, v
        if len(args) == 2 and args[1] is Ellipsis and not all(_conform(args[0], x)[0] for x in v):
            return False, v
        return True, tuple(v)
    if isinstance(origin, type):  # dict[str, int] and the like: the container's type only
        return isinstance(v, origin), v
    if isinstance(tp, type):
        return isinstance(v, tp), v
    return True, v  # an annotation form not listed above is left to the class


def check_value(cls: type, name: str, value, rule: Range | OneOf | None = None):
    """``value`` as field ``name`` of ``cls`` keeps it (a list becomes a tuple); ConfigError naming
    ``Class.field`` if its type is not the field's or it breaks ``rule``."""
    return check_arg(f"{cls.__name__}.{name}", value, field_types(cls)[name], rule)


def check_arg(what: str, value, tp, rule: Range | OneOf | None = None):
    """``value`` checked against the annotation ``tp`` and ``rule`` (None passes the rule); returns
    it as kept (a list for a tuple becomes a tuple); ConfigError naming ``what`` otherwise."""
    ok, kept = _conform(tp, value)
    if ok and (rule is None or kept is None or rule.fits(kept)):
        return kept
    parts = _union_parts(tp)
    want = describe(tp)
    if rule is not None:
        want = rule.text(describe(next(a for a in parts if a is not type(None))))
        want += (" or None" if type(None) in parts else "") + rule.note
    got = f"{value!r}" if ok else f"{value!r} ({type(value).__name__})"
    hint = f"; build a {tp.__name__}(...) or pass the dict through get_method" \
        if isinstance(value, dict) and dataclasses.is_dataclass(tp) else ""
    raise ConfigError(f"{what} must be {want}, got {got}{hint}")


def check_args(who: str, spec: dict, **values) -> None:
    """Each keyword argument against ``spec[name] = (annotation, rule or None)``; a failure names
    ``who`` and the argument: ``Compressor threshold must be a number in [0, 1), got 2``."""
    for name, value in values.items():
        tp, rule = spec[name]
        check_arg(f"{who} {name}", value, tp, rule)


def check_fields(config, **rules: Range | OneOf) -> None:
    """Every field of ``config`` against its annotation, and the fields named in ``rules`` against
    their rule (call first in ``__post_init__``)."""
    cls = type(config)
    for name in field_types(cls):
        v = getattr(config, name)
        kept = check_value(cls, name, v, rules.pop(name, None))
        if kept is not v:
            object.__setattr__(config, name, kept)  # frozen: the one normalisation, list -> tuple
    if rules:
        raise TypeError(f"check_fields: {cls.__name__} has no field(s) {sorted(rules)}")


def check_tree(config) -> None:
    """The types of every field of ``config`` and of every config nested in it."""
    check_fields(config)
    for name in field_types(type(config)):
        v = getattr(config, name)
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            check_tree(v)
