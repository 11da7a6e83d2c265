"""Read a YAML file safely while remembering where every key and value came from.

The YAML is composed into nodes with a safe loader (C-accelerated when available) and turned into
plain Python data by hand, so each value's line and column can be looked up by its path in the
document, duplicate keys are caught, and no tag can construct arbitrary objects.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pyplan.errors import PlanError
from pyplan.files import read_capped

__all__ = ["Source", "error_at", "load_yaml", "parse_yaml"]

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_PLAIN_TAGS = {f"tag:yaml.org,2002:{t}" for t in
               ("str", "int", "float", "bool", "null", "map", "seq", "merge", "timestamp")}
DocPath = tuple  # keys (str) and list indices (int) from the document root

_MERGE = "tag:yaml.org,2002:merge"
MAX_FILE_BYTES = 8 * 2**20  # larger plan or resolved files are refused before parsing
MAX_NODES = 1_000_000       # values a document may expand to, aliases included
MAX_DEPTH = 64              # nesting levels


@dataclass(frozen=True)
class Source:
    """A loaded YAML document: its data plus a (line, column) for every path in it."""

    path: str
    sha256: str
    data: Any
    marks: dict = field(repr=False)
    key_marks: dict = field(repr=False)
    quoted: frozenset = field(repr=False, default=frozenset())

    def locate(self, path: DocPath, *, key: bool = False) -> tuple[int, int]:
        """1-based (line, column) of a value, or of its key with key=True; falls back to parents."""
        path = tuple(path)
        if key and path in self.key_marks:
            return self.key_marks[path]
        while path not in self.marks and path:
            path = path[:-1]
        return self.marks.get(path, (1, 1))

    def error(self, path: DocPath, message: str, hint: str | None = None, *,
              key: bool = False, offset: int = 0) -> PlanError:
        """A PlanError pointing at `path`; `offset` moves the column inside a scalar string."""
        line, column = self.locate(path, key=key)
        if offset:
            column += offset + (1 if tuple(path) in self.quoted else 0)
        return PlanError(message, hint=hint, file=self.path, line=line, column=column)


class _Builder:
    """Turns a composed node tree into plain data, recording marks and rejecting duplicates."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.constructor = yaml.SafeLoader("")
        self.marks: dict = {}
        self.key_marks: dict = {}
        self.quoted: set = set()
        self.nodes = 0
        self.open: set[int] = set()  # nodes being built (an alias to one of them is a cycle)

    def fail(self, node: yaml.Node, message: str, hint: str | None = None) -> PlanError:
        mark = node.start_mark
        return PlanError(message, hint=hint, file=self.name, line=mark.line + 1,
                         column=mark.column + 1)

    def build(self, node: yaml.Node, path: DocPath) -> Any:
        # Aliases make the node graph a DAG (or a cycle): bound what it expands to, so a
        # "billion laughs" file or a self-referencing alias is an error, not a hang.
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise self.fail(node, f"the document expands to more than {MAX_NODES:,} values",
                            "aliases (*name) repeat what they point at; plans are small")
        if len(path) > MAX_DEPTH:
            raise self.fail(node, f"nested more than {MAX_DEPTH} levels deep")
        if id(node) in self.open:
            raise self.fail(node, "an alias refers to a node that contains it",
                            "a plan cannot contain itself")
        self.marks[path] = (node.start_mark.line + 1, node.start_mark.column + 1)
        if node.tag not in _PLAIN_TAGS:
            raise self.fail(node, f"YAML tag '{node.tag}' is not allowed in a plan",
                            "plans hold plain data: remove the tag")
        self.open.add(id(node))
        try:
            return self._build(node, path)
        finally:
            self.open.discard(id(node))

    def construct(self, node: yaml.Node) -> Any:
        """A scalar's value; a value its tag cannot hold (`!!int x`) is an error here."""
        try:
            return self.constructor.construct_object(node, deep=True)
        except Exception as exc:  # PyYAML's constructors fail in many ways on odd input
            problem = getattr(exc, "problem", None) if isinstance(exc, yaml.YAMLError) \
                else str(exc) if isinstance(exc, (ValueError, OverflowError)) else None
            if problem and "digits" in problem:  # Python's limit on int() of long strings
                problem = "the number has too many digits"
            kind = node.tag.rsplit(":", 1)[-1]
            raise self.fail(node, f"cannot read this value as {kind}"
                            + (f": {problem.strip()}" if problem else ""),
                            "write a plain number, string or true/false") from None

    def _build(self, node: yaml.Node, path: DocPath) -> Any:
        if isinstance(node, yaml.MappingNode):
            result: dict = {}
            merged: dict = {}  # `<<` merge keys, built here so their expansion is counted too
            for key_node, value_node in node.value:
                if key_node.tag == _MERGE:
                    sources = value_node.value if isinstance(value_node, yaml.SequenceNode) \
                        else [value_node]
                    for source in sources:
                        if not isinstance(source, yaml.MappingNode):
                            raise self.fail(source, "<< merges a mapping (or a list of them)")
                        for key, value in self.build(source, path).items():
                            merged.setdefault(key, value)  # earlier mappings win
                    continue
                if not isinstance(key_node, yaml.ScalarNode):
                    raise self.fail(key_node, "mapping keys must be plain scalars")
                key = self.construct(key_node)
                if not isinstance(key, (str, int, bool, float)) or key is None:
                    raise self.fail(key_node, f"unsupported mapping key {key!r}")
                if key in result:
                    first = self.key_marks[path + (key,)]
                    raise self.fail(key_node, f"duplicate key '{key}'",
                                    f"it was first set on line {first[0]}; remove one of them")
                self.key_marks[path + (key,)] = (key_node.start_mark.line + 1,
                                                 key_node.start_mark.column + 1)
                result[key] = self.build(value_node, path + (key,))
            return {**merged, **result}  # keys written in the mapping win over merged ones
        if isinstance(node, yaml.SequenceNode):
            return [self.build(item, path + (i,)) for i, item in enumerate(node.value)]
        if node.style in ("'", '"'):
            self.quoted.add(path)
        return self.construct(node)


