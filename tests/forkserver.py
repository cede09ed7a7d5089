"""The suite's child processes, started from a template process instead of a fresh interpreter.

Most of the suite's wall time used to go to processes it starts (``batchc run`` and ``serve`` on the
command line, tensor-parallel ranks, data-parallel replicas, executor processes), each a fresh
interpreter that imported torch and batchc again: about two seconds of CPU before its first line of
work, some two hundred times a run, on two cores. Here one *template* process per pytest process
imports them once, and each child is forked from it, ready to run.

- ``Popen`` and ``run`` take ``subprocess``'s arguments. A child that runs one of the repository's
  own modules (``[sys.executable, "-m", "compiler.cli" | "backend.…" | "tests.…", ...]``) or a
  program given with ``-c`` from the repository's root is forked from the template (the tests of
  the interpreter's own start and exit call ``subprocess`` itself); anything else (another program,
  another directory,
  an environment that changes what an import does: thread counts, Triton's interpreter, Python's own
  settings) starts the usual way. Either way the caller gets a ``subprocess.Popen``: pipes, text
  mode, ``communicate``, ``wait``, ``poll``, signals and exit statuses behave as for a fresh
  interpreter (a forked child runs the module as ``python -m`` would: ``sys.argv``, ``sys.path``,
  the environment, the working directory, fresh standard streams, ``atexit`` and non-daemon threads
  at exit, the exit status of an uncaught exception or ``KeyboardInterrupt``).
- ``spawn`` stands in for ``backend.children.spawn`` (the conftest installs it for each test but
  those marked ``real_processes``, and the template installs it in each child): the processes batchc
  starts are forked from the template too. ``backend.children``'s promise holds: a child dies with
  the process that asked for it (the template kills it when that process's end of the connection
  closes: when it exits, whatever killed it) and with the template, and leads its own process group.
  The tests of that promise itself (``tests/backend/test_children.py``, the command line's
  lifetimes and signals) start batchc's children as batchc does: ``Popen(..., real_children=True)``
  forks the ``batchc`` process under test and leaves its ``spawn`` alone, so every process it starts
  is a fresh interpreter and its own child.
- One template per pytest process, started on first use, with the environment the conftest set up;
  it dies with that process. ``BATCHC_TEST_FORK=0`` turns the whole mechanism off.
"""

from __future__ import annotations

import atexit
import errno
import io
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent
SOCKET_ENV = "BATCHC_TEST_FORKSERVER"
"""Where the template listens: set for every child, so a forked child's own children are forked too."""
OFF_ENV = "BATCHC_TEST_FORK"
OWN_PACKAGES = ("compiler", "backend", "ir", "passes", "tests")
PRELOAD = (
    "torch", "numpy", "compiler.cli", "compiler.launch", "compiler.cli.run", "compiler.cli.serve", "compiler.cli.tools",
    "compiler.offline.run", "compiler.offline.dp", "compiler.online.engine_process", "compiler.online.server",
    "backend.remote", "backend.tp.group", "backend.kernels",
)
"""What the template imports once (a module that fails to import is left to the child)."""
_SENSITIVE = ("OMP_", "MKL_", "OPENBLAS_", "KMP_", "GOMP_", "TRITON_", "TORCH", "PYTORCH_", "CUDA_", "NVIDIA_", "LD_", "MALLOC_", "PYTHON")
"""Environment variables read when a module is imported or a library loads: a child asking for other
values than the template's starts the usual way (``PYTHONPATH`` and ``PYTHONDONTWRITEBYTECODE``
are applied in the child)."""
_APPLIED = ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")


def _sensitive(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_SENSITIVE) and k not in _APPLIED}


# -- the template ---------------------------------------------------------------------------------


