"""Reading a job file into the spec tree (`spec.py`): YAML loaded safely and bounded, keys
and types checked against the tree's dataclasses, `--set key.path=value` overrides; then
`spec_checks.py` checks the values and their combinations. Each mistake is one `SpecError`
naming the file, the key path, the value and what would be valid.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from baton.errors import SpecError
from baton.spec import JobSpec, _key
from baton.spec_checks import MOST_INT, check_values
from baton.spec_checks import show as _show


def load_spec(path: str | os.PathLike, overrides: list[str] = ()) -> JobSpec:
    """Load and validate a job file; `overrides` are "key.path=value" strings (YAML values)."""
    source = str(path)
    if not source.isprintable() or len(source) > 200:  # the message stays one readable line
        source = _show(source, 200)
    try:
        data = Path(path).read_bytes()
    except (OSError, ValueError) as e:  # ValueError: a NUL in the path
        raise SpecError(f"{source}: cannot read the job file "
                        f"({getattr(e, 'strerror', None) or e})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"{source}: the job file is not UTF-8 text (byte {e.start} is "
                        f"{data[e.start]:#04x})") from None
    raw = _yaml(text, f"{source}: ")
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SpecError(f"{source}: the top level must be a mapping of sections, got {_kind(raw)}")
    for item in overrides:
        _apply_override(raw, item, source)
    return spec_from_dict(raw, source)


def spec_from_dict(raw: dict, source: str = "<spec>", one_world: bool = False) -> JobSpec:
    """`one_world`: one world size of an elastic job (`JobSpec.at_dp`), which may be smaller
    than the job as written allows on its own (a sharded job shrunk to one replica)."""
    _check_tree(raw, f"{source}: ")
    spec = _build(JobSpec, raw, "", source)
    check_values(spec, source, one_world)
    return spec


def _apply_override(raw: dict, item: str, source: str) -> None:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise SpecError(f"{source}: override {item!r} must look like key.path=value")
    parts = key.strip().split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise SpecError(f"{source}: override {item!r}: {part} is not a section")
    node[parts[-1]] = _yaml(value, f"{source}: override {_show(item)}: ")


class _Loader(yaml.SafeLoader):
    """safe_load's loader, reading "1e-6" (an exponent, no dot) as the number YAML 1.2 and a
    user mean: YAML 1.1 reads it as text, which a typed key turns back into a number
    (`_coerce`) but a value under model.options would keep."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                              re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                              list("-+0123456789"))


def _yaml(text: str, where: str) -> Any:
    """YAML text as plain data (safe_load: no tags that build objects), checked by _check_tree."""
    if _flow_depth(text) > 4 * MAX_DEPTH:  # before PyYAML's recursion spends a second on it
        raise SpecError(f"{where}the YAML is nested too deeply")
    try:
        value = yaml.load(text, Loader=_Loader)  # (safe: a SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or "invalid YAML"
        raise SpecError(f"{where}not valid YAML{at}: {problem}") from None
    except RecursionError:
        raise SpecError(f"{where}the YAML is nested too deeply") from None
    _check_tree(value, where)
    return value


MAX_DEPTH = 16  # a job file is 3 levels deep; model.options may nest a little further


def _flow_depth(text: str) -> int:
    """How deep `[` and `{` nest in `text`, quotes and comments skipped (roughly: a lone `'`
    or `#` in a plain value hides the rest of it, so deep nesting may go unseen here and end
    in PyYAML's RecursionError, with the same message). PyYAML parses nesting by recursion:
    5,000 levels took 0.6 s to end in a RecursionError on a 2-core machine, and more than the
    1-s budget of validation while the machine was busy (a flaky test, found this way)."""
    depth = most = 0
    quote = None
    comment = False
    for ch in text:
        if comment:
            comment = ch != "\n"
        elif quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#":
            comment = True
        elif ch in "[{":
            depth += 1
            most = max(most, depth)
        elif ch in "]}":
            depth = max(0, depth - 1)
    return most


