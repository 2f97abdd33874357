"""numba's cache stamps widened to a group of files, for kernels that inline code from
other files.

numba's own cache (`cache=True`) stamps each function's machine code with a hash of
the source file that defines it, so it misses an edit to a function that a kernel
calls or inlines from *another* file. Stage 1's core avoids that by keeping each
kernel and the numba helpers it calls in one file; stage1_cpu/fast/ cannot (its
one-region step inlines the core's row bodies), so depend() stamps each of its files
with a hash of its own sources and of the core files it inlines.
"""
from __future__ import annotations

import functools
from pathlib import Path

from numba.core.caching import CacheImpl, UserProvidedCacheLocator

from .numba_cache import stamp

_GROUPS: dict[str, list[Path]] = {}     # a source file -> the files its stamp covers


class GroupLocator(UserProvidedCacheLocator):
    """numba's locator for $NUMBA_CACHE_DIR, with the stamp of a whole group of files."""

    @classmethod
    def from_function(cls, py_func, py_file):
        if str(Path(py_file).resolve()) not in _GROUPS:
            return None                                  # numba's own locators take it
        return super().from_function(py_func, py_file)

    def get_source_stamp(self):
        files = _GROUPS[str(Path(self._py_file).resolve())]
        return _stamp_of(tuple((str(f), f.stat().st_mtime_ns, f.stat().st_size) for f in files))


def depend(files: list[Path], on: list[Path]) -> None:
    """Stamp every function cached from `files` with the contents of files + on, so that
    an edit to any of them recompiles it. Call before those files' kernels are defined."""
    group = sorted({Path(f).resolve() for f in list(files) + list(on)})
    for f in files:
        _GROUPS[str(Path(f).resolve())] = group
    if GroupLocator not in CacheImpl._locator_classes:
        CacheImpl._locator_classes.insert(0, GroupLocator)


@functools.lru_cache(maxsize=None)
def _stamp_of(files: tuple) -> str:
    """stamp(), once per version of the files (their paths, times and sizes say which)."""
    return stamp(f for f, _, _ in files)
