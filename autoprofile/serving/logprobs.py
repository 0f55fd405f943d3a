"""Logprobs in OpenAI's shapes, from the engine's entries (engine.logprobs.TokenLogprob: token id, logprob,
[(id, logprob)] its top-k by descending logprob). A token's text is its id decoded alone."""
from __future__ import annotations

from collections.abc import Sequence


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def _top_dict(tokenizer, token_id: int, logprob: float, top: list[tuple[int, float]]) -> dict[str, float]:
    """The top-k and the sampled token (vLLM's: up to k + 1 entries), by descending logprob; ids of the same
    text keep the highest."""
    out: dict[str, float] = {}
    for i, lp in sorted({*top, (token_id, logprob)}, key=lambda e: -e[1]):
        out.setdefault(token_text(tokenizer, i), lp)
    return out


def completion_block(tokenizer, entries: Sequence, offset: int) -> dict:
    """The legacy /v1/completions object (tokens, token_logprobs, top_logprobs, text_offset) of `entries`,
    the first token's text at character `offset` of the choice's text. An entry (id, None, None) is the
    prompt's first token (echo): it has no logprob."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, logprob, top in entries:
        text = token_text(tokenizer, token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(None if logprob is None else _top_dict(tokenizer, token_id, logprob, top))
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def echo_entries(prompt_ids: Sequence[int], prompt_logprobs: Sequence | None) -> list:
    """The prompt's tokens as entries: the first without a logprob, the rest from the engine's (None: no
    logprobs asked, every entry (id, None, None))."""
    first = [(prompt_ids[0], None, None)]
    if prompt_logprobs is None:
        return first + [(t, None, None) for t in prompt_ids[1:]]
    return first + list(prompt_logprobs[1:])


def _chat_token(tokenizer, token_id: int, logprob: float) -> dict:
    text = token_text(tokenizer, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_content(tokenizer, entries: Sequence) -> list[dict]:
    """/v1/chat/completions' logprobs.content of `entries`."""
    return [{**_chat_token(tokenizer, token_id, logprob),
             "top_logprobs": [_chat_token(tokenizer, i, lp) for i, lp in top]}
            for token_id, logprob, top in entries]


def cumulative(entries: Sequence) -> float:
    """A choice's cumulative logprob (best_of ranks choices by it)."""
    return sum(lp for _, lp, _ in entries)