def _serve(path: str, ready_fd: int) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    for name in PRELOAD:
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - the child imports it itself and reports what it says
            pass
    if len(os.listdir("/proc/self/task")) != 1:  # a fork copies one thread: a lock another held stays held
        raise SystemExit(f"forkserver: the template has {len(os.listdir('/proc/self/task'))} threads after importing")
    bare = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    base_path = json.loads(subprocess.run([sys.executable, "-c", "import sys, json; print(json.dumps(sys.path[1:]))"], env=bare,
                                          capture_output=True, check=True, cwd="/").stdout)  # (the interpreter's own part of sys.path)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "listen")
    sel.register(wake_r, selectors.EVENT_READ, "child")
    conns: dict[int, socket.socket] = {}  # pid -> the asker's connection, until the child is reaped
    others = _Others(path)
    os.write(ready_fd, b"ready\n")
    os.close(ready_fd)
    while True:
        for key, _ in sel.select():
            if key.data == "listen":
                try:
                    conn, _addr = listener.accept()
                except OSError:
                    continue
                started = _start(conn, listener, wake_r, wake_w, base_path, sel, others)
                if started is None:
                    conn.close()
                    continue
                pid, asker = started
                if asker is not conn:  # (a request another template handed on: the asker's own connection)
                    conn.close()
                conns[pid] = asker
                sel.register(asker, selectors.EVENT_READ, pid)
            elif key.data == "child":
                try:
                    while os.read(wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
                while True:
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    conn = conns.pop(pid, None)
                    if conn is not None:
                        sel.unregister(conn)
                        try:
                            conn.send(f"exit {status}".encode())
                        except OSError:
                            pass
                        conn.close()
            else:  # the asker's end closed while its child runs: the asker is gone, so is the child
                pid = key.data
                conn = key.fileobj
                assert isinstance(conn, socket.socket)
                try:
                    data = conn.recv(64)
                except OSError:
                    data = b""
                if data:
                    continue
                sel.unregister(conn)
                conn.close()
                conns.pop(pid, None)
                try:
                    os.killpg(pid, signal.SIGKILL) if os.getpgid(pid) == pid else os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass


class _Others:
    """The templates this one starts for children that need other import-time settings (a thread
    count, the C++ log level of torch): one per setting, each a fresh interpreter importing with it,
    started on first need; a request for one is handed on to it with the asker's connection."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.paths: dict[str, str | None] = {}  # the settings -> that template's socket (None: it could not start)

    def hand_on(self, req: dict[str, Any], conn: socket.socket, fds: list[int]) -> bool:
        key = json.dumps(sorted(_sensitive(req["env"]).items()))
        if key not in self.paths:
            self.paths[key] = None  # (until it says it is ready: a template that cannot start is not tried again)
            path = f"{self.path}.{len(self.paths)}"
            ready_r, ready_w = os.pipe()
            env = dict(req["env"], PYTHONPATH=os.environ.get("PYTHONPATH", ""))
            env.pop(SOCKET_ENV, None)
            template = os.getpid()
            proc = subprocess.Popen([sys.executable, "-m", "tests.forkserver", path, str(ready_w)], env=env, cwd=str(ROOT), pass_fds=(ready_w,),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, preexec_fn=lambda: _die_with_template(template))
            os.close(ready_w)
            if not _ready(ready_r):
                proc.kill()
                return False
            self.paths[key] = path
        path = self.paths[key]
        if path is None:
            return False
        other = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            other.connect(path)
            socket.send_fds(other, [json.dumps(dict(req, handed_on=True)).encode()], [conn.fileno(), *fds])
        except OSError:
            return False
        finally:
            other.close()
        return True


def _start(conn: socket.socket, listener: socket.socket, wake_r: int, wake_w: int, base_path: list[str],
           sel: selectors.BaseSelector, others: _Others) -> tuple[int, socket.socket] | None:
    """Fork the child a request asks for: its pid and the asker's connection (else None)."""
    try:
        msg, fds, _flags, _addr = socket.recv_fds(conn, 1 << 20, 256)
    except OSError:
        return None
    try:
        req = json.loads(msg)
        asker = conn
        if req.get("handed_on"):
            asker = socket.socket(fileno=os.dup(fds[0]))
            os.close(fds.pop(0))
        if _sensitive(req["env"]) != _sensitive(dict(os.environ)):
            if req.get("handed_on") or not others.hand_on(req, conn, fds):
                asker.send(json.dumps({"fallback": f"environment: {sorted(set(_sensitive(req['env']).items()) ^ set(_sensitive(dict(os.environ)).items()))}"}).encode())
                if asker is not conn:
                    asker.close()
            return None
        template = os.getpid()
        pid = os.fork()
        if pid == 0:
            sel.close()
            _child(req, fds, [listener.fileno(), conn.fileno(), asker.fileno(), wake_r, wake_w], base_path, template)
        try:
            asker.send(json.dumps({"pid": pid}).encode())
        except OSError:  # the asker left before it heard of its child
            os.kill(pid, signal.SIGKILL)
            if asker is not conn:
                asker.close()
            return None
        return pid, asker
    except (OSError, ValueError, KeyError, IndexError):
        return None
    finally:
        for fd in fds:
            os.close(fd)


def _child(req: dict[str, Any], fds: list[int], own: list[int], base_path: list[str], template: int) -> None:
    """In the forked child: become ``python -m module args`` (or ``python -c source args``) and never return."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in set(own):
            os.close(fd)
        _die_with_template(template)
        if req["new_session"]:
            os.setsid()
        elif req["process_group"] is not None:
            os.setpgid(0, req["process_group"])
        targets = [0, 1, 2, *req["pass_fds"]]
        high = [_above(os.dup(fd), max(targets) + 1) for fd in fds]  # (above every target: no dup2 below overwrites a source)
        for target, src in zip(targets, high, strict=True):
            os.dup2(src, target, inheritable=target in req["pass_fds"] or target <= 2)
        keep = sorted(set(targets))
        start = 3
        for fd in keep:
            if fd >= start:
                os.closerange(start, fd)
                start = fd + 1
        os.closerange(start, _max_fd())
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        extra = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [req["cwd"], *extra, *(p for p in base_path if p not in extra)]
        sys.dont_write_bytecode = bool(req["env"].get("PYTHONDONTWRITEBYTECODE"))
        _fresh_streams()
        if not req.get("real_children"):
            install()
        module, source, argv = req.get("module"), req.get("code"), req["argv"]
        import runpy

        try:
            if source is not None:  # `python -c SOURCE ARGS`: argv[0] is "-c", the path starts with "" (the working directory)
                sys.argv = ["-c", *argv]
                sys.path[0] = ""
                main = types.ModuleType("__main__")
                sys.modules["__main__"] = main
                exec(compile(source, "<string>", "exec"), main.__dict__)  # noqa: S102 - the program the caller asked for
            else:
                sys.argv = [module, *argv]
                try:
                    runpy._get_module_details(module, runpy._Error)  # type: ignore[attr-defined]  # what `python -m` checks first
                except runpy._Error as exc:  # type: ignore[attr-defined]
                    print(f"{sys.executable}: {exc}", file=sys.stderr)
                    raise SystemExit(1) from None
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = _exit_code(exc.code)
        except KeyboardInterrupt:
            sys.excepthook(*sys.exc_info())
            _finish()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
            code = 128 + signal.SIGINT
        except BaseException:  # noqa: BLE001 - as the interpreter does: the traceback, then status 1
            sys.excepthook(*sys.exc_info())
            code = 1
        code = _finish(code)
    except BaseException:  # noqa: BLE001 - the setup itself failed: say so where the caller reads
        try:
            os.write(2, traceback.format_exc().encode(errors="replace"))
        except OSError:
            pass
    finally:
        os._exit(code)


def _exit_code(value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    try:
        print(value, file=sys.stderr)
    except Exception:  # noqa: BLE001
        pass
    return 1


def _finish(code: int = 0) -> int:
    """What the interpreter does at exit: join non-daemon threads, run ``atexit``, flush the streams."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's own join of non-daemon threads
    except BaseException:  # noqa: BLE001
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BrokenPipeError:
            code = 120
        except Exception:  # noqa: BLE001
            pass
    return code


def _above(fd: int, low: int) -> int:
    import fcntl

    if fd >= low:
        return fd
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD, low)
    os.close(fd)
    return moved


