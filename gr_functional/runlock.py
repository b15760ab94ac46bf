"""One writer per run folder: an exclusive lock on ``OUT/.grf.lock`` held while a run lives.

Two ``grf train`` on the same ``--out`` would interleave lines in metrics.jsonl and overwrite each
other's checkpoints, so the second one exits 2 naming the holder. The lock is ``fcntl.flock`` on
the file (the kernel releases it when the holder dies, however it dies, so a SIGKILLed run never
blocks the next one); the file holds the holder's pid, host, start time and command while it
runs and is removed when it ends (emptied, when the run found it there). A non-empty file whose lock is free was left by a run that died:
it is taken over with a warning naming that run. On NFS, Linux emulates flock with POSIX byte-range
locks, which the server arbitrates, so runs on different hosts exclude each other too.
In a data-parallel run, rank 0 (the only rank that writes OUT) holds the lock.
"""
from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import sys
from pathlib import Path
from .errors import RunLocked  # noqa: F401 (re-exported)

LOCK_NAME = ".grf.lock"


def _describe(text: str) -> str:
    try:
        h = json.loads(text)
        return (f"pid {h.get('pid')} on host {h.get('host')}, started {h.get('started')}: "
                f"{h.get('command')}")
    except (ValueError, AttributeError):
        return repr(text[:200])


def is_held(out: str | Path) -> bool:
    """Whether a live run holds ``out``'s lock now (``grf report``'s status)."""
    try:
        fd = os.open(Path(out) / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


class RunLock:
    """``lock = RunLock(out); stale = lock.acquire(); ...; lock.release()``.

    ``acquire`` creates OUT if needed; ``release`` empties the file (so a rejected run leaves a
    finished folder byte-identical) and, when this lock created OUT and nothing else was written
    there, removes both again."""

    def __init__(self, out: str | Path):
        self.out = Path(out)
        self.path = self.out / LOCK_NAME
        self.fd: int | None = None
        self.created_out = False
        self.created_file = False

    def acquire(self) -> str | None:
        """Take the lock or raise ``RunLocked`` naming the holder. Returns a description of the
        dead run whose lock was taken over, or None."""
        try:
            return self._acquire()
        except OSError as exc:
            if exc.errno in (errno.ENOTDIR, errno.EISDIR, errno.EEXIST):  # --out is a file, the lock a folder
                raise RunLocked(f"cannot use {self.out} as a run folder: {exc.filename or self.path}: "
                                f"{exc.strerror or exc}; pass another --out") from None
            from .checkpoint import write_error  # read-only, full...: a write failure (exit 5)

            raise write_error(Path(exc.filename or self.path), exc) from None

    def _acquire(self) -> str | None:
        if not self.out.exists():
            self.out.mkdir(parents=True, exist_ok=True)
            self.created_out = True
        self.created_file = not self.path.exists()
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 4096, 0).decode(errors="replace")
                os.close(fd)
                raise RunLocked(f"{self.out} is in use by another grf train ({_describe(holder)}); wait for it to "
                                f"finish or stop it, or use another --out") from None
            try:  # a releasing run may have removed the file between our open and flock: retry
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self.fd = fd
        previous = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        me = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "command": " ".join(["grf", *sys.argv[1:]])}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        return _describe(previous) if previous else None

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, 0)
            if self.created_file:  # leave the folder as this run found it (a waiter re-opens: inode check)
                self.path.unlink()
            if self.created_out and not any(self.out.iterdir()):
                self.out.rmdir()
        except OSError:
            pass  # best effort: the kernel releases the lock below in any case
        finally:
            os.close(self.fd)
            self.fd = None
