"""Structured output requests: what a body asks for (OpenAI's `response_format`, vLLM's
`structured_outputs` and its older `guided_*` fields, a forced tool call), compiled by xgrammar into a
grammar, one matcher per request for the engine (autoprofile.engine.grammar).

    spec = parse_structured(body)                  # None, or a Spec naming the field it came from
    grammars = Grammars(tokenizer, vocab_size)     # the tokenizer's xgrammar.TokenizerInfo, built once
    matcher = await grammars.matcher(spec)         # compiled on a worker thread, cached by its text;
                                                   # invalid (schema, regex, grammar): a 400 naming spec.param

JSON is compact (xgrammar's any_whitespace off: no unbounded runs of whitespace), and an object takes only
the properties its schema names (xgrammar's strict mode; OpenAI's `strict` asks for that too). json_object
is any JSON object; with a "schema" beside it (instructor's JSON_SCHEMA mode), that schema.

Compile cost is bounded: a schema of at most MAX_SCHEMA_BYTES and MAX_SCHEMA_DEPTH (else a 400), a request
waits COMPILE_DEADLINE_S at most for its compile (else a 408), on Grammars' own threads (see Grammars).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from autoprofile.model_config import BYTE_OFFSET, FIRST_FOLDED
from autoprofile.serving.errors import APIError, bad

CACHE_SIZE = 256  # compiled grammars kept, by their kind and text
# xgrammar's compile time grows steeply with a schema's depth and width (this CPU: 300 nested objects 5 s,
# 2,000 optional properties 13 s, while 64 levels or 500 properties take 0.05-0.2 s): bounded here, and
# whatever passes the bounds by a deadline
MAX_SCHEMA_BYTES = 64 << 10  # a schema's (or regex's, grammar's) text
MAX_SCHEMA_DEPTH = 64  # JSON nesting of a schema (objects and arrays; an object property is 2 levels)
COMPILE_DEADLINE_S = 10.0  # a request waits this long for its compile (its queue wait included): then 408
COMPILE_THREADS = 2  # compiles at once within their deadline
MAX_OVERDUE = 2  # compiles past their deadline that stop holding a slot (they cannot be stopped)
FORMATS = ("text", "json_object", "json_schema")
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
_LOG_PREFIX = re.compile(r"^\[[\d:. -]+\]\s*\S+:\d+:\s*")  # "[09:53:37] /project/cpp/x.cc:4944: "
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}


@dataclass(frozen=True)
class Spec:
    """One grammar a request asks for: kind (json, json_object, regex, choice, grammar, or a tool call's
    format: tool_hermes, tool_llama), its text (a JSON schema's canonical JSON, a regex, ...), the field."""

    kind: str
    source: str
    param: str


def depth(value) -> int:
    """JSON nesting depth of a parsed value (a scalar is 0, {} and [] are 1), without recursion."""
    most, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, dict | list):
            most = max(most, d)
            todo += [(x, d + 1) for x in (v.values() if isinstance(v, dict) else v)]
    return most


def check_schema(value, param: str) -> str:
    """A JSON schema's canonical text, within MAX_SCHEMA_BYTES and MAX_SCHEMA_DEPTH (the compile cost grows
    steeply with both); a 400 naming param otherwise."""
    text = json.dumps(value, ensure_ascii=False)  # NOTE: key order is the output's order
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise bad(param, f"'{param}' is {len(text.encode())} bytes as JSON; this server compiles schemas of "
                  f"at most {MAX_SCHEMA_BYTES} bytes", code="schema_too_large")
    if depth(value) > MAX_SCHEMA_DEPTH:
        raise bad(param, f"'{param}' nests {depth(value)} levels of objects and arrays; this server compiles "
                  f"schemas of at most {MAX_SCHEMA_DEPTH} levels (use $defs and $ref for shared parts)",
                  code="schema_too_deep")
    return text


