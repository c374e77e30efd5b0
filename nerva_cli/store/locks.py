"""Who may write or remove what in the store while others read it: advisory flocks.

- A writer of a model name (pull, convert into the store, rm) holds `$NERVA_HOME/locks/<name>.lock`
  exclusively; a second one waits, saying whose turn it is (two `pull --force` of one name once
  raced to `os.rename ... Directory not empty`).
- A run holds its model's directory shared (`hold`) for as long as its engine lives; `rm` and the
  swap of `pull --force` take it exclusively without waiting and refuse while a run holds it. Of
  the two ways issue 49 allowed, this one: `rm` refuses, so a run streaming layers from disk is
  never cut off (a file deleted outside nerva still ends the run in one line: the pager's).
- A conversion's temporary directory whose writer is gone (kill -9, a crash, power) is removed
  by the next store operation (`sweep`: pull, convert, list, rm).

Lock files are never deleted: a waiter holding the old file open would lock a file no one else
sees, and two writers would run at once.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import weakref
from contextlib import contextmanager
from pathlib import Path

from nerva_cli.errors import NervaError, NotInStore
from nerva_cli.store.catalog import TEMP_NAME, StoredModel, load_metadata, models_root, store_dir

_writing: set[str] = set()  # names this process holds the write lock of (a second flock of its own would block)
# where a filesystem has no flock (some NFS setups): the store works unlocked, as it did before
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)


def _lock_file(name: str) -> int:
    path = store_dir("locks") / f"{name}.lock"
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise NervaError(f"{path}: {e.strerror} (the store's lock for {name})") from None


@contextmanager
def writing(name: str, say=None):
    """Holds the write lock of model `name`; waits for another writer, after `say`ing (one line)
    which process holds it."""
    fd = _lock_file(name)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip()  # empty: it has not written it yet
            if say is not None:
                say(f"waiting for {f'pid {pid}' if pid else 'another process'}, which is writing {name} in the store")
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            if e.errno not in _NO_LOCKS:
                raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # for the next waiter's line
        _writing.add(name)
        try:
            yield
        finally:
            _writing.discard(name)
    finally:
        os.close(fd)  # releases the lock


def _try_writing(name: str) -> int | None:
    """The name's write lock taken without waiting (its fd, to close), or None where a writer holds it."""
    fd = _lock_file(name)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except OSError as e:
        os.close(fd)
        if isinstance(e, BlockingIOError) or e.errno in _NO_LOCKS:  # unlockable: a live writer may be there
            return None
        raise


def holders(fd: int) -> list[int]:
    """Pids holding a flock on the file or directory open as `fd`, from /proc/locks (Linux; an
    empty list elsewhere)."""
    st = os.fstat(fd)
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return []
    pids = []
    for line in lines:
        fields = line.split()
        if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == key and fields[4].isdigit():
            pids.append(int(fields[4]))  # (a waiter's line has "->" in fields[1])
    return sorted(set(pids))


@contextmanager
def exclusive(model_dir: Path, label: str | None = None):
    """Holds `model_dir` exclusively while it is removed or replaced; refuses at once, naming the
    pids, while a run holds it (a chat may last hours: waiting would look like a hang)."""
    fd = os.open(model_dir, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pids = holders(fd)
            who = f"pid {', '.join(map(str, pids))}" if pids else "another process"
            what = f"{label} ({model_dir})" if label else str(model_dir)
            raise NervaError(f"{what} is in use by a run ({who}): end that run first") from None
        except OSError as e:
            if e.errno not in _NO_LOCKS:
                raise
        yield
    finally:
        os.close(fd)


def hold(model: StoredModel) -> StoredModel:
    """Holds `model`'s directory shared until release(model) (or the model is collected, or the
    process ends); -> the model as its directory is now: reloaded where `pull --force` replaced
    it between the find and the lock, refused where `rm` removed it."""
    for _ in range(3):
        try:
            fd = os.open(model.path, os.O_RDONLY)
        except FileNotFoundError:
            raise NotInStore(f"{model.path}: removed from the store as the run started") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits only for an rm or a swap under way
        except OSError as e:
            os.close(fd)
            if e.errno not in _NO_LOCKS:
                raise
            return model
        try:
            same = os.fstat(fd).st_ino == os.stat(model.path).st_ino
        except FileNotFoundError:
            os.close(fd)
            raise NotInStore(f"{model.path}: removed from the store as the run started") from None
        if same:
            held = load_metadata(model.path)  # what the directory holds now, under the lock
            held._hold = weakref.finalize(held, os.close, fd)
            return held
        os.close(fd)  # replaced meanwhile: lock the new directory
    raise NervaError(f"{model.path}: replaced again and again as the run started; try again")


def release(model: StoredModel) -> None:
    finalizer = getattr(model, "_hold", None)
    if finalizer is not None:
        finalizer()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def sweep() -> list[dict]:
    """Removes conversions' temporary directories whose writer is gone: its pid not alive and no
    writer of that name holding the lock (a pid of another pid namespace sharing the store may
    look dead). -> those left, one dict each (name, variant, pid, status, size, path), for
    `list --json`: `writing` (a live writer) or `stale` (could not be removed now)."""
    root = models_root()
    left = []
    if not root.is_dir():
        return left
    for tmp in sorted(root.glob("*/.*.tmp-*")):
        m = TEMP_NAME.match(tmp.name)
        if m is None or not tmp.is_dir():
            continue
        name, pid = tmp.parent.name, int(m["pid"])
        alive = _alive(pid)
        if not alive and _remove_stale(tmp, name):
            continue
        left.append({"name": name, "variant": m["variant"], "pid": pid, "status": "writing" if alive else "stale",
                     "size": _du(tmp), "path": str(tmp)})
    return left


def _remove_stale(tmp: Path, name: str) -> bool:
    fd = None
    if name not in _writing:
        try:
            fd = _try_writing(name)
        except NervaError:  # a store nerva cannot write (read-only): `list` still lists, the dir stays
            return False
        if fd is None:
            return False
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.parent.rmdir()  # only when that left it empty
        except OSError:
            pass
        return not tmp.exists()
    finally:
        if fd is not None:
            os.close(fd)


def _du(path: Path) -> int:
    total = 0
    for f in path.rglob("*"):
        try:
            total += f.stat().st_size if f.is_file() else 0
        except OSError:
            pass
    return total
