"""Structured output's host-side mask fill (autoprofile.engine.grammar.TokenBitmask.fill), CPU only: the
median time to fill the next-token bitmask of 1, 16, 64, 256 rows of a JSON schema grammar, each row's
matcher advanced to a random place of one answer, filled one row at a time (the matcher's own call, as before) and
batched (xgrammar.BatchGrammarMatcher on 1 thread and on fill_threads()), side by side (runs interleaved);
every batched fill is checked bit-identical to the per-row one. speedup: per-row / batched on fill_threads().

    python3 scripts/bench_grammar_fill.py                      # a 128k byte-level vocabulary
    python3 scripts/bench_grammar_fill.py --vocab 32000 --rows 1,16,64,256 --repeats 30
    python3 scripts/bench_grammar_fill.py --tokenizer MODEL_FOLDER  # a checkpoint's tokenizer.json

The vocabulary is synthetic, byte-level like a real BPE's: the 256 bytes, then pieces drawn from words,
" word", digits, and a few with JSON punctuation (seeded).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from autoprofile.engine.grammar import TokenBitmask, fill_threads  # noqa: E402

SCHEMA = {"type": "object", "required": ["id", "name", "email", "tags", "score", "active", "address"],
          "properties": {"id": {"type": "integer"}, "name": {"type": "string"},
                         "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z]+\\.[a-z]{2,3}$"},
                         "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
                         "score": {"type": "number"}, "active": {"type": "boolean"},
                         "address": {"type": "object", "required": ["street", "city", "zip"],
                                     "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}
LETTERS = "abcdefghijklmnopqrstuvwxyz"
PUNCT = ['{"', '":', '",', '"}', '},', '["', '"]', '":"', '", "', ': ', ', ', '.', '@', '-', '_', '\\n', '\\"']


def vocabulary(size: int, seed: int = 0) -> list[bytes]:
    """A byte-level vocabulary of `size` distinct tokens: the 256 bytes, then word-like pieces; id 0 is EOS."""
    rng = random.Random(seed)
    out, seen = [bytes([b]) for b in range(256)], set()
    seen.update(out)
    while len(out) < size:
        kind = rng.random()
        word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 9)))
        if kind < 0.5:
            piece = " " + word
        elif kind < 0.9:
            piece = word.capitalize() if rng.random() < 0.2 else word
        elif kind < 0.97:
            piece = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 3)))
        elif kind < 0.99:  # NOTE: pieces with a quote or escape are the fill's slow ones: kept rare, as in BPEs
            piece = rng.choice(PUNCT) + (word if rng.random() < 0.5 else "")
        else:
            piece = word + rng.choice(PUNCT)
        b = piece.encode()
        if b not in seen:
            seen.add(b)
            out.append(b)
    return out


DOC = {"id": 4821, "name": "Ada Lovelace of the analytical engine", "email": "ada.l@math.org",
       "tags": ["math", "poetry science", "engines"], "score": 97.25, "active": True,
       "address": {"street": "12 St James Square", "city": "London", "zip": "12345"}}


def doc_tokens(info) -> list[int]:
    """DOC (an answer to SCHEMA) as token ids: the longest vocabulary piece at each place."""
    pieces = {}
    for i, piece in enumerate(info.decoded_vocab):
        if piece and i not in info.special_token_ids:
            pieces.setdefault(piece, i)
    longest = max(map(len, pieces))
    doc, out, at = json.dumps(DOC).encode(), [], 0
    while at < len(doc):
        size = next(k for k in range(min(longest, len(doc) - at), 0, -1) if doc[at:at + k] in pieces)
        out.append(pieces[doc[at:at + size]])
        at += size
    return out


def matchers(compiled, tokens: list[int], n: int, seed: int) -> list:
    """n matchers of one grammar, each advanced by a random prefix of an answer's tokens (every place of
    the answer alike: keys, numbers, inside strings)."""
    import xgrammar
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        m = xgrammar.GrammarMatcher(compiled)
        for t in tokens[:rng.randrange(len(tokens))]:
            if not m.accept_token(t):
                raise SystemExit(f"the grammar refused token {t} of its own answer")
        out.append(m)
    return out


def median_ms(fns: list, repeats: int) -> list[float]:
    """The median ms of each fn, their runs interleaved (a shared host's load drifts alike over all)."""
    for fn in fns:
        fn()  # warm
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
    return [statistics.median(ts) for ts in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=128000, help="vocabulary size (>= 512), e.g. 32000 or 128000")
    ap.add_argument("--tokenizer", default=None,
                    help="a model folder with a tokenizer.json (its vocabulary instead of the synthetic one)")
    ap.add_argument("--rows", default="1,16,64,256", help="comma-separated row counts, e.g. 1,16,64,256")
    ap.add_argument("--repeats", type=int, default=20, help="timed fills per case (median), e.g. 20")
    args = ap.parse_args()
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        ap.error(f"--rows must be comma-separated integers, e.g. 1,16,64,256, got {args.rows!r}")
    if args.vocab < 512:
        ap.error(f"--vocab must be >= 512, e.g. 128000, got {args.vocab}")
    if min(rows) < 1 or args.repeats < 1:
        ap.error("--rows and --repeats must be >= 1, e.g. --rows 1,16,64,256 --repeats 20")
    import xgrammar
    t = time.perf_counter()
    if args.tokenizer is not None:
        if not (Path(args.tokenizer) / "tokenizer.json").is_file():
            ap.error(f"--tokenizer must be a folder with a tokenizer.json, e.g. a model checkpoint's folder, "
                     f"got {args.tokenizer}")
        from autoprofile.serving.structured import tokenizer_info
        from autoprofile.serving.tokenizer import HFTokenizer
        tok = HFTokenizer(Path(args.tokenizer), {})
        vocab_size = tok.tok.get_vocab_size(with_added_tokens=True)
        info, source = tokenizer_info(tok, vocab_size), args.tokenizer
    else:
        vocab_size, source = args.vocab, "synthetic byte-level"
        info = xgrammar.TokenizerInfo(vocabulary(vocab_size), xgrammar.VocabType.RAW, vocab_size=vocab_size,
                                      stop_token_ids=[0])
    compiled = xgrammar.GrammarCompiler(info, cache_enabled=False).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, strict_mode=True)
    pool = matchers(compiled, doc_tokens(info), max(rows), seed=1)
    threads = fill_threads()
    print(f"vocab {vocab_size} ({source}), JSON schema, {threads} fill threads (fill_threads), setup "
          f"{time.perf_counter() - t:.1f}s, median of {args.repeats}")
    print(f"{'rows':>5} {'per-row ms':>11} {'batched 1t ms':>14} {f'batched {threads}t ms':>15} {'speedup':>8}")
    for n in rows:
        pairs = list(zip(range(n), pool[:n]))
        ref = TokenBitmask(n, vocab_size, torch.device("cpu"))
        one = TokenBitmask(n, vocab_size, torch.device("cpu"))
        one._batch = xgrammar.BatchGrammarMatcher(1)
        many = TokenBitmask(n, vocab_size, torch.device("cpu"))
        many._batch = xgrammar.BatchGrammarMatcher(threads)

        def per_row():
            for i, m in pairs:
                m.fill_next_token_bitmask(ref.host, i)

        def batched(mask):
            # the batched call even for one row (TokenBitmask.fill takes the matcher's own call there)
            mask._batch.batch_fill_next_token_bitmask([m for _, m in pairs], mask.host, [i for i, _ in pairs])

        a, b, c = median_ms([per_row, lambda: batched(one), lambda: batched(many)], args.repeats)
        if not (torch.equal(ref.host, one.host) and torch.equal(ref.host, many.host)):
            raise SystemExit(f"{n} rows: the batched fill differs from the per-row fill")
        print(f"{n:>5} {a:>11.3f} {b:>14.3f} {c:>15.3f} {a / c:>7.2f}x")


if __name__ == "__main__":
    main()
