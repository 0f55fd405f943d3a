"""The prefix cache (host-side, no torch): the GPU's KV pages, the hash chain that names full pages of K/V,
and the host tier behind them, behind match / insert / evict / spill / load (SGLang's RadixCache and HiCache,
vLLM's KVCacheManager and BlockPool). The scheduler calls it; the runner moves the bytes.

Above the house's 500 lines on purpose: one owner of what a cached prefix is (pages, their hash chain, the
host tier and the hybrids' state checkpoints) behind one narrow interface; split, the tiers' eviction
and spill order would cross modules.

Pages (PageAllocator): reference counts and a free list, least recently freed first; PAD_PAGE is never handed
out. A page whose last holder frees it stays cached while it waits in the free list: a request with the same
prefix takes it back (`share`) until `alloc` hands it out again, which evicts it (`evict`: spilled to the host
tier first, when there is one).

The hash chain (on full pages): a full page of computed K/V is cached (`insert`) under the key (chain id of
the page before it, its tokens and images' hashes); the key's own chain id is the parent of the next page's
key.
Chain ids are never reused, so a key can only match the exact same prefix. `match` walks a request's page keys
(never its last token: that one must be computed to be sampled) through the GPU's map, then on through the
host tier: the scheduler starts the request's first chunk after them, attending to them like any later chunk
(prefill_kv_tokens and max_prefix_len bound it: inside the envelope).

State checkpoints (hybrid models, whose linear-attention layers keep a recurrent state instead of K/V per
token): a cached page may carry an opaque state id (CacheEntry.state), the state at the end of its prefix,
given to `insert`. `match(..., need_state=True)` ends at the last page that carries one (a prefix resumes only
from a checkpoint at its end), and whenever an entry's state leaves the cache (its page evicted, spilled or
forgotten, or a second checkpoint for a key already held) the owner's `free_state(state)` gives it back. The
host tier holds pages only: a spilled page's state is freed. With `checkpoints` N the cache owns the ids: N
checkpoint rows of the state cache (engine.state_cache), free, pending (`new_checkpoint`: a step copies a
slot's state into it; `drop_checkpoint` if that never reaches an entry) or on an entry. When none is free one
leaves its entry (its page stays cached as K/V, no longer a point a hybrid resumes from), least recently used
first in two segments (SLRU): a prompt's end (a multi-turn history's: dead once its next turn resumed from it,
so then the next to go) before shared ones (a fork's, `match`'s PrefixMatch.fork: where prompts part; or
resumed twice), which go first only past half the pool. A multi-turn load of C concurrent conversations resumes
every returning turn from C rows, one more for each shared prefix (unit_tests/test_hybrid_multi_turn.py).

Host tier (--host_kv; the pinned pages and their copies are engine.host_kv.HostKVPool): a cached page that
alloc hands out again is first saved to a host page under its key (`spill`, the step's saves; the step's
forward waits for them); a match may continue in the host tier: `load` gives those pages fresh GPU pages,
cached again at once under their keys and chain ids, and queues their copies back in one HostLoad (one id,
the step's kv_load_id) beside the steps that follow. Its owners (the scheduler's LOADING requests) wait,
without rows, until the runner reports the copies done (`loads_done`, never waited for); until then no match
that reaches those pages is used (PrefixMatch.loading) and no save writes their host pages (held). An owner
that leaves while loading (`leave`) gives its pages back once the copies are done. The load ids done since
the step before go to the next step (Copies.ready: under --tp every rank's forward waits for its own copies of
them); a step that never launched gives its own back (`rollback`), so the next step carries them. A page lives
on one tier: a page copied back leaves the host tier, and a key computed again on the GPU leaves it too
(`insert`), so every key is in the GPU's map, in the host tier, or gone (dropped by the host tier's LRU).
"""
from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field

PAD_PAGE = 0  # never handed out: padded graph rows write their K/V here (and the prefill stress, scratch)


