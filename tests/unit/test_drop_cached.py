"""``storage.local.objects.drop_cached``: a file's clean pages leave the page cache, its bytes stay."""

from __future__ import annotations

import os

import pytest

from storage.local.objects import drop_cached
from tests.support.page_cache import drops_pages, resident_pages


def test_a_files_clean_pages_leave_the_page_cache_and_its_bytes_stay(tmp_path):
    if not drops_pages(str(tmp_path)):
        pytest.skip(f"{tmp_path} is on a file system that keeps its pages")
    path = tmp_path / "f.bin"
    data = os.urandom(3 * 4096 * 64 + 123)  # not a multiple of the page size
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    assert path.read_bytes() == data
    assert resident_pages(str(path)) > 0, "read just now: cached"
    drop_cached(str(path))
    assert resident_pages(str(path)) == 0
    assert path.read_bytes() == data


def test_a_missing_or_empty_file_is_left_alone(tmp_path):
    drop_cached(str(tmp_path / "absent"))
    (tmp_path / "empty").write_bytes(b"")
    drop_cached(str(tmp_path / "empty"))
    assert (tmp_path / "empty").read_bytes() == b""
