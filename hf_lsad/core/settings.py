"""Dotted settings of dataclass configs: applied to a config, and generated as command-line flags.

A *setting* is a dotted field name and a value (``kmeans.n_clusters=25``). The evaluation
grid sweeps settings and ``hf-lsad fit`` reads them from flags that are generated from the
config's fields (their type, ``Literal`` choices, default and docstring), plus
``--set key=value`` for anything, so a CLI fit and an API fit with the same settings build
the same config.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import re
import textwrap
import types
import typing
from collections.abc import Iterator, Mapping
from itertools import pairwise
from typing import Any, Literal, TypeVar

from .serialization import config_from_dict, config_to_dict

C = TypeVar("C")


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """Set ``data[a][b] = value`` for ``key = "a.b"``; the field must exist."""
    parts = key.split(".")
    target = data
    for part in parts[:-1]:
        if not isinstance(target.get(part), dict):
            raise ValueError(f"config has no nested field {part!r} (in {key!r})")
        target = target[part]
    if parts[-1] not in target:
        raise ValueError(f"config has no field {parts[-1]!r} (in {key!r}); fields: {sorted(target)}")
    if isinstance(target[parts[-1]], tuple) and isinstance(value, list):
        value = tuple(value)  # JSON has no tuples
    target[parts[-1]] = value


def set_seeds(data: dict[str, Any], seed: int) -> bool:
    """Set every ``seed`` field (nested included); whether there was one."""
    found = False
    for key, value in data.items():
        if key == "seed":
            data[key], found = seed, True
        elif isinstance(value, dict):
            found = set_seeds(value, seed) or found
    return found


def build_config(cls: type[C], settings: Mapping[str, Any], *, seed: int | None = None, source: str = "") -> C:
    """``cls()`` with the dotted ``settings`` applied, and every ``seed`` field set to ``seed`` if given."""
    data = config_to_dict(cls())  # asdict keeps tuples, so list values from JSON are converted back
    for key, value in settings.items():
        set_dotted(data, key, value)
    if seed is not None:
        set_seeds(data, seed)
    return config_from_dict(cls, data, source=source or f"{cls.__name__} settings {dict(settings)}")


def has_seed(cls: type) -> bool:
    """Whether the config ``cls`` has a ``seed`` field, nested ones included."""
    return set_seeds(config_to_dict(cls()), 0)


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of dataclass ``cls`` (and its bases), by field name."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        definition = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0]
        assert isinstance(definition, ast.ClassDef)  # getsource of a class starts at its class statement
        body = definition.body
        for node, after in pairwise(body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def config_fields(cls: type, prefix: str = "") -> Iterator[tuple[str, Any, Any, str]]:
    """``(dotted name, type, default, doc)`` of every leaf field of dataclass ``cls`` (nested ones flattened)."""
    hints, docs, defaults = typing.get_type_hints(cls), field_docs(cls), config_to_dict(cls())
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        hint = hints[field.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            nested_default = getattr(cls(), field.name)
            for name, kind, _default, doc in config_fields(hint, f"{prefix}{field.name}."):
                yield (
                    name,
                    kind,
                    _dotted_get(config_to_dict(nested_default), name[len(prefix) + len(field.name) + 1 :]),
                    doc,
                )
        else:
            yield f"{prefix}{field.name}", hint, defaults[field.name], docs.get(field.name, "")


def _dotted_get(data: Mapping[str, Any], key: str) -> Any:
    for part in key.split("."):
        data = data[part]
    return data


def _optional(hint: Any) -> tuple[Any, bool]:
    """``(T, True)`` for ``T | None``, else ``(hint, False)``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return hint, False


def _scalar(kind: Any, optional: bool) -> Any:
    def parse(text: str) -> Any:
        if optional and text.lower() == "none":
            return None
        return kind(text)

    parse.__name__ = getattr(kind, "__name__", "value")
    return parse


def plain_text(doc: str) -> str:
    """A docstring's text as a terminal shows it: ``literal`` and :role:`name` markup reduced to the name."""
    return re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", doc).replace("``", "")


def add_config_arguments(parser: argparse.ArgumentParser, cls: type, *, title: str, group: str = "setting") -> None:
    """Add one ``--dotted.name`` flag (underscores as dashes) per leaf field of ``cls``
    (destination ``<group>:<name>``).

    Flags default to "not given", so only the flags passed override the config's own defaults.
    ``group`` keeps the flags of two configs of one command apart (:func:`settings_from_args`).
    """
    arguments = parser.add_argument_group(title)
    for name, hint, default, doc in config_fields(cls):
        kind, optional = _optional(hint)
        kwargs: dict[str, Any] = {"dest": f"{group}:{name}", "default": argparse.SUPPRESS}
        origin = typing.get_origin(kind)
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif origin is Literal:
            kwargs["choices"] = list(typing.get_args(kind))
        elif origin in (list, tuple):
            element = typing.get_args(kind)[0]
            kwargs.update(nargs="+", type=element if element in (int, float, str) else str)
        else:
            kwargs["type"] = _scalar(kind if kind in (int, float, str) else str, optional)
        if "choices" not in kwargs and kind is not bool:
            kwargs["metavar"] = name.rsplit(".", 1)[-1].upper()
        first_sentence = plain_text(doc.split(". ")[0].rstrip("."))
        kwargs["help"] = f"{first_sentence} (default: {default})".replace("%", "%%")
        arguments.add_argument(f"--{name.replace('_', '-')}", **kwargs)


def settings_from_args(
    args: argparse.Namespace, pairs: list[str] | None = None, *, group: str = "setting"
) -> dict[str, Any]:
    """The settings given by the generated flags of ``group``, then by ``--set key=value`` pairs (values parsed as
    JSON if they are)."""
    settings = {key.split(":", 1)[1]: value for key, value in vars(args).items() if key.startswith(f"{group}:")}
    for pair in pairs or []:
        key, sep, text = pair.partition("=")
        if not sep:
            raise ValueError(f"--set takes key=value, got {pair!r}")
        try:
            settings[key.strip()] = json.loads(text)
        except json.JSONDecodeError:
            settings[key.strip()] = text
    return settings
