"""Each service's real entry point, started the way an operator would, with something wrong: it exits with status 1
and one line on stderr that says what is wrong and what to do, never a traceback."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from graphmesh.launcher import free_port
from tests.model_fixtures import make_tiny_llama

BIN = Path(sys.executable).parent
SERVICES = ("graphmesh-coordinator", "graphmesh-executor", "graphmesh-kvstore")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("llama"))


def _needs(program: str, checkpoint: Path) -> list[str]:
    """What each service needs besides the flag under test: the coordinator loads a model before it binds (its
    executors are dialled only after, so one that is not there does no harm)."""
    return ["--model", str(checkpoint), "--executors", "127.0.0.1:1"] if program == "graphmesh-coordinator" else []


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port another process's socket (here: this one's) listens on."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        yield taken.getsockname()[1]


def _start(program: str, *args: str, prefix: str = "") -> tuple[int, str]:
    """The exit status and the one line the program wrote that starts with `prefix` (default: its name; asserted
    to be one line)."""
    run = subprocess.run([str(BIN / program), *args], capture_output=True, text=True, timeout=180)
    assert "Traceback" not in run.stderr, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith(f"{prefix or program}:")]
    assert len(lines) == 1, run.stderr
    return run.returncode, lines[0]


@pytest.mark.parametrize("program", SERVICES)
def test_a_port_in_use_is_named_with_what_to_do(program: str, taken_port: int, checkpoint: Path) -> None:
    code, line = _start(program, "--listen", f"127.0.0.1:{taken_port}", *_needs(program, checkpoint))
    assert code == 1
    assert line == (f"{program}: cannot listen on 127.0.0.1:{taken_port}: port {taken_port} is in use by another "
                    "process; stop it, or pass --listen with another port (port 0 picks a free one)")


def test_an_address_of_another_machine_is_named() -> None:
    # 192.0.2.0/24 is TEST-NET-1 (RFC 5737): never an address of this machine
    code, line = _start("graphmesh-kvstore", "--listen", "192.0.2.1:50060", "--allow-insecure-remote")
    assert code == 1
    assert line == ("graphmesh-kvstore: cannot listen on 192.0.2.1:50060: 192.0.2.1 is not an address of this machine; "
                    "pass --listen with one that is")


@pytest.mark.parametrize("program", ["graphmesh-executor", "graphmesh-kvstore"])
def test_a_metrics_port_in_use_is_named(program: str) -> None:
    # the metrics endpoint listens on every interface: hold the port there too
    with socket.socket() as everywhere:
        everywhere.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        port = free_port()
        everywhere.bind(("0.0.0.0", port))
        everywhere.listen()
        code, line = _start(program, "--listen", "127.0.0.1:0", "--metrics-port", str(port))
    assert code == 1
    assert line == (f"{program}: cannot serve metrics on 0.0.0.0:{port}: Address already in use; pass another "
                    "--metrics-port, or 0 for none")


@pytest.mark.parametrize("program", SERVICES)
def test_a_token_file_that_cannot_be_read_is_named(program: str, tmp_path: Path, checkpoint: Path) -> None:
    missing = tmp_path / "no-such-token"
    code, line = _start(program, "--listen", "127.0.0.1:0", "--mesh-token-file", str(missing),
                        *_needs(program, checkpoint))
    assert code == 1
    assert line == f"{program}: cannot read the token file {missing}: No such file or directory"


def test_a_model_that_cannot_be_read_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "model.gguf"
    code, line = _start("graphmesh-coordinator", "--listen", "127.0.0.1:0", "--executors", "127.0.0.1:1",
                        "--model", str(missing))
    assert code == 1
    assert line == f"graphmesh-coordinator: checkpoint {missing} does not exist"
    code, line = _start("graphmesh-executor", "--listen", "127.0.0.1:0", "--preload-model", str(missing))
    assert code == 1
    assert line == f"graphmesh-executor: checkpoint {missing} does not exist"


def test_graphmesh_up_says_in_one_line_why_its_coordinator_did_not_start(taken_port: int, checkpoint: Path) -> None:
    code, line = _start("graphmesh", "up", "--model", str(checkpoint), "--backend", "numpy", "--executors", "1",
                        "--listen", f"127.0.0.1:{taken_port}", "--http-listen", "", prefix="graphmesh-coordinator")
    assert code == 1
    assert line == (f"graphmesh-coordinator: cannot listen on 127.0.0.1:{taken_port}: port {taken_port} is in use by "
                    "another process; stop it, or pass --listen with another port (port 0 picks a free one)")


def test_graphmesh_generate_says_in_one_line_that_its_model_cannot_be_read(tmp_path: Path) -> None:
    missing = tmp_path / "model.gguf"
    code, line = _start("graphmesh", "generate", "--prompt", "hi", "--model", str(missing), "--backend", "numpy",
                        "--executors", "1", prefix="graphmesh-coordinator")
    assert code == 1
    assert line == f"graphmesh-coordinator: checkpoint {missing} does not exist"
