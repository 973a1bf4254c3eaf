"""The engine core's process as the front end holds it: spawned, spoken to over two ZMQ sockets, and watched.

States: not launched -> launched (launch: the process, the sockets, the receive thread) -> gone (the process exited:
`gone` is called once with its status, after every event it sent before) -> closed (close). The receive thread
resolves the Replies to calls itself and hands every other event to `events`; it also watches: while `watching`
(serving) a core that sends nothing, not even its idle beat, for parallel.step_timeout_s is reported to `silent`.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import zmq

from appliance.core.config import RuntimeConfig
from appliance.core.request import EngineUnavailableError
from appliance.engine.process import messages as m
from npu.liveness import STATE_WORDS, state_letter  # (stdlib only: no torch here)

log = logging.getLogger("appliance.engine.process.client")

CORE_MODULE = "appliance.engine.process.core_process"
POLL_MS = 50              # the receive thread looks at the core's process this often while no event arrives

_spawner: ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def spawn(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    """Popen (stdin a pipe) from one thread that lives as long as this process: the core asks the kernel to kill it
    when that thread ends (npu.liveness.exit_with_parent), so no exit of the front end leaves the core behind.
    (npu.device_group.spawn does the same for ranks; that module loads torch, which this process never needs.)"""
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="core-spawner")
    return _spawner.submit(subprocess.Popen, argv, stdin=subprocess.PIPE, env=env).result()


def exit_reason(status: int) -> str:
    """A Popen returncode in words: 'killed by SIGKILL', 'exited with status 1'."""
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exited with status {status}"


def state_words(pid: int) -> str:
    """' (its process is stopped: SIGSTOP or a debugger)' and the like for a local process; '' when nothing to say."""
    words = STATE_WORDS.get(state_letter(pid), "")
    return f" ({words})" if words else ""


class CoreChild:
    """The core process, its sockets and its receive thread (see the module docstring)."""

    def __init__(self, rc: RuntimeConfig, events: Callable[[m.Event], None], gone: Callable[[int], None],
                 silent: Callable[[float], None]):
        self.rc = rc
        self.watching = False                   # serving: a silent core is hung
        self._events_to, self._gone, self._silent = events, gone, silent
        self.proc: subprocess.Popen | None = None
        self._dir: str | None = None
        self._ctx: zmq.Context | None = None
        self._commands: zmq.Socket | None = None
        self._events: zmq.Socket | None = None
        self._receiver: threading.Thread | None = None
        self._encoder = m.encoder()
        self.ids = itertools.count(1)           # call ids (Submit's too)
        self._lock = threading.Lock()           # _calls
        self._send_lock = threading.Lock()      # the commands socket
        self._calls: dict[int, Future[m.Reply]] = {}
        self._closing = threading.Event()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and not self._closing.is_set()

    def launch(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="appliance-core-")
        commands, events = f"ipc://{self._dir}/commands", f"ipc://{self._dir}/events"
        self._ctx = zmq.Context(1)
        self._commands = self._ctx.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.SNDHWM, 0)
        self._commands.setsockopt(zmq.LINGER, 0)
        self._commands.bind(commands)
        self._events = self._ctx.socket(zmq.PULL)
        self._events.setsockopt(zmq.RCVHWM, 0)
        self._events.setsockopt(zmq.LINGER, 0)
        self._events.bind(events)
        env = dict(os.environ)
        source = str(Path(__file__).resolve().parents[3])        # the code this process runs, for the core too
        env["PYTHONPATH"] = os.pathsep.join([source] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        self.proc = spawn([sys.executable, "-m", CORE_MODULE, commands, events, str(os.getpid())], env)
        assert self.proc.stdin is not None
        self.proc.stdin.write(pickle.dumps(self.rc))
        self.proc.stdin.close()
        log.info("engine core process started: pid %d", self.proc.pid)
        self._receiver = threading.Thread(target=self._receive, name="core-receiver", daemon=True)
        self._receiver.start()

    def send(self, command: m.Command) -> None:
        payload = self._encoder.encode(command)
        with self._send_lock:
            if self._commands is None or self._closing.is_set():
                raise EngineUnavailableError("the engine core is closed")
            self._commands.send(payload, copy=False)

    def expect(self, call: int) -> Future[m.Reply]:
        """The future of call's Reply (register it before sending the command)."""
        future: Future[m.Reply] = Future()
        with self._lock:
            self._calls[call] = future
        return future

    def forget(self, call: int) -> None:
        with self._lock:
            self._calls.pop(call, None)

    def call(self, command: Callable[[int], m.Command], timeout: float | None = None) -> m.Reply:
        """Send a command and wait for its Reply (a core that dies meanwhile answers with a Fault)."""
        call = next(self.ids)
        future = self.expect(call)
        if not self.alive():
            self.forget(call)
            raise EngineUnavailableError("the engine core process is not running")
        self.send(command(call))
        try:
            return future.result(timeout)
        finally:
            self.forget(call)

    def fail_calls(self, fault: m.Fault) -> None:
        """Answer every call still waiting with `fault` (the core is gone)."""
        with self._lock:
            calls, self._calls = self._calls, {}
        for call, future in calls.items():
            future.set_result(m.Reply(call, error=fault))

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()

    def reap(self, wait_s: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            log.warning("the engine core process %d did not exit; killing it", self.proc.pid)
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        self._closing.set()
        if self._receiver is not None and self._receiver is not threading.current_thread():
            self._receiver.join(5)
        with self._send_lock:
            for sock in (self._commands, self._events):
                if sock is not None:
                    sock.close(linger=0)
            self._commands = self._events = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    # -- the receive thread --------------------------------------------------------------------------------------
    def _receive(self) -> None:
        decoder = m.event_decoder()
        events, proc = self._events, self.proc
        assert events is not None and proc is not None
        last_event = time.monotonic()
        while not self._closing.is_set():
            if events.poll(POLL_MS):
                self._dispatch(decoder.decode(events.recv(copy=False).buffer))
                last_event = time.monotonic()
                continue
            silent = time.monotonic() - last_event
            if silent > self.rc.parallel.step_timeout_s and self.watching:
                self._silent(silent)
            status = proc.poll()
            if status is not None:
                while events.poll(0):               # what it sent before it went
                    self._dispatch(decoder.decode(events.recv(copy=False).buffer))
                self._gone(status)
                return

    def _dispatch(self, event: m.Event) -> None:
        if isinstance(event, m.Reply):
            with self._lock:
                future = self._calls.pop(event.call, None)
            if future is not None:
                future.set_result(event)
        elif not isinstance(event, m.Beat):         # (a Beat only says the core is alive: its time is noted)
            self._events_to(event)
