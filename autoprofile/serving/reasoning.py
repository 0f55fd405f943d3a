"""Reasoning models (--reasoning_parser, vLLM's names): the reply's thinking, written inside
`<think>...</think>`, goes to `reasoning_content`, apart from `content`.

- qwen3: the reply thinks when it opens with `<think>`, or when the prompt ends inside an open `<think>`
  (templates that start the thinking for the model); a reply with neither is all content
  (enable_thinking false renders a closed `<think></think>` in the prompt).
- deepseek_r1: the template opens `<think>` in the prompt, so the reply thinks from its first token (an
  opening `<think>` it writes itself is dropped) until `</think>`; a reply cut before it is all reasoning.
max_tokens counts the thinking tokens, as vLLM does: they are output tokens of the request.
ReasoningStream gives the same split as `split` for a reply that arrives in deltas.
"""
from __future__ import annotations

from autoprofile.config import REASONING_PARSERS as PARSERS  # noqa: F401 - the names, for callers

THINK, END = "<think>", "</think>"


def starts_thinking(parser: str, prompt_tail: str) -> bool:
    """Whether the reply begins inside the thinking (before any text of its own), from the prompt's end."""
    if parser == "deepseek_r1":
        return True
    at = prompt_tail.rfind(THINK)
    return at >= 0 and END not in prompt_tail[at + len(THINK):]


def _opened(text: str, thinking: bool) -> tuple[str, bool]:
    """The text after a `<think>` that opens it, and whether the reply thinks."""
    if text.startswith(THINK):
        return text[len(THINK):], True
    return text, thinking


def split(text: str, thinking: bool) -> tuple[str | None, str | None]:
    """A whole reply's (reasoning, content), each None when empty."""
    text, thinking = _opened(text, thinking)
    if not thinking:
        return None, text or None
    reasoning, closed, content = text.partition(END)
    return reasoning or None, (content if closed else "") or None


def _held(text: str, marker: str) -> int:
    """Length of text's longest end that could start `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """Text deltas in, (reasoning delta, content delta) out: text that could still be `<think>` or
    `</think>` is held until what follows it is known."""

    def __init__(self, thinking: bool):
        self.mode = "start"  # start: the reply may still open with <think>; then think or content
        self.thinking = thinking
        self.buffer = ""

    def push(self, delta: str) -> tuple[str, str]:
        self.buffer += delta
        if self.mode == "start":
            if THINK.startswith(self.buffer) and self.buffer != THINK:
                return "", ""
            self.buffer, thinking = _opened(self.buffer, self.thinking)
            self.mode = "think" if thinking else "content"
        if self.mode == "content":
            out, self.buffer = self.buffer, ""
            return "", out
        at = self.buffer.find(END)
        if at >= 0:
            reasoning, content = self.buffer[:at], self.buffer[at + len(END):]
            self.mode, self.buffer = "content", ""
            return reasoning, content
        cut = len(self.buffer) - _held(self.buffer, END)
        out, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return out, ""

    def finish(self) -> tuple[str, str]:
        """What is held at the end of the reply."""
        if self.mode == "start":
            self.mode = "think" if self.thinking else "content"
        rest, self.buffer = self.buffer, ""
        return (rest, "") if self.mode == "think" else ("", rest)


def reasoning_tokens(ids: list[int], end_ids: list[int], thinking: bool, reasoning: str | None) -> int:
    """The reply's thinking tokens, through the ids of `</think>` (all of them when it never closed)."""
    n = len(end_ids)
    at = next((i for i in range(len(ids) - n + 1) if n and ids[i:i + n] == end_ids), None)
    if at is not None and (thinking or reasoning is not None):
        return at + n
    return len(ids) if reasoning is not None else 0