def _max_fd() -> int:
    try:
        return os.sysconf("SC_OPEN_MAX")
    except (ValueError, OSError):
        return 65536


def _die_with_template(template: int) -> None:
    """batchc's own parent-death rule (``backend.children``: the signal, then the check that the
    template had not died first), in a child of the template (which imported it: nothing loads here)."""
    from backend import children

    children._die_with(template)


def _fresh_streams() -> None:
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    encoding = os.environ.get("PYTHONIOENCODING") or None

    def out(fd: int, errors: str, line: bool) -> IO[str]:
        return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=encoding, errors=errors, line_buffering=line,
                                write_through=unbuffered)

    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding=encoding)
    sys.stdout = sys.__stdout__ = out(1, "strict", os.isatty(1))
    sys.stderr = sys.__stderr__ = out(2, "backslashreplace", True)


# -- the asking side ------------------------------------------------------------------------------


_lock = threading.Lock()
_started: dict[int, str | None] = {}  # pid of the asker -> the socket path of the template it started


def _template_path() -> str | None:
    """The template's socket: the one this process inherited, else one this process starts."""
    if os.environ.get(OFF_ENV) == "0":
        return None
    inherited = os.environ.get(SOCKET_ENV)
    if inherited and os.path.exists(inherited):
        return inherited
    with _lock:
        if os.getpid() in _started:
            return _started[os.getpid()]
        _started[os.getpid()] = path = _start_template()
        return path


