"""The group's entry points refuse bad arguments and environments at once, naming the value (no
process is started and nothing waits on a group that cannot form)."""

from __future__ import annotations

import re

import pytest
import typeguard

from backend.tp.group import connect, launched_rank, spawn_workers
from compiler.offline.distributed import placement
from compiler.workload import ServeError


@pytest.mark.parametrize(("env", "message"), [
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK '2' and WORLD_SIZE '2' must be ints with 0 <= RANK < WORLD_SIZE <= 64"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK '-1' and WORLD_SIZE '2'"),
    ({"RANK": "\u0661", "WORLD_SIZE": "2"}, "RANK '\u0661' and WORLD_SIZE '2'"),  # a non-ASCII digit is not a rank
    ({"RANK": "0", "WORLD_SIZE": "65"}, "RANK '0' and WORLD_SIZE '65'"),
    ({"RANK": "0", "WORLD_SIZE": "9" * 40}, "RANK '0' and WORLD_SIZE '" + "9" * 40 + "'"),
])
def test_a_bad_launcher_environment_is_refused(env: dict[str, str], message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        launched_rank()
    with pytest.raises(ServeError):
        placement(None)


def test_no_launcher_means_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert launched_rank() is None and placement(None) == (0, 1, False) and placement(2) == (0, 2, False)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"rank": 2, "world": 2}, "connect: rank must be an int in [0, 2), got 2"),
    ({"rank": True, "world": 2}, "connect: rank must be an int in [0, 2), got True"),
    ({"world": True}, "connect: world must be an int in [1, 64], got True"),
    ({"world": 2.0}, "connect: world must be an int in [1, 64], got 2.0"),
    ({"timeout_s": 0}, "connect: timeout_s must be a number of seconds in (0, 86400], got 0"),
    ({"timeout_s": float("nan")}, "connect: timeout_s must be a number of seconds in (0, 86400], got nan"),
    ({"timeout_s": "5"}, "connect: timeout_s must be a number of seconds in (0, 86400], got '5'"),
    ({"start_timeout_s": True}, "connect: start_timeout_s must be a number of seconds in (0, 86400], got True"),
    ({"backend": "mpi"}, "connect: backend must be 'gloo' or 'nccl', got 'mpi'"),
])
def test_connect_refuses_bad_arguments(kwargs: dict[str, object], message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_PORT", "29599")
    args: dict[str, object] = {"rank": 0, "world": 2, "timeout_s": 5} | kwargs
    with typeguard.suppress_type_checks(), pytest.raises(ValueError, match=re.escape(message)):
        connect(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(("port", "addr", "message"), [
    ("", "127.0.0.1", "MASTER_PORT must be a port number in [1, 65535], got ''"),
    ("abc", "127.0.0.1", "MASTER_PORT must be a port number in [1, 65535], got 'abc'"),
    ("99999", "127.0.0.1", "MASTER_PORT must be a port number in [1, 65535], got '99999'"),
    ("29599", "", "MASTER_ADDR must be a host name or address, got ''"),
    ("29599", "host\n", "MASTER_ADDR must be a host name or address, got 'host\\n'"),
])
def test_connect_refuses_a_bad_address(port: str, addr: str, message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_PORT", port)
    monkeypatch.setenv("MASTER_ADDR", addr)
    with pytest.raises(ValueError, match=re.escape(message)):
        connect(1, 2, timeout_s=5)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"world": 0}, "spawn_workers: world must be an int in [1, 64], got 0"),
    ({"command": "python"}, "spawn_workers: command must be a non-empty list of strings (program and arguments), got 'python'"),
    ({"command": []}, "spawn_workers: command must be a non-empty list of strings (program and arguments), got []"),
    ({"timeout_s": -5}, "spawn_workers: timeout_s must be a number of seconds in (0, 86400], got -5"),
])
def test_spawn_workers_refuses_bad_arguments_before_starting_anything(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"world": 2, "command": ["python", "-c", "pass"], "timeout_s": 5} | kwargs
    with typeguard.suppress_type_checks(), pytest.raises(ValueError, match=re.escape(message)):
        spawn_workers(**args)  # type: ignore[arg-type]
