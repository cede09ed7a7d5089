"""Output paths of the command line (``--json``, ``--outputs``): checked and claimed before the run,
written at its end.

Invariants: nothing is ever left behind and a file already at the path stays as it was unless the
run gets to write it, whatever ends the process. On Linux the claim is an unnamed temporary file
(``O_TMPFILE``) in the path's directory: it has no name until the end, when it is linked into place
(straight onto the path when nothing is there, else under a fresh name renamed onto the path, with
SIGINT and SIGTERM held off between the two), so even SIGKILL leaves nothing. Where the filesystem
has no unnamed files, a named temporary file ``.NAME.<hex>.tmp`` next to the path is removed on
every exit that runs Python (an exception, SIGINT, SIGTERM), not on SIGKILL. ``claimed`` lists the
paths claimed in this process, written or not (the interruption message says which).
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import sys

from backend import children
from compiler.cli.args import UsageError, shown_path


def check_output(option: str, path: str) -> None:
    """Refuse an output path that cannot be written, before anything runs ('-' is stdout): the
    path, if it exists, must be a writable regular file (not a symbolic link, even a dangling
    one, a device, a FIFO, a socket or a directory) in an existing directory."""
    from backend.hybrid.checkpoint import file_kind

    if path == "-":
        return
    head, name = os.path.split(path)
    parent = head or "."
    try:
        st: os.stat_result | None = os.lstat(path)
    except FileNotFoundError:
        st = None
    except NotADirectoryError:
        raise UsageError(f"{option} {shown_path(path)}: no such directory {shown_path(parent)}") from None
    except OSError as exc:
        raise UsageError(f"{option} {shown_path(path)}: cannot use it ({exc.strerror})") from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{option} {shown_path(path)}: is a directory")
    if name in ("", ".", ".."):
        raise UsageError(f"{option} {shown_path(path)}: names a directory, not a file")
    if st is not None and stat.S_ISLNK(st.st_mode):
        raise UsageError(f"{option} {shown_path(path)}: is a symbolic link (links are not followed; '-' is stdout)")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{option} {shown_path(path)}: {file_kind(st.st_mode)}, not a regular file ('-' is stdout)")
    if not os.path.isdir(parent):
        raise UsageError(f"{option} {shown_path(path)}: no such directory {shown_path(parent)}")
    if not os.access(parent, os.W_OK | os.X_OK) or (st is not None and not os.access(path, os.W_OK)):
        raise UsageError(f"{option} {shown_path(path)}: not writable")


_O_TMPFILE: int = os.O_TMPFILE if sys.platform == "linux" else 0
"""``open``'s flag for an unnamed file (Linux only; elsewhere every claim is a named file)."""
_NO_TMPFILE: frozenset[int] = frozenset({errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT})
"""``open(dir, O_TMPFILE)``'s errors on a kernel or filesystem without unnamed files."""

claimed: list[OutputFile] = []
"""Every output path claimed in this process (the command line's interruption message reads it)."""


def _fresh(parent: str, name: str) -> str:
    return os.path.join(parent, f".{name[:64]}.{secrets.token_hex(6)}.tmp")


class OutputFile:
    """An output path ('-' is stdout) claimed before the run: ``open`` checks the path and creates a
    temporary file in its directory (unnamed where it can: see the module; else ``O_EXCL |
    O_NOFOLLOW`` next to it, so nothing already there is written through), refusing the path in one
    line if either fails; ``write`` fills it at the end and puts it in place; ``close`` drops it if
    it was never written. Use it as a context manager around the run."""

    def __init__(self, option: str, path: str | None) -> None:
        self.option, self.path = option, path
        self._fd: int | None = None
        self._tmp: str | None = None
        self.written = False

    def open(self) -> None:
        if self.path is None:
            return
        claimed.append(self)
        if self.path == "-":
            return
        check_output(self.option, self.path)
        head, name = os.path.split(self.path)
        parent = head or "."
        fd = self._unnamed(parent)
        if fd is None:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            for _ in range(8):
                tmp = _fresh(parent, name)
                try:
                    fd = os.open(tmp, flags, 0o666)
                    break
                except FileExistsError:
                    continue
                except OSError as exc:
                    raise UsageError(f"{self.option} {shown_path(self.path)}: cannot create a file in {shown_path(parent)} ({exc.strerror})") from None
            else:
                raise UsageError(f"{self.option} {shown_path(self.path)}: cannot create a file in {shown_path(parent)}")
            self._tmp = tmp
        self._fd = fd
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise UsageError(f"{self.option} {shown_path(self.path)}: cannot create a regular file in {shown_path(parent)}")
            try:
                os.fchmod(fd, stat.S_IMODE(os.lstat(self.path).st_mode))  # replacing a file keeps its permissions
            except FileNotFoundError:
                pass
        except OSError as exc:
            self.close()
            raise UsageError(f"{self.option} {shown_path(self.path)}: cannot use it ({exc.strerror})") from None
        except BaseException:
            self.close()
            raise

    def _unnamed(self, parent: str) -> int | None:
        """An unnamed file in ``parent`` (None where the filesystem has none)."""
        tmpfile = _O_TMPFILE
        if not tmpfile:
            return None
        try:
            return os.open(parent, tmpfile | os.O_WRONLY | os.O_CLOEXEC, 0o666)
        except OSError as exc:
            if exc.errno in _NO_TMPFILE:
                return None
            assert self.path is not None
            raise UsageError(f"{self.option} {shown_path(self.path)}: cannot create a file in {shown_path(parent)} ({exc.strerror})") from None

    def _put_in_place(self, fd: int) -> None:
        """Give the unnamed file ``fd`` the path: linked straight onto it when nothing is there,
        else under a fresh name renamed onto it (``write`` holds SIGINT and SIGTERM off meanwhile:
        a signal between the two would leave that name)."""
        assert self.path is not None
        source = f"/proc/self/fd/{fd}"
        head, name = os.path.split(self.path)
        # (a directory descriptor makes os.link call linkat, which follows the /proc link to the
        # file with AT_SYMLINK_FOLLOW; plain link() would try to link the /proc entry itself)
        parent = os.open(head or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            try:
                os.link(source, name, dst_dir_fd=parent, follow_symlinks=True)
                return
            except FileExistsError:
                pass
            for _ in range(8):
                tmp = os.path.basename(_fresh(".", name))
                try:
                    os.link(source, tmp, dst_dir_fd=parent, follow_symlinks=True)
                    break
                except FileExistsError:
                    continue
            else:
                raise FileExistsError(errno.EEXIST, "no fresh name", self.path)
            try:
                os.replace(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
            except BaseException:
                os.unlink(tmp, dir_fd=parent)
                raise
        finally:
            os.close(parent)

    def write(self, text: str) -> None:
        if self.path is None:
            return
        if self.path == "-":
            print(text)
            self.written = True
            return
        assert self._fd is not None, "write before open"
        data = memoryview((text + "\n").encode("utf-8"))
        try:
            while data:
                data = data[os.write(self._fd, data):]
            with children.deferred():  # in place and known to be, or neither
                if self._tmp is None:
                    self._put_in_place(self._fd)
                else:
                    os.replace(self._tmp, self.path)
                    self._tmp = None
                self.written = True
            os.close(self._fd)
            self._fd = None
        except OSError as exc:
            raise UsageError(f"{self.option} {shown_path(self.path)}: cannot write it ({exc.strerror})") from None
        finally:
            self.close()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._tmp is not None:
            try:
                os.unlink(self._tmp)
            except OSError:
                pass
            self._tmp = None

    def __enter__(self) -> OutputFile:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


