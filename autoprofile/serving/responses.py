"""OpenAI's Responses API (POST /v1/responses, as vLLM serves it) over the chat path.

A Responses body becomes a chat request (parse_responses): `instructions` a system message, `input` a
string or items (messages with content parts, `function_call` and `function_call_output` items) as chat
messages, `tools` / `tool_choice` in chat's shape, `text.format` as `response_format` (not in a turn whose
tool_choice forces a call: it has no text; openai-agents sends both), `max_output_tokens` as `max_tokens`;
the chat template, tool parsing, grammar and reasoning split run as for chat. A client's
mistake names the Responses field (`input[2].content`, `max_output_tokens`, `text.format.schema`).
The chat reply becomes output items (a reasoning item, a message, function calls); a stream's chat chunks
become Responses events (ResponseEvents). `previous_response_id`: the stored conversation (its messages
and replies, not its instructions) comes before `input`; stored responses live in this server's memory,
least recently used dropped first past RESPONSES_STORED or RESPONSES_STORED_BYTES (ResponseStore).
The handlers (at the end) run the chat path of serving.openai.

Above the house's 500 lines on purpose: the Responses API in one place, from its body to its events.
"""
from __future__ import annotations

import functools
import json
import re
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

from aiohttp import web

from autoprofile.serving.async_engine import EngineFailure
from autoprofile.serving.choices import Choice
from autoprofile.serving.errors import APIError, bad
from autoprofile.serving.openai import (Serving, chunks, complete_body, engine_failure, parsed, room, start,
                                        think, with_images)
from autoprofile.serving.protocol import RESPONSES, GenerateArgs, Limits, check_fields, parse_chat, show
from autoprofile.serving.reasoning import END, reasoning_tokens

RESPONSES_STORED = 1024  # stored responses kept for previous_response_id
RESPONSES_STORED_BYTES = 64 << 20  # and their conversations' JSON bytes
TEXT_PARTS = ("input_text", "output_text", "text")
INPUT_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


@dataclass
class ResponsesRequest:
    """What a Responses body asks beyond its chat request: the fields echoed in the response object, and the
    conversation so far (chat messages, no instructions) for the stored response."""

    body: dict
    history: list[dict]
    store: bool
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))


# ---------------------------------------------------------------- stored responses
@dataclass
class Stored:
    response: dict
    messages: list[dict]  # the conversation through this response's reply
    size: int


class ResponseStore:
    """Responses kept for previous_response_id, least recently used dropped first."""

    def __init__(self, max_entries: int = RESPONSES_STORED, max_bytes: int = RESPONSES_STORED_BYTES,
                 registry=None):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.items: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = self.evicted = 0
        if registry is not None:
            self._gauges(registry)

    def _gauges(self, registry) -> None:
        from prometheus_client import Gauge
        Gauge("autoprofile_responses_stored", "Responses kept for previous_response_id",
              registry=registry).set_function(lambda: len(self.items))
        Gauge("autoprofile_responses_stored_bytes", "JSON bytes of the stored responses' conversations",
              registry=registry).set_function(lambda: self.bytes)
        Gauge("autoprofile_responses_evicted", "Stored responses dropped (least recently used) so far",
              registry=registry).set_function(lambda: self.evicted)

    def put(self, response: dict, messages: list[dict]) -> None:
        size = len(json.dumps([response, messages], ensure_ascii=False).encode())
        if size > self.max_bytes:
            self.evicted += 1
            return
        self.items[response["id"]] = Stored(response, messages, size)
        self.bytes += size
        while len(self.items) > self.max_entries or self.bytes > self.max_bytes:
            _, old = self.items.popitem(last=False)
            self.bytes -= old.size
            self.evicted += 1

    def get(self, rid: str) -> Stored | None:
        got = self.items.get(rid)
        if got is not None:
            self.items.move_to_end(rid)
        return got


def not_found(rid: str, param: str | None) -> APIError:
    return APIError(404, f"no stored response has the id '{rid:.100}' (responses live in this server's "
                    f"memory, the {RESPONSES_STORED} most recently used, and only with store true)",
                    param=param, code="previous_response_not_found" if param else "not_found")


