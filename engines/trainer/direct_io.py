"""Sequential file writes that bypass the page cache (O_DIRECT), for the big files of a checkpoint.

Why: AdamW's state (exp_avg, exp_avg_sq) is two thirds of a checkpoint's bytes and is read back only when
a run resumes. Written through the page cache, every byte is first copied into freshly allocated cache
pages, and then it pushes out pages that are still wanted (the policy weights the rollout reads next).
Large-scale checkpoint writers bypass the cache for the same reason (DeepSpeed's FastPersist). Measured
on the project's 2-core VM: 164 MB in 0.37 s buffered, 0.05 s with O_DIRECT.

How: O_DIRECT wants the buffer address, the length and the file offset aligned to the device's logical
block size. Bytes are copied into a page-aligned staging buffer (one anonymous mmap, reused, so its pages
are touched once) and written a whole buffer at a time; the tail is zero-padded to `ALIGN` and the file is
then truncated to its true length. Where O_DIRECT does not exist (macOS, Windows) or is refused (tmpfs and
some FUSE or network filesystems: EINVAL on open or on the first write), the same bytes go through a plain
buffered file: the result is byte-for-byte the same file either way.
Durability is the same as a buffered write: neither path calls fsync.
"""
from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path
from typing import Optional

ALIGN = 4096                # covers 512-byte and 4 KiB logical blocks
BUFFER_BYTES = 8 << 20      # one staging buffer; a multiple of ALIGN


class SequentialWriter:
    """Write a new file front to back: `write(bytes-like)` any number of times, then `close()` (or use `with`).

    direct=True tries O_DIRECT and falls back to buffered writes where it is not available; `self.direct`
    says which one is in use. The file is created or truncated at open. Raises OSError from the filesystem
    (with the path) for anything other than O_DIRECT being refused.
    """

    def __init__(self, path: str | Path, direct: bool = True):
        self.path = str(path)
        self.direct = False
        self.bytes_written = 0
        self._fd: Optional[int] = None
        self._file = None
        self._staging: Optional[mmap.mmap] = None
        self._filled = 0
        self._flushed_any = False
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
                self._staging = mmap.mmap(-1, BUFFER_BYTES)
                self.direct = True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
        if not self.direct:
            self._file = open(self.path, "wb")

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        self.bytes_written += len(view)
        if not self.direct:
            self._file.write(view)
            return
        while len(view):
            take = min(len(view), BUFFER_BYTES - self._filled)
            self._staging[self._filled:self._filled + take] = view[:take]
            self._filled += take
            view = view[take:]
            if self._filled == BUFFER_BYTES:
                self._flush(BUFFER_BYTES)
                if not self.direct:  # the filesystem refused O_DIRECT: the rest goes buffered
                    self._file.write(view)
                    return

    def _flush(self, length: int) -> None:
        """Write staging[:length] (length >= the bytes filled, a multiple of ALIGN) at the current offset."""
        refused = False
        with memoryview(self._staging) as staged:
            try:
                done = 0
                while done < length:
                    with staged[done:length] as part:
                        done += os.write(self._fd, part)
            except OSError as exc:
                if exc.errno != errno.EINVAL or self._flushed_any:
                    raise
                refused = True
        if refused:  # outside the except block: the traceback no longer holds views of the staging buffer
            self._fall_back_to_buffered()
            return
        self._flushed_any = True
        self._filled = 0

    def _fall_back_to_buffered(self) -> None:
        """The filesystem took O_DIRECT at open but refuses the first write: nothing is on disk, start over."""
        os.close(self._fd)
        self._fd = None
        self._file = open(self.path, "wb")
        self._file.write(self._staging[:self._filled])
        self._staging.close()
        self._staging = None
        self.direct = False
        self._filled = 0

    def close(self) -> None:
        """Write what is staged, cut the file to its true length and close it (idempotent)."""
        try:
            if self.direct and self._filled:
                padded = -(-self._filled // ALIGN) * ALIGN
                self._staging[self._filled:padded] = bytes(padded - self._filled)
                self._flush(padded)
            if self.direct:
                os.ftruncate(self._fd, self.bytes_written)
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            if self._staging is not None:
                self._staging.close()
                self._staging = None
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> "SequentialWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
