"""Files the pipeline writes: atomically (a hidden sibling temp, then rename), with the
permissions of the umask, temporaries swept when their owner starts again; and one writer per
run output, by an OS lock that dies with its holder."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


UMASK = _read_umask()  # once, at import: reading it sets it, which other threads would see


def temp_prefix(path: Path) -> str:
    """The name prefix of `path`'s temporaries: `.<name>.`"""
    return f".{Path(path).name}."


def atomic_write(path: Path, write: Callable[[IO], None], binary: bool = False, fsync: bool = False) -> None:
    """`write(fh)` into a temp file beside `path`, then rename it over `path`; on any error the
    temp file is removed and `path` is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path), dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~UMASK)  # mkstemp creates 0600
        with os.fdopen(fd, "wb" if binary else "w") as fh:
            write(fh)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda fh: fh.write(text))


def atomic_directory(path: Path, fill: Callable[[Path], None]) -> None:
    """`fill(tmp)` populates a temp folder beside `path`, which then replaces `path` whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(path), dir=path.parent))
    try:
        tmp.chmod(0o777 & ~UMASK)  # mkdtemp creates 0700
        fill(tmp)
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_stale_temporaries(*paths: Path) -> list[Path]:
    """Remove what an interrupted `atomic_write`/`atomic_directory` left beside `paths`; call
    only while owning them (under their `OutputLock`)."""
    removed = []
    for path in map(Path, paths):
        if not path.parent.is_dir():
            continue
        for stale in path.parent.glob(f"{temp_prefix(path)}*"):
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)
            removed.append(stale)
    return removed


class OutputLockedError(RuntimeError):
    """Another live process writes the same outputs."""


class OutputLock:
    """An exclusive `flock` on `path` holding the owner's PID. The kernel releases it when the
    owner dies, however it dies, so a stale lock is simply taken over."""

    def __init__(self, path: Path, what: str):
        self.path, self.what = Path(path), what
        self._fd: int | None = None

    def __enter__(self) -> OutputLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise OutputLockedError(
                f"{self.what} is being written by another process (PID {holder}, lock {self.path}); "
                "wait for it or stop it"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the flock
            self._fd = None
