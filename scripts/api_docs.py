"""Write docs/api.md, the request fields' reference, from autoprofile.serving.protocol.FIELDS (which endpoints
take a field, and whether it is served, ignored or refused) and DESCRIPTIONS below (what a served field does).

    python3 scripts/api_docs.py           # write docs/api.md
    python3 scripts/api_docs.py --check   # exit 1 if docs/api.md is not what this writes

A field served without a description stops the script, naming it: add a line to DESCRIPTIONS.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoprofile.serving.protocol import (FIELDS, IGNORED, MESSAGE_FIELDS, SERVED,  # noqa: E402
                                          STREAM_OPTIONS, UNSUPPORTED)

OUT = ROOT / "docs" / "api.md"

DESCRIPTIONS: dict[str, str] = {
    "model": "`--served_model_name` or `--model` (may be left out; any other name is a 404)",
    "prompt": "a string or a list of token ids, or a list of those (`n` choices each, indexed prompt by "
              "prompt)",
    "messages": "the conversation, rendered with the model's chat template (text and `image_url` parts)",
    "add_special_tokens": "add the tokenizer's special tokens (BOS) to a prompt (default true)",
    "return_token_strs": "also return each token's text",
    "tokens": "the token ids to turn back into text",
    "max_tokens": "the most tokens to generate (completions: 16; chat: what the request limit leaves)",
    "max_completion_tokens": "chat's newer name of `max_tokens`",
    "stop": "strings that end the answer (not in the text)",
    "stream": "server-sent events (`data: {chunk}` lines, then `data: [DONE]`)",
    "stream_options": "`include_usage` (a last chunk with the usage), vLLM's `continuous_usage_stats` (the "
                      "usage so far in every chunk)",
    "ignore_eos": "keep generating past the end-of-sequence token",
    "temperature": "sampling temperature (default 1; 0 = greedy)",
    "top_p": "nucleus sampling: keep the most likely tokens whose probabilities sum to `top_p`",
    "top_k": "keep the `top_k` most likely tokens (-1 or 0: all)",
    "seed": "the request's own generator: the same seed gives the same tokens",
    "input_ids": "`/generate`: a list of prompts as token ids",
    "max_new_tokens": "`/generate`: exactly this many tokens each (no stop at EOS)",
    "store": "`/v1/responses`: keep the response for `previous_response_id` (default true); elsewhere a "
             "no-op",
    "presence_penalty": "[-2, 2]: `logit -= presence * (count > 0)` over the output tokens",
    "frequency_penalty": "[-2, 2]: `logit -= frequency * count` over the output tokens",
    "repetition_penalty": "> 0: positive logits of prompt and output tokens divided by it, negative ones "
                          "multiplied",
    "logit_bias": "`{\"token id\": -100..100}` added to those logits",
    "min_p": "[0, 1]: keep the tokens whose probability is at least `min_p` times the largest",
    "min_tokens": "EOS and `stop_token_ids` are masked until this many tokens are out",
    "stop_token_ids": "ids that end the request (not in the text)",
    "n": "1-128 choices; they share the prompt's KV pages; with `seed`, choice i draws from `seed + i`",
    "best_of": "completions: generate `best_of` (>= `n`) and return the `n` of highest cumulative logprob",
    "logprobs": "completions: 0-20 alternatives per token; chat: `true`. The log-softmax of the raw logits",
    "top_logprobs": "chat: 0-20 alternatives per token, with `logprobs: true`",
    "echo": "completions: the prompt before the text (with `logprobs`, its tokens' logprobs too)",
    "tools": "`function` tools, rendered by the chat template; replies parsed into `tool_calls`",
    "tool_choice": "`auto`, `none`, `required` or a named function (the last two are a grammar: one call)",
    "parallel_tool_calls": "allow several calls in one reply",
    "response_format": "`json_object`, `json_schema` (with `strict`): the reply matches it (xgrammar)",
    "structured_outputs": "vLLM's: `json`, `regex`, `choice`, `grammar` (EBNF) or `json_object`",
    "return_token_ids": "vLLM's: the prompt's and each choice's token ids",
    "prompt_logprobs": "vLLM's: the logprobs of the prompt's tokens (and that many alternatives)",
    "allowed_token_ids": "vLLM's: sample only among these ids",
    "prompt_logprobs": "vLLM's: each prompt token's logprob, rank and text with its position's top 0-20 (the "
                       "first token null; completions on each choice, chat beside the choices; streamed in "
                       "the first chunk)",
    "guided_json": "vLLM's older name of `structured_outputs.json`",
    "guided_regex": "vLLM's older name of `structured_outputs.regex`",
    "guided_choice": "vLLM's older name of `structured_outputs.choice`",
    "guided_grammar": "vLLM's older name of `structured_outputs.grammar`",
    "add_generation_prompt": "end the prompt with the assistant's turn opening (default true)",
    "continue_final_message": "leave the last (assistant) message open, to be continued",
    "chat_template_kwargs": "extra variables for the chat template (e.g. `{\"enable_thinking\": false}`)",
    "input": "`/v1/responses`: a string, or items (messages, `function_call` and `function_call_output`)",
    "instructions": "`/v1/responses`: a system message for this turn",
    "max_output_tokens": "`/v1/responses`: the most tokens to generate",
    "text": "`/v1/responses`: `format` (`text`, `json_object`, `json_schema`)",
    "previous_response_id": "`/v1/responses`: continue a stored response's conversation",
}


def endpoints(field) -> str:
    return ", ".join(f"`{e}`" for e in field.endpoints)


def accepted(noop) -> str:
    return "null" if noop is None else f"null or `{json.dumps(noop)}`"


def undescribed() -> list[str]:
    return [k for k, f in FIELDS.items() if f.kind == SERVED and k not in DESCRIPTIONS]


def render() -> str:
    missing = undescribed()
    if missing:
        raise SystemExit(f"scripts/api_docs.py: add a line to DESCRIPTIONS for the served field(s) "
                         f"{', '.join(missing)}")
    served = [f"| `{k}` | {endpoints(f)} | {DESCRIPTIONS[k]} |"
              for k, f in FIELDS.items() if f.kind == SERVED]
    refused = [f"| `{k}` | {endpoints(f)} | {accepted(f.noop)} |" for k, f in FIELDS.items()
               if f.kind == UNSUPPORTED]
    ignored = ", ".join(f"`{k}`" for k, f in FIELDS.items() if f.kind == IGNORED)
    options = ", ".join(f"`{k}`" for k, f in STREAM_OPTIONS.items() if f.kind == SERVED)
    message = ", ".join(f"`{k}`" for k, f in MESSAGE_FIELDS.items() if f.kind == SERVED)
    return "\n".join([
        "# Request fields",
        "",
        "Written by `python3 scripts/api_docs.py` from `autoprofile/serving/protocol.py` (`FIELDS`): do not",
        "edit by hand. The endpoints themselves, their answers and their errors: [server.md](server.md).",
        "",
        "A field the server does not know is a 400 naming it and the nearest known field; a value out of",
        "range is a 400 naming the field.",
        "",
        "## Served",
        "",
        "| field | endpoints | what it does |",
        "|---|---|---|",
        *served,
        "",
        f"`stream_options` takes {options}. A chat message takes {message}.",
        "",
        "## Accepted and ignored",
        "",
        f"OpenAI's fields that change nothing here: {ignored}.",
        "",
        "## Not implemented yet",
        "",
        "A 400 naming the field, unless its value is the one that asks for nothing:",
        "",
        "| field | endpoints | accepted values |",
        "|---|---|---|",
        *refused,
        "",
    ])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="compare docs/api.md with what this writes")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if OUT.read_text() != text:
            print("docs/api.md is out of date: run python3 scripts/api_docs.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