def _compose(text: str, name: str) -> list[yaml.Node]:
    """The documents of a YAML text as node trees, composed from the parser's events without
    recursion: PyYAML's composers recurse once per nesting level (the C one overflows the stack
    and kills the process a hundred thousand levels down), so nesting is bounded here."""
    loader = _Loader(text)
    documents: list[yaml.Node] = []
    anchors: dict = {}
    stack: list[yaml.Node] = []  # open collections; a mapping's pending key sits beside it
    keys: list = []
    root: yaml.Node | None = None

    def attach(node: yaml.Node) -> None:
        nonlocal root
        if not stack:
            root = node
        elif isinstance(stack[-1], yaml.SequenceNode):
            stack[-1].value.append(node)
        elif keys[-1] is None:
            keys[-1] = node
        else:
            stack[-1].value.append((keys[-1], node))
            keys[-1] = None

    def anchor(event, node: yaml.Node) -> None:
        if event.anchor in anchors:
            first = anchors[event.anchor].start_mark.line + 1
            raise yaml.composer.ComposerError(
                None, None, f"found duplicate anchor {event.anchor!r} (first on line {first})",
                event.start_mark)
        if event.anchor is not None:
            anchors[event.anchor] = node

    try:
        while loader.check_event():
            event = loader.get_event()
            if isinstance(event, yaml.DocumentStartEvent):
                anchors, root = {}, None
            elif isinstance(event, yaml.DocumentEndEvent):
                documents.append(root)
            elif isinstance(event, yaml.AliasEvent):
                if event.anchor not in anchors:
                    raise yaml.composer.ComposerError(
                        None, None, f"found undefined alias {event.anchor!r}", event.start_mark)
                attach(anchors[event.anchor])
            elif isinstance(event, yaml.ScalarEvent):
                tag = event.tag
                if tag is None or tag == "!":
                    tag = loader.resolve(yaml.ScalarNode, event.value, event.implicit)
                node = yaml.ScalarNode(tag, event.value, event.start_mark, event.end_mark,
                                       style=event.style)
                anchor(event, node)
                attach(node)
            elif isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
                if len(stack) >= MAX_DEPTH:
                    raise PlanError(f"nested more than {MAX_DEPTH} levels deep", file=name,
                                    line=event.start_mark.line + 1,
                                    column=event.start_mark.column + 1)
                kind = yaml.SequenceNode if isinstance(event, yaml.SequenceStartEvent) \
                    else yaml.MappingNode
                tag = event.tag
                if tag is None or tag == "!":
                    tag = loader.resolve(kind, None, event.implicit)
                node = kind(tag, [], event.start_mark, None, flow_style=event.flow_style)
                anchor(event, node)
                attach(node)
                stack.append(node)
                keys.append(None)
            elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
                stack.pop().end_mark = event.end_mark
                keys.pop()
    finally:
        loader.dispose()
    return documents


