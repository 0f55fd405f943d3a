"""Multi-turn chat on a hybrid model's state checkpoints (issue 45, "a multi-turn run with prefix caching on and
off"), through the real Scheduler with no model: N conversations taking turns at once, each turn the history so
far (earlier prompts and replies) plus new tokens, as `bench_serving.py --multi-turn` sends them.

The rule these pin: a conversation between turns holds one checkpoint (its last prompt's end), so N concurrent
conversations resume on every returning turn from N rows (one more for each shared prefix); a turn never takes a
second row for the end of the K/V run it matched unless another prompt parts there; a crowd behind one shared
prefix takes one row for it; and a shared prefix's checkpoint outlives the conversations' churn."""
from __future__ import annotations

import random

import pytest

from autoprofile.engine.envelope import Envelope
from autoprofile.engine.prefix_cache import PrefixCache
from autoprofile.engine.request import Request
from autoprofile.engine.scheduler import Scheduler

PAGE = 16


def scheduler(rows: int, batch: int = 512, pages: int = 1024) -> Scheduler:
    env = Envelope.build(kv_pages=pages, page_size=PAGE, context_len=2048, batch_max_tokens=batch,
                         running_max_req_size=32, graph_max_batch_size=32, use_graphs=False)
    return Scheduler(env, pages, state_checkpoints=rows, hybrid=True)


def reply_token(req: Request, end: int) -> int:
    """A deterministic 'model': the next token is a hash of the tokens before position `end`."""
    return hash(tuple(req.tokens(0, end))) % 30_000 + 1


def run_conversations(s: Scheduler, histories: list[list[int]], turns: int, new: int, out: int,
                      own_reply: bool, overlap: bool, seed: int = 1) -> list[list[int]]:
    """Every conversation's turns, all conversations at once (each turn queued when its last one ends); the
    engine's loop (schedule, launch, read back; overlap: one step in flight). Returns each conversation's hit
    tokens by turn. own_reply: the next turn's history holds the reply the model gave (a chat client), else
    random tokens standing for it (bench_serving)."""
    rng = random.Random(seed)
    hits = [[] for _ in histories]
    turn, live, inflight = [0] * len(histories), {}, None

    def submit(c: int) -> None:
        histories[c] = histories[c] + [rng.randrange(1, 30_000) for _ in range(new)]
        req = Request(f"c{c}t{turn[c]}", list(histories[c]), max_tokens=out)
        live[req] = c
        s.add(req)

    ready = list(range(len(histories)))
    while ready or live or inflight:
        for c in ready:
            submit(c)
        ready = []
        step = s.schedule()
        if step is not None:
            s.launched(step)
        done, inflight = (inflight, step) if overlap else (step, None)
        if done is not None:
            s.resolve(done, [reply_token(r.request, r.start + len(r.ids)) for r in done.all_rows if r.sample])
        for req, c in list(live.items()):
            if req.finished:
                del live[req]
                hits[c].append(req.hit)
                reply = req.output_ids if own_reply else [rng.randrange(1, 30_000) for _ in range(out)]
                histories[c] = histories[c] + reply
                turn[c] += 1
                if turn[c] < turns:
                    ready.append(c)
    return hits


@pytest.fixture(autouse=True)
def record_hits(monkeypatch):
    """Each request's hit tokens at admission (Request.hit): the GPU pages its match gave it."""
    admit = Scheduler._admit

    def recording(self, req, hit, step):
        req.hit = len(hit.pages) * PAGE
        admit(self, req, hit, step)
    monkeypatch.setattr(Scheduler, "_admit", recording)


