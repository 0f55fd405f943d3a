"""Logits processors, vLLM's semantics and order, on the logits of a step's sampled rows before the sampler:
1. logit_bias: bias added to the token's logit;
2. min_tokens: the row's stop tokens (EOS and stop_token_ids: Request.stop_token_ids) to -inf while fewer than
   min_tokens output tokens exist, unless no other token is left (a grammar that allows only its end: the
   grammar wins, and the request ends short of min_tokens);
3. penalties: repetition_penalty on every token of the prompt or the output (a positive logit / r, a negative
   one * r), then logit -= frequency * count + presence * (count > 0) over the output tokens only;
4. min_p (sampled rows: greedy rows take the argmax of 1-3): tokens whose probability at the row's temperature
   is below min_p * the row's largest are -inf (logit < max + T * ln(min_p)); the sampler's top-k/top-p then
   work on what is left, as vLLM applies min_p before them.
Host side: a batch whose rows ask for none of it never reaches this module (SamplingParams.processed).

The token counts: made on the device each step from the rows' token lists (vLLM V1 does the same from
its token arrays), PROCESS_ROWS rows at a time: counts [PROCESS_ROWS, vocab] int32 and the masks are
transient, bounded whatever the rows (sampling.process_bytes_per_row, inside sampler_workspace_bytes). No
counts persist between steps: preemption and recompute need nothing. The overlapped engine: a decode row's
last output token may still be PENDING on the host; it is read on the device from ReqTable.last_tokens (the
token the slot sampled last), as the decode row's own input id is. Host cost: each processed row's prompt
and output ids go up every step (one pinned copy per PROCESS_ROWS rows).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from autoprofile.engine.request import PENDING
from autoprofile.engine.sampling import PROCESS_ROWS, SamplingParams
from autoprofile.engine.step_inputs import Staging, upload_array


@dataclass(frozen=True)
class RowTokens:
    """One processed row's host inputs: its parameters, prompt ids, output ids (PENDING: on the device) and
    stop ids; slot: its request slot (where a PENDING token is read)."""

    params: SamplingParams
    prompt: np.ndarray
    output: np.ndarray
    stop: tuple[int, ...]
    slot: int


def processed_rows(params: Sequence[SamplingParams]) -> list[int]:
    """The rows a processor runs on (host-side: [] skips the module)."""
    return [i for i, p in enumerate(params) if p.processed]


def row_tokens(row) -> RowTokens:
    """A StepRow's inputs. A stress row (no request) counts its whole context as prompt and as output, the
    most tokens a row of that context can upload (the counts' memory does not depend on the ids)."""
    req = row.request
    if req is None:
        context = np.resize(np.asarray(row.ids, dtype=np.int64), row.start + len(row.ids))
        return RowTokens(row.params, context, context, (), row.slot)
    if req.prompt_array is None:  # the prompt never changes: converted once, not every step
        req.prompt_array = np.asarray(req.prompt_ids, dtype=np.int64)
    return RowTokens(row.params, req.prompt_array, np.asarray(req.output_ids, dtype=np.int64),
                     tuple(sorted(req.stop_token_ids)), row.slot)


def apply(logits: torch.Tensor, rows: Sequence[int], tokens: Sequence[RowTokens],
          last_tokens: torch.Tensor | None = None, staging: Staging | None = None) -> None:
    """Process logits [B, V] in place at `rows` (indices into B, each with its RowTokens), PROCESS_ROWS at a
    time. last_tokens: the request table's (a PENDING output id reads its slot's entry)."""
    for lo in range(0, len(rows), PROCESS_ROWS):
        _apply_chunk(logits, rows[lo:lo + PROCESS_ROWS], tokens[lo:lo + PROCESS_ROWS], last_tokens, staging)


def _local(lists: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(row index of each id, ids) of a chunk's per-row id arrays."""
    lens = np.fromiter((len(a) for a in lists), np.int64, len(lists))
    ids = np.concatenate(lists) if lists else np.zeros(0, np.int64)
    return np.repeat(np.arange(len(lists), dtype=np.int64), lens), ids.astype(np.int64, copy=False)


def _host_inputs(rows: Sequence[int], tokens: Sequence[RowTokens]) -> tuple[list[np.ndarray], np.ndarray]:
    """The chunk's int64 arrays (row indices; prompt, output, bias and stop (row, id) pairs; PENDING outputs
    as -1 - slot) and fp64 arrays (bias values; per row: repetition, frequency, presence, min_p offset)."""
    none = np.zeros(0, np.int64)
    p_row, p_ids = _local([t.prompt if t.params.repetition_penalty != 1 else none for t in tokens])
    outputs = [t.output if t.params.penalized else none for t in tokens]
    o_row, o_ids = _local(outputs)
    slots = np.fromiter((t.slot for t in tokens), np.int64, len(tokens))[o_row]
    o_ids = np.where(o_ids == PENDING, -1 - slots, o_ids)  # read on the device from the slot's last token
    bias = [(i, tok, b) for i, t in enumerate(tokens) for tok, b in t.params.logit_bias]
    stop = [(i, tok) for i, t in enumerate(tokens) if len(t.output) < t.params.min_tokens for tok in t.stop]
    ints = [np.asarray(rows, np.int64), p_row, p_ids, o_row, o_ids,
            np.asarray([b[0] for b in bias], np.int64), np.asarray([b[1] for b in bias], np.int64),
            np.asarray([s[0] for s in stop], np.int64), np.asarray([s[1] for s in stop], np.int64)]
    floats = np.concatenate([np.asarray([b[2] for b in bias], np.float64),
                             [t.params.repetition_penalty for t in tokens],
                             [t.params.frequency_penalty for t in tokens],
                             [t.params.presence_penalty for t in tokens],
                             [_min_p_offset(t.params) for t in tokens]])
    return ints, floats


def _min_p_offset(p: SamplingParams) -> float:
    """T * ln(min_p): a token is kept when its logit >= the row's max + this (-inf: min_p off, or greedy)."""
    return p.temperature * math.log(p.min_p) if p.min_p > 0 and p.temperature > 0 else -math.inf


def _apply_chunk(logits: torch.Tensor, rows: Sequence[int], tokens: Sequence[RowTokens],
                 last_tokens: torch.Tensor | None, staging: Staging | None) -> None:
    dev, vocab, n = logits.device, logits.shape[1], len(rows)
    ints, floats = _host_inputs(rows, tokens)
    ends = np.cumsum([len(a) for a in ints]).tolist()
    flat_i = upload_array(np.concatenate(ints), dev, staging)
    idx, p_row, p_ids, o_row, o_ids, b_row, b_ids, s_row, s_ids = (
        flat_i[e - len(a):e] for a, e in zip(ints, ends))
    # the fp64 values ride the same int64 buffers, bit for bit
    bits = np.ascontiguousarray(floats, np.float64).view(np.int64)
    flat_f = upload_array(bits, dev, staging).view(torch.float64).float()
    nb = len(ints[5])
    b_val = flat_f[:nb]
    rep, freq, pres, min_p_offset = (v.unsqueeze(1) for v in flat_f[nb:].view(4, n))
    x = logits[idx].float()
    if nb:
        x.index_put_((b_row, b_ids), b_val, accumulate=True)
    if len(ints[7]):  # the stop tokens to -inf, unless that leaves a row nothing (a grammar's end wins)
        kept = x[s_row, s_ids]
        x.index_put_((s_row, s_ids), torch.full((), float("-inf"), device=dev))  # a fill: no blocking copy
        ended = x.amax(dim=-1) == float("-inf")
        x.index_put_((s_row, s_ids), torch.where(ended[s_row], kept, float("-inf")))
    if any(t.params.penalized for t in tokens):  # the counts of the output tokens (none yet: zeros)
        if last_tokens is not None:
            pending = o_ids < 0
            o_ids = torch.where(pending, last_tokens[(-1 - o_ids).clamp_(min=0)].long(), o_ids)
        counts = torch.zeros(n, vocab, dtype=torch.int32, device=dev)
        counts.index_put_((o_row, o_ids), torch.ones_like(o_ids, dtype=torch.int32), accumulate=True)
        output_seen = counts > 0
        if len(ints[1]):  # repetition: prompt or output
            seen = output_seen.clone()
            seen.index_put_((p_row, p_ids), torch.ones((), dtype=torch.bool, device=dev))  # no blocking copy
            factor = torch.where(seen, rep, 1.0)
            del seen
            x = torch.where(x > 0, x / factor, x * factor)
            del factor
        x -= counts * freq
        del counts
        x -= output_seen * pres
        del output_seen
    if any(_min_p_offset(t.params) > -math.inf for t in tokens):
        x.masked_fill_(x < x.amax(dim=-1, keepdim=True) + min_p_offset, float("-inf"))
    logits[idx] = x.to(logits.dtype)
