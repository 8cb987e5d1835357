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


class StagedFiles:
    """Files written under temporary names, renamed into place together by :meth:`commit`.

    Use as a context manager: anything still staged when the block ends (an error, Ctrl-C)
    is deleted, so no partial or temporary file is left behind.
    """

    def __init__(self) -> None:
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
        """Rename every staged file into place (SIGINT deferred until all are in place)."""
        with sigint_deferred():
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
