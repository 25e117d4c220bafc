"""A dir's exclusive lock: one writer at a time, for a run dir (membudget.rundir) or a token file being written
(membudget.token_file).

The lock is `fcntl.flock` on `<dir>/.lock`: the OS releases it when the process ends in any way (a SIGKILLed run
never blocks its own resume), and the file names the holder for the one-line error. The file is removed when the
holder releases it, so it is there only while one holds it (or after a SIGKILL).
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path
from typing import Optional

from membudget.errors import UserError

LOCK = ".lock"


class DirLock:
    """A dir's exclusive lock: held by a run's rank 0 from the start of the run to its end (the defaults), or by
    whatever else writes a dir that must have one writer (a token file's partial dir). `name`, `holder` and `fix`
    word the one-line refusal of a second writer."""

    def __init__(self, directory: Path, name: Optional[str] = None, holder: str = "another run",
                 fix: str = "wait for it to end, or give this run its own hydra.run.dir"):
        self.path = Path(directory) / LOCK
        self.name = name or f"hydra.run.dir={str(directory)!r}"
        self.holder, self.fix = holder, fix
        self._fd: Optional[int] = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 4096).decode(errors="replace").strip() or "another process"
                os.close(fd)
                raise UserError(f"{self.name}: {self.holder} is using it ({holder}); {self.fix}") from None
            # the holder removes the file on release: a lock taken on a file no longer at the path is no lock
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
                 .encode())
        self._fd = fd

    def release(self) -> None:
        """Remove the lock file, then unlock: the file exists only while a run holds it, so a run that ends
        (or is refused after its lock, or by it) leaves no `.lock` behind. A process SIGKILLed while holding
        it leaves the file, unlocked: the next run takes it over."""
        if self._fd is not None:
            try:
                os.unlink(self.path)  # still holding the lock: acquire() above retries on the new file
            except OSError:
                pass  # already gone, or the dir is read-only now: the unlocked file is harmless
            os.close(self._fd)  # closing releases the flock
            self._fd = None
