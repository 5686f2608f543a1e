"""``python -m MODULE ARGS`` (or ``-c CODE``, or a script) for the tests, forked from a process that has imported
torch already.

A fresh interpreter spends 3-4 s of CPU importing torch before a command line is even parsed (a 2-core host); the
CLI tests start some forty of them. A zygote process imports torch once per test worker and forks a child per
command: the child takes the command's working directory, environment, stdin, stdout and stderr, runs the module,
code or script as ``__main__`` (``sys.path[0]`` and ``sys.argv`` as the interpreter sets them for each form) and exits
with its status, after atexit handlers and non-daemon threads as at interpreter exit. What differs from a fresh
process: what torch reads at import (the command's OMP_NUM_THREADS is applied with torch.set_num_threads, the rest
is the zygote's) and the interpreter's own teardown (a program whose subject is either, or a signal from outside,
starts a fresh one with ``subprocess``).

Nothing of swapopt is imported before the fork, so the module, its configuration and everything it reads from the
environment start fresh in each child. One request may start several children at once (``run_all``: the ranks of a
multi-process job, tests/dist_utils.py's ``launch``), and a zygote may import more of torch before it forks
(``preload``: the distributed packages every rank imports); a zygote serves one preload, so the CLI's own imports stay
as a fresh interpreter's.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from pathlib import Path
from typing import NamedTuple

_TESTS = Path(__file__).resolve().parent


class Command(NamedTuple):
    """``python argv...`` in ``cwd`` with exactly ``env`` (argv: ``["-m", module, *args]``, ``["-c", code, *args]`` or
    ``[script, *args]``)."""

    argv: list[str]
    cwd: Path | str
    env: dict[str, str]


class Zygote:
    """The client: one zygote process per test process, preload and PYTHONPATH, started on first use, stopped at exit."""

    # One per preload and PYTHONPATH: a sitecustomize.py on PYTHONPATH (the mutations' in_subprocesses) runs once, as
    # the zygote starts, and its children inherit what it did.
    _shared: dict[tuple[tuple[str, ...], str | None], Zygote] = {}

    def __init__(self, preload: tuple[str, ...] = ()) -> None:
        """``preload``: modules the zygote imports after torch, before it forks (each child then has them)."""
        path = os.pathsep.join(filter(None, [str(_TESTS.parent), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path}
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__)), *preload], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, bufsize=0)
        self._buffer = b""  # replies read from the pipe, not yet taken line by line
        ready = self._line(120)
        if ready != {"ready": True}:
            raise RuntimeError(f"the CLI zygote did not start: {ready}")
        atexit.register(self.close)

    @classmethod
    def shared(cls, preload: tuple[str, ...] = ()) -> Zygote:
        key = (preload, os.environ.get("PYTHONPATH"))
        zygote = cls._shared.get(key)
        if zygote is None or zygote.proc.poll() is not None:
            zygote = cls._shared[key] = cls(preload)
        return zygote

    def _line(self, timeout: float) -> dict | None:
        """The zygote's next reply, or None after `timeout` seconds. Read from the descriptor itself: a buffered
        reader could take two replies at once and leave select() waiting for the second."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return {"closed": self.proc.poll()}
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def run(self, argv: list[str], *, cwd: Path | str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        """``argv`` in a forked child: a CompletedProcess with its text output, or TimeoutExpired after killing it."""
        (done,), killed = self._run_all([Command(argv, cwd, env)], timeout)
        if killed:
            raise subprocess.TimeoutExpired(done.args, timeout, done.stdout, done.stderr)
        return done

    def run_all(self, commands: list[Command], timeout: float) -> list[subprocess.CompletedProcess]:
        """Every command in a forked child of its own, all running at once (the ranks of one job): a CompletedProcess
        for each once all have exited. Past ``timeout`` seconds every child still running is killed (SIGKILL: its
        returncode is -9), so that a rank waiting for a peer that failed cannot hold the run up for ever."""
        return self._run_all(commands, timeout)[0]

    def _run_all(self, commands: list[Command], timeout: float) -> tuple[list[subprocess.CompletedProcess], bool]:
        """The children's results, and whether the timeout killed them."""
        for argv, _, _ in commands:
            form = argv[0] if argv else ""
            if not form or (form.startswith("-") and (form not in ("-m", "-c") or len(argv) < 2)):
                raise ValueError(f"the zygote runs ['-m', module, ...], ['-c', code, ...] or [script, ...], not {argv}")
        with tempfile.TemporaryDirectory() as tmp:
            children = [{"argv": [str(a) for a in argv], "cwd": str(cwd), "env": env,
                         "stdout": os.path.join(tmp, f"stdout{i}"), "stderr": os.path.join(tmp, f"stderr{i}")}
                        for i, (argv, cwd, env) in enumerate(commands)]  # fmt: skip
            self.proc.stdin.write(json.dumps({"children": children}).encode() + b"\n")
            started = self._line(30)
            if not started or "pids" not in started:
                raise RuntimeError(f"the CLI zygote did not start {[c['argv'] for c in children]}: {started}")
            done = self._line(timeout)
            killed = done is None
            if killed:
                for pid in started["pids"]:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:  # it had exited already
                        pass
                done = self._line(30)
            return [subprocess.CompletedProcess([sys.executable, *c["argv"]], code, Path(c["stdout"]).read_text(),
                                                Path(c["stderr"]).read_text())
                    for c, code in zip(children, done["returncodes"])], killed  # fmt: skip

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def run(argv: list[str], *, cwd: Path | str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    """``python argv...`` as subprocess.run(capture_output=True, text=True) gives it, from the shared zygote."""
    return Zygote.shared().run(argv, cwd=cwd, env=env, timeout=timeout)


def run_all(commands: list[Command], *, preload: tuple[str, ...] = (), timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """The commands at once, each as ``run`` runs one, from the shared zygote of ``preload``."""
    return Zygote.shared(preload).run_all(commands, timeout)


# ----- the zygote and its children ----------------------------------------------------------------------------
def _child(request: dict, installation: list[str]) -> None:
    """Become ``python argv...`` in the request's directory and environment; never returns."""
    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        threads = request["env"].get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:  # torch read it at the zygote's import: set what it would have
            import torch

            torch.set_num_threads(int(threads))
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT),
                                (2, request["stderr"], os.O_WRONLY | os.O_CREAT)):  # fmt: skip
            opened = os.open(path, flags, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own streams, as at start-up
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        # sys.path[0] as the interpreter sets it (-m: the working directory, -c: '', a script: its folder), then
        # the command's PYTHONPATH entries, then the installation's (the zygote's own PYTHONPATH left out)
        argv = request["argv"]
        kind = argv[0] if argv[0] in ("-m", "-c") else "script"
        first = {"-m": os.getcwd(), "-c": "", "script": os.path.dirname(os.path.abspath(argv[0]))}[kind]
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [first, *extra, *installation]
        try:
            if kind == "-m":
                sys.argv = argv[1:]  # run_module puts the module's path in argv[0]
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            elif kind == "-c":
                sys.argv = ["-c", *argv[2:]]
                main = types.ModuleType("__main__")
                sys.modules["__main__"] = main
                exec(compile(argv[1], "<string>", "exec"), main.__dict__)  # noqa: S102 - what python -c does
            else:
                sys.argv = argv
                runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as exc:
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                code = exc.code
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 - printed as the interpreter prints an uncaught exception
            sys.excepthook(*sys.exc_info())
            code = 1
        threading._shutdown()  # type: ignore[attr-defined]  # non-daemon threads end first, as at exit
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001, S110
                pass
        os._exit(code)


def _serve(preload: list[str]) -> None:
    import gc
    import importlib

    import torch  # noqa: F401 - what every child would import first, once

    for name in preload:
        importlib.import_module(name)
    # What the zygote imported lives in every child until it exits: out of the garbage collector's sight there
    # (Note [collection out of the collector's sight] in tests/conftest.py), and its pages stay shared with the
    # children instead of being copied when a collection writes to them.
    gc.collect()
    gc.freeze()
    own = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    installation = [p for p in sys.path[1:] if os.path.abspath(p) not in own]  # the zygote's sys.path[0]: tests/
    reply = sys.stdout
    reply.write(json.dumps({"ready": True}) + "\n")
    reply.flush()
    for line in sys.stdin:
        pids = []
        for child in json.loads(line)["children"]:
            pid = os.fork()
            if pid == 0:
                _child(child, installation)
            pids.append(pid)
        reply.write(json.dumps({"pids": pids}) + "\n")
        reply.flush()
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        reply.write(json.dumps({"returncodes": codes}) + "\n")
        reply.flush()


if __name__ == "__main__":
    _serve(sys.argv[1:])
