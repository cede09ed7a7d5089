"""Output paths of the command line (``--json``): checked and claimed before the run, written at
its end."""

from __future__ import annotations

import os
import secrets
import stat

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


class OutputFile:
    """An output path ('-' is stdout) claimed before the run: ``open`` checks the path and creates a
    temporary file next to it (``O_EXCL | O_NOFOLLOW``, so nothing already there is written
    through), refusing the path in one line if either fails; ``write`` fills it at the end and
    renames it onto the path; ``close`` removes it if it was never written. Use it as a context
    manager around the run."""

    def __init__(self, option: str, path: str | None) -> None:
        self.option, self.path = option, path
        self._fd: int | None = None
        self._tmp: str | None = None

    def open(self) -> None:
        if self.path is None or self.path == "-":
            return
        check_output(self.option, self.path)
        head, name = os.path.split(self.path)
        parent = head or "."
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        for _ in range(8):
            tmp = os.path.join(parent, f".{name[:64]}.{secrets.token_hex(6)}.tmp")
            try:
                fd = os.open(tmp, flags, 0o666)
                break
            except FileExistsError:
                continue
            except OSError as exc:
                raise UsageError(f"{self.option} {shown_path(self.path)}: cannot create a file in {shown_path(parent)} ({exc.strerror})") from None
        else:
            raise UsageError(f"{self.option} {shown_path(self.path)}: cannot create a file in {shown_path(parent)}")
        self._fd, self._tmp = fd, tmp
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

    def write(self, text: str) -> None:
        if self.path is None:
            return
        if self.path == "-":
            print(text)
            return
        assert self._fd is not None and self._tmp is not None, "write before open"
        data = memoryview((text + "\n").encode("utf-8"))
        try:
            while data:
                data = data[os.write(self._fd, data):]
            os.close(self._fd)
            self._fd = None
            os.replace(self._tmp, self.path)
            self._tmp = None
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


