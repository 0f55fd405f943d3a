"""Text <-> token ids for the OpenAI endpoints: the model folder's tokenizer, or a byte-level one.

- A model folder with `tokenizer.json` is read with `tokenizers`; its chat template comes from
  `tokenizer_config.json` (or `chat_template.jinja`) and is rendered with jinja2 in a sandbox, as
  transformers does. EOS ids: `config.json` and `generation_config.json` `eos_token_id`, plus the
  `eos_token` of `tokenizer_config.json`.
- `--tokenizer FOLDER` names another folder's `tokenizer.json` (a checkpoint folder without one needs it).
- Random-weight models (built-in, or --load_format dummy) without `tokenizer.json` get `ByteTokenizer`: UTF-8
  bytes, one id each (byte b is id b + 3); ids 0..2 and the config's BOS/EOS ids are specials and decode
  to nothing; every other id (>= 259: random weights emit any id of the vocabulary) decodes to one
  printable ASCII character, chr(32 + (id - 259) % 95). Text round-trips; any id decodes.

`TextStream` turns a request's output ids into text deltas: incremental detokenization (a window of
the previous tokens gives each new one its context; text ending in an incomplete character is held)
and stop strings (the first stop string to complete ends the text and is not part of it; text that could
be the start of a stop string is held back until it is known not to be).
"""
from __future__ import annotations

import json
import logging
import re
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from autoprofile.config import ServerConfig, tokenizer_problem
from autoprofile.model_config import BYTE_OFFSET, FIRST_FOLDED

log = logging.getLogger(__name__)

