"""The lock that lets one compare-and-swap writer of a local document in at a time: ``NAME.lock`` beside it.

    with DocLock(f"{path}.lock", wait_s=5.0) as held:   # LockHeld (a TimeoutError) after wait_s
        ...                                             # compare the stored version, write a temporary file
        held.check()                                    # LockLost if the lock is no longer this writer's
        os.replace(tmp, path)

Where the file system has POSIX record locks (local disks, NFSv4, most shared file systems),
``NAME.lock`` is a file that stays, locked with ``fcntl.lockf``. The kernel lets one holder in at a
time and drops the lock when its holder's process ends, however it ends, so nothing is ever broken
by age: a holder that is stopped or slow (a long fsync, SIGSTOP) keeps the lock for as long as it
lives, and a waiter gives up after ``wait_s`` with :class:`LockHeld`, naming the lock. The file's
age means nothing: one left by an earlier writer, or dated in the future by a skewed clock, is
simply locked again. POSIX locks belong to a process, not a thread, so the threads of one process
take turns on a lock of their own first.

Where the file system refuses record locks (``ENOLCK``, ``EOPNOTSUPP``: NFSv3 without its lock
daemon, some FUSE file systems), the lock is a directory, ``NAME.lock.owner``, holding one file
named after its holder's random id that says who holds it (host, boot, pid namespace, pid). It is
made whole under a name of its own and renamed into place; a rename onto a directory that is not
empty fails, so one writer gets in. Only a holder proven dead is broken: one of this machine (same
host, boot and pid namespace) whose process is gone. Its file is removed by its id (which can only
remove that holder's file) and the directory only if it is then empty, so a live holder's lock is
never removed and two writers are never in at once. A holder of another machine is never broken by
age: the waiter's LockHeld names it, for an operator to remove the directory once that process is
known to be gone. Every writer of one file system takes the same kind of lock: the file system
decides, not the writer.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import threading
import time
import uuid
from typing import Self

from ..errors import StorageError

# errnos of a file system without record locks: the directory lock is used instead
UNSUPPORTED = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS})
_BUSY = frozenset({errno.EAGAIN, errno.EACCES, errno.EINTR})
_RECORD_MAX = 4096  # an owner file is a few hundred bytes; one bigger is not a lock's

_thread_locks: dict[str, threading.Lock] = {}
_thread_locks_guard = threading.Lock()


class LockHeld(TimeoutError):
    """Another writer held the lock for the whole wait; the message names the lock (and its holder, when known)."""


class LockLost(StorageError):
    """The lock stopped being this writer's before its write: nothing was written."""


def _after_fork() -> None:
    """A child starts with no turn taken: a lock held by a thread of its parent is not its own."""
    global _thread_locks_guard
    _thread_locks.clear()
    _thread_locks_guard = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


def _thread_lock(path: str) -> threading.Lock:
    key = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
    with _thread_locks_guard:
        return _thread_locks.setdefault(key, threading.Lock())


def _sleep(delay: float, deadline: float) -> float:
    time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
    return min(delay * 2, 0.02)


