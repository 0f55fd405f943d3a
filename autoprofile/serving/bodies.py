"""The OpenAI response bodies (protocol.py parses the requests): a completion's and a chat completion's body,
its choices, its stream chunks, usage, and logprobs in OpenAI's shapes from the engine's entries
(engine.logprobs.TokenLogprob: token id, logprob, [(id, logprob)] its top-k by descending logprob; a token's
text is its id decoded alone)."""
from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

from autoprofile.serving.protocol import GenerateArgs


def request_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice(args: GenerateArgs, text: str | None, finish_reason: str, index: int = 0,
           logprobs: dict | None = None, tool_calls: list[dict] | None = None) -> dict:
    if args.chat:
        message = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def response(args: GenerateArgs, rid: str, text: str | None, finish_reason: str, prompt_tokens: int,
             completion_tokens: int, logprobs: dict | None = None, more: list[dict] = (),
             tool_calls: list[dict] | None = None) -> dict:
    """more: the choices after the first (n > 1: `choice` bodies, index 1..)."""
    return {"id": rid, "object": "chat.completion" if args.chat else "text_completion",
            "created": int(time.time()),
            "model": args.model, "choices": [choice(args, text, finish_reason, 0, logprobs, tool_calls), *more],
            "usage": usage(prompt_tokens, completion_tokens)}


def chunk(args: GenerateArgs, rid: str, created: int, text: str | None, finish_reason: str | None = None,
          role: bool = False, usage_body: dict | None = None, index: int = 0,
          logprobs: dict | None = None, tool_calls: list[dict] | None = None) -> dict:
    """One stream chunk of choice `index`: a text delta (with its tokens' logprobs), tool calls (each with its
    index), the closing finish_reason, or (choices empty) the usage."""
    if usage_body is not None:
        choices = []
    elif args.chat:
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choices = [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
    else:
        choices = [{"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}]
    body = {"id": rid, "object": "chat.completion.chunk" if args.chat else "text_completion",
            "created": created,
            "model": args.model, "choices": choices}
    if args.include_usage:
        body["usage"] = usage_body
    return body


# ---------------------------------------------------------------- logprobs
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
    for token_id, logprob, top, *_ in entries:
        text = token_text(tokenizer, token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(None if logprob is None else _top_dict(tokenizer, token_id, logprob, top))
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def echo_entries(prompt_ids: Sequence[int], prompt_logprobs: Sequence | None, k: int = 0) -> list:
    """The prompt's tokens as entries: the first without a logprob, the rest from the engine's, each with its
    top k (None: no logprobs asked, every entry (id, None, None))."""
    first = [(prompt_ids[0], None, None)]
    if prompt_logprobs is None:
        return first + [(t, None, None) for t in prompt_ids[1:]]
    return first + [(t, lp, top[:k]) for t, lp, top, *_ in prompt_logprobs[1:]]


def _vllm_logprob(tokenizer, token_id: int, logprob: float, rank: int) -> dict:
    return {"logprob": logprob, "rank": rank, "decoded_token": token_text(tokenizer, token_id)}


def prompt_logprobs_body(tokenizer, prompt_logprobs: Sequence, k: int) -> list[dict | None]:
    """vLLM's prompt_logprobs: null for the first prompt token, then per token {"token id": {logprob, rank,
    decoded_token}} of the prompt token and its position's top k (ranks 1..k), in that order (vLLM's dict:
    a prompt token among the top k keeps its place and takes the top-k entry)."""
    out: list[dict | None] = [None]
    for token_id, logprob, top, rank in prompt_logprobs[1:]:
        d = {str(token_id): _vllm_logprob(tokenizer, token_id, logprob, rank)}
        for r, (i, lp) in enumerate(top[:k], 1):
            d[str(i)] = _vllm_logprob(tokenizer, i, lp, r)
        out.append(d)
    return out


def _chat_token(tokenizer, token_id: int, logprob: float) -> dict:
    text = token_text(tokenizer, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_content(tokenizer, entries: Sequence) -> list[dict]:
    """/v1/chat/completions' logprobs.content of `entries`."""
    return [{**_chat_token(tokenizer, token_id, logprob),
             "top_logprobs": [_chat_token(tokenizer, i, lp) for i, lp in top]}
            for token_id, logprob, top in entries]
