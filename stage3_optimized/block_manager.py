"""The page allocator of the paged KV cache: a free list, reference counts, and a prefix cache.

Changed from stage 2: automatic prefix caching. Many requests start with the same
tokens (a system prompt, a few-shot preamble, the earlier turns of a chat); their
K/V rows for those positions are the same, so a page that holds them can be shared
instead of recomputed.

  * A full page of P token ids gets a key: SHA-256 of its parent page's key and its
    own ids, so the key of page i names the whole prefix 0 .. (i+1)*P - 1, not just
    the page (the same P ids after a different prefix have different K/V).
  * A page a sequence has filled is registered under its key. A new sequence walks
    its own full pages, key by key, and takes every page it finds, up to the first
    miss: those positions are already in the cache (`num_cached_tokens`).
  * Collision guard: the key is only a dict key. A found page must also hold the
    same P token ids *and* have the very same parent (the PageKey object itself, not
    an equal hash), so a hit is exact even if two prefixes ever hashed alike
    (SHA-256 makes that unlikely; a test forces it with a constant hash).
  * Shared pages have reference counts. A page whose count drops to zero keeps its
    contents and waits in an LRU of free cached pages: it is still a hit for the
    next request, and it is the first to be overwritten when fresh pages run out
    (the least recently freed goes first; a sequence frees its deepest page first,
    so a prefix is evicted from its tail and a surviving page's parents survive).
  * Only full pages are shared and a sequence never writes into a page it shares:
    the tokens after the hit go into fresh pages. On a full hit (every token of the
    sequence already cached) the last page is not taken, so at least one token is
    computed and its logits exist (nano-vllm recomputes the last block too; vLLM
    stops the hit one token short and writes that token into the shared page).

Pure Python: the block manager never touches the device; the model only sees
the block tables and slot numbers it produces (through BatchInfo).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from typing import Callable

import numpy as np

from .sequence import Sequence


def sha256_key(parent: bytes, ids: tuple[int, ...]) -> bytes:
    """The chained key of a page: SHA-256 over the parent's key and the page's ids (int64)."""
    return hashlib.sha256(parent + np.asarray(ids, dtype=np.int64).tobytes()).digest()


class PageKey:
    """What a full page holds: its P token ids after the prefix its parent names.
    Compared by identity: two PageKeys are the same content only if they are the same
    object, which the block manager guarantees by handing out the registered one."""
    __slots__ = ("hash", "parent", "ids")

    def __init__(self, hash: bytes, parent: "PageKey | None", ids: tuple[int, ...]):
        self.hash, self.parent, self.ids = hash, parent, ids


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True,
                 hash_fn: Callable[[bytes, tuple[int, ...]], bytes] = sha256_key):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"the KV cache needs at least one page of at least one position "
                             f"(got {num_pages} pages of {page_size})")
        self.num_pages = num_pages            # NB
        self.page_size = page_size            # P
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn                # a test passes a colliding one
        self.free: deque[int] = deque(range(num_pages))       # pages holding nothing worth keeping
        self.cached_free: OrderedDict[int, None] = OrderedDict()  # free but still cached, LRU first
        self.ref_count = [0] * num_pages      # sequences whose block table holds the page
        self.key_of: dict[int, PageKey] = {}  # registered page -> its content
        self.page_of: dict[bytes, int] = {}   # key hash -> registered page
        # counters for the server's stats and the benchmark's hit rate
        self.num_hit_tokens = self.num_lookup_tokens = 0

    def num_free_pages(self) -> int:
        """Pages a sequence can take now: empty ones and cached ones nobody holds."""
        return len(self.free) + len(self.cached_free)

    def pages_for(self, num_tokens: int) -> int:
        """Pages that hold positions 0..num_tokens-1."""
        return (num_tokens + self.page_size - 1) // self.page_size

    # ---- the prefix cache ----
    def _key(self, parent: PageKey | None, ids: tuple[int, ...]) -> bytes:
        return self.hash_fn(b"" if parent is None else parent.hash, ids)

    def find_cached(self, seq: Sequence) -> tuple[list[int], list[PageKey]]:
        """The registered pages that hold seq's leading full pages, up to the first miss,
        and their keys. Leaves at least one token of seq to compute. Changes nothing."""
        if not self.enable_prefix_caching:
            return [], []
        # exercise 3.1 begin
        P, ids = self.page_size, seq.token_ids
        pages, keys, parent = [], [], None
        for i in range((len(ids) - 1) // P):              # never the page of the last token
            chunk = tuple(ids[i * P:(i + 1) * P])
            page = self.page_of.get(self._key(parent, chunk))
            if page is None:
                break
            key = self.key_of[page]
            # the guard: same ids after the very same parent, or it is a collision
            if key.ids != chunk or key.parent is not parent:
                break
            pages.append(page)
            keys.append(key)
            parent = key
        # exercise 3.1 end
        return pages, keys

    def can_admit(self, seq: Sequence, cached: list[int], num_tokens: int) -> bool:
        """Could seq start with the cached pages and grow to num_tokens positions now?"""
        taken_from_free = sum(1 for p in cached if p in self.cached_free)
        fresh = self.pages_for(num_tokens) - len(cached)
        return fresh <= self.num_free_pages() - taken_from_free

    def admit(self, seq: Sequence, cached: list[int], keys: list[PageKey]) -> None:
        """seq (holding no pages) starts with the cached pages:
        their positions count as computed."""
        assert not seq.block_table and seq.num_computed == 0, f"{seq.id} already holds pages"
        for page in cached:
            if self.ref_count[page] == 0:
                del self.cached_free[page]                # back in use: no longer evictable
            self.ref_count[page] += 1
        seq.block_table = list(cached)
        seq.page_keys = list(keys)
        seq.num_computed = len(cached) * self.page_size
        if seq.num_preemptions == 0:                      # a recompute is not the client's hit
            seq.num_cached_tokens = seq.num_computed
            self.num_hit_tokens += seq.num_computed
            self.num_lookup_tokens += seq.num_prompt

    def register(self, seq: Sequence) -> None:
        """After a step: give a key to every page of seq that is now full and computed,
        and offer it to later requests (the first page with a given content wins; a
        duplicate computed at the same time stays private and adopts the winner's key)."""
        P = self.page_size
        if not self.enable_prefix_caching:
            return
        while len(seq.page_keys) < seq.num_computed // P:
            i = len(seq.page_keys)
            parent = seq.page_keys[-1] if seq.page_keys else None
            chunk = tuple(seq.token_ids[i * P:(i + 1) * P])
            h, page = self._key(parent, chunk), seq.block_table[i]
            other = self.page_of.get(h)
            if other is None:
                key = PageKey(h, parent, chunk)
                self.page_of[h] = page
                self.key_of[page] = key
            elif (other is not None and self.key_of[other].ids == chunk
                  and self.key_of[other].parent is parent):
                # same content elsewhere: share its identity
                key = self.key_of[other]
            else:
                key = PageKey(h, parent, chunk)           # a collision: stays unregistered
            seq.page_keys.append(key)

    def forget(self, seq: Sequence) -> None:
        """Take the registered pages that seq alone holds out of the prefix cache (before its
        pages are freed): its logits came out degenerate (a NaN or +inf), and the keys and values
        it computed may be what made them so. A later request computes them again. A page other
        sequences hold too was computed before them, and served them without harm."""
        for page in seq.block_table:
            if self.ref_count[page] == 1 and page in self.key_of:
                self._evict(page)

    def _evict(self, page: int) -> None:
        """Forget what a free cached page holds (it is about to be overwritten)."""
        key = self.key_of.pop(page)
        if self.page_of.get(key.hash) == page:
            del self.page_of[key.hash]

    def _take_fresh(self) -> int:
        """An empty page, or else the least recently freed cached one (evicted)."""
        if self.free:
            return self.free.popleft()
        page, _ = self.cached_free.popitem(last=False)
        self._evict(page)
        return page

    # ---- stage 2's allocator, over both free lists ----
    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Could seq grow to hold num_tokens positions with the pages that are free now?"""
        return self.pages_for(num_tokens) - len(seq.block_table) <= self.num_free_pages()

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow seq's block table to cover positions 0..num_tokens-1 (on demand: a decode
        step needs a new page only every P tokens)."""
        # exercise 2.2 begin
        need = self.pages_for(num_tokens) - len(seq.block_table)
        if need > self.num_free_pages():
            raise RuntimeError(f"out of KV pages: {seq.id} needs {need}, {self.num_free_pages()} "
                               "free (the scheduler should have preempted)")
        for _ in range(need):
            page = self._take_fresh()
            assert self.ref_count[page] == 0, f"page {page} is already held"
            self.ref_count[page] = 1
            seq.block_table.append(page)
        # exercise 2.2 end

    def free_pages(self, seq: Sequence) -> None:
        """Drop seq's hold on its pages (finish, abort, preempt). A page nobody holds goes
        to the LRU if it is registered (its contents stay a hit), else to the free list.
        Deepest page first, so that eviction eats a prefix from its tail."""
        # exercise 2.3 begin
        for page in reversed(seq.block_table):
            assert self.ref_count[page] > 0, f"page {page} was not held by {seq.id}"
            self.ref_count[page] -= 1
            if self.ref_count[page] == 0:
                if page in self.key_of:
                    self.cached_free[page] = None
                else:
                    self.free.append(page)
        seq.block_table = []
        seq.page_keys = []
        # exercise 2.3 end