class DocLock:
    """An exclusive lock on ``path`` (module doc), waited for at most ``wait_s`` seconds."""

    def __init__(self, path: str, wait_s: float):
        self.path = path
        self.wait_s = wait_s
        self.fd: int | None = None
        self.owner: OwnerDir | None = None  # the directory lock, where record locks are unsupported
        self._thread = _thread_lock(path)

    def __enter__(self) -> Self:
        deadline = time.monotonic() + self.wait_s
        if not self._thread.acquire(timeout=max(0.0, self.wait_s)):
            raise LockHeld(f"{self.path} is held by another writer of this process (waited {self.wait_s:g} s)")
        try:
            self._take(deadline)
        except BaseException:
            self._thread.release()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self.owner is not None:
                self.owner.release()
            elif self.fd is not None:
                os.close(self.fd)  # closing the file drops its record lock
        finally:
            self.fd, self.owner = None, None
            self._thread.release()

    def check(self) -> None:
        """LockLost unless the lock is still this writer's (a record lock always is while its file is open)."""
        if self.owner is not None:
            self.owner.check()

    def _take(self, deadline: float) -> None:
        delay = 0.001
        while True:
            fd = _open_lock_file(self.path)
            try:
                while True:
                    try:
                        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except OSError as e:
                        if e.errno in UNSUPPORTED:
                            os.close(fd)
                            fd = -1
                            self.owner = OwnerDir(f"{self.path}.owner")
                            self.owner.take(deadline, self.wait_s)
                            return
                        if e.errno not in _BUSY:
                            raise
                    if time.monotonic() >= deadline:
                        raise LockHeld(f"{self.path} is held by another writer (waited {self.wait_s:g} s); a "
                                       "writer keeps it for as long as its process lives, however slow or "
                                       "stopped, and loses it when the process ends")
                    delay = _sleep(delay, deadline)
                # Locked. The name may have been removed and made again meanwhile (by hand, or an older
                # writer): only a lock on the file the name is now counts.
                try:
                    now = os.lstat(self.path)
                except FileNotFoundError:
                    now = None
                mine = os.fstat(fd)
                if now is not None and (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
                    self.fd, fd = fd, -1
                    return
            finally:
                if fd >= 0:
                    os.close(fd)


def _open_lock_file(path: str) -> int:
    """The lock file, made if missing; never through a link, never a FIFO or device."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK):
            raise StorageError(f"the lock {path} is a symbolic link; refused (remove it)") from None
        if e.errno in (errno.EACCES, errno.EPERM):
            raise StorageError(f"cannot open the lock {path} to write ({e.strerror}): every writer of these "
                               "documents must be able to write it") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise StorageError(f"the lock {path} is not a regular file; refused (remove it)")
    return fd


# --- where record locks are unsupported: a directory named after its holder -----------------------------


def _proc_text(path: str) -> str:
    try:
        if path.startswith("/proc/self/ns/"):
            return os.readlink(path)
        with open(path) as f:
            return f.read(256).strip()
    except OSError:
        return ""


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` (> 0) of this machine has ended (a zombie, not yet reaped, has; another user's
    live process has not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    state = _proc_text(f"/proc/{pid}/stat").rpartition(")")[2].split()[:1]
    return state == ["Z"]


class OwnerDir:
    """The lock as a directory holding its holder's file (module doc). ``path``: ``NAME.lock.owner``."""

    def __init__(self, path: str):
        self.path = path
        self.id = uuid.uuid4().hex
        self.me = {"id": self.id, "host": socket.gethostname(), "boot": _proc_text("/proc/sys/kernel/random/boot_id"),
                   "pidns": _proc_text("/proc/self/ns/pid"), "pid": os.getpid()}

    def take(self, deadline: float, wait_s: float) -> None:
        tmp = f"{self.path}.{self.id}.tmp"
        os.mkdir(tmp, 0o755)
        try:
            fd = os.open(os.path.join(tmp, self.id), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "w") as f:
                json.dump({**self.me, "since_unix": time.time()}, f)
                f.flush()
                os.fsync(f.fileno())
            delay = 0.001
            while True:
                try:
                    os.rename(tmp, self.path)  # fails while the lock is a directory with a holder's file in it
                    return
                except OSError as e:
                    if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                        raise
                holder = self._holder()
                if holder is not None and self._dead(holder):
                    self._break(holder["id"])
                    continue
                if time.monotonic() >= deadline:
                    raise LockHeld(self._held(holder, wait_s))
                delay = _sleep(delay, deadline)
        finally:
            for p in (os.path.join(tmp, self.id), tmp):
                try:
                    os.rmdir(p) if p == tmp else os.unlink(p)
                except OSError:
                    pass

    def check(self) -> None:
        try:
            os.lstat(os.path.join(self.path, self.id))
        except FileNotFoundError:
            raise LockLost(f"the lock {self.path} is no longer this writer's; nothing was written") from None

    def release(self) -> None:
        try:
            os.unlink(os.path.join(self.path, self.id))
        except FileNotFoundError:
            return
        try:
            os.rmdir(self.path)  # only if empty: a writer that got in meanwhile has its file there
        except OSError:
            pass

    def _holder(self) -> dict | None:
        """The holder's record, or None (no holder just now, or one being written: look again)."""
        try:
            names = [n for n in os.listdir(self.path) if len(n) == 32]
        except (FileNotFoundError, NotADirectoryError):
            return None
        if len(names) != 1:
            return None
        try:
            fd = os.open(os.path.join(self.path, names[0]), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            with os.fdopen(fd, "rb") as f:
                record = json.loads(f.read(_RECORD_MAX))
        except (OSError, ValueError):
            return None
        if not isinstance(record, dict) or record.get("id") != names[0]:
            return None
        return record

    def _dead(self, holder: dict) -> bool:
        same_machine = all(holder.get(k) == self.me[k] for k in ("host", "boot", "pidns"))
        pid = holder.get("pid")
        return same_machine and isinstance(pid, int) and pid > 0 and pid != os.getpid() and process_gone(pid)

    def _break(self, holder_id: str) -> None:
        try:
            os.unlink(os.path.join(self.path, holder_id))  # that holder's file, by its id: no one else's
        except FileNotFoundError:
            return  # broken by another waiter already
        try:
            os.rmdir(self.path)
        except OSError:
            pass

    def _held(self, holder: dict | None, wait_s: float) -> str:
        if holder is None:
            return f"{self.path} is held by another writer (waited {wait_s:g} s)"
        who = f"pid {holder.get('pid')} on {holder.get('host')}"
        since = holder.get("since_unix")
        when = f" since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}" if isinstance(since, float) else ""
        return (f"{self.path} is held by {who}{when} (waited {wait_s:g} s); a holder of another machine is never "
                f"broken by age: if that process is gone, remove {self.path}")
