"""Typed sections from plain mappings: the one place a composed config dict becomes dataclasses.

Shared by the run config (:mod:`esopt_mp.config`) and the environments' own sections
(:mod:`esopt_mp.envs.registry`), so neither imports the other's module. Unknown keys and mistyped values raise
:class:`ConfigError` naming the dotted key.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any


class ConfigError(ValueError):
    """A configuration value is unknown, mistyped or impossible."""


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)
    if origin in (typing.Union, getattr(types, "UnionType", None)):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        kinds = [a for a in args if a is not type(None)]
        for a in kinds[:-1]:  # the first member that takes the value (``int | str``: 2 is an int, "auto" a string)
            try:
                return _coerce(value, a, key)
            except ConfigError:
                pass
        return _coerce(value, kinds[-1], key)
    if origin is list or tp is list:
        if not isinstance(value, (list, tuple)):
            hint = f" (write {key}=[{value}])" if isinstance(value, str) else ""
            raise ConfigError(f"{key}: expected a list, got {value!r}{hint}")
        args = typing.get_args(tp)
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)] if args else list(value)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        args = typing.get_args(tp)
        return {k: _coerce(v, args[1], f"{key}.{k}") for k, v in value.items()} if len(args) == 2 else dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    return value


def from_dict(cls, data: Any, prefix: str = "", _plain: bool = False):
    """Build dataclass ``cls`` from a nested dict; unknown keys raise :class:`ConfigError`. A class with a
    ``from_mapping`` classmethod (``EnvConfig``: open to environment sections) builds itself."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {data!r}")
    if not _plain and hasattr(cls, "from_mapping"):
        return cls.from_mapping(data, prefix)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in data:
        if k not in names:
            where = f"{prefix}.{k}" if prefix else k
            raise ConfigError(f"unknown config key '{where}'{did_you_mean(str(k), names, prefix)}; "
                              f"known keys here: {sorted(names)}")
    kwargs = {k: _coerce(v, hints[k], f"{prefix}.{k}" if prefix else k) for k, v in data.items()}
    return cls(**kwargs)


def flatten(d: dict, prefix: str = "") -> dict:
    """A nested mapping as dotted keys (``{"es": {"population": 8}}`` -> ``{"es.population": 8}``)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        out.update(flatten(v, key) if isinstance(v, dict) else {key: v})
    return out


def did_you_mean(word: str, choices, prefix: str = "") -> str:
    """``" (did you mean 'es.population'?)"`` for the closest of ``choices`` to a misspelt ``word``, else ``""``."""
    close = difflib.get_close_matches(word, [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean '{prefix + '.' if prefix else ''}{close[0]}'?)" if close else ""


def check(cond: bool, key: str, msg: str) -> None:
    """Raise :class:`ConfigError` ``"<key>: <msg>"`` unless ``cond``: the one shape of a refused setting."""
    if not cond:
        raise ConfigError(f"{key}: {msg}")


def check_choice(value: Any, choices: tuple, key: str) -> None:
    """``value`` must be one of ``choices``; the same line whether a config or a component's caller passed it."""
    check(value in choices, key, f"must be one of {choices}, got {value!r}")
