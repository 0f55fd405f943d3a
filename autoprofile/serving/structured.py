"""Structured output requests: what a body asks for (OpenAI's `response_format`, vLLM's
`structured_outputs` and its older `guided_*` fields, a forced tool call), compiled by xgrammar into a
grammar, one matcher per request for the engine (autoprofile.engine.grammar).

    spec = parse_structured(body)                  # None, or a Spec naming the field it came from
    grammars = Grammars(tokenizer, vocab_size)     # the tokenizer's xgrammar.TokenizerInfo, built once
    matcher = await grammars.matcher(spec)         # compiled on a worker thread, cached by its text;
                                                   # invalid (schema, regex, grammar): a 400 naming spec.param

JSON is compact (xgrammar's any_whitespace off: no unbounded runs of whitespace), and an object takes only
the properties its schema names (xgrammar's strict mode; OpenAI's `strict` asks for that too).
"""
from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

from autoprofile.serving.errors import bad
from models.config import BYTE_OFFSET, FIRST_FOLDED

CACHE_SIZE = 256  # compiled grammars kept, by their kind and text
FORMATS = ("text", "json_object", "json_schema")
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}


@dataclass(frozen=True)
class Spec:
    """One grammar a request asks for: kind (json, json_object, regex, choice, grammar, or a tool call's
    format: tool_hermes, tool_llama), its text (a JSON schema's canonical JSON, a regex, ...), the field."""

    kind: str
    source: str
    param: str


def _schema_text(value, param: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise bad(param, f"'{param}' must be a JSON schema (an object, or its JSON text)") from None
    if not isinstance(value, (dict, bool)):
        raise bad(param, f"'{param}' must be a JSON schema object, got {type(value).__name__}")
    return json.dumps(value, ensure_ascii=False)  # NOTE: key order is the output's order


def _response_format(value) -> Spec | None:
    if not isinstance(value, dict) or value.get("type") not in FORMATS:
        raise bad("response_format", "'response_format' must be {\"type\": \"text\"}, "
                  "{\"type\": \"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": "
                  "{\"name\", \"schema\", \"strict\"}}")
    extra = set(value) - {"type", "json_schema"}
    if extra:
        raise bad(f"response_format.{min(extra)}", f"unknown field 'response_format.{min(extra)}'")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Spec("json_object", "", "response_format")
    js = value.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("name"), str) or not js["name"]:
        raise bad("response_format.json_schema", "'response_format.json_schema' must be an object with a "
                  "'name' (string) and a 'schema' (JSON schema)")
    extra = set(js) - {"name", "schema", "strict", "description"}
    if extra:
        raise bad(f"response_format.json_schema.{min(extra)}",
                  f"unknown field 'response_format.json_schema.{min(extra)}'")
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise bad("response_format.json_schema.strict",
                  "'response_format.json_schema.strict' must be a boolean")
    if js.get("schema") is None:
        return Spec("json_object", "", "response_format.json_schema")
    param = "response_format.json_schema.schema"
    return Spec("json", _schema_text(js["schema"], param), param)


def _one(kind: str, value, param: str) -> Spec:
    if kind == "json":
        return Spec("json", _schema_text(value, param), param)
    if kind == "json_object":
        if value is not True:
            raise bad(param, f"'{param}' must be true")
        return Spec("json_object", "", param)
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise bad(param, f"'{param}' must be a non-empty list of non-empty strings")
        return Spec("choice", json.dumps(value, ensure_ascii=False), param)
    if not (isinstance(value, str) and value):
        raise bad(param, f"'{param}' must be a non-empty string")
    return Spec(kind, value, param)


def parse_structured(body: dict) -> Spec | None:
    """The grammar a body asks for (at most one of response_format, structured_outputs, guided_*)."""
    given = [k for k in ("response_format", "structured_outputs", *GUIDED) if body.get(k) is not None]
    if len(given) > 1:
        raise bad(given[1], f"'{given[1]}' and '{given[0]}' both constrain the output: send one")
    if not given:
        return None
    key = given[0]
    if key == "response_format":
        return _response_format(body[key])
    if key in GUIDED:
        return _one(GUIDED[key], body[key], key)
    so = body[key]
    if not isinstance(so, dict):
        raise bad(key, f"'{key}' must be an object with one of {', '.join(STRUCTURED_KEYS)}")
    asked = [k for k, v in so.items() if v is not None]
    unknown = [k for k in asked if k not in STRUCTURED_KEYS]
    if unknown:
        raise bad(f"{key}.{unknown[0]}", f"unknown field '{key}.{unknown[0]}': '{key}' takes one of "
                  f"{', '.join(STRUCTURED_KEYS)}")
    if len(asked) != 1:
        raise bad(key, f"'{key}' must hold exactly one of {', '.join(STRUCTURED_KEYS)}, got {asked}")
    return _one(asked[0], so[asked[0]], f"{key}.{asked[0]}")