class KVCacheFull(RuntimeError):
    """No free page or request slot left."""


class PageAllocator:
    """Pages with reference counts (PAD_PAGE is never handed out), free ones least recently freed first."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(PAD_PAGE + 1, num_pages))
        self._ref = [0] * num_pages

    @property
    def capacity(self) -> int:
        """Pages that can be handed out."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        """Pages nobody holds (cached ones included: alloc may evict them)."""
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KVCacheFull(f"KV cache full: {n} pages requested, "
                              f"{len(self._free)} of {self.capacity} free")
        pages = [self._free.popitem(last=False)[0] for _ in range(n)]
        for p in pages:
            self._ref[p] = 1
        return pages

    def free(self, pages: list[int]) -> None:
        """pages: in a request's order. The last goes back first, so alloc evicts a prefix's tail before its
        head (vLLM frees in reverse too): a head evicted first strands every cached page after it, and a
        working set a little over the cache (conversations returning in turn) would hit nothing."""
        for p in reversed(pages):
            if not PAD_PAGE < p < self.num_pages or not self._ref[p]:
                raise ValueError(f"page {p} is not allocated (double free?)")
            self._ref[p] -= 1
            if not self._ref[p]:
                self._free[p] = None

    def is_free(self, page: int) -> bool:
        return not self._ref[page]

    def share(self, page: int) -> None:
        """One more holder of a page (taken back from the free list if nobody held it)."""
        if not self._ref[page]:
            del self._free[page]
        self._ref[page] += 1


@dataclass
class CacheEntry:
    """A cached full page of K/V on the GPU."""
    key: tuple  # (parent chain id, tokens)
    page: int
    chain: int  # the parent of the next page's key
    state: Hashable | None = None  # a state checkpoint at the end of its prefix (hybrid models), opaque
    resumes: int = 0  # requests that resumed from its checkpoint (PrefixCache.resumed)


# a host tier page of a match: (host page, parent chain id, tokens, chain id)
HostHit = tuple[int, int, tuple, int]


@dataclass
class PrefixMatch:
    """The cached run of a request's leading pages: on the GPU, then continuing in the host tier."""
    pages: list[int] = field(default_factory=list)  # GPU pages
    chain: int = 0  # the chain id after them
    host: list[HostHit] = field(default_factory=list)
    loading: bool = False  # a GPU page of it is still being loaded from the host tier: wait for it
    state: Hashable | None = None  # the checkpoint at the end of `pages` (match's need_state)
    kv_pages: int = 0  # GPU pages of the cached run before need_state cut it back to `pages`
    fork: tuple | None = None  # the key of the run's last GPU page when another cached prefix goes on after it


@dataclass
class HostLoad:
    """One step's copies back from the host tier, in flight until the runner reports them done: no step reads
    its GPU pages, no save writes its host pages before."""
    requests: list = field(default_factory=list)  # its owners (LOADING requests), waiting for it
    gpu_pages: list[int] = field(default_factory=list)
    host_pages: list[int] = field(default_factory=list)
    drained: list[int] = field(default_factory=list)  # pages of owners that left while loading: freed after


@dataclass
class Copies:
    """A step's host tier copies, before its forward, saves first."""
    saves: list[tuple[int, int]] = field(default_factory=list)  # (gpu page, host page)
    loads: list[tuple[int, int]] = field(default_factory=list)  # (host page, gpu page)
    load_id: int = 0  # the loads' id (0: none)
    ready: list[int] = field(default_factory=list)  # load ids done since the step before




