"""SequentialWriter writes exactly the bytes it is given, with O_DIRECT where the filesystem takes it and
through a plain file where it does not; a big safetensors file written that way reads back unchanged.

Expected bytes are the concatenation of the inputs (built here with bytes +), and `probe_direct` asks the
filesystem itself whether it takes O_DIRECT, independently of the writer.
"""
from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engines.trainer import direct_io
from engines.trainer.direct_io import ALIGN, BUFFER_BYTES, SequentialWriter
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
CASES = [(), (0,), (1,), (ALIGN,), (ALIGN - 1, 2), (BUFFER_BYTES,), (BUFFER_BYTES - 3, 7, ALIGN),
         (3 * BUFFER_BYTES + 5,), (100, BUFFER_BYTES * 2, 1)]


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
    tensors = {"exp_avg": torch.randn(DIRECT_MIN_BYTES // 4 + 123), "step": torch.tensor(7.0),
               "exp_avg_sq": torch.rand(1001).bfloat16()}
    path = tmp_path / "opt.safetensors"
    digest = write_safetensors(tensors, path)
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    back = load_file(str(path))
    for name, tensor in tensors.items():
        assert torch.equal(back[name], tensor), name
