from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SAMPLE_LOCOMO = REPO / "data" / "sample" / "locomo_sample.json"


def memgas_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(RAY_AUTH_MODE="disabled", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TQDM_DISABLE="1",
               TOKENIZERS_PARALLELISM="false")
    return env


def _failed(args: tuple[str, ...], proc: subprocess.CompletedProcess) -> AssertionError:
    return AssertionError(f"memgas {' '.join(args)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def run_memgas_process(*args: str, timeout: float = 600, check: bool = True,
                       env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run the installed console script as a user would: a real process (the smoke tests, kills, races)."""
    exe = Path(sys.executable).with_name("memgas")
    proc = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=timeout,
                          env={**memgas_env(), **(env or {})}, cwd=REPO)
    if check and proc.returncode != 0:
        raise _failed(args, proc)
    return proc


@contextlib.contextmanager
def _as_a_process(env: dict[str, str]) -> Iterator[None]:
    """What a new `memgas` process would start from, for the length of one in-process call: the working
    directory and environment of :func:`run_memgas_process`, no fault-hook counts, and no log handler, so that
    the CLI's own ``logging.basicConfig`` puts its handler on the captured stderr (pytest's handlers would
    otherwise keep the log off stderr, and "one line on stderr" would not see INFO lines a user sees)."""
    from memgas.pipeline import faults

    cwd, environ = os.getcwd(), dict(os.environ)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    counts = faults._counts
    os.chdir(REPO)
    os.environ.update({**memgas_env(), **env})
    root.handlers = []
    faults._counts = {}
    try:
        yield
    finally:
        for h in root.handlers:  # the one basicConfig added on the captured stream
            h.close()
        root.handlers, faults._counts = handlers, counts
        root.setLevel(level)
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)


class InProcessTimeout(BaseException):
    """Raised by the alarm in :func:`run_memgas`: a BaseException, so the CLI's last-resort ``except Exception``
    cannot turn it into an exit code (a subprocess past its timeout fails the test; so does this)."""


@contextlib.contextmanager
def _deadline(seconds: float, what: str) -> Iterator[None]:
    def expired(signum: int, frame: object) -> None:
        raise InProcessTimeout(f"{what} ran past its {seconds:.0f} s timeout")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_memgas(*args: str, timeout: float = 600, check: bool = True,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``memgas ARGS`` in this process through ``memgas.jobs.cli.main`` (no interpreter start, no torch import,
    models cached in ``executor._LOCAL_HOSTS`` across calls), returned as the console script's
    CompletedProcess: exit code, stdout, stderr. A call past ``timeout`` raises :class:`InProcessTimeout`
    (a command that should have been refused but serves or runs on fails instead of hanging the suite).

    Fault specs that end the process (``kill@``, ``term@``) need :func:`run_memgas_process`."""
    from memgas.jobs import cli

    out, err = io.StringIO(), io.StringIO()
    with (_as_a_process(env or {}), _deadline(timeout, f"memgas {' '.join(args)}"), contextlib.redirect_stdout(out),
          contextlib.redirect_stderr(err)):
        try:
            rc = cli.main(list(args))
        except SystemExit as exc:  # argparse exits from parse_args (--help: 0, a usage error: 2)
            rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    proc = subprocess.CompletedProcess(["memgas", *args], rc, out.getvalue(), err.getvalue())
    if check and proc.returncode != 0:
        raise _failed(args, proc)
    return proc


@pytest.fixture(scope="session")
def sample_locomo() -> Path:
    return SAMPLE_LOCOMO


@pytest.fixture(scope="session")
def cli() -> Callable[..., subprocess.CompletedProcess]:
    """``cli("stats", bank, check=False)`` runs `memgas` in-process (:func:`run_memgas`)."""
    return run_memgas


@pytest.fixture(scope="session")
def cli_process() -> Callable[..., subprocess.CompletedProcess]:
    """``cli_process(...)``: the installed `memgas` console script as a real process (:func:`run_memgas_process`)."""
    return run_memgas_process


@pytest.fixture(scope="session")
def memgas_exe() -> tuple[str, dict[str, str], Path]:
    """(path of the console script, its environment, the repo root) for tests that spawn and kill it."""
    return str(Path(sys.executable).with_name("memgas")), memgas_env(), REPO