# ---------------------------------------------------------------- the body as a chat request
def _text(value, where: str) -> str:
    """A content string, or text parts joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") in TEXT_PARTS
                                       and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    raise bad(where, f"'{where}' must be a string or a list of text parts ({{\"type\": \"input_text\", "
              f"\"text\": ...}}), got {show(value)}")


def _part(p, where: str) -> dict:
    kind = p.get("type") if isinstance(p, dict) else None
    if kind in TEXT_PARTS and isinstance(p.get("text"), str):
        return {"type": "text", "text": p["text"]}
    if kind == "input_image" and isinstance(p.get("image_url"), str):
        return {"type": "image_url", "image_url": {"url": p["image_url"]}}
    raise bad(where, f"'{where}' must be {{\"type\": \"input_text\", \"text\": ...}} or {{\"type\": "
              f"\"input_image\", \"image_url\": ...}}, got {show(p)}", code="unsupported_value")


def _message(item: dict, where: str) -> dict:
    role = INPUT_ROLES.get(item.get("role"))
    if role is None:
        raise bad(f"{where}.role", f"'{where}.role' must be one of {', '.join(INPUT_ROLES)}, got "
                  f"{show(item.get('role'))}")
    content = item.get("content")
    if isinstance(content, list):
        content = [_part(p, f"{where}.content[{j}]") for j, p in enumerate(content)]
    elif not isinstance(content, str):
        raise bad(f"{where}.content", f"'{where}.content' must be a string or a list of content parts")
    return {"role": role, "content": content}


def _call(item: dict, where: str) -> dict:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str) or (key != "arguments" and not item[key]):
            raise bad(f"{where}.{key}", f"'{where}.{key}' must be a string, got {show(item.get(key))}")
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def input_messages(value) -> tuple[list[dict], list[str]]:
    """`input` as chat messages, and each message's input path (for errors)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}], ["input"]
    if not (isinstance(value, list) and value):
        raise bad("input", "'input' must be a string or a non-empty list of items (messages, function_call, "
                  f"function_call_output), got {show(value)}")
    messages, origins = [], []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(where, f"'{where}' must be an object (a message or another input item)")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and origins[-1] != "previous_response_id":
                last.setdefault("tool_calls", []).append(_call(item, where))
                continue
            messages.append({"role": "assistant", "content": None, "tool_calls": [_call(item, where)]})
        elif kind == "function_call_output":
            if not (isinstance(item.get("call_id"), str) and item["call_id"]):
                raise bad(f"{where}.call_id", f"'{where}.call_id' must be the call's call_id (a string)")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            continue  # earlier thinking is not rendered again (chat templates drop it too)
        else:
            raise bad(f"{where}.type", f"'{where}.type' must be message, function_call, function_call_output "
                      f"or reasoning, got {show(kind)}", code="unsupported_value")
        origins.append(where)
    return messages, origins


def _tools(tools) -> list[dict]:
    if not isinstance(tools, list):
        raise bad("tools", "'tools' must be a list of {\"type\": \"function\", \"name\", \"parameters\"}")
    out = []
    for i, t in enumerate(tools):
        if not (isinstance(t, dict) and t.get("type") == "function"):
            kind = t.get("type") if isinstance(t, dict) else t
            raise bad(f"tools[{i}].type", f"'tools[{i}]' must be a function tool ({{\"type\": \"function\", "
                      f"\"name\", \"parameters\"}}); built-in tools are not served, got {show(kind)}",
                      code="unsupported_value")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                     if t.get(k) is not None}})
    return out


def _tool_choice(choice):
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _forces_call(choice) -> bool:
    return choice == "required" or isinstance(choice, dict) and choice.get("type") == "function"


