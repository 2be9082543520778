"""Loading a config: YAML (duplicate keys refused), --set overrides, validation errors that name the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import ValidationError

from ppoflow.config.root import PPOFlowConfig


class ConfigError(ValueError):
    """A config that cannot be used; the message names the field, the value and what is allowed."""


def _format_validation_error(err: ValidationError, origin: str) -> str:
    """One line per problem: `field = value (type): what is allowed`; checks across fields name their own."""
    lines = [f"invalid config ({origin}):"]
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        given = e.get("input")
        if not field or isinstance(given, dict):  # a check over a whole section: its message names the fields
            lines.append(f"  {field + ': ' if field else ''}{msg}")
            continue
        given_s = json.dumps(given, default=str)[:80]
        if e["type"].endswith("_type") or e["type"] == "finite_number":
            given_s += f" ({type(given).__name__})"  # `true` for an int, NaN for a float: say what was given
        lines.append(f"  {field} = {given_s}: {msg}")
    return "\n".join(lines)


def _first_duplicate_key(node: yaml.Node, where: str, seen: set[int]) -> Optional[tuple[str, str, int, int]]:
    """(mapping's dotted path, key, first line, second line) of the first key given twice in one mapping of the
    composed YAML `node`, or None. Merge keys (`<<: *base`) are not keys of their own: a key beside one
    overrides the merged value, as YAML means it. Lines are 1-based."""
    if id(node) in seen:  # an alias of a node already walked
        return None
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        children = [(f"{where}.{i}" if where else str(i), item) for i, item in enumerate(node.value)]
    elif isinstance(node, yaml.MappingNode):
        lines: dict[str, int] = {}
        children = []
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                continue
            key, line = key_node.value, key_node.start_mark.line + 1
            if key in lines:
                return where, key, lines[key], line
            lines[key] = line
            children.append((f"{where}.{key}" if where else key, value_node))
    else:
        return None
    for path, child in children:
        if found := _first_duplicate_key(child, path, seen):
            return found
    return None


def _load_yaml(text: str, origin: str, root: str = "") -> Any:
    """yaml.safe_load, but a key given twice in one mapping is a ConfigError naming the key, its section
    (dotted, under `root`) and both lines (PyYAML keeps the last value without a word, so the first one the
    reader sees would silently not count). Raises yaml.YAMLError for text that is not YAML."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None and (duplicate := _first_duplicate_key(node, root, set())):
            where, key, first, second = duplicate
            section = f"in {where!r}" if where else "at the top level"
            lines = (f" line {second}", f" (first on line {first})") if "\n" in text.strip() else ("", "")
            raise ConfigError(
                f"{origin}{lines[0]}: key {key!r} is given twice {section}{lines[1]}; "
                f"YAML would keep only the last value: remove one"
            )
        return None if node is None else loader.construct_document(node)
    finally:
        loader.dispose()


def _parse_value(text: str, origin: str = "--set value", key: str = "") -> Any:
    """`--set` values are YAML scalars: 3, 0.1, true, null, [1, 2], or plain strings."""
    try:
        return _load_yaml(text, origin, key)
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `key.sub=value` overrides to a nested dict (in place) and return it."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.field=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p!r} is not a section")
        node[parts[-1]] = _parse_value(raw, f"override {item!r}", key.strip())
    return data


def build_config(data: dict[str, Any], origin: str = "<dict>") -> PPOFlowConfig:
    try:
        return PPOFlowConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, origin)) from None


def load_config(path: Optional[str | Path] = None, overrides: Optional[list[str]] = None) -> PPOFlowConfig:
    """Load a YAML config (or defaults when path is None), apply `--set` overrides, validate.

    ConfigError for a missing file, text that is not YAML, a key given twice in one mapping (naming the key and
    both lines), or a value that does not validate (naming the field)."""
    data: dict[str, Any] = {}
    origin = "defaults"
    if path is not None:
        origin = str(path)
        try:
            data = _load_yaml(Path(path).read_text(), f"config file {path}") or {}
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping, got {type(data).__name__}")
    if overrides:
        apply_overrides(data, overrides)
        origin += " + --set"
    return build_config(data, origin)


def as_config(config: PPOFlowConfig | dict[str, Any]) -> PPOFlowConfig:
    """Flows receive the config as a model or as its JSON form (deployments, run_deployment): validate the latter.
    ConfigError with the CLI's message (one line per problem, naming the field), which becomes the run's state."""
    return config if isinstance(config, PPOFlowConfig) else build_config(config, "the flow run's config parameter")