def assert_all_back(s: Scheduler) -> None:
    c = s.cache
    assert sorted(s.free_slots) == list(range(s.env.running_reqs)) and c.num_free == c.capacity
    assert c.num_free_checkpoints + c.num_held_checkpoints == c.checkpoints
    assert not s._saving and not s._stops and not c._claims


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("own_reply", [False, True], ids=["bench-reply", "own-reply"])
def test_n_conversations_on_n_rows_resume_from_their_last_prompt_on_every_returning_turn(own_reply, overlap):
    """6 conversations x 4 turns at once on 6 rows: every returning turn resumes at the end of its last
    prompt's full pages (its last token excluded), the most a prompt's checkpoint can give. The scheduler's
    earlier rule (a second checkpoint at the end of every matched K/V run: the last turn's prompt and reply)
    took a second row a turn and evicted other conversations' live ones."""
    s = scheduler(rows=6)
    histories = [[] for _ in range(6)]
    hits = run_conversations(s, histories, turns=4, new=45, out=24, own_reply=own_reply, overlap=overlap)
    for c, got in enumerate(hits):
        prompts, want, length = [], [0], 0
        for t in range(4):
            length += 45
            prompts.append(length)
            length += 24
        want += [(p - 1) // PAGE * PAGE for p in prompts[:-1]]
        assert got == want, (c, got, want)
    assert_all_back(s)


def test_fewer_rows_than_conversations_leave_some_returning_turns_without_a_checkpoint():
    """The rule's other side: 6 conversations on 5 rows. A conversation between turns holds a row, so at most 5
    have one to resume from when they return: some returning turns recompute from zero (here the first turns'
    step saved 5 checkpoints, and the sixth conversation never gets one back). `--state_checkpoints` wants a
    row per concurrent conversation."""
    s = scheduler(rows=5)
    hits = run_conversations(s, [[] for _ in range(6)], turns=3, new=45, out=8, own_reply=True, overlap=False)
    returning = [h for got in hits for h in got[1:]]
    assert 0 in returning and sum(h > 0 for h in returning) <= 5 * 2
    assert_all_back(s)


def test_a_shared_system_prompt_costs_one_more_row_and_keeps_its_checkpoint():
    """6 conversations opening with one 100-token system prompt, on 7 rows: the system prompt's checkpoint
    (saved where two earlier prompts parted) survives the conversations' churn: every first turn and a later
    conversation resume from it, every returning turn from its own last prompt."""
    system = [random.Random(7).randrange(1, 30_000) for _ in range(100)]
    s = scheduler(rows=7)
    for seed in (2, 3):  # the second parts from the first after the system prompt: its checkpoint there
        run_conversations(s, [list(system)], turns=1, new=45, out=8, own_reply=True, overlap=False, seed=seed)
    hits = run_conversations(s, [list(system) for _ in range(6)], turns=3, new=45, out=8, own_reply=True,
                             overlap=True)
    for got in hits:
        assert got[0] == 96 and got[1:] == [(100 + 45 - 1) // PAGE * PAGE, (100 + 45 + 8 + 45 - 1) // PAGE * PAGE], got
    assert s.cache.num_held_checkpoints == 7
    late = run_conversations(s, [list(system)], turns=1, new=45, out=8, own_reply=True, overlap=False, seed=9)
    assert late == [[96]]  # the system prompt's last full page
    assert_all_back(s)


def test_a_crowd_behind_one_shared_prefix_takes_one_row_for_its_checkpoint():
    """One request caches a system prompt; then 5 prompts behind it are admitted in one step: one takes a row
    for the checkpoint where they part from the first, the others none (a duplicate would be dropped when its
    page is read back, after evicting a live checkpoint for its row)."""
    system = list(range(1, 101))
    s = scheduler(rows=8)
    run_conversations(s, [list(system)], turns=1, new=30, out=4, own_reply=True, overlap=False)
    for i in range(5):
        s.add(Request(f"r{i}", system + [1000 + i] * 30, max_tokens=4))
    step = s.schedule()
    assert len(step.rows) == 5 and all(r.start == 0 for r in step.rows)
    at_fork = [r for r in step.rows if r.start + len(r.ids) == 96]  # the fork: the system's last full page
    assert len(at_fork) == 5 and len(step.state_saves) == 1
    s.launched(step)
    s.resolve(step, [])
    assert s.cache.num_held_checkpoints == 2  # the first request's prompt end, the fork


def test_shared_checkpoints_outlive_churn_up_to_half_the_pool():
    """Two segments, least recently used first in each (SLRU): a fork's checkpoint (where prompts part) and one
    resumed twice are shared; a new checkpoint evicts a prompt end's first, shared ones only past half the
    pool."""
    c = PrefixCache(64, page_size=1, checkpoints=4)
    keys = []
    pages = c.alloc(40)
    fork_row = c.new_checkpoint(fork=(0, (1,)))
    chain = c.insert(pages[0], 0, (1,), state=fork_row)
    again = c.new_checkpoint(fork=(0, (1,)))
    assert again is not None  # its claim ended when its checkpoint reached the entry
    c.drop_checkpoint(again)
    for i in range(1, 30):  # conversations' checkpoints churn through the other rows
        row = c.new_checkpoint()
        keys.append((i + 1,))
        c.insert(pages[i], chain, (i + 1,), state=row)
    assert c.entry(pages[0]).state == fork_row
    for i in range(3):  # two more shared ones (resumed twice): three shared, over half the pool of 4
        m = c.match([(1,), keys[-1 - i]], need_state=True)
        assert m.state is not None
        c.resumed(m.state)
        c.resumed(m.state)
    c.new_checkpoint()  # evicts the least recently used shared one: the fork's
    assert c.entry(pages[0]).state is None


def test_a_match_forks_only_where_another_cached_prefix_goes_on():
    c = PrefixCache(16, page_size=1)
    pages = c.alloc(4)
    a = c.insert(pages[0], 0, (1,))
    b = c.insert(pages[1], a, (2,))
    assert c.match([(1,), (2,), (3,)]).fork is None  # the run ends where the cached prefix ends
    c.insert(pages[2], a, (9,))
    assert c.match([(1,), (3,)]).fork == (0, (1,))  # (1, 9) goes on after (1,)
    assert c.match([(1,), (2,), (3,)]).fork is None
    c.insert(pages[3], b, (5,))
    assert c.match([(1,), (2,), (3,)]).fork == (a, (2,))
    c.free(pages)
    c.alloc(15)  # every page evicted: nothing goes on
    assert c.match([(1,)]).fork is None and not c._children
