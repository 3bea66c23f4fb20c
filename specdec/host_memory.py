"""Giving host memory back to the OS after a burst (glibc only; elsewhere these do nothing).

glibc serves a freed block larger than its mmap threshold back to the OS at once, but it also
raises that threshold each time such a block is freed, up to 32 MiB; after a burst the KV caches
and activations of a large batch are then carved out of the heap instead, and a long-running
server's resident memory stays near its peak. Pinning the threshold keeps large blocks (KV caches)
mmapped, and trimming hands back the heap's free pages. Pinned at 1 MiB, not glibc's initial
128 KiB, so that a decoding step's temporaries (logits, MLP activations) stay on the heap instead
of being mmapped and faulted in anew every step.
"""

from __future__ import annotations

import ctypes
import functools

M_MMAP_THRESHOLD = -3  # mallopt parameter
MMAP_THRESHOLD_BYTES = 1 << 20  # pinned instead of growing (see above)


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 - glibc has both
        return libc
    except (OSError, AttributeError):
        return None


def pin_mmap_threshold() -> bool:
    """Stop glibc from raising its mmap threshold (a server calls this once at start)."""
    libc = _libc()
    return bool(libc and libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def trim_heap() -> None:
    """Return the heap's free pages to the OS."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
