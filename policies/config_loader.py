"""A strict mapping → dataclass loader for every typed config of the project.

Every config is a frozen ``kw_only`` dataclass validated in ``__post_init__``; a bad value
raises :class:`ConfigError` naming the field and what is allowed. :func:`from_mapping` builds
one from parsed TOML/YAML/JSON, rejecting unknown keys (a typo must not silently fall back to
a default).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, Union

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range; the message names the field."""


def require(condition: bool, field: str, allowed: str, value: object) -> None:
    if not condition:
        raise ConfigError(f"{field}: must be {allowed}, got {value!r}")


def require_finite(config: Any) -> None:
    """Every float field of the dataclass ``config`` (and every float in a tuple field) is
    finite: ``inf`` passes ``> 0`` checks and then silently disables what it configures."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        values = value if isinstance(value, tuple) else (value,)
        for v in values:
            if isinstance(v, float):
                require(math.isfinite(v), f.name, "a finite number (not inf or nan)", value)


def from_mapping(cls: type[T], data: Mapping[str, Any], *, field: str = "") -> T:
    """Build the dataclass ``cls`` from ``data``: nested dataclasses recursively, unknown keys
    refused, simple types checked; errors name the dotted field."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{field or cls.__name__}: must be a table/mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{field or cls.__name__}: unknown key(s) {unknown}; allowed: {sorted(fields)}")
    kwargs = {name: _convert(hints[name], value, _join(field, name)) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field is missing
        raise ConfigError(f"{field or cls.__name__}: {exc}") from None
    except ConfigError as exc:
        raise ConfigError(f"{field}.{exc}" if field else str(exc)) from None
    except ValueError as exc:  # a component's own validation
        raise ConfigError(f"{field}: {exc}" if field else str(exc)) from None


def to_mapping(config: Any) -> dict[str, Any]:
    """The plain-data form of a config dataclass (for JSON, logs and Ray)."""
    return dataclasses.asdict(config)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _convert(hint: Any, value: Any, field: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, field)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{field}: {value!r} fits none of {options}")
    if origin is Literal:
        allowed = typing.get_args(hint)
        require(value in allowed, field, f"one of {list(allowed)}", value)
        return value
    if origin in (tuple, list):
        require(isinstance(value, (list, tuple)), field, "a list", value)
        args = typing.get_args(hint)
        item = args[0] if args else Any
        return tuple(_convert(item, v, f"{field}[{i}]") for i, v in enumerate(value))
    if origin in (dict, Mapping) or hint in (dict, Mapping):
        require(isinstance(value, Mapping), field, "a table/mapping", value)
        return dict(value)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return from_mapping(hint, value, field=field)
    if hint is bool:
        require(isinstance(value, bool), field, "true or false", value)
        return value
    if hint is int:
        require(isinstance(value, int) and not isinstance(value, bool), field, "an integer", value)
        return value
    if hint is float:
        require(isinstance(value, (int, float)) and not isinstance(value, bool), field, "a number", value)
        require(math.isfinite(value), field, "a finite number (not inf or nan)", value)
        return float(value)
    if hint is str:
        require(isinstance(value, str), field, "a string", value)
        return value
    return value