class PrefixCache:
    """The GPU's pages and their hash chain, and the host tier behind them. Host-side: it decides which page
    holds what and which copies a step carries; the runner moves the bytes."""

    def __init__(self, num_pages: int, page_size: int, host_pages: int = 0, enabled: bool = True,
                 free_state: Callable[[Hashable], None] | None = None, checkpoints: int = 0):
        """num_pages: pages of the built cache, the pad page included; host_pages: pages of the host tier (0:
        none; needs enabled); free_state: gives back a state checkpoint that leaves the cache; checkpoints:
        state checkpoint rows whose ids this cache hands out (0: the owner's states are opaque)."""
        self.pages, self.page_size, self.enabled = PageAllocator(num_pages), page_size, enabled
        self.host = HostPages(host_pages) if host_pages and enabled else None
        self.free_state = free_state
        self.checkpoints = checkpoints if enabled else 0
        self._free_rows = list(range(self.checkpoints - 1, -1, -1))
        self._claims: dict[Hashable, tuple] = {}  # pending checkpoint -> the cached key it is for (a fork)
        # checkpoints on entries, least recently used first, in two segments (SLRU): a prompt's end (a
        # history's next turn resumes there) and shared ones (where prompts part, or resumed twice)
        self._held: OrderedDict[Hashable, CacheEntry] = OrderedDict()
        self._shared: OrderedDict[Hashable, CacheEntry] = OrderedDict()
        self._entries: dict[tuple, CacheEntry] = {}  # key -> its entry
        self._at: dict[int, CacheEntry] = {}  # GPU page -> its entry
        self._children: dict[int, int] = {}  # chain id -> GPU entries whose key follows it
        self._ids = itertools.count(1)  # chain ids; 0: the empty prefix
        self.loads: dict[int, HostLoad] = {}  # in flight, by load id
        self._load_of: dict[object, HostLoad] = {}  # owners waiting for a load
        self._loading: set[int] = set()  # GPU pages of the loads in flight
        self._load_ids = itertools.count(1)
        self._copies, self._load = Copies(), None  # the step being built's
        self.hit_tokens = 0  # tokens whose K/V a match found (GPU or host tier)
        self.host_hit_tokens = 0  # of those, the host tier's

    @property
    def capacity(self) -> int:
        return self.pages.capacity

    @property
    def num_free(self) -> int:
        return self.pages.num_free

    @property
    def num_used(self) -> int:
        return self.pages.capacity - self.pages.num_free

    def alloc(self, n: int) -> list[int]:
        """n pages; a cached one among them is evicted first (spilled to the host tier)."""
        pages = self.pages.alloc(n)
        for p in pages:
            if p in self._at:
                self.evict(p)
        return pages

    def free(self, pages: list[int]) -> None:
        """Cached pages stay cached until alloc needs them."""
        self.pages.free(pages)

    def registered(self) -> dict[tuple, int]:
        """Every key cached on the GPU -> its page (the tests' view)."""
        return {key: e.page for key, e in self._entries.items()}

    def entry(self, page: int) -> CacheEntry | None:
        return self._at.get(page)

    # ------------------------------------------------------------ match, insert, evict, spill
    def match(self, keys: Iterable[tuple], need_state: bool = False) -> PrefixMatch:
        """The cached run of the page keys `keys` (tokens of each leading full page, in order): on the GPU,
        then in the host tier. need_state: only up to the last GPU page that carries a state checkpoint."""
        m = PrefixMatch()
        if not self.enabled:
            return m
        keys, found = iter(keys), []
        for tokens in keys:
            e = self._entries.get((m.chain, tokens))
            if e is None:
                if self.host is not None and not need_state:
                    m.host = self._host_run(m.chain, itertools.chain([tokens], keys))
                break
            found.append(e)
            m.chain = e.chain
        m.kv_pages = len(found)
        if found and found[-1].chain in self._children:
            m.fork = found[-1].key
        if need_state:
            while found and found[-1].state is None:
                found.pop()
            m.chain = found[-1].chain if found else 0
        m.pages = [e.page for e in found]
        m.state = found[-1].state if found else None
        for held in (self._held, self._shared):
            if m.state in held:
                held.move_to_end(m.state)
        m.loading = not self._loading.isdisjoint(m.pages)
        return m

    def _host_run(self, chain: int, keys: Iterable[tuple]) -> list[HostHit]:
        out = []
        for tokens in keys:
            found = self.host.lookup(chain, tokens)
            if found is None:
                break
            out.append((found[0], chain, tokens, found[1]))
            chain = found[1]
        return out

    def available(self, m: PrefixMatch) -> int:
        """Free pages left once the match's GPU pages are taken (those nobody holds are among the free)."""
        return self.pages.num_free - sum(self.pages.is_free(p) for p in m.pages)

    def take(self, m: PrefixMatch, owner) -> tuple[list[int], int]:
        """The match's pages become owner's: its GPU pages shared, its host tier pages loaded into fresh ones
        (owner then waits for the load: loads_done). Returns the pages and the chain id after them."""
        for p in m.pages:
            self.pages.share(p)
        pages, chain = list(m.pages), m.chain
        if m.host:
            fresh, chain = self.load(m.host, owner)
            pages += fresh
            self.host_hit_tokens += len(m.host) * self.page_size
        self.hit_tokens += len(pages) * self.page_size
        return pages, chain

    def insert(self, page: int, parent: int, tokens: tuple, chain: int | None = None,
               state: Hashable | None = None) -> int:
        """Cache a held, full page under (parent, tokens); returns the chain id its successor's key uses. If
        the same prefix is cached in another page already, that one stays the cached copy (it takes `state`
        if it has none) and its chain id is returned. chain: the id the key had before (a page back from the
        host tier keeps it: its successors there still hang on it); None: the host tier's, if the key was
        there (recomputed while the host tier held it: one tier holds it), else a new one."""
        key = (parent, tokens)
        e = self._entries.get(key)
        if e is not None:
            if e.state is None:
                self._attach(e, state)
            elif state is not None:
                self._free_state(state)
            return e.chain
        if chain is None and self.host is not None:
            chain = self.host.discard(key)
        self.evict(page, spill=False)
        e = CacheEntry(key, page, next(self._ids) if chain is None else chain)
        self._entries[key], self._at[page] = e, e
        self._children[parent] = self._children.get(parent, 0) + 1
        self._attach(e, state)
        return e.chain

    def _attach(self, e: CacheEntry, state: Hashable | None) -> None:
        shared = self._claims.pop(state, None) is not None  # a fork's
        e.state, e.resumes = state, 0
        if state is not None and self.checkpoints:
            (self._shared if shared else self._held)[state] = e

    def evict(self, page: int, spill: bool = True) -> None:
        """The page leaves the GPU's map (alloc hands it out; spill False: its K/V is not what its key says, a
        failed step's copy back); spilled to the host tier first, while it still holds its K/V."""
        e = self._at.pop(page, None)
        if e is None:
            return
        del self._entries[e.key]
        if self._children[e.key[0]] == 1:
            del self._children[e.key[0]]
        else:
            self._children[e.key[0]] -= 1
        if spill and self.host is not None:
            self.spill(e)
        if e.state is not None:
            self._free_state(e.state)

    def spill(self, e: CacheEntry) -> None:
        """The entry's K/V goes to a host page under its key: a save of the step being built."""
        host_page = self.host.put(e.key, e.chain)
        if host_page is not None:
            self._copies.saves.append((e.page, host_page))

    def _free_state(self, state: Hashable) -> None:
        self._claims.pop(state, None)
        if self.checkpoints:
            self._held.pop(state, None)
            self._shared.pop(state, None)
            self._free_rows.append(state)
        if self.free_state is not None:
            self.free_state(state)

    # ------------------------------------------------------------ state checkpoints (hybrid models)
    def new_checkpoint(self, fork: tuple | None = None) -> int | None:
        """A checkpoint row for a step's copy of a slot's state, pending until `insert` puts it on an entry:
        a free one, else the least recently used leaves its entry. None when every row is pending, or when
        `fork` (the key of a cached page where prompts part: PrefixMatch.fork) has one pending already: a
        crowd admitted behind the same shared prefix would each take a row for one checkpoint, evicting
        conversations' live ones, and all but the first would be dropped as duplicates."""
        if fork is not None and fork in self._claims.values():
            return None
        if self._free_rows:
            row = self._free_rows.pop()
        elif self._held or self._shared:
            shared = not self._held or len(self._shared) > self.checkpoints // 2
            row, e = (self._shared if shared else self._held).popitem(last=False)
            e.state = None
        else:
            return None
        if fork is not None:
            self._claims[row] = fork
        return row

    def resumed(self, state: Hashable) -> None:
        """A request resumes from checkpoint `state`. Its first resume makes it the next to evict: a
        multi-turn history's checkpoint is dead once the turn that resumed from it saves a deeper one (kept,
        concurrent conversations evict each other's live ones); its second moves it to the shared segment (a
        shared prefix, or a turn sent again), where each resume makes it the most recently used."""
        e = self._held.get(state)
        if e is not None:
            e.resumes += 1
            if e.resumes == 1:
                self._held.move_to_end(state, last=False)
            else:
                self._shared[state] = self._held.pop(state)
        elif state in self._shared:
            self._shared.move_to_end(state)

    def drop_checkpoint(self, row: int) -> None:
        """A pending checkpoint that reaches no entry (its request left, or its step failed) is free."""
        self._claims.pop(row, None)
        self._free_rows.append(row)

    @property
    def num_free_checkpoints(self) -> int:
        return len(self._free_rows)

    @property
    def num_held_checkpoints(self) -> int:
        """Checkpoints on cached entries (resumable points)."""
        return len(self._held) + len(self._shared)

    # ------------------------------------------------------------ the host tier's loads
    def load(self, hits: list[HostHit], owner) -> tuple[list[int], int]:
        """Fresh GPU pages for the host tier's `hits`, cached at once under their keys and chain ids, their
        copies queued in the step's load, which owner waits for; returns them and the chain id after them."""
        if self._load is None:
            self._load = HostLoad()
        for host_page, *_ in hits:
            self.host.take(host_page)  # out of the host tier's LRU before alloc's evictions spill
        fresh = self.alloc(len(hits))
        chain = 0
        for page, (host_page, parent, tokens, linked) in zip(fresh, hits):
            chain = self.insert(page, parent, tokens, linked)
            self._copies.loads.append((host_page, page))
        self._load.gpu_pages += fresh
        self._load.host_pages += [host_page for host_page, *_ in hits]
        self._load.requests.append(owner)
        self._load_of[owner] = self._load
        self._loading.update(fresh)
        return fresh, chain

    @property
    def pending_loads(self) -> list[int]:
        """Ids of the loads in flight (the engine asks the runner which are done)."""
        return list(self.loads)

    def loads_done(self, ids: Iterable[int]) -> list:
        """The runner's copies of these loads have run: their host pages, and the pages of owners that left
        while loading, are free; returns their owners, whose pages are ready."""
        owners = []
        for i in ids:
            load = self.loads.pop(i, None)
            if load is None:
                continue
            self.host.release(load.host_pages)
            self._loading.difference_update(load.gpu_pages)
            self.pages.free(load.drained)
            for owner in load.requests:
                del self._load_of[owner]
            owners += load.requests
            self._copies.ready.append(i)
        return owners

    def leave(self, owner, pages: list[int]) -> None:
        """A loading owner leaves: its pages go back once its load is done (the copies may still write
        them)."""
        load = self._load_of.pop(owner)
        load.requests.remove(owner)
        load.drained += pages

    def has_copies(self) -> bool:
        """The step being built has copies to carry (a step must launch for them)."""
        return bool(self._copies.saves or self._copies.loads)

    def take_copies(self) -> Copies:
        """The step being built's copies, its load given an id (in flight from now on)."""
        copies, self._copies = self._copies, Copies()
        if self._load is not None:
            copies.load_id = next(self._load_ids)
            self.loads[copies.load_id] = self._load
            self._load = None
        return copies

    def rollback(self, copies: Copies) -> list:
        """A step that never launched: its saves' host pages drop their keys and its loads' GPU pages leave
        the map (the copies may not have run: what they moved is unknown); the load ids it carried as ready
        go to the next step. Returns the owners of its load (they wait again and recompute)."""
        for _, host_page in copies.saves:
            self.host.drop(host_page)
        for _, page in copies.loads:
            self.evict(page, spill=False)
        self._copies.ready[:0] = copies.ready
        load = self.loads.get(copies.load_id)
        return list(load.requests) if load is not None else []


