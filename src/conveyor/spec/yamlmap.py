"""YAML loading that remembers where each key was written, and refuses hostile documents.

Errors in a spec must name ``file:line key.path``; PyYAML's composer keeps the marks,
so we walk the node tree once and record the line of every key path.

A spec or params file may come from anywhere, so reading one is bounded: its size, how deep
it nests (libyaml's own composer recurses in C and crashes the process past ~50,000 levels)
and how far its aliases expand (a "billion laughs" document is a few hundred bytes that
expand to 9^9 nodes). Past a bound the document is refused with a :class:`YamlRefused`
naming the line, before any of it is walked; tags are only the safe ones (no ``!!python/``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from yaml.composer import Composer

from conveyor.errors import SpecIssue

Key = tuple[str | int, ...]

# Bounds on one spec or params file: far above what configuration needs (the reference project's
# spec and params: 2 KiB and under 150 values each), low enough that a document at a bound is
# refused in about half a second.
MAX_BYTES = 2 * 2**20
MAX_DEPTH = 100  # levels of nested mappings and lists
# values of the document (keys, scalars, lists, mappings) as written, and the most its aliases may
# add to it when expanded (a bomb of a few hundred bytes expands to 9^9)
MAX_NODES = 50_000
# A DVC file (dvc.yaml, a .dvc file) is a pipeline's whole record of stages, which DVC reads with no
# bound: a 5,000-stage dvc.yaml is 0.6 MB and 50,000 values. Its bounds are what still reads in
# seconds (about 0.1 s per 10,000 values), and its aliases may add MAX_NODES values, as any file's.
MAX_DVC_BYTES = 64 * 2**20
MAX_DVC_NODES = 2_000_000


class YamlRefused(yaml.MarkedYAMLError):
    """A document conveyor does not read: too big (:data:`MAX_BYTES`, :data:`MAX_NODES`, aliases
    expanded), not UTF-8, not a file, nested too deep, or with a tag that would build an object
    (``!!python/object``). ``problem`` says which; ``key`` is the key path where, if known."""

    def __init__(self, problem: str, mark: Any = None, key: str = "") -> None:  # PyYAML's Mark or libyaml's
        super().__init__(problem=problem, problem_mark=mark)
        self.key = key


class _BoundedComposer(Composer):
    """PyYAML's composer with bounds on nesting and on the number of nodes, placed before the
    parser in a loader's bases so that it, not libyaml's recursive C composer, builds the nodes.

    Each node's expanded size (itself and everything under it, aliases followed) is known
    once it is composed; an alias adds its node's size to the document's count, so the count
    is the size of the document as the code reading it sees it.
    """

    if TYPE_CHECKING:  # the parser a loader is built with gives these
        def check_event(self, *choices: type[yaml.Event]) -> bool: ...
        def peek_event(self) -> Any: ...  # PyYAML's events, or libyaml's

    max_nodes = MAX_NODES  # values written (aliases not expanded)

    def __init__(self) -> None:
        Composer.__init__(self)  # not super(): in a loader's bases, the next __init__ wants a stream
        self._keys: list[str | int] = []  # key path of the node being composed
        self._count = 0  # values, aliases expanded
        self._written = 0  # values, aliases not expanded
        self._sizes: dict[yaml.Node, int] = {}

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            return self._alias(parent, index)
        event = self.peek_event()
        if len(self._keys) >= MAX_DEPTH:
            raise YamlRefused(f"nested more than {MAX_DEPTH} levels deep: flatten it",
                              event.start_mark, self._key(index))
        self._count += 1
        self._written += 1
        if self._written > self.max_nodes:
            raise YamlRefused(f"holds more than {self.max_nodes:,} values: a file this big is data, not "
                              "configuration; keep data in files that stages read", event.start_mark,
                              self._key(index))
        self._keys.append(_segment(index))
        try:
            node = super().compose_node(parent, index)
        finally:
            self._keys.pop()
        if node is None:
            return None
        children = [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) \
            else node.value if isinstance(node, yaml.SequenceNode) else []
        self._sizes[node] = 1 + sum(self._sizes[child] for child in children)
        return node

    def _alias(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        event = self.peek_event()
        target = self.anchors.get(event.anchor)
        if target is not None:  # an undefined alias is PyYAML's error, with its own message
            size = self._sizes.get(target)
            if size is None:
                raise YamlRefused(f"alias '*{event.anchor}' lies inside the node it names: a structure that "
                                  "contains itself", event.start_mark, self._key(index))
            self._count += size
            if self._count - self._written > MAX_NODES:
                raise YamlRefused(f"aliases expand the document past {MAX_NODES:,} values (at '*{event.anchor}'"
                                  "): a YAML bomb, or anchors to write out in full", event.start_mark,
                                  self._key(index))
        return super().compose_node(parent, index)

    def _key(self, index: Any) -> str:
        """The key path of the node at ``index`` of the node being composed (elided past 8 keys)."""
        keys = [str(k) for k in [*self._keys, _segment(index)] if k != ""]
        return ".".join(keys if len(keys) <= 8 else [*keys[:6], "..."])


def _segment(index: Any) -> str | int:
    """The key a node has in its parent: its index in a list, its key in a mapping ("" for a key itself)."""
    if isinstance(index, int):
        return index
    return str(index.value) if isinstance(index, yaml.ScalarNode) else ""


def _yaml12(base: Any) -> Any:
    """``base`` with YAML 1.2 booleans (only true/false are booleans) and the bounded composer.

    YAML 1.1 also reads on/off/yes/no as booleans, which would turn a stage's ``on:``
    key into ``True``. DVC reads YAML 1.2 too, so params mean the same to both.
    """
    def __init__(self: Any, stream: str) -> None:
        base.__init__(self, stream)
        _BoundedComposer.__init__(self)

    loader: Any = type(f"Yaml12{base.__name__}", (_BoundedComposer, base), {"__init__": __init__})
    loader.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.copy().items()
    }
    loader.add_implicit_resolver(
        "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
    return loader


Yaml12Loader: Any = _yaml12(yaml.SafeLoader)
# libyaml's parser (its events; the nodes are composed in Python, bounded), several times faster;
# a document it refuses is parsed again by PyYAML's, whose messages name the offending character
_FastLoader: Any = _yaml12(getattr(yaml, "CSafeLoader", yaml.SafeLoader))
_LOADERS = {False: (_FastLoader, Yaml12Loader),  # by dvc_file
            True: tuple(type(f"Dvc{c.__name__}", (c,), {"max_nodes": MAX_DVC_NODES})
                        for c in (_FastLoader, Yaml12Loader))}


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


def load_yaml(path: Path, text: str | None = None, *, dvc_file: bool = False) -> LoadedYaml:
    """Parse ``path`` (or ``text``, what it would hold); raises ``yaml.YAMLError`` (with a mark)
    on bad syntax, and its subclass :class:`YamlRefused` for a document conveyor does not read at all.
    ``dvc_file``: a DVC file (dvc.yaml, a ``.dvc`` file), read with :data:`MAX_DVC_BYTES` and
    :data:`MAX_DVC_NODES` as its bounds."""
    fast, plain = _LOADERS[dvc_file]
    text = _read_text(path, MAX_DVC_BYTES if dvc_file else MAX_BYTES) if text is None else text
    try:
        return _load(path, text, fast)
    except YamlRefused:
        raise
    except yaml.YAMLError:
        pass
    try:
        return _load(path, text, plain)
    except yaml.reader.ReaderError as exc:  # a control character: PyYAML gives its offset, not its line
        line = text.count("\n", 0, exc.position)
        column = exc.position - (text.rfind("\n", 0, exc.position) + 1)
        character = f"#x{exc.character:04x}" if isinstance(exc.character, int) else repr(exc.character)
        raise yaml.MarkedYAMLError(problem=f"character {character} is not allowed in YAML ({exc.reason})",
                                   problem_mark=yaml.Mark(str(path), exc.position, line, column, None, 0)
                                   ) from None


def yaml_issue(path: Path, exc: yaml.YAMLError) -> SpecIssue:
    """What :func:`load_yaml` raised about ``path``, as the line a user reads: file, line, key, problem
    (a syntax error also names its column, as DVC's do: a line may hold a whole flow mapping)."""
    mark = getattr(exc, "problem_mark", None)
    line = mark.line + 1 if mark is not None else None
    problem = getattr(exc, "problem", None) or str(exc)
    if isinstance(exc, YamlRefused):
        return SpecIssue(path, line, exc.key, problem)
    if mark is not None:
        problem += f" (column {mark.column + 1})"
    if "got '{'" in problem and mark is not None and "${" in _line_of(mark):
        problem += ("; inside [...] or {...}, a value holding ${...} must be quoted: write "
                    "['models/m-${item.eta}.json'], or the list one item per line ('- models/m-${item.eta}.json')")
    return SpecIssue(path, line, "", f"not valid YAML: {problem}")


def _line_of(mark: Any) -> str:
    """The text of the line ``mark`` points at (PyYAML keeps the whole document in ``buffer``)."""
    buffer = getattr(mark, "buffer", None)
    if not isinstance(buffer, str):
        return ""
    start = buffer.rfind("\n", 0, mark.index) + 1
    end = buffer.find("\n", mark.index)
    return buffer[start:end if end >= 0 else len(buffer)]


def _read_text(path: Path, limit: int) -> str:
    """The text of ``path``: a regular file of at most ``limit`` bytes, in UTF-8."""
    if not path.is_file():  # a directory, or a device or pipe that would never end
        what = "a directory" if path.is_dir() else "not a regular file" if path.exists() else "not found"
        raise YamlRefused(f"is {what}: expected a YAML file")
    try:
        with path.open("rb") as stream:
            data = stream.read(limit + 1)
    except OSError as exc:
        raise YamlRefused(f"cannot be read: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise YamlRefused(f"is larger than {limit // 2**20} MiB: a file this big is data, not "
                          "configuration; keep data in files that stages read")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start)
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1)
        raise YamlRefused(f"is not UTF-8 text: byte 0x{data[exc.start]:02x} at column {column + 1}; "
                          "save it as UTF-8", yaml.Mark(str(path), exc.start, line, column, None, 0)) from None