def _format(text) -> dict | None:
    """`text` -> chat's response_format."""
    if not isinstance(text, dict):
        raise bad("text", f"'text' must be an object {{\"format\": ...}}, got {show(text)}")
    extra = set(text) - {"format", "verbosity"}
    if extra or text.get("verbosity") is not None:
        key = min(extra) if extra else "verbosity"
        raise bad(f"text.{key}", f"'text.{key}' is not served: send {{\"format\": ...}}",
                  code="unsupported_parameter")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not (isinstance(fmt, dict) and fmt.get("type") in ("text", "json_object", "json_schema")):
        raise bad("text.format", "'text.format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                  "{\"type\": \"json_schema\", \"name\", \"schema\", \"strict\"}")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


_RENAMES = ((r"^max_tokens", "max_output_tokens"), (r"^response_format\.json_schema", "text.format"),
            (r"^response_format", "text.format"), (r"^tools\[(\d+)\]\.function", r"tools[\1]"))


def _renamed(e: APIError, origins: list[str]) -> APIError:
    """A chat error as the Responses field that caused it."""
    def rename(name: str) -> str:
        m = re.match(r"messages\[(\d+)\]", name)
        if m:
            k = int(m.group(1))
            return (origins[k] if k < len(origins) else "input") + name[m.end():]
        if name == "messages":
            return "input"
        for old, new in _RENAMES:
            name, n = re.subn(old, new, name)
            if n:
                break
        return name
    if e.param is None:
        return e
    param = rename(e.param)
    message = e.message.replace(f"'{e.param}'", f"'{param}'")
    return APIError(e.status, message, param, e.type, e.code, e.headers)


def parse_responses(body: object, limits: Limits, tokenizer,
                    store: ResponseStore) -> tuple[GenerateArgs, ResponsesRequest]:
    """POST /v1/responses: the chat request it makes, and what the response object echoes."""
    if not isinstance(body, dict):
        raise bad(None, "the body must be a JSON object", code="invalid_json")
    check_fields(body, RESPONSES)
    history, origins = [], []
    prev = body.get("previous_response_id")
    if prev is not None:
        if not isinstance(prev, str):
            raise bad("previous_response_id", f"'previous_response_id' must be a string, got {show(prev)}")
        stored = store.get(prev)
        if stored is None:
            raise not_found(prev, "previous_response_id")
        history, origins = list(stored.messages), ["previous_response_id"] * len(stored.messages)
    messages, where = input_messages(body.get("input"))
    history, origins = history + messages, origins + where
    chat = {k: body[k] for k in ("model", "temperature", "top_p", "stream", "parallel_tool_calls")
            if body.get(k) is not None}
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions", f"'instructions' must be a string, got {show(instructions)}")
    chat["messages"] = ([{"role": "system", "content": instructions}] if instructions else []) + history
    origins = (["instructions"] if instructions else []) + origins
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    fmt = _format(body["text"]) if body.get("text") is not None else None
    if fmt is not None and not _forces_call(body.get("tool_choice")):  # a forced call's turn has no text
        chat["response_format"] = fmt
    if body.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    store_it = body.get("store", True)
    if not isinstance(store_it, bool):
        raise bad("store", f"'store' must be true or false, got {show(store_it)}")
    try:
        args = parse_chat(chat, limits, tokenizer)
    except APIError as e:
        raise _renamed(e, origins) from None
    args.return_token_ids = True  # the reasoning tokens are counted on them
    return args, ResponsesRequest(body, history, store_it)


# ---------------------------------------------------------------- the response object
def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"type": "message", "id": item_id or _id("msg"), "status": status, "role": "assistant",
            "content": [output_text(text)] if status == "completed" else []}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(text: str, item_id: str | None = None) -> dict:
    return {"type": "reasoning", "id": item_id or _id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def call_item(call: dict, status: str = "completed", item_id: str | None = None) -> dict:
    return {"type": "function_call", "id": item_id or _id("fc"), "call_id": call["id"],
            "name": call["function"]["name"],
            "arguments": call["function"]["arguments"] if status == "completed" else "", "status": status}


def output_items(message: dict) -> list[dict]:
    """A chat reply's message as output items: its reasoning, its text, its calls."""
    items = [reasoning_item(message["reasoning_content"])] if message.get("reasoning_content") else []
    if message.get("content"):
        items.append(message_item(message["content"]))
    return items + [call_item(c) for c in message.get("tool_calls") or []]


def usage(prompt_tokens: int, output_tokens: int, reasoning_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + output_tokens}


def response_object(req: ResponsesRequest, model: str, status: str, output: list[dict],
                    usage_body: dict | None, finish_reason: str | None = None) -> dict:
    b = req.body
    incomplete = status == "incomplete" or finish_reason == "length"
    return {"id": req.id, "object": "response", "created_at": req.created, "model": model,
            "status": "incomplete" if incomplete else status, "output": output, "usage": usage_body,
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
            "metadata": b.get("metadata") or {}, "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "previous_response_id": b.get("previous_response_id"),
            "temperature": b.get("temperature", 1.0), "top_p": b.get("top_p", 1.0),
            "tool_choice": b.get("tool_choice") or "auto", "tools": b.get("tools") or [],
            "text": b.get("text") or {"format": {"type": "text"}}, "truncation": "disabled",
            "store": req.store, "background": False, "reasoning": None, "user": b.get("user")}


def reply_message(output: list[dict]) -> dict:
    """The output items as the assistant's chat message of the stored conversation."""
    text = "".join(p["text"] for it in output if it["type"] == "message" for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"],
                                                                    "arguments": it["arguments"]}}
             for it in output if it["type"] == "function_call"]
    return {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}


