"""A request alone, then the same request inside a crowd (issue 19's --deterministic check, shared by the CPU
test and the GPU one): the crowd's requests arrive around it, so its prompt is cut into other chunks, shares
mixed steps with decode rows and decodes among up to the envelope's rows, some of them seeded or sampled."""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from autoprofile.engine.engine import LLMEngine
from autoprofile.engine.multimodal import MultiModalInput
from autoprofile.engine.sampling import GREEDY, SamplingParams
from autoprofile.engine.scheduler import StepRow


@dataclass
class Crowded:
    alone: list[int]
    crowded: list[int]
    most_rows: int  # the most rows of one step the request was in (decode rows and chunks)
    mixed_steps: int  # steps of the run with both chunks and decode rows
    graph_steps: int  # decode steps of the run replayed through a captured graph
    chunks_alone: list[int]  # the tokens of each chunk its prompt was cut into, alone and in the crowd
    chunks_crowded: list[int]


def model_runner(runner):
    """The ModelRunner under tensor parallelism's wrappers (StepBroadcaster, GuardedRunner: each holds the one
    it wraps as `runner`), whose step_log records the steps and whose cfg the crowd reads."""
    while "runner" in vars(runner):
        runner = runner.runner
    return runner


def alone_and_in_a_crowd(runner, prompt: list[int], params: SamplingParams, max_tokens: int, crowd: int = 300,
                         seed: int = 0, overlap: bool = False,
                         mm: Callable[[], MultiModalInput] | None = None,
                         image_request: Callable[[int], tuple[list[int], MultiModalInput]] | None = None
                         ) -> Crowded:
    """runner: a ModelRunner, or under TP rank 0's StepBroadcaster. overlap: the crowd runs on the overlapped
    engine (the server's default on one device). A vision-language model: mm makes the request's images (a
    new MultiModalInput each run: the engine keeps its encoder slots there), image_request(i) the crowd's
    i-th request with images (every third one: their encoder steps hold other images beside the request's)."""
    rng = random.Random(seed)
    vocab = runner.model_config.vocab_size
    log = model_runner(runner)
    longest = min(3 * len(prompt), log.cfg.context_len - 2 * max_tokens)
    log.step_log = []
    if mm is None:
        alone = LLMEngine(runner).generate([prompt], params, max_tokens)[0]
    else:
        alone = run_one(LLMEngine(runner), prompt, params, max_tokens, mm())
    chunks_alone = [s.prefill_tokens for s in log.step_log if s.prefill_rows]
    others = []
    for i in range(crowd):
        p = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, longest))]
        sp = rng.choice([GREEDY, SamplingParams(temperature=0.8, top_p=0.9),
                         SamplingParams(temperature=1.0, top_p=0.95, seed=i)])
        images = None
        if image_request is not None and i % 3 == 0:
            p, images = image_request(i)
        others.append((p, sp, rng.randrange(1, 2 * max_tokens), images))
    engine = LLMEngine(runner, overlap=overlap)
    half = crowd // 2
    for p, sp, n, images in others[:half]:
        engine.add_request(p, sp, n, mm=images)
    for _ in range(3):  # the crowd is decoding when the request arrives
        engine.step()
    probe = engine.add_request(prompt, params, max_tokens, mm=None if mm is None else mm())
    req = engine._requests[probe]
    for p, sp, n, images in others[half:]:
        engine.add_request(p, sp, n, mm=images)
    crowded, rows_with_it, mixed, graphs, chunks = [], [], 0, 0, []
    while engine.has_unfinished():
        computed, before = req.num_computed, len(log.step_log)
        crowded += [t for o in engine.step() if o.request_id == probe for t in o.new_token_ids]
        shapes = log.step_log[before:]
        mixed += sum(bool(s.decode_rows and s.prefill_rows) for s in shapes)
        graphs += sum(bool(s.graph_rows) for s in shapes)
        if req.num_computed != computed and shapes:  # the request was in this step
            rows_with_it.append(max(s.decode_rows + s.prefill_rows for s in shapes))
            if computed < len(prompt):
                chunks.append(min(req.num_computed, len(prompt)) - computed)
    log.step_log = None
    return Crowded(alone, crowded, max(rows_with_it, default=0), mixed, graphs, chunks_alone, chunks)


def run_one(engine: LLMEngine, prompt: list[int], params: SamplingParams, max_tokens: int,
            mm: MultiModalInput) -> list[int]:
    """One request with images through an idle engine: its tokens."""
    rid, out = engine.add_request(prompt, params, max_tokens, mm=mm), []
    while engine.has_unfinished():
        out += [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
    return out


def last_logits_alone_and_beside(runner, prompt: list[int], before: list[int],
                                 after: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of prompt's last token prefilled alone, then in one step between two other prompts (so each
    GEMM runs at another row count and the prompt's rows at another offset): under --deterministic the same
    bits (a difference a sampled token can hide shows in the logits). An idle
    ModelRunner (no request holds slots 0..2 or the pages from 1); under TP every rank calls it (the
    forward's collectives)."""
    page, first, writes = runner.cfg.page_size, 1, []
    for slot, ids in enumerate([before, prompt, after]):
        pages = -(-len(ids) // page)
        writes.append((slot, 0, list(range(first, first + pages))))
        first += pages
    runner.req_table.write(writes)
    rows = [StepRow(slot, 0, ids, True, GREEDY) for slot, ids in enumerate([before, prompt, after])]
    with torch.no_grad():
        alone = runner._prefill(rows[1:2])[0][0].cpu()
        beside = runner._prefill(rows)[0][1].cpu()
    return alone, beside


def crowd_on_tp_ranks(guarded, prompt: list[int], probes: tuple[int, ...], before: list[int],
                      after: list[int], params: SamplingParams, max_tokens: int, crowd: int):
    """A rank's part of the TP --deterministic check, on its built GuardedRunner: every rank runs the
    prefills of last_logits_alone_and_beside (prompt's first n tokens, each n of probes); then rank 0 runs
    the crowd through the step broadcast (as `serve --tp` does) and returns (the logits as float lists: exact,
    and they cross the launcher's pipe; Crowded); the other ranks run every step it ships and return their
    count."""
    from autoprofile.tp import broadcast
    logits = [t.float().tolist() for n in probes
              for t in last_logits_alone_and_beside(model_runner(guarded), prompt[:n], before, after)]
    if guarded.guard.rank:
        return broadcast.worker_loop(guarded)
    b = broadcast.StepBroadcaster(guarded)
    try:
        return logits, alone_and_in_a_crowd(b, prompt, params, max_tokens, crowd=crowd)
    finally:
        b.close()