_BASE_ENV = dict(os.environ)
"""The environment when this module was first imported (the conftest imports it after its settings)."""


def _start_template() -> str | None:
    folder = tempfile.mkdtemp(prefix="batchc-fork-")
    path = os.path.join(folder, "s")
    ready_r, ready_w = os.pipe()
    env = dict(_BASE_ENV, PYTHONPATH=os.pathsep.join(p for p in [str(ROOT), *sys.path] if p))
    env.pop(SOCKET_ENV, None)
    try:
        proc = _real_spawn([sys.executable, "-m", "tests.forkserver", path, str(ready_w)], env=env,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, pass_fds=(ready_w,))
    finally:
        os.close(ready_w)
    from backend import children

    with children._lock:  # (not one of the process's children that kill_all ends: it serves them all)
        children._live.discard(proc)
    _keep.append(proc)
    atexit.register(_stop_template, proc, folder)
    if not _ready(ready_r):
        proc.kill()
        return None
    os.environ[SOCKET_ENV] = path
    return path


_keep: list[subprocess.Popen[bytes]] = []
READY_S = 120.0
"""How long a template may take to import before it is given up (its children then start fresh)."""


def _ready(fd: int) -> bool:
    """Whether a starting template says "ready" on ``fd`` within ``READY_S`` (it closes its end if it fails)."""
    import select

    with os.fdopen(fd, "rb") as ready:
        if not select.select([ready], [], [], READY_S)[0]:
            return False
        return ready.readline() == b"ready\n"


def _stop_template(proc: subprocess.Popen[bytes], folder: str) -> None:
    import shutil

    proc.kill()
    proc.wait()
    shutil.rmtree(folder, ignore_errors=True)