def _schema_text(value, param: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except RecursionError:
            raise bad(param, f"'{param}' nests deeper than the JSON parser allows; this server compiles "
                      f"schemas of at most {MAX_SCHEMA_DEPTH} levels", code="schema_too_deep") from None
        except ValueError:
            raise bad(param, f"'{param}' must be a JSON schema (an object, or its JSON text)") from None
    if not isinstance(value, (dict, bool)):
        raise bad(param, f"'{param}' must be a JSON schema object, got {type(value).__name__}")
    return check_schema(value, param)


def _response_format(value) -> Spec | None:
    if not isinstance(value, dict) or value.get("type") not in FORMATS:
        raise bad("response_format", "'response_format' must be {\"type\": \"text\"}, "
                  "{\"type\": \"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": "
                  "{\"name\", \"schema\", \"strict\"}}")
    kind = value["type"]
    extra = set(value) - {"type", "json_schema", *(("schema",) if kind == "json_object" else ())}
    if extra:
        raise bad(f"response_format.{min(extra)}", f"unknown field 'response_format.{min(extra)}'")
    if kind == "text":
        return None
    if kind == "json_object":  # instructor's JSON_SCHEMA mode adds a "schema" (vLLM honours it)
        if value.get("schema") is None:
            return Spec("json_object", "", "response_format")
        return Spec("json", _schema_text(value["schema"], "response_format.schema"), "response_format.schema")
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
    if len(value.encode()) > MAX_SCHEMA_BYTES:
        raise bad(param, f"'{param}' is {len(value.encode())} bytes; this server compiles at most "
                  f"{MAX_SCHEMA_BYTES}", code="schema_too_large")
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


def compile_error(e: Exception) -> str:
    """xgrammar's message without its log prefix (time, source file and line)."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return _LOG_PREFIX.sub("", first).strip()[:300]


@dataclass
class CompileStats:
    """Compiles since start, for /metrics."""

    compiles: int = 0  # grammars compiled (not found in the cache)
    seconds: float = 0.0  # their compile time
    hits: int = 0  # requests served from the cache (or joining a compile in flight)
    invalid: int = 0  # specs xgrammar refused (400)
    timeouts: int = 0  # requests answered 408: their compile passed the deadline
    running: int = 0  # compiles in flight
    overdue: int = 0  # of which past their deadline


@dataclass
class _Compile:
    """One compile in flight, shared by every request for its spec."""

    future: concurrent.futures.Future
    slot: bool = True  # holds a slot: until it ends, or passes its deadline while MAX_OVERDUE allow
    overdue: bool = False


class Grammars:
    """Compiles specs for one tokenizer (xgrammar.GrammarCompiler); keeps the last CACHE_SIZE by text.

    matcher(): a cache hit is a new matcher at once, on the event loop; a miss waits for one of `threads`
    slots, then compiles on this object's own threads (never the default executor); the same spec in flight
    is compiled once. A request waits `deadline_s` at most (slot and compile), then gets a 408; the compile
    goes on (xgrammar cannot be stopped) and its result is cached. A compile past its deadline gives its
    slot back (at most `max_overdue` at once), so slow schemas cannot hold every slot."""

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = CACHE_SIZE,
                 threads: int = COMPILE_THREADS, deadline_s: float = COMPILE_DEADLINE_S,
                 max_overdue: int = MAX_OVERDUE):
        import xgrammar
        self.info = tokenizer_info(tokenizer, vocab_size)
        self.compiler = xgrammar.GrammarCompiler(self.info, cache_enabled=False)
        self.cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self.cache_size = cache_size
        self.lock = threading.Lock()
        self.stats = CompileStats()
        self.threads, self.deadline_s, self.max_overdue = threads, deadline_s, max_overdue
        self.pool = concurrent.futures.ThreadPoolExecutor(threads + max_overdue, "grammar-compile")
        self.pending: dict[tuple[str, str], _Compile] = {}  # event-loop side
        self._slots: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def compiles(self) -> int:
        return self.stats.compiles

    def _cached(self, key: tuple[str, str]):
        with self.lock:
            hit = self.cache.get(key)
            if hit is not None:
                self.cache.move_to_end(key)
            return hit

    def cached(self, spec: Spec) -> bool:
        """Whether spec's grammar is compiled and kept."""
        return self._cached((spec.kind, spec.source)) is not None

    def compiled(self, spec: Spec):
        """The compiled grammar of spec (cached); a 400 naming spec.param if xgrammar refuses it."""
        key = (spec.kind, spec.source)
        hit = self._cached(key)
        if hit is not None:
            return hit
        start = time.perf_counter()
        try:
            out = self._compile(spec)
        except (RuntimeError, ValueError, TypeError) as e:
            self.stats.invalid += 1
            what = {"json": "JSON schema", "regex": "regular expression", "grammar": "EBNF grammar"}.get(
                spec.kind, "value")
            raise bad(spec.param, f"'{spec.param}' is not a {what} this server can compile: "
                      f"{compile_error(e)}") from None
        with self.lock:
            self.stats.compiles += 1
            self.stats.seconds += time.perf_counter() - start
            self.cache[key] = out
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        return out
    def _compile(self, spec: Spec):
        import xgrammar
        c, kind, src = self.compiler, spec.kind, spec.source
        if kind == "json":
            return c.compile_json_schema(src, any_whitespace=False, strict_mode=True)
        if kind == "json_object":  # an object, as OpenAI and vLLM give (not any JSON value)
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
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

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # NOTE: an asyncio.Semaphore belongs to one event loop
            self._loop, self._slots, self.pending = loop, asyncio.Semaphore(self.threads), {}
        return self._slots

    def _start(self, key: tuple[str, str], spec: Spec) -> _Compile:
        job = self.pending[key] = _Compile(self.pool.submit(self.compiled, spec))
        self.stats.running += 1
        loop = self._loop

        def ended(_) -> None:
            try:
                loop.call_soon_threadsafe(self._ended, key, job)
            except RuntimeError:  # the event loop is closed
                pass
        job.future.add_done_callback(ended)
        return job

    def _ended(self, key: tuple[str, str], job: _Compile) -> None:
        if self.pending.get(key) is job:
            del self.pending[key]
        self.stats.running -= 1
        self.stats.overdue -= job.overdue
        if job.slot:
            self._slots.release()

    def _overdue(self, job: _Compile) -> None:
        """A request's deadline passed while job compiles: it gives its slot back if MAX_OVERDUE allow."""
        if job.future.done() or job.overdue:
            return
        job.overdue = True
        self.stats.overdue += 1
        if job.slot and self.stats.overdue <= self.max_overdue:
            job.slot = False
            self._slots.release()

    async def matcher(self, spec: Spec):
        """A fresh matcher of spec: a 400 if xgrammar refuses it, a 408 past the deadline."""
        import xgrammar
        key = (spec.kind, spec.source)
        hit = self._cached(key)
        if hit is not None:
            self.stats.hits += 1
            return xgrammar.GrammarMatcher(hit)
        slots, start = self._semaphore(), time.monotonic()
        job = self.pending.get(key)
        try:
            if job is None:
                await asyncio.wait_for(slots.acquire(), self.deadline_s)
                job = self.pending.get(key)  # started by another request meanwhile
                if job is None:
                    job = self._start(key, spec)
                else:
                    slots.release()
            else:
                self.stats.hits += 1
            left = self.deadline_s - (time.monotonic() - start)
            out = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(job.future)), max(left, 0))
        except TimeoutError:
            self.stats.timeouts += 1
            if job is not None:
                self._overdue(job)
            raise APIError(408, f"'{spec.param}' did not compile within {self.deadline_s:g} s (this "
                           f"server's compile deadline; {self.stats.running} compiles running): send a "
                           "smaller schema, or retry later (the compile goes on, and its result is kept)",
                           param=spec.param, code="grammar_compile_timeout") from None
        return xgrammar.GrammarMatcher(out)
