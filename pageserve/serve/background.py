"""Run a server on a thread of this process (notebooks, tests) and wait until it answers.

``start_server_in_background(model="smollm2-135m-instruct")`` loads the model, builds the
app, binds a free loopback port and returns a ``BackgroundServer`` once ``/health`` is 200.
"""
from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from pageserve.engine.config import EngineConfig
from pageserve.engine.llm_engine import LLMEngine

from .api import build_app


@dataclass
class BackgroundServer:
    url: str  # http://host:port
    port: int
    app: Any
    server: Any  # uvicorn.Server
    thread: threading.Thread
    api_key: str | None = None

    @property
    def base_url(self) -> str:
        """The OpenAI client's ``base_url``."""
        return self.url + "/v1"

    def stop(self, timeout: float = 30.0) -> None:
        """Stop uvicorn (the app's lifespan stops the engine thread) and wait for it."""
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> "BackgroundServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def build_engine(loaded: Any = None, **config: Any) -> LLMEngine:
    """An ``LLMEngine`` for serving; keywords are ``EngineConfig`` fields."""
    return LLMEngine(EngineConfig(**config), loaded, stream_outputs=True)


def start_server_in_background(
    app: Any = None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str | None = None,
    served_model_name: str | None = None,
    max_waiting_requests: int | None = None,
    chat_template: str | None = None,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    lora_modules: list | None = None,
    startup_timeout_s: float = 300.0,
    log_level: str = "warning",
    **engine_config: Any,
) -> BackgroundServer:
    """Serve ``app`` (or a new app over an engine built from ``engine_config``) on a thread.
    ``lora_modules``: ``(name, path)`` pairs served from the start (``build_app``; ``enable_lora=True`` too).

    ``port=0`` takes a free port. Returns once ``/health`` answers 200; raises
    ``RuntimeError`` if the server stops or does not answer within ``startup_timeout_s``.
    """
    import httpx
    import uvicorn

    if app is None:
        app = build_app(build_engine(**engine_config), served_model_name=served_model_name, api_key=api_key,
                        max_waiting_requests=max_waiting_requests, chat_template=chat_template,
                        enable_auto_tool_choice=enable_auto_tool_choice, tool_call_parser=tool_call_parser,
                        reasoning_parser=reasoning_parser, lora_modules=lora_modules)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5,
                                           timeout_keep_alive=30))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="pageserve-uvicorn", daemon=True)
    thread.start()
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}"
    deadline = time.monotonic() + startup_timeout_s
    while time.monotonic() < deadline:
        if not thread.is_alive():
            raise RuntimeError(f"the server on {url} stopped during startup (see the log above)")
        if server.started:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    return BackgroundServer(url, port, app, server, thread, api_key)
            except httpx.HTTPError:
                pass
        time.sleep(0.05)
    server.should_exit = True
    raise RuntimeError(f"the server on {url} did not become healthy within {startup_timeout_s:.0f} s")


@dataclass
class ServerProcess:
    """``pageserve serve`` in a child process: what a benchmark client talks to, so the
    client's Python never shares an interpreter (and its GIL) with the server's."""

    url: str
    port: int
    process: Any  # subprocess.Popen
    log_path: str

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def stop(self, timeout: float = 30.0) -> int | None:
        """Ctrl-C the server (it shuts down cleanly) and wait; kill it if it hangs."""
        import signal
        import subprocess

        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def serve_args(**engine_config: Any) -> list[str]:
    """``EngineConfig`` keywords as ``pageserve serve`` flags (the flags are generated from the
    same dataclass: ``block_size=32`` -> ``--block-size 32``, bools as ``--x / --no-x``)."""
    import json

    out = []
    for name, value in engine_config.items():
        if name not in EngineConfig.field_names():
            raise TypeError(f"{name!r} is not an EngineConfig field")
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        elif isinstance(value, (list, tuple)):
            out += [flag, ",".join(str(v) for v in value)]
        else:
            out += [flag, "none" if value is None else str(value)]
    return out


def start_server_process(
    *, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None, log_path: str | None = None,
    startup_timeout_s: float = 600.0, extra_args: list[str] | None = None, **engine_config: Any,
) -> ServerProcess:
    """Start ``python -m pageserve.cli serve`` with these ``EngineConfig`` keywords and wait
    for ``/health``. Its output goes to ``log_path`` (a temporary file by default); raises
    ``RuntimeError`` with the log's tail if it exits or stays unhealthy."""
    import os
    import subprocess
    import sys
    import tempfile

    port = port or _free_port(host)
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix="pageserve-serve-", suffix=".log")
        os.close(fd)
    cmd = [sys.executable, "-m", "pageserve.cli", "serve", "--host", host, "--port", str(port),
           "--log-level", "warning", *serve_args(**engine_config), *(extra_args or [])]
    if api_key:
        cmd += ["--api-key", api_key]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=False)
    shown = f"[{host}]" if ":" in host else host
    server = ServerProcess(f"http://{shown}:{port}", port, proc, log_path)
    return wait_until_healthy(server, "pageserve serve", startup_timeout_s)


def wait_until_healthy(server: ServerProcess, what: str, timeout_s: float, poll_s: float = 0.2) -> ServerProcess:
    """Poll ``server``'s ``/health`` until it answers 200; if the process exits or the time
    runs out, stop it and raise ``RuntimeError`` with the tail of its log."""
    import httpx

    proc = server.process
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(server.url + "/health", timeout=5).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    server.stop(10)
    tail = open(server.log_path, errors="replace").read()[-3000:]
    raise RuntimeError(f"{what} on {server.url} did not become healthy (exit {proc.returncode}):\n{tail}")
