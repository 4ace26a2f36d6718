"""Completion text, shared by every reward (kept free of imports so any reward module can use it)."""

from __future__ import annotations

from typing import Any


def completion_text(c: Any) -> str:
    """Plain text of a completion; TRL conversational completions are lists of message dicts."""
    if isinstance(c, str):
        return c
    if isinstance(c, (list, tuple)) and c and isinstance(c[-1], dict):
        content = c[-1].get("content")
        return content if isinstance(content, str) else ""
    return ""
