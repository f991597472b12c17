"""Fault injection for tests and benchmarks: a loopback TCP proxy that can delay, drop or black-hole a
link, and signals for processes (kill -9, SIGSTOP). Boundary corruption and deterministic stage
failures are armed on the executor itself (StageService.InjectFault)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from types import TracebackType


class TcpProxy:
    """Forwards 127.0.0.1:<port> to `target` (and more ports to more targets of the same process: `forward`).
    mode, for all of them: "pass", "delay" (delay_s per forwarded read), "drop" (close every connection, refuse
    new ones) or "blackhole" (keep connections, forward nothing)."""

    def __init__(self, target: str, delay_s: float = 0.0) -> None:
        self.mode = "pass"
        self.delay_s = delay_s
        self._servers: list[socket.socket] = []
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        self.address = self.forward(target)

    def forward(self, target: str) -> str:
        """Forwards one more loopback port to `target` (an executor's boundary link, say); returns its address."""
        host, port = target.rsplit(":", 1)
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        self._servers.append(server)
        threading.Thread(target=self._accept, args=(server, (host, int(port))), daemon=True).start()
        return f"127.0.0.1:{server.getsockname()[1]}"

    def set_mode(self, mode: str, delay_s: float | None = None) -> None:
        if mode not in ("pass", "delay", "drop", "blackhole"):
            raise ValueError(f"unknown proxy mode {mode!r}")
        self.mode = mode
        if delay_s is not None:
            self.delay_s = delay_s
        if mode == "drop":
            with self._lock:
                conns, self._conns = self._conns, []
            for c in conns:
                _close(c)

    def _accept(self, server: socket.socket, target: tuple[str, int]) -> None:
        while not self._closed:
            try:
                client, _ = server.accept()
            except OSError:
                return
            if self.mode == "drop":
                _close(client)
                continue
            try:
                upstream = socket.create_connection(target, timeout=5)
            except OSError:
                _close(client)
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.settimeout(None)
            with self._lock:
                self._conns += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                while self.mode == "blackhole" and not self._closed:
                    time.sleep(0.05)
                if self.mode == "delay" and self.delay_s:
                    time.sleep(self.delay_s)
                if self.mode == "drop":
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _close(src)
            _close(dst)

    def close(self) -> None:
        self._closed = True
        for server in self._servers:
            _close(server)
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            _close(c)

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()


def kill9(process: subprocess.Popen[bytes]) -> None:
    process.kill()
    process.wait()


def freeze(process: subprocess.Popen[bytes]) -> None:
    os.kill(process.pid, signal.SIGSTOP)


def thaw(process: subprocess.Popen[bytes]) -> None:
    os.kill(process.pid, signal.SIGCONT)
