"""Container image references, checked the way registries and engines read them (the
grammar of the OCI distribution reference: `[host[:port]/]path[:tag][@digest]`, the path
in lower case), so a bad one is one sentence before anything is made."""

from __future__ import annotations

import re

_DOMAIN_PART = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"(?:{_DOMAIN_PART}(?:\.{_DOMAIN_PART})*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?"
_PATH_PART = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_NAME = rf"(?:{_DOMAIN}/)?{_PATH_PART}(?:/{_PATH_PART})*"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
REFERENCE = re.compile(rf"(?P<name>{_NAME})(?::(?P<tag>{_TAG}))?(?:@(?P<digest>{_DIGEST}))?")
NAME_MAX = 255


def image_problem(reference: str) -> str | None:
    """Return why `reference` is not an image reference (one phrase, with the fix), or
    None when it is one."""
    shown = repr(reference[:80])
    if not reference.strip():
        return "the image is empty; give one, e.g. ghcr.io/team/train:1.4"
    if reference != reference.strip() or any(c.isspace() for c in reference):
        return f"{shown} has a space in it; an image reference has none"
    found = REFERENCE.fullmatch(reference)
    if found is None:
        lowered = reference.lower()
        hint = (
            f" (its path must be lower case: {lowered!r}?)"
            if lowered != reference and REFERENCE.fullmatch(lowered)
            else ""
        )
        return (
            f"{shown} is not an image reference{hint}; write [host[:port]/]path[:tag][@digest],"
            " e.g. ghcr.io/team/train:1.4"
        )
    if len(found.group("name")) > NAME_MAX:
        return f"{shown}... has a name over {NAME_MAX} characters; registries refuse it"
    return None