class ForkedPopen(subprocess.Popen):  # type: ignore[type-arg]  # text or bytes, as the caller's arguments say
    """A ``subprocess.Popen`` whose child is forked from the template when it can be (see the module)."""

    _conn: socket.socket | None = None

    def __init__(self, args: Any, *, real_children: bool = False, **kwargs: Any) -> None:
        """``real_children``: the forked child leaves ``backend.children.spawn`` as batchc has it, so the
        processes it starts are fresh interpreters, its own children (see ``Popen``)."""
        self._real_children = real_children
        super().__init__(args, **kwargs)

    def _execute_child(self, args: Any, executable: Any, preexec_fn: Any, close_fds: bool, pass_fds: Sequence[int], cwd: Any,
                       env: Any, startupinfo: Any, creationflags: Any, shell: bool, p2cread: int, p2cwrite: int, c2pread: int,
                       c2pwrite: int, errread: int, errwrite: int, *rest: Any) -> None:
        start_new_session, process_group = rest[-2], rest[-1]
        target = _target_of(args, executable, shell, close_fds, cwd, preexec_fn)
        path = _template_path() if target is not None else None
        if target is not None and path is not None:
            child_env = dict(os.environ if env is None else env)
            if self._real_children:
                child_env.pop(SOCKET_ENV, None)
            else:
                child_env.setdefault(SOCKET_ENV, path)
            req = {
                **target, "argv": [os.fsdecode(a) for a in args[3:]], "env": {os.fsdecode(k): os.fsdecode(v) for k, v in child_env.items()},
                "real_children": self._real_children,
                "cwd": str(Path(os.getcwd() if cwd is None else os.fsdecode(cwd)).resolve()), "pass_fds": list(pass_fds),
                "new_session": bool(start_new_session), "process_group": None if process_group in (None, -1) else process_group,
            }
            fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1, errwrite if errwrite != -1 else 2, *pass_fds]
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                conn.connect(path)
                socket.send_fds(conn, [json.dumps(req).encode()], fds)
                reply = json.loads(conn.recv(1 << 16) or b'{"fallback": "the template is gone"}')
            except (OSError, ValueError):
                reply = {"fallback": "the template did not answer"}
            if "pid" not in reply and os.environ.get("BATCHC_TEST_FORK_LOG"):
                with open(os.environ["BATCHC_TEST_FORK_LOG"], "a") as log:
                    log.write(f"{os.getpid()} {target}: {reply.get('fallback')}\n")
            if "pid" in reply:
                self.pid = int(reply["pid"])
                self._child_created = True
                self._conn = conn
                self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
                return
            conn.close()
        super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,  # type: ignore[misc]  # Popen's private hook
                               creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, *rest)

    def _internal_poll(self, _deadstate: int | None = None, *args: Any, **kwargs: Any) -> int | None:
        if self._conn is None:
            return super()._internal_poll(_deadstate, *args, **kwargs)  # type: ignore[misc, no-any-return]  # Popen's private hook
        if self.returncode is None and self._waitpid_lock.acquire(False):  # type: ignore[attr-defined]
            try:
                if self.returncode is None:
                    pid, status = self._try_wait(os.WNOHANG)
                    if pid == self.pid:
                        self._handle_exitstatus(status)  # type: ignore[attr-defined]
            finally:
                self._waitpid_lock.release()  # type: ignore[attr-defined]
        return self.returncode

    def _try_wait(self, wait_flags: int) -> tuple[int, int]:
        conn = self._conn
        if conn is None:
            return super()._try_wait(wait_flags)  # type: ignore[misc, no-any-return]  # Popen's private hook
        if wait_flags & os.WNOHANG:
            import select

            ready, _, _ = select.select([conn], [], [], 0)
            if not ready:
                return 0, 0
        try:
            msg = conn.recv(64)
        except OSError:
            msg = b""
        status = int(msg.split()[1]) if msg.startswith(b"exit ") else int(signal.SIGKILL)  # (the template died: so did its child)
        conn.close()
        self._conn = None
        return self.pid, status