def _check_tree(value: Any, where: str) -> None:
    """Plain data a spec can be read from: mappings keyed by text, no deeper than MAX_DEPTH,
    no recursive aliases (`&a [*a]` loads as a list holding itself). Iterative: no recursion
    for hostile input to exhaust."""
    stack = [(value, "", 0, ())]
    while stack:
        node, path, depth, above = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        at = path or "the top level"
        if id(node) in above:
            raise SpecError(f"{where}{at}: a recursive alias (a value that contains itself)")
        if depth >= MAX_DEPTH:
            raise SpecError(f"{where}{at}: nested more than {MAX_DEPTH} levels deep")
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            if isinstance(node, dict) and not isinstance(key, str):
                raise SpecError(f"{where}{at}: the key {_show(key)} ({_kind(key)}) must be text")
            if isinstance(node, list):
                name = f"{path}[{key}]"
            else:
                name = f"{path}.{key}" if path else key
            stack.append((child, name, depth + 1, above + (id(node),)))


def _kind(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _build(cls: type, raw: Any, prefix: str, source: str) -> Any:
    where = prefix.rstrip(".") or "the top level"
    if not isinstance(raw, dict):
        raise SpecError(f"{source}: {where}: expected a mapping, got {_kind(raw)} {_show(raw)}")
    hints = _hints(cls)
    fields = {_key(f): f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))  # all text: _check_tree saw the keys first
    if unknown:
        key = unknown[0] if len(unknown[0]) <= 80 else _show(unknown[0])
        close = difflib.get_close_matches(unknown[0], fields, n=1)
        fix = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(fields)}"
        raise SpecError(f"{source}: {prefix}{key}: unknown key; {fix}")
    values = {}
    for name, f in fields.items():
        if name in raw:
            values[f.name] = _coerce(hints[f.name], raw[name], f"{prefix}{name}", source)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise SpecError(f"{source}: {prefix}{name}: required key is missing")
    return cls(**values)


_hints = functools.cache(typing.get_type_hints)  # 3/4 of the time of building a spec, uncached


def _coerce(tp: Any, value: Any, key: str, source: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key + ".", source)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _coerce(options[0], value, key, source)
        # several shapes (a name, a list, a mapping): the one whose container type matches
        def shape(option):
            if typing.get_origin(option) is list:
                return list
            return dict if dataclasses.is_dataclass(option) or option is dict else None

        mine = list if isinstance(value, list) else dict if isinstance(value, dict) else None
        for option in options:
            if shape(option) is mine:
                return _coerce(option, value, key, source)
        raise SpecError(f"{source}: {key}: unexpected {_kind(value)} {_show(value)}")
    if origin is Literal:
        if not any(value == a and type(value) is type(a) for a in args):  # 1 is not true
            choices = " | ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in args)
            raise SpecError(f"{source}: {key}: {_show(value)} is not one of {choices}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise SpecError(f"{source}: {key}: expected a list, got {_kind(value)} {_show(value)}")
        return [_coerce(args[0], v, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise SpecError(f"{source}: {key}: expected a mapping, got {_kind(value)} {_show(value)}")
        return value
    if tp is float and not isinstance(value, bool):
        number = value
        try:  # YAML 1.1 reads "3e-4" (no dot) as a string
            if isinstance(value, (int, str)):
                number = float(value)
        except OverflowError:
            raise SpecError(f"{source}: {key}: {_show(value)} is too large for a number") from None
        except ValueError:
            pass
        if isinstance(number, float):
            if not math.isfinite(number):
                raise SpecError(f"{source}: {key}: {_show(value)} is invalid; give a finite number")
            return number
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise SpecError(f"{source}: {key}: expected {_kind(tp())}, got {_kind(value)} {_show(value)}")
    if tp is int and abs(value) > MOST_INT:
        raise SpecError(f"{source}: {key}: {_show(value)} is invalid; at most {MOST_INT:,}")
    return value