PRINTABLE = 95  # ' ' .. '~'
# Built-in models have no chat template of their own; this one names each role and ends ready for the reply.
# Its tools section and tool turns follow Qwen2.5's template (hermes: <tools>, <tool_call>, <tool_response>),
# shortened: the tiny models' contexts are a few hundred byte tokens.
BYTE_CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|system|>\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n' }}{%- endif %}
{{- '# Tools\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\nCall: <tool_call>\\n{"name": <name>, "arguments": <args>}\\n</tool_call>\\n' }}
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'system' and loop.first and tools %}
{%- elif m.role == 'assistant' and m.tool_calls %}
{{- '<|assistant|>\\n' + m.content }}
{%- for c in m.tool_calls %}
{%- set c = c.function if c.function is defined else c %}
{{- '<tool_call>\\n{"name": "' + c.name + '", "arguments": ' }}{{- c.arguments | tojson }}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '\\n' }}
{%- elif m.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|user|>' }}{%- endif %}
{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '\\n' }}{%- endif %}
{%- else %}
{{- '<|' + m.role + '|>\\n' + m.content + '\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"""
CONTEXT_TOKENS = 5  # prompt tokens that give the first output token its detokenization context (as vLLM)


class ChatTemplateError(ValueError):
    """The template rejected the messages (e.g. roles that do not alternate): the client's mistake."""


@dataclass(frozen=True)
class ChatOptions:
    """How a chat is rendered (vLLM's request fields): the assistant's header after the messages, or the last
    message left open for the model to continue (transformers' continue_final_message: the text after its
    content is cut); kwargs: extra template variables (chat_template_kwargs, e.g. enable_thinking)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: tuple[tuple[str, object], ...] = ()


RESERVED = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")  # the template's own


def cut_after_final(text: str, final: str) -> str:
    """The render cut right after the final message's content (its end-of-turn and what follows go)."""
    at = text.rfind(final.strip()) if final.strip() else -1
    if at < 0:
        raise ChatTemplateError("continue_final_message: the chat template does not render the final "
                                "message's content as given, so it cannot be left open")
    return text[:at + len(final.strip())]


class Verbatim(str):
    """Text the server puts into a message (an image's mark): tokenized as the template's own text, its
    special tokens kept. Any other text of a message is the client's: special-token text there is plain
    text."""


Span = tuple[int, int]


@dataclass(frozen=True)
class RenderedChat:
    """The chat template's text, and where the clients' text lies in it (None: the template changed that
    text, e.g. trimmed it, so its place is unknown); texts: (message index, client text), in order."""

    text: str
    client: tuple[Span, ...] | None
    texts: tuple[tuple[int, str], ...]


def _pieces(content) -> list[str]:
    return [content] if isinstance(content, str) else list(content)


def client_spans(skeleton: str, slot: re.Pattern, texts: Sequence[str], text: str) -> tuple[Span, ...] | None:
    """The spans of texts in text, read off the skeleton (the same render with slot k in place of texts[k]);
    None unless each slot appears once, in order, and filling them gives text back."""
    out, spans, at, length = [], [], 0, 0
    for m in slot.finditer(skeleton):
        k = len(spans)
        if k >= len(texts) or int(m.group(1)) != k:
            return None
        out += [skeleton[at:m.start()], texts[k]]
        length += m.start() - at
        spans.append((length, length + len(texts[k])))
        length, at = length + len(texts[k]), m.end()
    out.append(skeleton[at:])
    return tuple(spans) if len(spans) == len(texts) and "".join(out) == text else None


def _ids(value) -> set[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return {value}
    return {v for v in value if isinstance(v, int)} if isinstance(value, list) else set()


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.policies["json.dumps_kwargs"] = {"ensure_ascii": False}
        env.globals.update(raise_exception=raise_exception,
                           strftime_now=lambda fmt: datetime.now().strftime(fmt))
        self.template = env.from_string(source)
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: list[dict], tools: list[dict] | None = None,
               options: ChatOptions = ChatOptions()) -> str:
        from jinja2 import TemplateError
        try:
            text = self.template.render(**dict(options.kwargs), messages=messages,
                                        add_generation_prompt=options.add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token, tools=tools or None)
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template rejected the messages: {e}") from None
        if options.continue_final_message and messages:
            return cut_after_final(text, "".join(_pieces(messages[-1]["content"])))
        return text

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    options: ChatOptions = ChatOptions()) -> RenderedChat:
        """messages' content: a string (the client's) or a list of pieces (Verbatim: the server's). Rendered
        twice, the second time with a slot for each client text, to learn where those texts lie."""
        nonce = secrets.token_hex(8)
        texts, plain, marked = [], [], []
        for i, m in enumerate(messages):
            pieces = _pieces(m["content"])
            plain.append({**m, "content": "".join(pieces)})
            slots = []
            for p in pieces:
                if isinstance(p, Verbatim) or not p:
                    slots.append(str(p))
                else:
                    slots.append(f"\x00{nonce}.{len(texts)}\x00")
                    texts.append((i, p))
            marked.append({**m, "content": "".join(slots)})
        text = self.render(plain, tools, options)
        slot = re.compile(f"\x00{nonce}\\.(\\d+)\x00")
        skeleton = self.render(marked, tools, options)
        return RenderedChat(text, client_spans(skeleton, slot, [t for _, t in texts], text), tuple(texts))


class ByteTokenizer:
    """UTF-8 bytes as ids (see the module docstring for every id's text)."""

    kind = "byte-level"

    def __init__(self, vocab_size: int, eos_token_ids: Iterable[int] = (), specials: Iterable[int] = ()):
        if vocab_size < FIRST_FOLDED:
            raise ValueError(f"a byte-level tokenizer needs a vocabulary of >= {FIRST_FOLDED} ids, got "
                             f"{vocab_size}")
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.specials = frozenset(range(BYTE_OFFSET)) | self.eos_token_ids | frozenset(specials)
        self.special_texts: tuple[str, ...] = ()  # no text encodes to a special id
        self.chat = ChatTemplate(BYTE_CHAT_TEMPLATE)

    def encode(self, text: str, add_special_tokens: bool = True, plain: Sequence[Span] = ()) -> list[int]:
        return [b + BYTE_OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        out, raw = [], bytearray()
        for i in ids:
            if i in self.specials:
                continue
            if i < FIRST_FOLDED:
                raw.append(i - BYTE_OFFSET)
                continue
            out.append(raw.decode("utf-8", errors="replace"))
            raw.clear()
            out.append(chr(32 + (i - FIRST_FOLDED) % PRINTABLE))
        out.append(raw.decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            options: ChatOptions = ChatOptions()) -> str:
        return self.chat.render(messages, tools, options)

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    options: ChatOptions = ChatOptions()) -> RenderedChat:
        return self.chat.render_chat(messages, tools, options)


class HFTokenizer:
    """A model folder's tokenizer.json (+ tokenizer_config.json's chat template and EOS)."""

    kind = "tokenizer.json"

    def __init__(self, folder: Path, config: dict):
        from tokenizers import Tokenizer
        self.tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        # NOTE: a second tokenizer, not a toggled flag: encodes run on several threads at once
        self.as_text = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.as_text.encode_special_tokens = True  # special-token text -> the ids of its characters
        added = self.tok.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self.special_texts = tuple(sorted((added[i].content for i in self.special_ids), key=len,
                                          reverse=True))
        tc = _read_json(folder / "tokenizer_config.json")
        gen = _read_json(folder / "generation_config.json")
        bos, eos = _token_text(tc.get("bos_token")), _token_text(tc.get("eos_token"))
        eos_ids = _ids(config.get("eos_token_id")) | _ids(gen.get("eos_token_id"))
        if eos is not None and self.tok.token_to_id(eos) is not None:
            eos_ids.add(self.tok.token_to_id(eos))
        self.eos_token_ids = frozenset(eos_ids)
        source = tc.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        if source is None and (folder / "chat_template.jinja").is_file():
            source = (folder / "chat_template.jinja").read_text()
        self.chat = ChatTemplate(source, bos or "", eos or "") if isinstance(source, str) else None

    def encode(self, text: str, add_special_tokens: bool = True, plain: Sequence[Span] = ()) -> list[int]:
        """text's ids; special-token text inside a `plain` span (a client's text) is encoded as text, as if
        it were ordinary characters (the text elsewhere is split at special tokens as tokenizers does)."""
        enc = self.tok.encode(text, add_special_tokens=add_special_tokens)
        if not plain:
            return enc.ids
        if add_special_tokens:
            raise ValueError("plain spans are for text without added BOS/EOS (add_special_tokens=False)")
        kept = [(t, s, e) for t, (s, e) in zip(enc.ids, enc.offsets)
                if t in self.special_ids and not any(a <= s and e <= b for a, b in plain)]
        if len(kept) == sum(t in self.special_ids for t in enc.ids):
            return enc.ids
        ids, at = [], 0
        for t, s, e in kept:
            ids += self._text_ids(text[at:s]) + [t]
            at = e
        return ids + self._text_ids(text[at:])

    def _text_ids(self, text: str) -> list[int]:
        return self.as_text.encode(text, add_special_tokens=False).ids if text else []

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def _template(self) -> ChatTemplate:
        if self.chat is None:
            raise ChatTemplateError("this model has no chat template (tokenizer_config.json has no "
                                    "chat_template): use /v1/completions")
        return self.chat

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            options: ChatOptions = ChatOptions()) -> str:
        return self._template().render(messages, tools, options)

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    options: ChatOptions = ChatOptions()) -> RenderedChat:
        return self._template().render_chat(messages, tools, options)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path) as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def load_tokenizer(cfg: ServerConfig) -> ByteTokenizer | HFTokenizer:
    """--tokenizer's or the model folder's tokenizer.json; the byte-level tokenizer for random weights
    without one. A checkpoint without one is refused (ValueError; the CLI refuses it at validation)."""
    mc = cfg.model_config
    if cfg.tokenizer_dir is not None:
        tok = HFTokenizer(cfg.tokenizer_dir, mc.raw)
    elif problem := tokenizer_problem(cfg):
        raise ValueError(problem)
    else:
        folder = Path(mc.path) if mc.path else None
        gen = _read_json(folder / "generation_config.json") if folder else {}
        eos = _ids(mc.raw.get("eos_token_id")) | _ids(gen.get("eos_token_id"))
        tok = ByteTokenizer(mc.vocab_size, eos, _ids(mc.raw.get("bos_token_id")))
    source = f" from {cfg.tokenizer_dir}" if cfg.tokenizer else ""
    log.info("tokenizer: %s%s, EOS ids %s", tok.kind, source, sorted(tok.eos_token_ids))
    return tok


