"""Reading a user's YAML or JSON file: every way it can be wrong becomes one InvalidSpec
sentence naming the file and the fix (not a folder, not text, too deep, a duplicate key,
a syntax error), never a traceback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tasks.errors import InvalidSpec

MAX_BYTES = 16 * 1024 * 1024


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a mapping with the same key twice (YAML says keys are unique;
    PyYAML would silently keep the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
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
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
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


def read(path: Path, what: str = "a job YAML or JSON file") -> Any:
    """Return the document in the file at `path`."""
    if path.is_dir():
        raise InvalidSpec(f"{path}: is a folder; give the path of {what}.")
    if not path.is_file():
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