def _load(path: Path, text: str, loader_class: Any) -> LoadedYaml:
    loader = loader_class(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return LoadedYaml(path=path, data=None, lines={})
        lines: dict[Key, int] = {}
        duplicates: list[tuple[Key, int]] = []
        _record_lines(node, (), lines, duplicates)
        try:
            data = loader.construct_document(node)
        except yaml.constructor.ConstructorError as exc:
            raise _refused_tag(exc, node) from None
    finally:
        loader.dispose()
    return LoadedYaml(path=path, data=data, lines=lines, duplicates=tuple(duplicates))


def _refused_tag(exc: yaml.constructor.ConstructorError, root: yaml.Node) -> yaml.YAMLError:
    """A tag the safe loader has no constructor for (``!!python/object``, ``!custom``), as a refusal
    naming its key; any other construction error as it is."""
    found = re.search(r"constructor for the tag '([^']*)'", str(exc.problem))
    if found is None:
        return exc
    tag = found.group(1).replace("tag:yaml.org,2002:", "!!")
    return YamlRefused(f"tag '{tag}' is not allowed: conveyor reads plain YAML (mappings, lists, strings, numbers), "
                       "never objects", exc.problem_mark, _key_at(root, exc.problem_mark))


def _key_at(root: yaml.Node, mark: yaml.Mark | None) -> str:
    """The key path of the node that starts at ``mark`` (the walk is bounded: aliases were counted)."""
    todo: list[tuple[yaml.Node, Key]] = [(root, ())]
    while todo:
        node, key = todo.pop()
        if node.start_mark is mark:
            return ".".join(map(str, key))
        if isinstance(node, yaml.MappingNode):
            todo += [(v, (*key, str(k.value))) for k, v in node.value]
        elif isinstance(node, yaml.SequenceNode):
            todo += [(item, (*key, i)) for i, item in enumerate(node.value)]
    return ""


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
