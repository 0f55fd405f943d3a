"""engine.prefix_cache on its own: state checkpoints beside pages (hybrid models), evictions giving them back,
the host tier's copies a step carries; and the scheduler and the stress importing without torch."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from autoprofile.engine.prefix_cache import Copies, PrefixCache

ROOT = Path(__file__).resolve().parents[1]


def cache_with_run(freed: list, host_pages: int = 0) -> tuple[PrefixCache, list[int], list[int]]:
    """Three cached pages of keys (1,), (2,), (3,) after one another; the middle one carries state 'b'."""
    c = PrefixCache(5, page_size=1, host_pages=host_pages, free_state=freed.append)
    pages, chains, chain = c.alloc(3), [], 0
    for page, token, state in zip(pages, (1, 2, 3), (None, "b", None)):
        chain = c.insert(page, chain, (token,), state=state)
        chains.append(chain)
    return c, pages, chains


def test_a_match_that_needs_state_ends_at_the_last_page_with_a_checkpoint():
    c, pages, chains = cache_with_run([])
    full = c.match([(1,), (2,), (3,), (4,)])
    assert full.pages == pages and full.chain == chains[2] and full.state is None
    hybrid = c.match([(1,), (2,), (3,), (4,)], need_state=True)
    assert hybrid.pages == pages[:2] and hybrid.chain == chains[1] and hybrid.state == "b"
    assert c.match([(1,)], need_state=True).pages == []  # no checkpoint: nothing to resume from
    c.enabled = False
    assert c.match([(1,), (2,)]).pages == []


def test_a_checkpoint_goes_back_to_its_owner_when_its_page_leaves_the_cache():
    freed = []
    c, pages, chains = cache_with_run(freed)
    assert c.insert(c.alloc(1)[0], chains[0], (2,), state="b2") == chains[1]  # the key is cached already
    assert freed == ["b2"] and c.entry(pages[1]).state == "b"
    c.insert(pages[0], 0, (1,), state="a")  # cached without a checkpoint: it takes this one
    assert c.entry(pages[0]).state == "a" and freed == ["b2"]
    c.free(pages)
    c.alloc(3)  # evicts the three (the fourth page is still held)
    assert sorted(freed) == ["a", "b", "b2"] and c.registered() == {}


def test_a_spilled_page_keeps_its_key_in_the_host_tier_but_not_its_checkpoint():
    freed = []
    c, pages, chains = cache_with_run(freed, host_pages=4)
    c.free(pages)
    c.alloc(4)  # every page, the three cached ones spilled (saves of the step being built)
    assert freed == ["b"]
    copies = c.take_copies()
    assert sorted(g for g, _ in copies.saves) == sorted(pages) and copies.load_id == 0
    hit = c.match([(1,), (2,)])
    assert hit.pages == [] and [h[2] for h in hit.host] == [(1,), (2,)]
    assert c.match([(1,), (2,)], need_state=True).host == []  # the host tier holds no state


def test_a_step_that_never_ran_gives_back_the_loads_it_named_ready():
    c = PrefixCache(5, page_size=1)
    c.take_copies()
    assert c.rollback(Copies(ready=[3, 4])) == []  # no load of its own: no owner waits again
    assert c.take_copies().ready == [3, 4] and c.take_copies().ready == []


BLOCKED = """
import importlib.abc, sys

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"{name} is blocked")

sys.meta_path.insert(0, NoTorch())
import autoprofile.engine.{module}
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


@pytest.mark.parametrize("module", ["scheduler", "stress", "prefix_cache"])
def test_the_host_side_engine_imports_without_torch(module):
    code = textwrap.dedent(BLOCKED).replace("{module}", module)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
