"""Saved slot files moved between two slot folders (``launcher.server.slotsave.move``): a deploy
that changes ``--slot-save-path``, or a second instance with a folder of its own. Real files on
this machine's filesystems; what a server makes of them is in tests/test_handover.py."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import pytest

from launcher.server import slotsave

#: a user no file here belongs to (what a ``DynamicUser=`` service's uid looks like to root)
OTHER_UID, OTHER_GID = 61234, 61234

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")


def saved_file(folder: Path, slot: int = 0, data: bytes = b"cells" * 100) -> slotsave.Saved:
    name = slotsave.FILENAME.format(slot=slot)
    (folder / name).write_bytes(data)
    (folder / name).chmod(0o644)  # as a server with another umask writes it
    return slotsave.Saved(slot, name, 10, len(data), 1.0)


def folders(tmp_path: Path) -> tuple[Path, Path]:
    src, dst = tmp_path / "old", tmp_path / "new"
    src.mkdir()
    dst.mkdir()
    return src, dst


def test_a_move_within_one_filesystem_leaves_the_file_only_in_the_new_folder(
    tmp_path: Path,
) -> None:
    src, dst = folders(tmp_path)
    s = saved_file(src)
    moved, skipped = slotsave.move([s], src, dst)
    assert (moved, skipped) == ([s], [])
    assert not (src / s.filename).exists()
    assert (dst / s.filename).read_bytes() == b"cells" * 100


@contextmanager
def other_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A folder on another filesystem than ``tmp_path`` (/dev/shm's tmpfs)."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("no second filesystem at /dev/shm")
    folder = Path(tempfile.mkdtemp(dir=shm))
    try:
        yield folder
    finally:
        shutil.rmtree(folder)


def test_a_move_across_filesystems_copies_the_bytes_private_and_removes_the_old(
    tmp_path: Path,
) -> None:
    with other_filesystem(tmp_path) as src:
        dst = tmp_path / "new"
        dst.mkdir()
        s = saved_file(src, data=os.urandom(3 << 20))
        data = (src / s.filename).read_bytes()
        assert slotsave.move([s], src, dst) == ([s], [])
        assert (dst / s.filename).read_bytes() == data
        assert (dst / s.filename).stat().st_mode & 0o777 == 0o600
        assert sorted(p.name for p in dst.iterdir()) == [s.filename]  # no .part left
        assert not (src / s.filename).exists()


def test_a_renamed_file_is_private_too(tmp_path: Path) -> None:
    src, dst = folders(tmp_path)
    s = saved_file(src)
    slotsave.move([s], src, dst)
    assert (dst / s.filename).stat().st_mode & 0o777 == 0o600


def test_a_copy_replaces_what_a_killed_move_left(tmp_path: Path) -> None:
    with other_filesystem(tmp_path) as src:
        dst = tmp_path / "new"
        dst.mkdir()
        s = saved_file(src)
        (dst / (s.filename + slotsave.PART)).write_bytes(b"half")
        assert slotsave.is_slot_file(s.filename + slotsave.PART)  # the recovery's sweep takes it
        assert slotsave.move([s], src, dst) == ([s], [])
        assert sorted(p.name for p in dst.iterdir()) == [s.filename]


def test_a_link_in_the_old_folder_is_not_followed(tmp_path: Path) -> None:
    src, dst = folders(tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("root's file")
    name = slotsave.FILENAME.format(slot=0)
    (src / name).symlink_to(victim)
    moved, skipped = slotsave.move([slotsave.Saved(0, name, 10, 11, 1.0)], src, dst)
    assert moved == [] and "symbolic link" in skipped[0]["reason"]
    assert victim.read_text() == "root's file" and not (dst / name).exists()


@pytest.mark.parametrize("across", [False, True], ids=["rename", "copy"])
def test_a_link_in_the_new_folder_is_replaced_not_written_through(
    tmp_path: Path, across: bool
) -> None:
    victim = tmp_path / "victim"
    victim.write_text("root's file")
    dst = tmp_path / "new"
    dst.mkdir()
    with other_filesystem(tmp_path) if across else nullcontext(tmp_path / "old") as src:
        src.mkdir(exist_ok=True)
        s = saved_file(src)
        (dst / s.filename).symlink_to(victim)
        (dst / (s.filename + slotsave.PART)).symlink_to(victim)
        assert slotsave.move([s], src, dst) == ([s], [])
    assert victim.read_text() == "root's file"
    assert (dst / s.filename).is_file() and not (dst / s.filename).is_symlink()


@needs_root
def test_a_file_moved_into_a_services_folder_belongs_to_that_service(tmp_path: Path) -> None:
    src, dst = folders(tmp_path)
    os.chown(dst, OTHER_UID, OTHER_GID)
    s = saved_file(src)
    slotsave.move([s], src, dst)
    st = (dst / s.filename).stat()
    assert (st.st_uid, st.st_gid) == (OTHER_UID, OTHER_GID)


@needs_root
@pytest.mark.parametrize("across", [False, True], ids=["rename", "copy"])
def test_a_file_moved_into_a_folder_of_roots_keeps_the_owner_that_wrote_it(
    tmp_path: Path, across: bool
) -> None:
    dst = tmp_path / "new"
    dst.mkdir()
    with other_filesystem(tmp_path) if across else nullcontext(tmp_path / "old") as src:
        src.mkdir(exist_ok=True)
        s = saved_file(src)
        os.chown(src / s.filename, OTHER_UID, OTHER_GID)
        slotsave.move([s], src, dst)
    st = (dst / s.filename).stat()
    assert (st.st_uid, st.st_gid) == (OTHER_UID, OTHER_GID)


def test_a_file_that_cannot_move_stays_where_it_was_and_says_why(tmp_path: Path) -> None:
    src, dst = folders(tmp_path)
    good, bad = saved_file(src, 0), saved_file(src, 1)
    (dst / bad.filename).mkdir()  # a folder where the file would go: the rename fails
    moved, skipped = slotsave.move([good, bad], src, dst)
    assert moved == [good]
    assert [s["slot"] for s in skipped] == [1]
    assert bad.filename in skipped[0]["reason"] and str(dst) in skipped[0]["reason"]
    assert (src / bad.filename).is_file()


def test_a_missing_folder_moves_nothing_and_names_it(tmp_path: Path) -> None:
    src = tmp_path / "old"
    src.mkdir()
    s = saved_file(src)
    moved, skipped = slotsave.move([s], src, tmp_path / "gone")
    assert moved == []
    assert "slot folder" in skipped[0]["reason"] and "gone" in skipped[0]["reason"]
    assert (src / s.filename).is_file()
