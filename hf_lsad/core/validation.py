"""Type and range checks for configs read from JSON, as strict as transformers is with a config.

:func:`hf_lsad.core.serialization.config_from_dict` calls :func:`check_fields` on every
dataclass it builds from a file, so a bad value fails when the file is loaded, with a
message that names the file, the key, the value and what was expected, never later at
the first scoring call:

- every field's value must have its annotated type: ``int`` (not ``bool``, not ``"2"``),
  ``float`` (an ``int`` is accepted; ``NaN`` and ``inf``, which Python's ``json`` reads,
  are not), ``str``, ``bool``, ``list[...]``/``tuple[...]`` of those, ``X | None``;
- numeric fields declare their bounds on the field (:func:`ranged`, a :class:`Range`); a config's
  ``__post_init__`` checks them (:func:`check_ranges`) with its enums and cross-field rules, so a
  value out of range fails however the config is built.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, Union

from ..errors import GuardFormatError

_NONE = type(None)


@dataclass(frozen=True)
class Range:
    """The values a numeric config field may take; declared on the field (:func:`ranged`), the one home of the rule.

    Checked when a config is built (its ``__post_init__`` calls :func:`check_ranges`), so a config read
    from JSON (:func:`hf_lsad.core.serialization.config_from_dict`) and one built from command-line
    flags (:mod:`hf_lsad.core.settings`) obey the same bounds.
    """

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    expected: str = ""
    """How an error message says what was expected ("a positive integer")."""

    def holds(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)


POSITIVE = Range(low=1, expected="a positive integer")
NON_NEGATIVE = Range(low=0, expected="a number >= 0")
POSITIVE_NUMBER = Range(low=0, low_open=True, expected="a number > 0")
OPEN_UNIT = Range(low=0, high=1, low_open=True, high_open=True, expected="a number in (0, 1)")
HALF_OPEN_UNIT = Range(low=0, high=1, low_open=True, expected="a number in (0, 1]")
CLOSED_UNIT = Range(low=0, high=1, expected="a number in [0, 1]")
CONFIDENCE = Range(low=0.5, high=1, high_open=True, expected="a number in [0.5, 1)")
_RANGE = "hf_lsad.range"


def ranged(bounds: Range, default: Any = dataclasses.MISSING) -> Any:
    """A dataclass field (with ``default``, if given) whose value must satisfy ``bounds`` (``None`` is allowed)."""
    return dataclasses.field(default=default, metadata={_RANGE: bounds})


def field_range(cls: type, name: str) -> Range | None:
    """The :class:`Range` declared on field ``name`` of dataclass ``cls``, if any."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f.metadata.get(_RANGE)
    return None


def check_ranges(config: Any) -> None:
    """Raise ``ValueError`` naming the first field of ``config`` outside its declared :class:`Range`."""
    for f in dataclasses.fields(config):
        bounds = f.metadata.get(_RANGE)
        value = getattr(config, f.name)
        if bounds is not None and value is not None and not bounds.holds(value):
            raise ValueError(f"key {f.name!r} is {value!r}, expected {bounds.expected}")


def describe(hint: Any) -> str:
    """A type hint as a user reads it: ``int``, ``list[float]``, ``int | None``."""
    if isinstance(hint, type) and not typing.get_args(hint):
        return {"int": "an integer", "float": "a finite number", "str": "a string", "bool": "true or false"}.get(
            hint.__name__, hint.__name__
        )
    return str(hint).replace("typing.", "")


