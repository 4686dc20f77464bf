"""Reading a user's YAML or JSON file: every way it can be wrong becomes one InvalidSpec
sentence naming the file and the fix (not a folder, not text, too deep, a duplicate key,
an alias that expands too far or into itself, a syntax error), never a traceback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from gpuflow.tasks.errors import InvalidSpec

MAX_BYTES = 16 * 1024 * 1024
# What a document may hold once its aliases are expanded (an alias is shared when read,
# but validating, copying or sending the spec expands it): a few "billion laughs" lines
# would otherwise take gigabytes. Real specs are thousands of values.
MAX_EXPANDED_VALUES = 200_000
MAX_EXPANDED_CHARS = 4 * MAX_BYTES


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a mapping with the same key twice (YAML says keys are unique;
    PyYAML would silently keep the last); keys merged in with `<<` may be overridden."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`, then overrides
                continue
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise InvalidSpec(
                    f"{{where}}: the key {key!r} appears twice (lines {seen[key]} and {line});"
                    " keep one of them."
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def parse(text: str, where: str) -> Any:
    """Return the document in `text` (YAML, so JSON too); `where` names it in errors."""
    loader = _UniqueKeyLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _bound(node, where)
        return loader.construct_document(node)
    except InvalidSpec as exc:
        raise InvalidSpec(str(exc).replace("{where}", where)) from None
    except RecursionError:
        raise InvalidSpec(
            f"{where}: nested too deeply to read; a job spec needs only a few levels."
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" at line {mark.line + 1}" if mark else ""
        problem = getattr(exc, "problem", None)
        raise InvalidSpec(
            f"{where}: not valid YAML{line}{' (' + problem + ')' if problem else ''};"
            " fix the syntax there."
        ) from None
    finally:
        loader.dispose()


def _bound(root: yaml.Node, where: str) -> None:
    """Refuse a document whose aliases refer to themselves or expand past the limits,
    measured on the node graph (each node once), before anything is built from it."""
    sizes: dict[int, tuple[int, int]] = {}  # id(node) -> (values, characters) expanded
    visiting: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in sizes:
            continue
        children: list[yaml.Node] = []
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        if not children_done:
            if id(node) in visiting:
                raise InvalidSpec(
                    f"{where}: an alias at line {node.start_mark.line + 1} refers to the value"
                    " that holds it; write the value out instead."
                )
            visiting.add(id(node))
            stack.append((node, True))
            stack.extend((child, False) for child in children if id(child) not in sizes)
            continue
        visiting.discard(id(node))
        values = 1 + sum(sizes[id(child)][0] for child in children)
        chars = (len(node.value) if isinstance(node, yaml.ScalarNode) else 0) + sum(
            sizes[id(child)][1] for child in children
        )
        if values > MAX_EXPANDED_VALUES or chars > MAX_EXPANDED_CHARS:
            raise InvalidSpec(
                f"{where}: its aliases (*name) expand to more than {MAX_EXPANDED_VALUES:,}"
                f" values or {MAX_EXPANDED_CHARS // 2**20} MiB of text (from line"
                f" {node.start_mark.line + 1}); write the values out or use fewer aliases."
            )
        sizes[id(node)] = (values, chars)


def read(path: Path, what: str = "a job YAML or JSON file") -> Any:
    """Return the document in the file at `path`."""
    if path.is_dir():
        raise InvalidSpec(f"{path}: is a folder; give the path of {what}.")
    if not path.is_file():
        if path.exists():  # a device, a FIFO, a socket: reading one may block or never end
            raise InvalidSpec(
                f"{path}: is not a regular file (a device, FIFO or socket); give the path of"
                f" {what}."
            )
        raise InvalidSpec(f"{path}: no such file; give the path of {what}.")
    try:
        if path.stat().st_size > MAX_BYTES:
            raise InvalidSpec(
                f"{path}: is {path.stat().st_size // 2**20} MiB, too large for {what}; check the path."
            )
        raw = path.read_bytes()
    except PermissionError:
        raise InvalidSpec(
            f"{path}: cannot be read (permission denied); fix its permissions."
        ) from None
    try:
        if b"\0" in raw:
            raise UnicodeDecodeError("utf-8", raw, raw.index(b"\0"), raw.index(b"\0") + 1, "NUL")
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidSpec(
            f"{path}: is not a text file (not UTF-8); give the path of {what}."
        ) from None
    return parse(text, str(path))
