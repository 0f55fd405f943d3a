"""Tool calling on /v1/chat/completions: the request's `tools`, `tool_choice` and `parallel_tool_calls`, the
tools rendered by the model's chat template, and the reply's text parsed into OpenAI `tool_calls`.

Formats, chosen from the chat template's text (as vLLM's tool parsers are named):
- hermes (Qwen2.5, Qwen3): each call is `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
- llama3_json (Llama 3.1): the reply is `{"name": ..., "parameters": {...}}` (after an optional
  `<|python_tag|>`), several joined by `;`.
tool_choice "required" or a named function is a grammar (serving.structured: tool_hermes, tool_llama): the
reply is exactly one call of a tool the request names, its arguments valid for the tool's parameters, so it
always parses. "auto" parses what the model writes; "none" renders the tools and parses nothing.
Streaming (ToolStream): text before a call streams as content; once a call starts it is held and sent whole
when it closes (one delta with its index, id, type, name and the arguments' full JSON text).
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from autoprofile.serving.errors import bad
from autoprofile.serving.structured import Spec, check_schema

HERMES, LLAMA = "hermes", "llama3_json"
OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_SEPARATOR = re.compile(r"\s*(;\s*)?")


@dataclass(frozen=True)
class Tools:
    functions: tuple[dict, ...]  # each tool's {"name", "description"?, "parameters"?}
    choice: str  # "auto" | "none" | "required" | "function" (then `name`)
    name: str | None
    parallel: bool
    format: str  # HERMES | LLAMA
    forced: Spec | None  # the grammar of "required" / a named function

    @property
    def rendered(self) -> list[dict]:
        """The tools as chat templates take them (OpenAI's shape)."""
        return [{"type": "function", "function": f} for f in self.functions]

    @property
    def parses(self) -> bool:
        return self.choice != "none"


def tool_format(tokenizer) -> str | None:
    """The tool-call format of the tokenizer's chat template (None: it renders no tools)."""
    source = getattr(getattr(tokenizer, "chat", None), "source", "") or ""
    if "tools" not in source:
        return None
    if OPEN in source:
        return HERMES
    if PYTHON_TAG in source or '"parameters"' in source:
        return LLAMA
    return None


def _function(i: int, t) -> dict:
    where = f"tools[{i}]"
    if not (isinstance(t, dict) and t.get("type", "function") == "function"
            and isinstance(t.get("function"), dict)):
        raise bad(where, f"'{where}' must be {{\"type\": \"function\", \"function\": {{\"name\", "
                  "\"description\", \"parameters\"}}")
    f = t["function"]
    name = f.get("name")
    if not (isinstance(name, str) and re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name)):
        raise bad(f"{where}.function.name", f"'{where}.function.name' must be 1 to 64 letters, digits, "
                  f"'_', '.' or '-', got {name!r:.80}")
    params = f.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise bad(f"{where}.function.parameters",
                  f"'{where}.function.parameters' must be a JSON schema object")
    out = {"name": name}
    if isinstance(f.get("description"), str):
        out["description"] = f["description"]
    out["parameters"] = params if params is not None else {"type": "object", "properties": {}}
    return out


DEFS = "$defs"


def _moved(ref: str, root: str) -> str:
    """A local $ref of the parameters, once they sit at `root` (`definitions` read as `$defs`)."""
    path = ref[1:]
    if path.startswith("/definitions/"):
        path = f"/{DEFS}/" + path[len("/definitions/"):]
    return root + path


def _rooted(value, root: str):
    """value with its local `$ref`s ("#...") moved under `root` (a JSON pointer); no recursion (a schema
    may nest as deep as the body's parser allows)."""
    out: list = [None]
    todo = [(value, out, 0)]
    while todo:
        v, parent, key = todo.pop()
        if isinstance(v, dict):
            new = parent[key] = {}
            for k, x in v.items():
                if k == "$ref" and isinstance(x, str) and x.startswith("#"):
                    new[k] = _moved(x, root)
                else:
                    todo.append((x, new, k))
        elif isinstance(v, list):
            new = parent[key] = [None] * len(v)
            todo += [(x, new, i) for i, x in enumerate(v)]
        else:
            parent[key] = v
    return out[0]


def _defs(params: dict, root: str) -> dict:
    """A tool's parameters as one `$defs` entry at `root`: its own `$defs` (or `definitions`) and every local
    `$ref` re-pointed there, so that `#/$defs/...` still resolves once the parameters sit inside a call."""
    body = {k: v for k, v in params.items() if k != "definitions"}
    if "definitions" in params:
        body[DEFS] = {**params["definitions"], **params.get(DEFS, {})}
    return _rooted(body, root)