def _check(hint: Any, value: Any, key: str, source: str) -> Any:
    """``value`` converted to ``hint`` (ints to floats, lists to tuples), or :class:`GuardFormatError`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)

    def fail(expected: str | None = None) -> GuardFormatError:
        return GuardFormatError(
            f"{source}: key {key!r} is {value!r} ({type(value).__name__}), expected {expected or describe(hint)}"
        )

    if hint is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None:
            if _NONE in args:
                return None
            raise fail()
        options = [a for a in args if a is not _NONE]
        for option in options:
            try:
                return _check(option, value, key, source)
            except GuardFormatError:
                continue
        raise fail()
    if hint is bool:
        if not isinstance(value, bool):
            raise fail()
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail()
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise fail()
        if not math.isfinite(value):
            raise fail("a finite number (NaN and infinity are not allowed)")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise fail()
        return value
    if origin in (list, collections.abc.Sequence):
        if not isinstance(value, list):
            raise fail()
        (item,) = args or (Any,)
        return [_check(item, v, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise fail()
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_check(args[0], v, f"{key}[{i}]", source) for i, v in enumerate(value))
        if len(args) != len(value):
            raise fail(f"{len(args)} values")
        return tuple(_check(a, v, f"{key}[{i}]", source) for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict:
        if not isinstance(value, dict):
            raise fail()
        key_hint, value_hint = args or (Any, Any)
        return {_check(key_hint, k, key, source): _check(value_hint, v, f"{key}.{k}", source) for k, v in value.items()}
    return value  # a type this module does not know: the dataclass's own checks apply


def check_fields(cls: type, values: dict[str, Any], *, source: str) -> dict[str, Any]:
    """``values`` (JSON fields of dataclass ``cls``, nested dataclasses already built) checked and converted.

    Raises :class:`GuardFormatError` naming ``source``, the key, the value and the expected
    type or range.
    """
    hints = typing.get_type_hints(cls)
    checked = {}
    for key, value in values.items():
        hint = hints.get(key, Any)
        checked[key] = value if hasattr(value, "__dataclass_fields__") else _check(hint, value, key, source)
        bounds = field_range(cls, key)
        if bounds is not None and checked[key] is not None and not bounds.holds(checked[key]):
            raise GuardFormatError(f"{source}: key {key!r} is {checked[key]!r}, expected {bounds.expected}")
    return checked


def require_object(value: Any, *, source: str, what: str = "a JSON object") -> dict[str, Any]:
    """``value`` if it is a dict, else :class:`GuardFormatError` naming what it is."""
    if not isinstance(value, dict):
        raise GuardFormatError(f"{source}: expected {what}, got {type(value).__name__} {_short(value)}")
    return value


def require_keys(data: dict[str, Any], required: set[str], optional: set[str], *, source: str) -> None:
    """Exactly ``required`` keys plus any of ``optional``; names the missing and unknown ones."""
    missing = sorted(required - set(data))
    unknown = sorted(set(data) - required - optional)
    if missing:
        raise GuardFormatError(f"{source}: missing key(s) {missing}")
    if unknown:
        raise GuardFormatError(f"{source}: unknown key(s) {unknown}; allowed: {sorted(required | optional)}")


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


GUARD_VERSION_KEYS = {"hf_lsad", "torch", "faiss"}


def check_format_version(version: Any, expected: int, *, source: str = "") -> None:
    """A saved folder's ``format_version`` must be ``expected``, the one this hf-lsad writes; a later one was written
    by a newer hf-lsad, which the error says. ``source`` (the file) begins the message when given."""
    if isinstance(version, bool) or version != expected:
        newer = isinstance(version, int) and not isinstance(version, bool) and version > expected
        why = ": written by a newer hf-lsad, which reads it (pip install -U hf-lsad)" if newer else ""
        where = f"{source}: " if source else ""
        raise GuardFormatError(f"{where}format_version {version!r}, expected {expected}{why}")


def check_guard_header(raw: dict[str, Any], *, source: str, format_version: int) -> None:
    """The top level of a guard's ``config.json``: exactly its keys, each of its type.

    The nested ``guard``, ``detector`` and ``calibration`` objects are checked when they
    are built (:func:`check_fields`), the ``integrity`` block by
    :func:`hf_lsad.core.integrity.verify_integrity`.
    """
    require_object(raw, source=source)
    check_format_version(raw.get("format_version"), format_version, source=source)
    # A missing "integrity" block gets its own message (verify_integrity): how to upgrade an older guard.
    require_keys(
        raw,
        {"format_version", "versions", "guard", "detector", "d_sae"},
        {"calibration", "integrity", "running", "inputs", "heads", "budget", "fingerprint"},
        source=source,
    )
    versions = require_object(raw["versions"], source=f"{source}:versions")
    require_keys(versions, GUARD_VERSION_KEYS, set(), source=f"{source}:versions")
    for key, value in versions.items():
        _check(str, value, key, f"{source}:versions")
    require_object(raw["guard"], source=f"{source}:guard")
    require_object(raw["detector"], source=f"{source}:detector")
    if raw["d_sae"] is not None:
        _check(int, raw["d_sae"], "d_sae", source)
        if raw["d_sae"] < 1:
            raise GuardFormatError(f"{source}: key 'd_sae' is {raw['d_sae']!r}, expected a positive integer or null")
    if "calibration" in raw:
        require_object(raw["calibration"], source=f"{source}:calibration")
    if ("heads" in raw) != ("budget" in raw):
        raise GuardFormatError(f"{source}: supervised 'heads' and their 'budget' come together; found one of them")
    if "heads" in raw:
        if not isinstance(raw["heads"], list) or not raw["heads"]:
            raise GuardFormatError(f"{source}: key 'heads' must be a non-empty list of head configs")
        for i, head in enumerate(raw["heads"]):
            require_object(head, source=f"{source}:heads[{i}]")
        require_object(raw["budget"], source=f"{source}:budget")
