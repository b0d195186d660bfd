"""Files the pipeline writes: atomically (a hidden sibling temp, then rename), with the
permissions of the umask, temporaries swept when their owner starts again; and one writer per
run output, by an OS lock that dies with its holder."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

from pfl_tasks.errors import OutputLockedError, OutputPathError


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
    except BaseException as err:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(err, OSError) and err.filename is None:  # a failed write names no file: this one
            err.filename = str(path)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda fh: fh.write(text))


_LIBC = ctypes.CDLL(None, use_errno=True)
AT_FDCWD, RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>


def _exchange(a: Path, b: Path) -> None:
    """Swap the entries `a` and `b` in one atomic step (Linux's renameat2 RENAME_EXCHANGE)."""
    renameat2 = getattr(_LIBC, "renameat2", None)  # glibc 2.28+
    if renameat2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(a), None, str(b))


def atomic_directory(path: Path, fill: Callable[[Path], None]) -> None:
    """`fill(tmp)` populates a temp folder beside `path`, which then replaces `path` whole in one
    atomic exchange: whenever a kill strikes, `path` is the old folder or the new one (a temp
    folder may be stranded; `remove_stale_temporaries` sweeps it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(path), dir=path.parent))
    try:
        tmp.chmod(0o777 & ~UMASK)  # mkdtemp creates 0700
        fill(tmp)
        if not os.path.lexists(path):
            os.rename(tmp, path)
        else:
            try:
                _exchange(tmp, path)  # tmp now holds the old folder
            except OSError as err:
                if err.errno not in (errno.EINVAL, errno.ENOSYS):
                    raise
                # a filesystem that cannot exchange (NFS): the old folder is moved aside first, so
                # a kill between these two renames leaves none at `path` until a rerun
                old = tmp.with_name(f"{tmp.name}-old")
                os.rename(path, old)
                os.rename(tmp, path)
                shutil.rmtree(old)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the old folder, or an unfinished new one


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


def check_output_dir(directory: Path) -> None:
    """Raise OutputPathError unless `directory` is, or can be made as, a writable folder; creates
    nothing."""
    existing = Path(directory)  # the deepest folder there is
    for part in reversed([Path(directory), *Path(directory).parents]):
        if part.is_dir():
            existing = part
        elif part.is_symlink():
            raise OutputPathError(f"{part} is a link to {os.readlink(part)}, which does not exist: "
                                  "create its target or remove the link")
        elif part.exists():
            raise OutputPathError(f"{part} is not a directory: move it away")
        else:
            break  # `part` and what is under it get created
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputPathError(f"{existing}: no permission to write there")


class OutputLock:
    """An exclusive `flock` on `path` holding the owner's PID. The kernel releases it when the
    owner dies, however it dies, so a stale lock is simply taken over. A lock file deleted under
    its owner (`rm -rf .locks`) would let a second writer in: `verify` finds that out."""

    def __init__(self, path: Path, what: str, doing: str = "written by another process"):
        self.path, self.what, self.doing = Path(path), what, doing
        self._fd: int | None = None

    def __enter__(self) -> OutputLock:
        holder = self._take()
        if holder is not None:
            raise OutputLockedError(f"{self.what} is being {self.doing} (PID {holder}, lock {self.path}); "
                                    "wait for it or stop it")
        return self

    def fileno(self) -> int:
        """The locked file: a child process given it holds the lock until it ends too."""
        return self._fd

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the flock
            self._fd = None

    def verify(self) -> None:
        """Still the one writer: a lock file deleted under this owner is taken anew, unless
        another process took the new one meanwhile; then OutputLockedError, and this process must
        write no more of the outputs (they are the other's now)."""
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(self._fd), os.stat(self.path)):
                return
        self.__exit__()
        holder = self._take()
        if holder is not None:
            raise OutputLockedError(
                f"{self.what}: its lock {self.path} was deleted while this process held it, and PID {holder} "
                "took a new one: stopped without writing more (the outputs are that process's now)"
            )

    def _take(self) -> str | None:
        """Lock `path`, created if missing: None when taken, else the holder's PID."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            return holder
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return None