def call_schema(functions: list[dict], args_key: str) -> dict:
    """The JSON schema of one call of any of `functions`: {"name": <its name>, args_key: <its parameters>};
    each tool's parameters live in the root's `$defs` under its name (their `$ref`s re-pointed there)."""
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                               args_key: {"$ref": f"#/{DEFS}/{f['name']}"}},
              "required": ["name", args_key]} for f in functions]
    defs = {f["name"]: _defs(f["parameters"], f"#/{DEFS}/{f['name']}") for f in functions}
    return {DEFS: defs, **(calls[0] if len(calls) == 1 else {"anyOf": calls})}


def parse_tools(body: dict, tokenizer) -> Tools | None:
    """The request's tools (None without any); a 400 naming the field for a malformed one, a tool_choice
    naming no tool given, or a model whose chat template renders no tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", "'parallel_tool_calls' must be true or false")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise bad("tool_choice", "'tool_choice' needs 'tools' (the functions it may call)")
        return None
    if not isinstance(tools, list):
        raise bad("tools", "'tools' must be a list of {\"type\": \"function\", \"function\": {...}}")
    functions = tuple(_function(i, t) for i, t in enumerate(tools))
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        twice = sorted(n for n in names if names.count(n) > 1)[0]
        raise bad("tools", f"'tools' names the function '{twice}' twice")
    fmt = tool_format(tokenizer)
    if fmt is None:
        raise bad("tools", "this model's chat template does not render tools (no tool-call format known for "
                  "it): tool use is not supported with this model", code="unsupported_value")
    name = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        f = choice.get("function")
        name = f.get("name") if choice.get("type") == "function" and isinstance(f, dict) else None
        if name not in names:
            raise bad("tool_choice", f"'tool_choice' must name one of the tools ({', '.join(names)}): "
                      f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {str(choice):.100}")
        choice = "function"
    elif choice not in ("auto", "none", "required"):
        raise bad("tool_choice", f"'tool_choice' must be \"auto\", \"none\", \"required\" or "
                  f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {str(choice):.100}")
    forced = None
    if choice in ("required", "function"):
        key = "arguments" if fmt == HERMES else "parameters"
        picked = [f for f in functions if choice == "required" or f["name"] == name]
        for i, f in enumerate(functions):
            if f in picked:
                check_schema(f["parameters"], f"tools[{i}].function.parameters")
        forced = Spec("tool_hermes" if fmt == HERMES else "tool_llama",
                      json.dumps(call_schema(picked, key), ensure_ascii=False), "tools")
    return Tools(functions, choice, name, True if parallel is None else parallel, fmt, forced)


def refuse_unrendered_tool_defs(tools: Tools, prompt: str) -> None:
    """Every tool's name must reach the prompt (a template that drops them would hide the tools)."""
    for i, f in enumerate(tools.functions):
        if f["name"] not in prompt:
            raise bad(f"tools[{i}]", f"this model's chat template does not render 'tools[{i}]' "
                      f"({f['name']}): tool use is not supported with this model", code="unsupported_value")


# ---------------------------------------------------------------- the reply
def _call(obj, args_keys: tuple[str, ...]) -> dict | None:
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if not isinstance(args, dict):
        return None
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def _hermes_call(text: str) -> dict | None:
    """One hermes call's JSON as a call; None if it is no call (not JSON, nested past the parser, no name).
    A raw control character inside a string (a newline in free text) is read as itself (strict=False); the
    arguments go out re-serialised, escaped."""
    try:
        return _call(json.loads(text, strict=False), ("arguments", "parameters"))
    except (ValueError, RecursionError):
        return None


def _llama_calls(body: str) -> list[dict] | None:
    """llama3_json's calls, one JSON object after another joined by `;` (decoded first, then split: a `;`
    inside an argument is text; raw control characters in strings read as hermes' are); None unless the whole
    body is calls."""
    decoder, calls, at = json.JSONDecoder(strict=False), [], 0
    while True:
        try:
            obj, at = decoder.raw_decode(body, at)
            call = _call(obj, ("parameters", "arguments"))
        except (ValueError, RecursionError):
            return None
        if call is None:
            return None
        calls.append(call)
        sep = _SEPARATOR.match(body, at)
        if sep.end() == len(body):
            return calls
        if ";" not in sep.group():
            return None
        at = sep.end()


