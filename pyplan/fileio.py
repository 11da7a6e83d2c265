"""Atomic file writes: a reader sees the old file or the new one, never half of it."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from pyplan.errors import PyplanError

__all__ = ["check_not_input", "check_output", "read_capped", "write_atomic"]


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


def check_not_input(output: str | Path, *inputs: str | Path | None) -> None:
    """PyplanError when `output` is one of the files a command reads (writing the result would
    destroy its own input, e.g. `pyplan export PLAN -o PLAN`) or cannot be replaced by a file
    (check_output). Commands call it before their work, so nothing is computed in vain."""
    target = check_output(output)
    if not target.exists() and not target.resolve().parent.is_dir():
        raise PyplanError(f"cannot write {output}: its directory does not exist",
                          hint="create the directory first, or choose another output")
    for given in inputs:
        if given is None:
            continue
        try:
            same = os.path.samefile(output, given) if Path(output).exists() else \
                Path(output).resolve() == Path(given).resolve()
        except (OSError, ValueError):
            continue
        if same:
            raise PyplanError(f"refusing to write over {given}, which this command reads",
                              hint="choose another output file")