def parse_yaml(text: str, name: str) -> Source:
    """Parse YAML text (one document) into a Source; `name` is used in error messages."""
    try:
        documents = _compose(text, name)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = dict(file=name, line=(mark.line + 1) if mark else 1,
                     column=(mark.column + 1) if mark else 1)
        problem = (exc.problem or exc.context or "invalid YAML").strip()
        if "nesting depth" in problem:  # PyYAML >= 6.0.4's own limit, met while it looks ahead
            raise PlanError(f"nested more than {MAX_DEPTH} levels deep", **where) from None
        raise PlanError(f"YAML syntax: {problem}", hint="check indentation, quotes and colons",
                        **where) from None
    except yaml.YAMLError as exc:
        raise PlanError(f"YAML syntax: {exc}", file=name) from None
    documents = [d for d in documents if d is not None]
    if not documents:
        raise PlanError("the file is empty", hint="start from an example in plans/", file=name)
    if len(documents) > 1:
        second = documents[1].start_mark
        raise PlanError("the file holds more than one YAML document",
                        hint="keep one plan per file", file=name,
                        line=second.line + 1, column=second.column + 1)
    builder = _Builder(name)
    data = builder.build(documents[0], ())
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    return Source(name, digest, data, builder.marks, builder.key_marks, frozenset(builder.quoted))


def error_at(file: str | Path | None, keys: tuple, message: str,
             hint: str | None = None) -> PlanError:
    """A PlanError at the position of `keys` (e.g. ("model", "stages")) in the plan `file`, or
    at the file alone when it cannot be read now."""
    if file:
        try:
            return load_yaml(file).error(keys, message, hint)
        except PlanError:  # unreadable now: the message without a position
            pass
    return PlanError(message, hint=hint, file=str(file) if file else None)


def load_yaml(path: str | Path) -> Source:
    """Read and parse a YAML file; unreadable or non-UTF-8 files raise PlanError."""
    name = str(path)
    try:
        raw = read_capped(path, MAX_FILE_BYTES + 1)  # at most the limit: /dev/zero, pipes
    except FileNotFoundError:
        raise PlanError("no such file", hint="check the path", file=name) from None
    except IsADirectoryError:
        raise PlanError("is a directory, not a plan file", file=name) from None
    except OSError as exc:
        raise PlanError(f"cannot read the file: {exc.strerror}", file=name) from None
    except ValueError as exc:  # e.g. a NUL in the path
        raise PlanError(f"cannot read the file: {exc}", file=name) from None
    if len(raw) > MAX_FILE_BYTES:
        raise PlanError(f"the file is larger than {MAX_FILE_BYTES // 2**20} MiB, the limit "
                        "for plans and resolved plans", file=name)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise PlanError("the file is not valid UTF-8 text", hint="save it as UTF-8",
                        file=name, line=line) from None
    return parse_yaml(text, name)
