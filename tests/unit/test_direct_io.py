"""SequentialWriter writes exactly the bytes it is given, with O_DIRECT where the filesystem takes it and
through a plain file where it does not; a big safetensors file written that way reads back unchanged.

Expected bytes are the concatenation of the inputs (built here with bytes +), and `probe_direct` asks the
filesystem itself whether it takes O_DIRECT, independently of the writer.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engines.trainer import direct_io
from engines.trainer.direct_io import ALIGN, BUFFER_BYTES, RING, SequentialWriter
from engines.trainer.state import DIRECT_MIN_BYTES, write_safetensors


def probe_direct(folder: Path) -> bool:
    """Whether a 4 KiB aligned O_DIRECT write works in `folder` (tmpfs and some overlay setups refuse it)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    import mmap

    path = folder / ".probe"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    except OSError:
        return False
    try:
        buf = mmap.mmap(-1, ALIGN)
        os.write(fd, buf)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        path.unlink()


def pieces(*sizes: int) -> list[bytes]:
    return [os.urandom(n) for n in sizes]


# sizes around the alignment and the staging buffer: empty, a tail only, exact multiples, several buffers
CASES = [
    (),
    (0,),
    (1,),
    (ALIGN,),
    (ALIGN - 1, 2),
    (BUFFER_BYTES,),
    (BUFFER_BYTES - 3, 7, ALIGN),
    (3 * BUFFER_BYTES + 5,),
    (100, BUFFER_BYTES * 2, 1),
]


@pytest.mark.parametrize("sizes", CASES)
def test_file_holds_exactly_the_written_bytes(tmp_path, sizes):
    chunks = pieces(*sizes)
    path = tmp_path / "f.bin"
    with SequentialWriter(path) as writer:
        for chunk in chunks:
            writer.write(chunk)
    assert writer.direct == probe_direct(tmp_path)
    assert path.read_bytes() == b"".join(chunks)
    assert writer.bytes_written == sum(sizes)


def test_an_existing_file_is_truncated(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * (3 * ALIGN))
    with SequentialWriter(path) as writer:
        writer.write(b"abc")
    assert path.read_bytes() == b"abc"


def test_buffered_when_asked(tmp_path):
    path = tmp_path / "f.bin"
    with SequentialWriter(path, direct=False) as writer:
        writer.write(b"hello")
    assert writer.direct is False and path.read_bytes() == b"hello"


def test_falls_back_when_the_open_is_refused(tmp_path, monkeypatch):
    """tmpfs says EINVAL to O_DIRECT at open: the writer must go buffered, not fail."""
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(direct_io.os, "open", refusing_open)
    chunks = pieces(10, BUFFER_BYTES)
    with SequentialWriter(tmp_path / "f.bin") as writer:
        for chunk in chunks:
            writer.write(chunk)
    assert writer.direct is False
    assert (tmp_path / "f.bin").read_bytes() == b"".join(chunks)


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
@pytest.mark.parametrize("sizes", [(BUFFER_BYTES + 10, 3), (5,)])  # refused at a full buffer / at the tail
def test_falls_back_when_the_first_write_is_refused(tmp_path, monkeypatch, sizes):
    """Some FUSE filesystems take the flag at open and refuse the write: still the same file, buffered."""
    real_write = os.write

    def refusing_write(fd, data):
        if writer_fd.get("fd") == fd:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    writer_fd = {}
    monkeypatch.setattr(direct_io.os, "write", refusing_write)
    chunks = pieces(*sizes)
    path = tmp_path / "f.bin"
    writer = SequentialWriter(path)
    if not writer.direct:
        writer.close()
        pytest.skip("this filesystem refuses O_DIRECT at open (covered by the test above)")
    writer_fd["fd"] = writer._fd
    for chunk in chunks:
        writer.write(chunk)
    writer.close()
    assert writer.direct is False
    assert path.read_bytes() == b"".join(chunks)


def test_other_errors_are_not_swallowed(tmp_path):
    with pytest.raises(OSError) as info:
        SequentialWriter(tmp_path / "missing-folder" / "f.bin")
    assert info.value.errno == errno.ENOENT and "missing-folder" in str(info.value)


