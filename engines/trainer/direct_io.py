"""Sequential file writes that bypass the page cache (O_DIRECT), for the big files of a checkpoint.

Why: AdamW's state (exp_avg, exp_avg_sq) is two thirds of a checkpoint's bytes and is read back only when
a run resumes. Written through the page cache, every byte is first copied into freshly allocated cache
pages, and then it pushes out pages that are still wanted (the policy weights the rollout reads next).
Large-scale checkpoint writers bypass the cache for the same reason (DeepSpeed's FastPersist). Measured
on the project's 2-core VM: 164 MB in 0.37 s buffered, 0.05-0.12 s with O_DIRECT (the virtio disk varies run to run).

How: O_DIRECT wants the buffer address, the length and the file offset aligned to the device's logical
block size. Bytes are copied into a page-aligned staging buffer (an anonymous mmap) and written a whole
buffer at a time. Staging buffers come from a pool kept for the life of the process (`RING` of them, 24
MiB), so their pages are touched once per process, not once per file: mapping, first-touching and unmapping
a fresh 8 MiB buffer cost ~6 ms, ~70 ms for the 12 buffers of one checkpoint of the 10M-parameter Llama
(246 MB), against ~0.25 ms per buffer reused. A reused buffer's old bytes never reach a file: only the
filled part is written. The tail is zero-padded to `ALIGN` and the file is then truncated to its true
length. Where O_DIRECT does not exist (macOS, Windows) or is refused (tmpfs and
some FUSE or network filesystems: EINVAL on open or on the first write), the same bytes go through a plain
buffered file: the result is byte-for-byte the same file either way.
Neither path calls fsync: storage.fs fsyncs each file (and its folder) as it moves it into a checkpoint.

Overlap: an O_DIRECT write blocks until the device has the bytes, and the caller (state.write_safetensors)
hashes every chunk on the same thread, so written synchronously the two take turns. The first full buffer
is still written on the caller's thread (its EINVAL is what says O_DIRECT is refused); after that, full
buffers go to one I/O thread per writer, which writes them in order and hands them back, while the caller
fills the next of `RING` buffers. That thread copies and hashes nothing: it sleeps in os.write. Files of
one buffer or less start no thread. Measured on the 2-core VM (virtio disk, ext4), 10 x 16 MB float32
tensors with sha256 of each chunk on the caller (sha256 alone: 0.093 s), medians of 4 batches of 7-20 runs:
    synchronous   0.18-0.19 s wall, 0.12 s process CPU
    RING=2        0.17-0.18 s wall, 0.13 s process CPU; the caller still waits 0.035 s for buffers
    RING=3        0.13-0.15 s wall, 0.14 s process CPU, of which the I/O thread 0.007 s (in os.write)
RING=4 was no faster than 3. The extra CPU is the thread and first touching two more buffers' pages.
"""

from __future__ import annotations

import errno
import mmap
import os
import queue
import threading
import time
from pathlib import Path
from threading import Thread
from typing import Optional

ALIGN = 4096  # covers 512-byte and 4 KiB logical blocks
BUFFER_BYTES = 8 << 20  # one staging buffer; a multiple of ALIGN
RING = 3  # staging buffers once writes go asynchronous (2 gave an inconsistent gain)

_pool: list[mmap.mmap] = []  # free staging buffers, kept for the next writer (see the module docstring)
_pool_lock = threading.Lock()


def _take_buffer() -> mmap.mmap:
    with _pool_lock:
        if _pool:
            return _pool.pop()
    return mmap.mmap(-1, BUFFER_BYTES)


def _give_back(buffers: list[mmap.mmap]) -> None:
    """Return buffers to the pool; beyond RING of them (writers that ran at once), unmap the rest."""
    with _pool_lock:
        keep = max(0, RING - len(_pool))
        _pool.extend(buffers[:keep])
    for buf in buffers[keep:]:
        buf.close()


def _write_all(fd: int, buf: mmap.mmap, length: int) -> None:
    """os.write buf[:length] at fd's current offset, looping over short writes; raises the OSError as is."""
    with memoryview(buf) as staged:
        done = 0
        while done < length:
            with staged[done:length] as part:
                done += os.write(fd, part)


