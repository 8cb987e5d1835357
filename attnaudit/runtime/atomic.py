"""Atomic output files: write to a temporary name beside the target, then rename into place.

A reader (or a rerun after Ctrl-C) never sees a half-written report, figure or checkpoint:
``os.replace`` within one folder is atomic on POSIX and Windows. Several files that belong
together (a JSON report and its figure; weights and their side-car) are staged first and
renamed one after the other with SIGINT held back, so an interrupt either leaves none of
them or all of them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
from pathlib import Path
from typing import Callable, Iterator

from attnaudit.errors import AuditError


def temp_path_for(target: Path) -> Path:
    """A fresh, empty temporary file in ``target``'s folder, named after it (suffix kept)."""
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=f".tmp{target.suffix}")
    os.close(fd)
    return Path(name)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _is_regular_target(target: Path) -> bool:
    """Devices and pipes (/dev/null, /dev/stdout) are written in place: they cannot be renamed over."""
    return not target.exists() or target.is_file()


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """Hold SIGINT back for the block (main thread only); a pending one fires when it ends."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextlib.contextmanager
def folder_lock(folder: Path) -> Iterator[None]:
    """An exclusive advisory lock (``flock``) on ``folder`` itself, held for the block: no lock
    file is created. Where ``flock`` is missing (Windows) or the folder cannot be opened, the
    block runs unlocked (each file is still renamed atomically)."""
    try:
        import fcntl
    except ImportError:  # Windows
        yield
        return
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


class StagedFiles:
    """Files written under temporary names, renamed into place together by :meth:`commit`.

    Use as a context manager: anything still staged when the block ends (an error, Ctrl-C)
    is deleted, so no partial or temporary file is left behind.
    """

    def __init__(self, overwrite: bool = True) -> None:
        self.overwrite = overwrite  # False: a target that exists at commit time is not replaced
        self._staged: list[tuple[Path, Path]] = []  # (temporary, target)
        self._direct: list[tuple[Path, Callable[[Path], object]]] = []

    def stage(self, target: str | Path, write: Callable[[Path], object]) -> None:
        """Call ``write(path)`` on a temporary path beside ``target`` now; rename at commit."""
        target = Path(target)
        if not _is_regular_target(target):
            self._direct.append((target, write))
            return
        tmp = temp_path_for(target)
        self._staged.append((tmp, target))
        write(tmp)
        # mkstemp makes files private (0600), and some writers recreate the file; outputs get
        # the usual mode (0666 minus umask), set after writing.
        os.chmod(tmp, 0o666 & ~_umask())

    def commit(self) -> None:
        """Rename every staged file into place (SIGINT deferred until all are in place).

        Several files (or any file that must not replace an existing one) are renamed under
        an exclusive lock on each folder they go into (:func:`folder_lock`), so two runs
        writing the same folder at once leave one run's set, whole, never a mix of the two;
        without ``overwrite`` a target another process created since the run checked it is
        refused under that lock (:class:`~attnaudit.errors.AuditError`) instead of replaced."""
        with sigint_deferred(), contextlib.ExitStack() as locks:
            if len(self._staged) > 1 or not self.overwrite:
                for folder in sorted({str(target.parent.resolve()) for _, target in self._staged}):
                    locks.enter_context(folder_lock(Path(folder)))
            if not self.overwrite:
                taken = [str(target) for _, target in self._staged if target.is_file()]
                if taken:
                    raise AuditError(
                        f"{taken[0]} appeared while this run was writing (another run?); pass --overwrite or choose "
                        "another path"
                    )
            for tmp, target in self._staged:
                os.replace(tmp, target)
            self._staged.clear()
        for target, write in self._direct:
            write(target)
        self._direct.clear()

    def discard(self) -> None:
        for tmp, _ in self._staged:
            with contextlib.suppress(OSError):
                tmp.unlink()
        self._staged.clear()
        self._direct.clear()

    def __enter__(self) -> "StagedFiles":
        return self

    def __exit__(self, *exc) -> None:
        self.discard()


def write_bytes_atomic(target: str | Path, data: bytes) -> None:
    """Write ``data`` to ``target`` atomically (devices such as /dev/null are written directly)."""
    with StagedFiles() as files:
        files.stage(target, lambda p: Path(p).write_bytes(data))
        files.commit()


def write_text_atomic(target: str | Path, text: str) -> None:
    """Write UTF-8 ``text`` to ``target`` atomically."""
    write_bytes_atomic(target, text.encode("utf-8"))
