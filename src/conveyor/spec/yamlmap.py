"""YAML loading that remembers where each key was written.

Errors in a spec must name ``file:line key.path``; PyYAML's composer keeps the marks,
so we walk the node tree once and record the line of every key path.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

Key = tuple[str | int, ...]


def _yaml12(base: Any) -> Any:
    """``base`` with YAML 1.2 booleans: only true/false are booleans.

    YAML 1.1 also reads on/off/yes/no as booleans, which would turn a stage's ``on:``
    key into ``True``. DVC reads YAML 1.2 too, so params mean the same to both.
    """
    loader: Any = type(f"Yaml12{base.__name__}", (base,), {})
    loader.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.copy().items()
    }
    loader.add_implicit_resolver(
        "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
    return loader


Yaml12Loader: Any = _yaml12(yaml.SafeLoader)
# libyaml's parser, several times faster; a document it refuses is parsed again by
# PyYAML's, whose messages name the offending character
_FastLoader: Any = _yaml12(getattr(yaml, "CSafeLoader", yaml.SafeLoader))


@dataclass(frozen=True)
class LoadedYaml:
    """A YAML document as plain data, with the 1-based line of each key path."""

    path: Path
    data: Any
    lines: Mapping[Key, int] = field(default_factory=dict)
    duplicates: tuple[tuple[Key, int], ...] = ()  # keys written twice in one mapping, with line

    def line(self, key: Key) -> int | None:
        """The line of ``key``, or of its closest ancestor that has one."""
        for n in range(len(key), -1, -1):
            if key[:n] in self.lines:
                return self.lines[key[:n]]
        return None


def load_yaml(path: Path) -> LoadedYaml:
    """Parse ``path``; raises ``yaml.YAMLError`` (with a mark) on bad syntax."""
    text = path.read_text(encoding="utf-8")
    try:
        return _load(path, text, _FastLoader)
    except yaml.YAMLError:
        return _load(path, text, Yaml12Loader)


def _load(path: Path, text: str, loader_class: Any) -> LoadedYaml:
    loader = loader_class(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return LoadedYaml(path=path, data=None, lines={})
        lines: dict[Key, int] = {}
        duplicates: list[tuple[Key, int]] = []
        _record_lines(node, (), lines, duplicates)
        data = loader.construct_document(node)
    finally:
        loader.dispose()
    return LoadedYaml(path=path, data=data, lines=lines, duplicates=tuple(duplicates))


def _record_lines(node: yaml.Node, key: Key, lines: dict[Key, int],
                  duplicates: list[tuple[Key, int]]) -> None:
    lines.setdefault(key, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for k_node, v_node in node.value:
            child = (*key, str(k_node.value))
            if child[-1] in seen:
                duplicates.append((child, k_node.start_mark.line + 1))
            seen.add(str(child[-1]))
            lines.setdefault(child, k_node.start_mark.line + 1)
            _record_lines(v_node, child, lines, duplicates)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _record_lines(item, (*key, i), lines, duplicates)
