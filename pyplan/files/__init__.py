"""Atomic file writes (a reader sees the old file or the new one, never half of it), the check
that an output does not land on what a command reads (check_not_input), and the lock of a
folder one process writes into (hold_lock)."""

from __future__ import annotations

import fcntl
import os
import stat
import tempfile
from pathlib import Path

from pyplan.errors import PyplanError

__all__ = ["check_not_input", "check_output", "hold_lock", "read_capped", "write_atomic"]

_HELD: dict[str, int] = {}  # the folders this process holds locked, and their open descriptors


def read_capped(path: str | Path, limit: int) -> bytes:
    """At most `limit` bytes of a file, however long it is (/dev/zero). Opened without waiting:
    a named pipe nobody writes to reads as empty instead of blocking the open for ever. Raises
    OSError (and ValueError for a NUL in the path) as open() does."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as handle:
            return handle.read(limit)
    finally:
        os.close(fd)


def check_output(path: str | Path, what: str = "") -> Path:
    """The file to write for the output `path`: its target when it is a symlink (the link
    stays). PyplanError when it exists and is not a regular file (a device such as /dev/full,
    a named pipe, a directory): renaming over it would replace the user's node with a file.
    /dev/null is accepted: what is written there is discarded (`-o /dev/null`)."""
    path = Path(path)
    if _discarded(path):
        return path
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    try:
        mode = target.stat().st_mode
    except FileNotFoundError:
        return target
    except (OSError, ValueError) as exc:
        raise PyplanError(f"cannot write {what}{path}: "
                          f"{getattr(exc, 'strerror', None) or exc}") from None
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "a named pipe" if stat.S_ISFIFO(mode) \
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a special file"
        raise PyplanError(f"{what}{path} exists and is {kind}, not a regular file; pyplan "
                          "replaces its outputs whole, so it does not write there",
                          hint="choose a file name")
    return target


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write to a temporary file beside `path`, flush it to disk, then rename it over `path`
    (over its target when `path` is a symlink). An existing `path` that is not a regular file
    is refused (check_output)."""
    path = check_output(path)
    if _discarded(path):
        return
    raw = data.encode("utf-8") if isinstance(data, str) else data
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp",
                                   dir=path.parent if str(path.parent) else ".")
    except OSError as exc:
        raise PyplanError(f"cannot write {path}: {exc.strerror}",
                          hint="check that the directory exists and is writable") from None
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(raw)
            handle.flush()
            os.fsync(handle.fileno())
        # mkstemp creates 0600; give the file the mode a plain open() would (or keep the old one).
        try:
            mode = path.stat().st_mode & 0o7777
        except FileNotFoundError:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise PyplanError(f"cannot write {path}: {exc.strerror}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _discarded(path: Path) -> bool:
    try:
        return os.path.samefile(path, os.devnull)
    except (OSError, ValueError):
        return False


def check_not_input(output: str | Path, *inputs: str | Path | None, flag: str = "",
                    kind: str = "file") -> None:
    """PyplanError when writing `output` would destroy what the command reads or must keep:
    `output` is one of `inputs` or lies inside one that is a folder (a checkpoint, a weights
    folder), compared by device and inode after following links, so a hard link, a symlink or
    `./a/../b` is caught (e.g. `pyplan export PLAN -o PLAN`). `kind`: "file" (replaced whole:
    also check_output's refusals), "folder" (files are added into it: `run --save`), or
    "replaced folder" (replaced whole, so no input may lie inside it either). `flag` starts
    the message (`--log PATH: ...`). Commands call it before their work, so nothing is
    computed in vain."""
    named = f"{flag} {output}: " if flag else ""
    if str(output) == "" or "\0" in str(output):
        raise PyplanError(f"{flag or 'the output'} {str(output)!r}: " +
                          ("an empty path names no file" if not str(output) else
                           "a NUL character, which no file name can hold"),
                          hint="give a file or folder name")
    if kind == "file":
        target = check_output(output, f"{flag} " if flag else "")
        if not target.exists() and not target.resolve().parent.is_dir():
            raise PyplanError(f"{named or f'cannot write {output}: '}its directory does not "
                              "exist",
                              hint="create the directory first, or choose another output")
    elif Path(output).exists() and not Path(output).is_dir():
        raise PyplanError(f"{named}exists and is not a folder",
                          hint="choose a folder (a new name, or an existing directory)")
    around = _identities(output)
    if not around:
        return
    for given in inputs:
        if given is None or str(given) == "" or not os.path.exists(given):
            continue  # nothing there to lose
        inside = _identities(given)
        if inside and (inside[0] == around[0] or around[0] in _files_in(given)):
            what = "write over"
        elif inside and inside[0] in around:
            what = "write inside"
        elif inside and kind == "replaced folder" and around[0] in inside:
            what = "replace a folder holding"
        else:
            continue
        raise PyplanError(f"{named}refusing to {what} {given}, which this command reads",
                          hint="choose another output file" if kind == "file" else
                          "choose another folder")


def _files_in(folder: str | Path, limit: int = 10_000) -> set[tuple[int, int]]:
    """(st_dev, st_ino) of the files directly in `folder` (a hard link to one of them is that
    file), at most `limit` of them; empty when `folder` is not a directory."""
    found = set()
    try:
        with os.scandir(folder) as entries:
            for entry, _ in zip(entries, range(limit)):
                if entry.is_file():
                    info = entry.stat()
                    found.add((info.st_dev, info.st_ino))
    except (OSError, ValueError):
        pass
    return found


def _identities(path: str | Path) -> list[tuple[int, int]]:
    """(st_dev, st_ino) of `path` (after its links) and of each folder above it that exists;
    empty when the path cannot be looked at."""
    try:
        real = Path(os.path.realpath(path))
    except (OSError, ValueError):
        return []
    found = []
    for folder in (real, *real.parents):
        try:
            info = os.stat(folder)
        except (OSError, ValueError):
            continue
        found.append((info.st_dev, info.st_ino))
    return found if os.path.exists(real) else [(-1, -1), *found]  # -1: a path not there yet


def hold_lock(folder: str | Path, what: str) -> None:
    """Lock `folder` (created if need be) for this process until it exits: an exclusive flock
    on the folder itself (nothing is added to it), which the kernel releases however the
    process ends (a kill too), so a stale lock never blocks a restart. PyplanError when
    another process holds it."""
    real = os.path.realpath(folder)
    if real in _HELD:
        return
    try:
        os.makedirs(real, exist_ok=True)
        fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise PyplanError(f"{what}: cannot lock the folder: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise PyplanError(f"{what}: another process is saving into this folder",
                          hint="wait until it ends, or choose another folder") from None
    _HELD[real] = fd
