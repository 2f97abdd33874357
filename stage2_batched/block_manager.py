"""The page allocator of the paged KV cache: a free list and who owns which page.

New in stage 2 (stage 1 gives its one sequence a contiguous [Hkv, T_max, D] cache).
The cache is a pool of NB pages of P positions each; a sequence's positions are
spread over pages listed in its block table: position t lives in page
block_table[t // P] at offset t % P. Pages are taken from the free list only when
a sequence grows into them, and all return at once when it finishes, is aborted or
is preempted, so memory follows what sequences actually hold, not max_ctx each.

Pure Python: the block manager never touches the device; the model only sees
the block tables and slot numbers it produces (through BatchInfo).
"""
from __future__ import annotations

from collections import deque

from .sequence import Sequence


class BlockManager:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"the KV cache needs at least one page of at least one position "
                             f"(got {num_pages} pages of {page_size})")
        self.num_pages = num_pages            # NB
        self.page_size = page_size            # P
        self.free: deque[int] = deque(range(num_pages))
        self.owner: dict[int, str] = {}       # page -> id of the sequence holding it

    def num_free_pages(self) -> int:
        return len(self.free)

    def pages_for(self, num_tokens: int) -> int:
        """Pages that hold positions 0..num_tokens-1."""
        return (num_tokens + self.page_size - 1) // self.page_size

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Could seq grow to hold num_tokens positions with the pages that are free now?"""
        return self.pages_for(num_tokens) - len(seq.block_table) <= len(self.free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow seq's block table to cover positions 0..num_tokens-1 (on demand: a decode
        step needs a new page only every P tokens)."""
        # exercise 2.2 begin
        need = self.pages_for(num_tokens) - len(seq.block_table)
        if need > len(self.free):
            raise RuntimeError(f"out of KV pages: {seq.id} needs {need}, {len(self.free)} free "
                               "(the scheduler should have preempted)")
        for _ in range(need):
            page = self.free.popleft()
            assert page not in self.owner, f"page {page} is already owned by {self.owner[page]}"
            self.owner[page] = seq.id
            seq.block_table.append(page)
        # exercise 2.2 end

    def free_pages(self, seq: Sequence) -> None:
        """Return every page of seq to the free list (finish, abort, preempt)."""
        # exercise 2.3 begin
        for page in seq.block_table:
            assert self.owner.pop(page) == seq.id, f"page {page} was not owned by {seq.id}"
            self.free.append(page)
        seq.block_table = []
        # exercise 2.3 end