# ---------------------------------------------------------------- streaming text out
class Detokenizer:
    """Incremental detokenization: decode a window from the last emitted boundary, emit the new text
    once it does not end in an incomplete character (U+FFFD)."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix = 0
        self.read = len(self.ids)

    def add(self, new_ids: Sequence[int]) -> str:
        self.ids += new_ids
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]

    def flush(self) -> str:
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(before):]


class TextStream:
    """Output ids in, text deltas out; stop strings end the text (excluded from it), looked for once more than
    min_tokens ids came (vLLM's: a stop string within the first min_tokens is text)."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int] = (), stop: Sequence[str] = (),
                 min_tokens: int = 0):
        self.detok = Detokenizer(tokenizer, prompt_ids)
        self.min_tokens, self.tokens = min_tokens, 0
        self.stop = tuple(stop)
        self.longest = max((len(s) for s in self.stop), default=0)
        self.text = ""
        self.sent = 0
        self.stopped = False

    def push(self, ids: Sequence[int]) -> str:
        """The text that can be sent now; sets .stopped when a stop string appeared (text ends before it)."""
        self.tokens += len(ids)
        return self._extend(self.detok.add(ids), final=False)

    def finish(self) -> str:
        """Everything still held (the request ended)."""
        return self._extend(self.detok.flush(), final=True)

    def _extend(self, delta: str, final: bool) -> str:
        if self.stopped:
            return ""
        start = max(len(self.text) - self.longest + 1, 0)
        self.text += delta
        # the stop string that completes first wins (then the one that starts first)
        stops = self.stop if self.tokens > self.min_tokens else ()
        hits = [(i + len(s), i) for s in stops if (i := self.text.find(s, start)) >= 0]
        if hits:
            self.text, self.stopped = self.text[:min(hits)[1]], True
            final = True
        end = len(self.text) if final else len(self.text) - self._partial_stop()
        out, self.sent = self.text[self.sent:end], max(end, self.sent)
        return out

    def _partial_stop(self) -> int:
        """Length of the longest end of the text that is the start of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best