# ---------------------------------------------------------------- the host tier's bookkeeping
class HostPages:
    """The host tier's pages: free, cached (a key, least recently used first) or held (taken by copies back
    to the GPU, free again once they have run: release(); no save writes them before)."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages))  # a heap: lowest first, so a run of saves gets a run of pages
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._key: dict[int, tuple] = {}  # host page -> key
        self._page: dict[tuple, int] = {}  # key -> host page
        self._chain: dict[int, int] = {}  # host page -> its chain id
        self._children: dict[int, set[int]] = {}  # chain id -> the cached host pages whose key follows it
        self._held: set[int] = set()
        # every key put here leaves as exactly one of: loaded back, dropped (LRU, a failed step), discarded
        # (recomputed on the GPU), or is cached still
        self.saved = self.loaded = self.dropped = self.discarded = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def keys(self) -> dict[tuple, int]:
        """Every cached key -> its host page (the tests' view)."""
        return dict(self._page)

    def lookup(self, parent: int, tokens: tuple) -> tuple[int, int] | None:
        """(host page, chain id) holding `tokens` after the prefix `parent`, or None."""
        page = self._page.get((parent, tokens))
        return None if page is None else (page, self._chain[page])

    def put(self, key: tuple, chain: int) -> int | None:
        """A host page for an evicted GPU page's key (a free one, else the least recently used is dropped);
        None if the tier has no page to give (all held) or the key is cached here already."""
        if key in self._page:
            return None
        if self._free:
            page = heapq.heappop(self._free)
        elif self._lru:
            self._drop_from(next(iter(self._lru)))
            page = heapq.heappop(self._free)
        else:
            return None
        self._key[page], self._page[key], self._chain[page] = key, page, chain
        self._children.setdefault(key[0], set()).add(page)
        self._lru[page] = None
        self.saved += 1
        return page

    def take(self, page: int) -> None:
        """A cached page goes back to the GPU: it leaves the index, held until release()."""
        self._forget(page)
        self._held.add(page)
        self.loaded += 1

    def release(self, pages: list[int]) -> None:
        """The copies back from these held pages have run: they are free."""
        for page in pages:
            self._held.remove(page)
            heapq.heappush(self._free, page)

    def discard(self, key: tuple) -> int | None:
        """The key is cached on the GPU again (recomputed): its host page is free; returns its chain id."""
        page = self._page.get(key)
        if page is None:
            return None
        chain = self._chain[page]
        self._forget(page)
        heapq.heappush(self._free, page)
        self.discarded += 1
        return chain

    def drop(self, page: int) -> None:
        """A failed step's save: the page's content is unknown, its key goes."""
        if page in self._key:
            self._drop_from(page)

    def _drop_from(self, page: int) -> None:
        """The page goes, and with it the pages cached after it: their keys hang on its
        chain id, which no tier holds any more (ids are never reused), so no lookup can reach them."""
        stack = [page]
        while stack:
            page = stack.pop()
            stack += self._children.get(self._chain[page], ())
            self._forget(page)
            heapq.heappush(self._free, page)
            self.dropped += 1

    def _forget(self, page: int) -> None:
        key = self._key.pop(page)
        del self._page[key], self._chain[page], self._lru[page]
        children = self._children[key[0]]
        children.discard(page)
        if not children:
            del self._children[key[0]]