def test_large_safetensors_file_goes_direct_and_reads_back(tmp_path):
    tensors = {
        "exp_avg": torch.randn(DIRECT_MIN_BYTES // 4 + 123),
        "step": torch.tensor(7.0),
        "exp_avg_sq": torch.rand(1001).bfloat16(),
    }
    path = tmp_path / "opt.safetensors"
    digest = write_safetensors(tensors, path)
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    back = load_file(str(path))
    for name, tensor in tensors.items():
        assert torch.equal(back[name], tensor), name


def direct_or_skip(writer: SequentialWriter) -> None:
    if not writer.direct:
        writer.close()
        pytest.skip("this filesystem refuses O_DIRECT at open")


def test_the_ring_wraps_several_times(tmp_path):
    """7 full buffers and a tail, in pieces that straddle buffer edges: every buffer of the ring is reused."""
    sizes = (BUFFER_BYTES // 3 + 1,) * 21 + (12345,)
    assert sum(sizes) > 7 * BUFFER_BYTES >= 2 * RING * BUFFER_BYTES
    chunks = pieces(*sizes)
    expected = b""
    for chunk in chunks:
        expected += chunk
    path = tmp_path / "f.bin"
    with SequentialWriter(path) as writer:
        for chunk in chunks:
            writer.write(chunk)
    data = path.read_bytes()
    assert len(data) == len(expected) == writer.bytes_written
    assert hashlib.sha256(data).hexdigest() == hashlib.sha256(expected).hexdigest()
    assert writer.wait_s >= 0 and writer.io_thread_cpu_s >= 0


def spy_writes(monkeypatch, fail_after: int | None = None) -> list[tuple[int, threading.Thread]]:
    """Record (fd, thread) of every os.write; with fail_after, the writes after that many raise ENOSPC."""
    calls, real_write = [], os.write

    def spying_write(fd, data):
        calls.append((fd, threading.current_thread()))
        if fail_after is not None and len(calls) > fail_after:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(direct_io.os, "write", spying_write)
    return calls


@pytest.mark.timeout(60)
def test_the_first_buffer_is_written_by_the_caller_and_the_rest_by_one_io_thread(tmp_path, monkeypatch):
    calls = spy_writes(monkeypatch)
    chunks = pieces(4 * BUFFER_BYTES + 10)
    before = set(threading.enumerate())
    writer = SequentialWriter(tmp_path / "f.bin")
    direct_or_skip(writer)
    for chunk in chunks:
        writer.write(chunk)
    writer.close()
    assert set(threading.enumerate()) == before
    assert (tmp_path / "f.bin").read_bytes() == b"".join(chunks)
    me = threading.current_thread()
    # 5 writes: the probe (caller), 3 full buffers (one other thread), the padded tail (caller, at close)
    assert [thread is me for _, thread in calls] == [True, False, False, False, True]
    assert len({thread for _, thread in calls if thread is not me}) == 1


@pytest.mark.parametrize("size", [0, 5, BUFFER_BYTES - 1, BUFFER_BYTES, BUFFER_BYTES + 5])
def test_a_small_file_starts_no_thread(tmp_path, monkeypatch, size):
    """Up to one buffer (and a tail: the tail is written at close) everything happens on the caller."""
    started = []
    monkeypatch.setattr(direct_io, "Thread", lambda *a, **k: started.append(a) or threading.Thread(*a, **k))
    calls = spy_writes(monkeypatch)
    chunk = os.urandom(size)
    with SequentialWriter(tmp_path / "f.bin") as writer:
        writer.write(chunk)
    assert started == []
    assert all(thread is threading.current_thread() for _, thread in calls)
    assert (tmp_path / "f.bin").read_bytes() == chunk
    assert writer.io_thread_cpu_s == 0.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [2 * BUFFER_BYTES, 9 * BUFFER_BYTES + 7])  # raised by close() / by write()
def test_an_error_in_the_io_thread_surfaces_and_leaves_no_thread(tmp_path, monkeypatch, size):
    calls = spy_writes(monkeypatch, fail_after=1)  # the synchronous first buffer goes through
    before = set(threading.enumerate())
    path = tmp_path / "f.bin"
    with pytest.raises(OSError) as info:
        with SequentialWriter(path) as writer:
            if not writer.direct:
                pytest.skip("this filesystem refuses O_DIRECT at open")
            for start in range(0, size, 3 << 20):  # several writes, so the error can reach one of them
                writer.write(b"\0" * min(3 << 20, size - start))
    assert info.value.errno == errno.ENOSPC and str(path) in str(info.value)
    assert set(threading.enumerate()) == before
    assert calls[0][1] is threading.current_thread() and calls[1][1] is not threading.current_thread()
    writer.close()  # idempotent: nothing more to raise or release


@pytest.mark.timeout(60)
@pytest.mark.parametrize("io_error", [False, True])
def test_an_exception_in_the_with_body_propagates_unmasked(tmp_path, monkeypatch, io_error):
    """Even when the I/O thread failed too, the body's exception is the one raised, and nothing hangs."""
    spy_writes(monkeypatch, fail_after=1 if io_error else None)
    before = set(threading.enumerate())
    chunk = os.urandom(3 * BUFFER_BYTES + 5)
    with pytest.raises(RuntimeError, match="body failed"):
        with SequentialWriter(tmp_path / "f.bin") as writer:
            try:
                writer.write(chunk)
            except OSError:  # the I/O thread's error may reach write() already; close() raises it anyway
                assert io_error
            raise RuntimeError("body failed")
    assert set(threading.enumerate()) == before
    if not io_error:  # what was written before the exception is still on disk, as before
        assert (tmp_path / "f.bin").read_bytes() == chunk


def test_staging_buffers_are_mapped_once_and_reused_by_later_writers(tmp_path, monkeypatch):
    """Three files of several buffers each, one after another (as a checkpoint's files are written): RING
    buffers are mapped in all, not RING per file, and each file still holds exactly its own bytes, also a
    short file written into buffers that held another file's bytes before."""
    import mmap as real_mmap

    mapped = []

    class CountingMmap:
        @staticmethod
        def mmap(*args, **kwargs):
            mapped.append(args)
            return real_mmap.mmap(*args, **kwargs)

    monkeypatch.setattr(direct_io, "_pool", [])  # start from an empty pool
    monkeypatch.setattr(direct_io, "mmap", CountingMmap)
    contents = [bytes([0xAA]) * (3 * BUFFER_BYTES + 17), os.urandom(2 * BUFFER_BYTES + ALIGN + 1), bytes([0x55]) * 5001]
    for k, data in enumerate(contents):
        with SequentialWriter(tmp_path / f"f{k}.bin") as writer:
            direct_or_skip(writer)
            for start in range(0, len(data), 3_000_000):
                writer.write(data[start : start + 3_000_000])
    assert len(mapped) == RING
    for k, data in enumerate(contents):
        assert (tmp_path / f"f{k}.bin").read_bytes() == data, k
    assert len(direct_io._pool) == RING


def _cached_bytes(path: Path) -> int:
    """The kernel's count of `path`'s bytes in the page cache (util-linux fincore), independent of direct_io."""
    import subprocess

    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)], capture_output=True)
    return int(out.stdout.split()[0])


@pytest.mark.skipif(not hasattr(os, "posix_fadvise") or shutil.which("fincore") is None, reason="util-linux fincore")
def test_read_into_page_cache_leaves_a_direct_written_file_cached(tmp_path):
    if not probe_direct(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    path = tmp_path / "weights.bin"
    size = 6 * BUFFER_BYTES + 12345
    with SequentialWriter(path, direct=True) as f:
        f.write(os.urandom(size))
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # nothing of it cached, whatever the writer did
    os.close(fd)
    assert _cached_bytes(path) < size // 4
    direct_io.read_into_page_cache(path)
    assert _cached_bytes(path) >= size - ALIGN  # every page (fincore counts whole pages)