def remember(store: ResponseStore, req: ResponsesRequest, response: dict) -> None:
    if req.store and response["status"] in ("completed", "incomplete"):
        store.put(response, req.history + [reply_message(response["output"])])


# ---------------------------------------------------------------- streamed events
class ResponseEvents:
    """A chat stream's chunks (one choice, usage at the end) as Responses events, each with its
    sequence_number; `response` is the response object once the stream ended."""

    def __init__(self, req: ResponsesRequest, model: str, count_reasoning):
        self.req, self.model, self.count_reasoning = req, model, count_reasoning
        self.seq, self.output, self.open = 0, [], None  # open: (kind, item) still receiving text
        self.texts: dict[str, str] = {}
        self.ids: list[int] = []
        self.finish: str | None = None
        self.response: dict | None = None

    def _event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def start(self) -> list[dict]:
        body = response_object(self.req, self.model, "in_progress", [], None)
        return [self._event("response.created", response=body), self._event("response.in_progress",
                                                                              response=body)]

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        kind, item = self.open
        self.open, at, text = None, len(self.output) - 1, self.texts.pop(item["id"])
        where = dict(item_id=item["id"], output_index=at, content_index=0)
        if kind == "reasoning":
            done = reasoning_item(text, item["id"])
            part = done["content"][0]
            events = [self._event("response.reasoning_text.done", text=text, **where)]
        else:
            done = message_item(text, item_id=item["id"])
            part = done["content"][0]
            events = [self._event("response.output_text.done", text=text, logprobs=[], **where)]
        self.output[at] = done
        return events + [self._event("response.content_part.done", part=part, **where),
                         self._event("response.output_item.done", output_index=at, item=done)]

    def _text(self, kind: str, delta: str) -> list[dict]:
        events = []
        if self.open is None or self.open[0] != kind:
            events += self._close()
            item = {"type": "reasoning", "id": _id("rs"), "summary": [], "content": []} \
                if kind == "reasoning" else message_item("", "in_progress")
            self.output.append(item)
            self.open, self.texts[item["id"]] = (kind, item), ""
            part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else output_text("")
            at = len(self.output) - 1
            events += [self._event("response.output_item.added", output_index=at, item=item),
                       self._event("response.content_part.added", item_id=item["id"], output_index=at,
                                   content_index=0, part=part)]
        item_id = self.open[1]["id"]
        self.texts[item_id] += delta
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return events + [self._event(name, item_id=item_id, output_index=len(self.output) - 1,
                                     content_index=0, delta=delta, **extra)]

    def _call(self, call: dict) -> list[dict]:
        events = self._close()
        done = call_item(call)
        self.output.append(done)
        at = len(self.output) - 1
        where = dict(item_id=done["id"], output_index=at)
        return events + [self._event("response.output_item.added", output_index=at,
                                     item=call_item(call, "in_progress", done["id"])),
                         self._event("response.function_call_arguments.delta", delta=done["arguments"],
                                     **where),
                         self._event("response.function_call_arguments.done", arguments=done["arguments"],
                                     name=done["name"], **where),
                         self._event("response.output_item.done", output_index=at, item=done)]

    def feed(self, chunk: dict) -> list[dict]:
        """One chat chunk's events; the usage chunk (the last) ends the response."""
        if not chunk["choices"]:
            return self._end(chunk.get("usage") or {})
        c = chunk["choices"][0]
        self.ids += c.get("token_ids") or []
        delta, events = c.get("delta") or {}, []
        if delta.get("reasoning_content"):
            events += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            events += self._call(call)
        if c.get("finish_reason"):
            self.finish = c["finish_reason"]
        return events

    def _end(self, chat_usage: dict) -> list[dict]:
        events = self._close()
        reasoning = next((it["content"][0]["text"] for it in self.output if it["type"] == "reasoning"), None)
        body = usage(chat_usage.get("prompt_tokens", 0), chat_usage.get("completion_tokens", 0),
                     self.count_reasoning(self.ids, reasoning))
        self.response = response_object(self.req, self.model, "completed", self.output, body, self.finish)
        kind = "response.incomplete" if self.response["status"] == "incomplete" else "response.completed"
        return events + [self._event(kind, response=self.response)]

    def error(self, body: dict) -> dict:
        e = body["error"]
        return self._event("error", code=e.get("code"), message=e.get("message"), param=e.get("param"))