# ---------------------------------------------------------------- the tokenizer's vocabulary for xgrammar
def tokenizer_info(tokenizer, vocab_size: int):
    """xgrammar's TokenizerInfo of a serving tokenizer (ByteTokenizer or HFTokenizer): each id's text,
    special ids empty (a grammar never emits them; its stop tokens are the tokenizer's EOS ids)."""
    import xgrammar
    stop = sorted(i for i in tokenizer.eos_token_ids if i < vocab_size)
    if hasattr(tokenizer, "tok"):  # HFTokenizer: tokenizer.json, its vocabulary as written there
        vocab = tokenizer.tok.get_vocab(with_added_tokens=True)
        encoded = [""] * max(vocab_size, max(vocab.values()) + 1)
        for piece, i in vocab.items():
            encoded[i] = "" if i in tokenizer.special_ids else piece
        meta = xgrammar.TokenizerInfo._detect_metadata_from_hf(tokenizer.tok.to_str())
        return xgrammar.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab_size,
                                      stop_token_ids=stop, add_prefix_space=meta["add_prefix_space"])
    encoded = [b"" if i in tokenizer.specials else bytes([i - BYTE_OFFSET]) if i < FIRST_FOLDED
               else tokenizer.decode([i]).encode() for i in range(vocab_size)]
    return xgrammar.TokenizerInfo(encoded, xgrammar.VocabType.RAW, vocab_size=vocab_size,
                                  stop_token_ids=stop)


def _ebnf_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


class Grammars:
    """Compiles specs for one tokenizer (xgrammar.GrammarCompiler); keeps the last CACHE_SIZE by text."""

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = CACHE_SIZE):
        import xgrammar
        self.info = tokenizer_info(tokenizer, vocab_size)
        self.compiler = xgrammar.GrammarCompiler(self.info, cache_enabled=False)
        self.cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self.cache_size = cache_size
        self.lock = threading.Lock()
        self.compiles = 0  # grammars compiled (not found in the cache)

    def compiled(self, spec: Spec):
        """The compiled grammar of spec (cached); a 400 naming spec.param if xgrammar refuses it."""
        key = (spec.kind, spec.source)
        with self.lock:
            hit = self.cache.get(key)
            if hit is not None:
                self.cache.move_to_end(key)
                return hit
        try:
            out = self._compile(spec)
        except (RuntimeError, ValueError, TypeError) as e:
            what = {"json": "JSON schema", "regex": "regular expression", "grammar": "EBNF grammar"}.get(
                spec.kind, "value")
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise bad(spec.param, f"'{spec.param}' is not a {what} this server can compile: "
                      f"{first[:300]}") from None
        with self.lock:
            self.compiles += 1
            self.cache[key] = out
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        return out

    def _compile(self, spec: Spec):
        import xgrammar
        c, kind, src = self.compiler, spec.kind, spec.source
        if kind == "json":
            return c.compile_json_schema(src, any_whitespace=False, strict_mode=True)
        if kind == "json_object":
            return c.compile_builtin_json_grammar()
        if kind == "regex":
            return c.compile_regex(src)
        if kind == "grammar":
            return c.compile_grammar(src)
        if kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(_ebnf_literal(s) for s in json.loads(src)))
        if kind in ("tool_hermes", "tool_llama"):
            call = xgrammar.Grammar.from_json_schema(src, any_whitespace=False, strict_mode=True)
            if kind == "tool_llama":
                return c.compile_grammar(call)
            parts = [xgrammar.Grammar.from_ebnf(f"root ::= {_ebnf_literal(t)}")
                     for t in ("<tool_call>\n", "\n</tool_call>")]
            return c.compile_grammar(xgrammar.Grammar.concat(parts[0], call, parts[1]))
        raise ValueError(f"unknown grammar kind {kind!r}")

    def new_matcher(self, spec: Spec):
        import xgrammar
        return xgrammar.GrammarMatcher(self.compiled(spec))

    async def matcher(self, spec: Spec):
        """A fresh matcher of spec, compiled off the event loop (a cache hit too: it may wait on the lock)."""
        return await asyncio.to_thread(self.new_matcher, spec)