def _target_of(args: Any, executable: Any, shell: bool, close_fds: bool, cwd: Any, preexec_fn: Any) -> dict[str, str] | None:
    """What a child would run, when the template can fork it (else ``None``): ``{"module": name}`` for
    ``python -m`` one of the repository's own modules, ``{"code": source}`` for ``python -c source``;
    either from the repository's root (elsewhere its imports could name other files than the
    template's)."""
    if shell or executable is not None or not close_fds or preexec_fn is not None or isinstance(args, (str, bytes)):
        return None
    args = [os.fsdecode(a) if isinstance(a, (str, bytes, os.PathLike)) else a for a in args]
    if len(args) < 3 or args[0] != sys.executable or args[1] not in ("-m", "-c") or not isinstance(args[2], str):
        return None
    if args[1] == "-m" and args[2].split(".")[0] not in OWN_PACKAGES:
        return None
    here = Path(os.getcwd() if cwd is None else os.fsdecode(cwd)).resolve()
    if here != ROOT:
        return None
    return {"module": args[2]} if args[1] == "-m" else {"code": args[2]}


def Popen(args: Any, *, real_children: bool = False, **kwargs: Any) -> subprocess.Popen[Any]:  # noqa: N802 - subprocess's own name
    """``subprocess.Popen``, forked from the template where it can be. ``real_children``: the processes
    the child starts through ``backend.children.spawn`` are fresh interpreters and its own children, as
    in a fresh ``batchc`` (for the tests of how they live and die: only the process under test is
    forked)."""
    return ForkedPopen(args, real_children=real_children, **kwargs)


def run(args: Any, *, input: Any = None, capture_output: bool = False, timeout: float | None = None, check: bool = False,
        **kwargs: Any) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run``, forked from the template where it can be."""
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    with ForkedPopen(args, **kwargs) as proc:
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            proc.kill()
            exc.stdout, exc.stderr = proc.communicate()
            raise
        except BaseException:
            proc.kill()
            raise
        code = proc.poll()
        assert code is not None
    if check and code:
        raise subprocess.CalledProcessError(code, proc.args, out, err)
    return subprocess.CompletedProcess(proc.args, code, out, err)


def spawn(args: Sequence[str], *, env: Mapping[str, str] | None = None, stdin: int | IO[bytes] | None = None,
          stdout: int | IO[bytes] | None = None, stderr: int | IO[bytes] | None = None, pass_fds: Sequence[int] = ()) -> subprocess.Popen[bytes]:
    """``backend.children.spawn``, forked from the template where it can be: a child that leads its own
    process group and dies with this process (the template kills it when this process's end closes)."""
    from backend import children

    if _target_of(list(args), None, False, True, None, None) is None or _template_path() is None:
        return _real_spawn(args, env=env, stdin=stdin, stdout=stdout, stderr=stderr, pass_fds=pass_fds)
    proc: subprocess.Popen[bytes] = ForkedPopen(list(args), env=None if env is None else dict(env), stdin=stdin, stdout=stdout,
                                                stderr=stderr, pass_fds=tuple(pass_fds), process_group=0)
    with children._lock:  # (what backend.children.spawn does with each child: kill_all's list)
        children._live.add(proc)
    return proc


_original: list[Any] = []
"""``backend.children.spawn`` itself, as it was before ``install`` (looked up on first use: importing
batchc here, when the conftest is imported, would come before typeguard instruments it)."""


def _real_spawn(args: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    from backend import children

    if not _original:
        _original.append(children.spawn)
    proc: subprocess.Popen[bytes] = _original[0](args, **kwargs)
    return proc


def install() -> None:
    """Route ``backend.children.spawn`` through the template, in this process."""
    from backend import children

    if not _original:
        _original.append(children.spawn)
    children.spawn = spawn  # type: ignore[assignment]  # the same signature, forked where it can be


def uninstall() -> None:
    """Put ``backend.children.spawn`` back."""
    from backend import children

    if _original:
        children.spawn = _original[0]  # type: ignore[assignment]


if __name__ == "__main__":
    try:
        _serve(sys.argv[1], int(sys.argv[2]))
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        if exc.errno != errno.EPIPE:
            raise