def sse(event: dict) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()


# ---------------------------------------------------------------- the handlers (on openai.py's chat path)
class ResponsesServing(Serving, Protocol):
    responses: ResponseStore  # for previous_response_id


async def responses(request: web.Request, st: ResponsesServing) -> web.StreamResponse:
    """POST /v1/responses: the body as a chat request (parse_responses); its reply as a response object,
    or as Responses events."""
    args, req = await parsed(request, st, st.bounds["openai"], parse_responses, st.limits, st.tokenizer,
                             st.responses)
    if args.images:
        args = await with_images(st, args)
    think(st, args)
    room(st, args, 1)
    choices = await start(st, args)
    try:
        if args.stream:
            return await _respond_stream(request, st, args, req, choices)
        chat = (await complete_body(st, args, [(args, choices)]))
    finally:
        for c in choices:
            c.handle.close()
    first, used = chat["choices"][0], chat["usage"]
    message = first["message"]
    thought = _reasoning_count(st, args, first["token_ids"], message.get("reasoning_content"))
    body = response_object(req, args.model, "completed", output_items(message),
                           usage(used["prompt_tokens"], used["completion_tokens"], thought),
                           first["finish_reason"])
    remember(st.responses, req, body)
    return web.json_response(body)


async def _respond_stream(request: web.Request, st: ResponsesServing, args: GenerateArgs, req,
                          choices: list[Choice]) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    events = ResponseEvents(req, args.model, functools.partial(_reasoning_count, st, args))
    try:
        for e in events.start():
            await resp.write(sse(e))
        async for body in chunks(st, args, [(args, choices)]):
            for e in events.feed(body):
                await resp.write(sse(e))
    except EngineFailure as e:
        await resp.write(sse(events.error(engine_failure(e).body())))
    except ConnectionResetError:  # the client went away: close() aborts the request
        return resp
    if events.response is not None:
        remember(st.responses, req, events.response)
    await resp.write_eof()
    return resp


def _reasoning_count(st: ResponsesServing, args: GenerateArgs, ids: list[int], reasoning: str | None) -> int:
    if args.thinking is None:
        return 0
    return reasoning_tokens(ids, st.tokenizer.encode(END, add_special_tokens=False), args.thinking, reasoning)


async def stored_response(request: web.Request, st: ResponsesServing) -> web.Response:
    """GET /v1/responses/{response_id}: a stored response (this server's memory), else a 404."""
    rid = request.match_info["response_id"]
    stored = st.responses.get(rid)
    if stored is None:
        raise not_found(rid, None)
    return web.json_response(stored.response)