def parse_calls(text: str, fmt: str) -> tuple[str | None, list[dict]]:
    """The reply's text outside its tool calls (None if empty) and the calls, in OpenAI's shape. A call that
    does not parse stays text; whitespace between a call and the text beside it is not content (the stream
    gives the same: ToolStream)."""
    if fmt == HERMES:
        calls, kept, at = [], [], 0
        for m in _HERMES_CALL.finditer(text):
            call = _hermes_call(m.group(1))
            if call is None:
                continue
            piece = text[at:m.start()]
            kept.append((piece.lstrip() if calls else piece).rstrip())
            calls.append(call)
            at = m.end()
        content = "".join(kept) + text[at:].lstrip() if calls else text
        return (content or None), calls
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].strip()
    calls = _llama_calls(body) if body.startswith("{") else None
    return (None, calls) if calls else (text or None, [])


def reply_calls(text: str, tools: Tools) -> tuple[str | None, list[dict]]:
    """A whole reply's content and calls under the request's tools: one call when parallel_tool_calls is
    false; a forced call's markup is never content (cut by max_tokens: no content and no call)."""
    content, calls = parse_calls(text, tools.format)
    if tools.forced is not None and not calls:
        content = None
    return content, calls if tools.parallel else calls[:1]


def _held_prefix(text: str, marker: str) -> int:
    """Length of text's longest suffix that could start `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _trailing_space(text: str) -> int:
    return len(text) - len(text.rstrip())


class ToolStream:
    """A streamed reply's text deltas -> (content delta, completed tool calls) as they become known; the same
    content and calls as reply_calls on the whole text. Whitespace is held until what follows it is known
    (a call drops it)."""

    def __init__(self, tools: Tools):
        self.tools, self.buffer, self.sent = tools, "", 0  # sent: calls emitted
        self.mode = "start" if tools.format == LLAMA else "text"
        self.after = False  # a call just closed: the whitespace that follows is not content
        self.calls: list[dict] = []

    def _keep(self, calls: list[dict]) -> list[dict]:
        out = calls if self.tools.parallel else calls[:max(1 - self.sent, 0)]
        self.sent += len(out)
        self.calls += out
        return out

    def _text(self, text: str) -> str:
        if self.after:
            text = text.lstrip()
            self.after = not text
        return text

    def push(self, delta: str) -> tuple[str, list[dict]]:
        self.buffer += delta
        if self.mode == "start":  # llama3_json: the first visible text says whether the reply is a call
            head = self.buffer.lstrip()
            if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
                return "", []
            self.mode = "json" if head.startswith(("{", PYTHON_TAG)) else "plain"
        if self.mode == "json":  # held whole: parsed at the end
            return "", []
        if self.mode == "plain":
            out, self.buffer = self.buffer, ""
            return out, []
        content, calls = "", []
        while True:
            at = self.buffer.find(OPEN)
            if at < 0:  # held: a possible start of OPEN, and the whitespace before it
                cut = len(self.buffer) - _held_prefix(self.buffer, OPEN)
                cut -= _trailing_space(self.buffer[:cut])
                content += self._text(self.buffer[:cut])
                self.buffer = self.buffer[cut:]
                break
            end = self.buffer.find(CLOSE, at)
            if end < 0:  # held: the open call and the whitespace before it
                cut = at - _trailing_space(self.buffer[:at])
                content += self._text(self.buffer[:cut])
                self.buffer = self.buffer[cut:]
                break
            block = self.buffer[at:end + len(CLOSE)]
            call = _hermes_call(_HERMES_CALL.fullmatch(block).group(1))
            if call is not None:
                content += self._text(self.buffer[:at].rstrip())
                calls.append(call)
                self.after = True
            else:
                content += self._text(self.buffer[:at] + block)
            self.buffer = self.buffer[end + len(CLOSE):]
        return content, self._keep(calls)

    def finish(self) -> tuple[str, list[dict]]:
        """The rest at the end of the reply: an unclosed call stays text (a forced one is dropped)."""
        rest, self.buffer = self.buffer, ""
        if self.mode in ("json", "start"):
            content, calls = parse_calls(rest, LLAMA)
            content = (content or "") if not calls else ""
        else:
            content, calls = self._text(rest), []
        if self.tools.forced is not None and not calls and not self.calls:
            content = ""
        return content, self._keep(calls)