class SequentialWriter:
    """Write a new file front to back: `write(bytes-like)` any number of times, then `close()` (or use `with`).

    direct=True tries O_DIRECT and falls back to buffered writes where it is not available; `self.direct`
    says which one is in use. The file is created or truncated at open. Raises OSError from the filesystem
    (with the path) for anything other than O_DIRECT being refused; an error of the background writes is
    raised by the next write() that needs a free buffer, or else by close(). close() always closes the
    file, stops the I/O thread and frees the buffers, and is idempotent. If the body of a `with` raises,
    the rest is still written and closed, but an error doing so is dropped: the body's exception propagates.
    After close(), `wait_s` is the time the caller waited for a free buffer and `io_thread_cpu_s` the CPU
    time the I/O thread used (0 where there was none).
    """

    def __init__(self, path: str | Path, direct: bool = True):
        self.path = str(path)
        self.direct = False
        self.bytes_written = 0
        self.wait_s = 0.0
        self.io_thread_cpu_s = 0.0
        self._fd: Optional[int] = None
        self._file = None
        self._buffers: list[mmap.mmap] = []  # every staging buffer, to free at close
        self._staging: Optional[mmap.mmap] = None  # the one the caller is filling
        self._filled = 0
        self._flushed_any = False
        self._thread: Optional[Thread] = None
        self._full: queue.SimpleQueue = queue.SimpleQueue()  # buffers to write, in file order; None: stop
        self._free: queue.SimpleQueue = queue.SimpleQueue()  # buffers written (or skipped after an error)
        self._error: Optional[BaseException] = None  # the I/O thread's first error
        self._closed = False
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
                self._staging = _take_buffer()
                self._buffers.append(self._staging)
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
            self._staging[self._filled : self._filled + take] = view[:take]
            self._filled += take
            view = view[take:]
            if self._filled < BUFFER_BYTES:
                continue
            if self._flushed_any:
                self._hand_over()
                continue
            self._flush(BUFFER_BYTES)  # the first buffer, on this thread: it probes whether O_DIRECT is taken
            if not self.direct:  # the filesystem refused O_DIRECT: the rest goes buffered
                self._file.write(view)
                return

    def _flush(self, length: int) -> None:
        """Write staging[:length] (length >= the bytes filled, a multiple of ALIGN) at the current offset,
        on the caller's thread. EINVAL on the first write means O_DIRECT is refused: fall back to buffered."""
        refused = False
        try:
            _write_all(self._fd, self._staging, length)
        except OSError as exc:
            if exc.errno != errno.EINVAL or self._flushed_any:
                raise OSError(exc.errno, exc.strerror, self.path) from exc
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
        self._file.write(self._staging[: self._filled])
        self._release_buffers()
        self.direct = False
        self._filled = 0

    def _hand_over(self) -> None:
        """Queue the full staging buffer for the I/O thread (started on first use) and take a free one:
        waits while all RING buffers are queued. Raises the I/O thread's error, if it had one."""
        if self._thread is None:
            for _ in range(RING - 1):
                self._buffers.append(_take_buffer())
                self._free.put(self._buffers[-1])
            self._thread = Thread(target=self._io_loop, name=f"direct-io {self.path}", daemon=True)
            self._thread.start()
        self._full.put(self._staging)
        started = time.perf_counter()
        self._staging = self._free.get()
        self.wait_s += time.perf_counter() - started
        self._filled = 0
        self._raise_io_error()

    def _io_loop(self) -> None:
        """The I/O thread: write each queued buffer in order and hand it back. It copies and hashes nothing:
        it sleeps in os.write while the device works. After an error it only hands buffers back, so the
        caller never waits forever."""
        started = time.thread_time()
        try:
            while (buf := self._full.get()) is not None:
                if self._error is None:
                    try:
                        _write_all(self._fd, buf, BUFFER_BYTES)
                    except Exception as exc:  # noqa: BLE001 - any error goes to the caller, whatever it is
                        self._error = exc
                self._free.put(buf)
        finally:
            self.io_thread_cpu_s = time.thread_time() - started

    def _stop_io_thread(self) -> None:
        """Let the I/O thread write what is queued, then join it (no-op when there is none)."""
        if self._thread is not None:
            self._full.put(None)
            self._thread.join()
            self._thread = None

    def _raise_io_error(self) -> None:
        exc = self._error
        if isinstance(exc, OSError):
            raise OSError(exc.errno, exc.strerror, self.path) from exc
        if exc is not None:
            raise exc

    def _release_buffers(self) -> None:
        _give_back(self._buffers)
        self._buffers = []
        self._staging = None

    def close(self) -> None:
        """Wait for the queued writes, write what is staged, cut the file to its true length and close it
        (idempotent). Raises the I/O thread's error, if it had one."""
        if self._closed:
            return
        self._closed = True
        try:
            self._stop_io_thread()
            self._raise_io_error()
            if self.direct and self._filled:
                padded = -(-self._filled // ALIGN) * ALIGN
                self._staging[self._filled : padded] = bytes(padded - self._filled)
                self._flush(padded)
            if self.direct:
                os.ftruncate(self._fd, self.bytes_written)
        finally:
            self._stop_io_thread()  # the thread uses the fd and the buffers: it goes first
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            self._release_buffers()
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> "SequentialWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception:  # noqa: BLE001 - the body's exception is the one to see
            pass


def read_into_page_cache(path: str | Path) -> None:
    """Read `path` once through the page cache, a buffer's length at a time into one reused buffer, for a file
    written past the cache that another process reads next (the policy weights a vLLM engine loads at the next
    rollout). The pages end up cached, not mapped here: unlike reading the file through a memory map, they do not
    count in this process's resident set. Why not posix_fadvise(WILLNEED): in `ppoflow train`, issued while the
    optimizer state's O_DIRECT writes followed, it left vLLM's reload of SmolLM2's weights at 1.0 s, against
    0.4-0.6 s after this read (CHANGELOG). OSError (the file cannot be opened or read) as raised."""
    fd = os.open(path, os.O_RDONLY)
    try:
        buffer = bytearray(BUFFER_BYTES)
        while os.readv(fd, [buffer]) > 0:
            pass
    finally:
        os.close(fd)
