"""A directory held open while it is read (transduce.io.pinned): its files come from the copy that was in place when
it was opened, whatever replaces it meanwhile."""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest

from transduce.io.atomic import atomic_directory
from transduce.io.pinned import PinnedDir, Replaced, await_replacement, read_pinned


def _directory(path, text: str):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "a.txt"), "w") as f:
        f.write(text)
    with open(os.path.join(path, "b.txt"), "w") as f:
        f.write(text.upper())


def _replace(final, text: str):
    with atomic_directory(final) as tmp:
        _directory(tmp, text)


def test_files_opened_before_a_replace_are_the_old_copys_and_names_resolve_in_it(tmp_path):
    final = str(tmp_path / "d")
    _directory(final, "old")
    pinned = PinnedDir(final)
    assert pinned.read_bytes("a.txt") == b"old" and not pinned.replaced()
    _replace(final, "new")  # renamed away, then removed
    assert pinned.replaced() and pinned.read_bytes("a.txt") == b"old"  # held open
    with open(pinned.path_of("a.txt"), "rb") as f:  # what a library that opens by name is given
        assert f.read() == b"old"
    assert pinned.sha256("a.txt") == hashlib.sha256(b"old").hexdigest() and pinned.size("a.txt") == 3
    with pytest.raises(Replaced):  # never opened, and the old copy is gone: read it again by its name
        pinned.read_bytes("b.txt")
    assert PinnedDir(final).read_bytes("b.txt") == b"NEW"
    pinned.close()


def test_a_read_replaced_under_it_starts_again_and_gives_up_after_its_tries(tmp_path):
    final = str(tmp_path / "d")
    _directory(final, "one")
    reads = []

    def read(pinned):
        reads.append(pinned.read_bytes("a.txt"))
        if len(reads) == 1:
            _replace(final, "two")
        return pinned.read_bytes("b.txt")  # the first read's copy was removed: Replaced, read again

    assert read_pinned(final, read) == b"TWO" and reads == [b"one", b"two"]

    def always(pinned):
        _replace(final, "x")
        return pinned.read_bytes("b.txt")

    with pytest.raises(Replaced):
        read_pinned(final, always, attempts=3)


def test_a_missing_directory_is_waited_for_only_while_a_replace_is_under_way(tmp_path):
    final = str(tmp_path / "d")
    assert await_replacement(final) is False  # nothing there, nothing moved aside: missing
    _directory(final, "x")
    assert await_replacement(final) is True
    old = tmp_path / ".d.old-host-1-abc"  # between a replace's two renames: the previous copy moved aside
    os.rename(final, old)
    assert await_replacement(final, attempts=2) is False  # a writer killed there: the caller says so
    shutil.move(old, final)
    assert await_replacement(final) is True


def test_a_held_file_is_linked_only_as_itself(tmp_path):
    final = str(tmp_path / "d")
    _directory(final, "old")
    pinned = PinnedDir(final)
    pinned.open("a.txt")
    assert pinned.link("a.txt", str(tmp_path / "linked")) and (tmp_path / "linked").read_text() == "old"
    _replace(final, "new")  # the name now names another file: not linked, nothing left behind
    assert not pinned.link("a.txt", str(tmp_path / "other")) and not (tmp_path / "other").exists()
