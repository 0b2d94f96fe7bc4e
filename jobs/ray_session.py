"""The job's Ray session: connect to a cluster or start a local embedded Ray, in the background while the driver
does its own work, and shut it down.

A local Ray takes seconds to start (its GCS, raylet, monitor and log processes), which the driver spent
waiting before it verified the bank and planned the first stage. :func:`begin_ray` starts it in a thread and
returns at once; every use of Ray waits for it first (:func:`ray_module`, for the executor and placement), so
the start overlaps the driver's work up to the first task. What fails fast still does, in the caller's thread
and before anything starts: an unreachable address, an address-space limit too small for any start
(``ray_limits``). An error of the start itself is raised where Ray is first used.

The thread that starts Ray lives until :func:`shutdown_ray`: Ray starts its processes with
``PR_SET_PDEATHSIG``, which kills them when the *thread* that forked them ends. Off the main thread,
``ray.init`` leaves the SIGTERM handler as it is (the CLI's: SIGTERM is handled like Ctrl-C); where the caller
installed none, the handler ``ray.init`` would have installed is (``sys.exit``: Ray's atexit hook then stops its
processes).
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import socket
import sys
import threading
from types import ModuleType
from typing import Any

from memgas.jobs.ray_limits import address_space_checked, check_address_space
from memgas.pipeline.errors import EnvironmentFailure, MemgasError

log = logging.getLogger(__name__)

#: Seconds to wait for a cluster's GCS port before giving up (a wrong --address must not hang).
CONNECT_TIMEOUT_S = 10.0

#: Prefixes of the driver's variables that Ray workers get through the job's ``runtime_env``: offline HF
#: flags and caches, thread caps, vLLM settings (VLLM_ENABLE_V1_MULTIPROCESSING, VLLM_BATCH_INVARIANT, ...),
#: fault injection. Values are sent as they are: a path (HF_HOME) must exist on every node.
FORWARDED_PREFIXES: tuple[str, ...] = ("HF_", "TRANSFORMERS_", "OMP_", "MKL_", "TOKENIZERS_", "MEMGAS_", "VLLM_")
#: Name parts that mark a secret. Ray writes the job's runtime_env to its logs (and the dashboard), so
#: secrets never go there: a local Ray's workers inherit them from the driver's process (the raylet is its
#: child); on a cluster they must be set in the environment of ``ray start`` on each node (docs/reliability.md).
SECRET_MARKERS: tuple[str, ...] = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "API_KEY", "APIKEY", "CREDENTIAL",
                                   "PRIVATE_KEY", "ACCESS_KEY")
#: Worker environment unless the driver logs at DEBUG (``-v``): the libraries' own progress bars (model
#: loading, encoder batches) would otherwise reach the terminal through Ray's log forwarding, interleaved
#: with the driver's one bar per stage and Ray's deduplication banners. Warnings and errors still reach the
#: driver (they are log lines, not bars); variables the user forwards (:func:`forwarded_env`) win.
QUIET_WORKER_ENV: dict[str, str] = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def is_secret_name(name: str) -> bool:
    """True for variable names that hold credentials (HF_TOKEN, OPENAI_API_KEY, MEMGAS_DB_PASSWORD, ...)."""
    upper = name.upper()
    return any(m in upper for m in SECRET_MARKERS)


def forwarded_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables of ``environ`` (default: this process's) that workers get through ``runtime_env``:
    :data:`FORWARDED_PREFIXES`, never a secret (:func:`is_secret_name`)."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if k.startswith(FORWARDED_PREFIXES) and not is_secret_name(k)}


def worker_env() -> dict[str, str]:
    """What the job's workers get through ``runtime_env``: :func:`forwarded_env`, quietened unless ``-v``."""
    quiet = {} if logging.getLogger().getEffectiveLevel() <= logging.DEBUG else QUIET_WORKER_ENV
    return {**quiet, **forwarded_env()}


def _check_reachable(address: str) -> None:
    """Fail fast with one line when a ``host:port`` cluster address does not answer."""
    if address == "auto" or address.startswith("ray://"):
        if address.startswith("ray://"):
            try:
                importlib.import_module("ray.util.client")
                importlib.import_module("grpc")
            except ImportError:
                raise EnvironmentFailure(
                    f"ray address {address}: ray:// needs Ray's client extra: pip install 'ray[client]'"
                ) from None
            hostport = address[len("ray://"):]
        else:
            return
    else:
        hostport = address
    host, _, port = hostport.rpartition(":")
    # a port outside 1-65535 is bad input (exit 2), not an unreachable cluster: socket raises OverflowError
    if not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) <= 65535:
        raise MemgasError(f"ray address {address!r}: expected host:port (port 1-65535), ray://host:port or auto")
    try:
        with socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as exc:
        raise EnvironmentFailure(f"ray address {address}: cannot connect ({exc}); is the cluster running?") from None


class _OffMainThread(logging.Filter):
    """Drops Ray's warning that it set no SIGTERM handler off the main thread: that is intended here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


class _Start(threading.Thread):
    """Runs ``ray.init`` and then holds its processes' parent thread until :func:`shutdown_ray` (a daemon: it
    never keeps the interpreter from exiting, and lives through the atexit hooks, Ray's included)."""

    def __init__(self, address: str | None, num_cpus: int | None) -> None:
        super().__init__(name="ray-start", daemon=True)
        self.address, self.num_cpus = address, num_cpus
        self.runtime_env = {"env_vars": worker_env()}  # the driver's log level, read in the caller's thread
        self.ready, self.released = threading.Event(), threading.Event()
        self.described: str | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        import ray

        quiet = _OffMainThread()
        logging.getLogger("ray._private.worker").addFilter(quiet)
        try:
            if self.address:
                ray.init(address=self.address, log_to_driver=True, runtime_env=self.runtime_env)
                self.described = f"cluster:{self.address}"
            else:
                with address_space_checked():  # a start that fails under a finite `ulimit -v`: named as the limit
                    ray.init(
                        # "local": always a new embedded instance, never a stale or foreign cluster that `ray
                        # start` left on this machine (ray.init() without an address would attach to the latest one)
                        address="local",
                        num_cpus=self.num_cpus,
                        include_dashboard=False,
                        log_to_driver=True,
                        configure_logging=False,
                        runtime_env=self.runtime_env,
                    )
                self.described = f"local:{ray.available_resources().get('CPU', 0):.0f}cpu"
            log.info("ray: %s", self.described)
        except BaseException as exc:  # raised where Ray is first used (wait_for_ray)
            self.error = exc
        finally:
            logging.getLogger("ray._private.worker").removeFilter(quiet)
            self.ready.set()
        self.released.wait()


#: the start begun by :func:`begin_ray`, until :func:`shutdown_ray` releases it
_start: _Start | None = None


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    sys.exit(signum)  # what ray.init installs on the main thread


def begin_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Begin connecting to a cluster (``address`` or RAY_ADDRESS) or starting a local embedded Ray, and return;
    :func:`wait_for_ray` (every use of Ray) waits for it. An unreachable address and an address-space limit
    too small for Ray are raised here, before anything starts.

    Either way the job's workers get :func:`forwarded_env` (offline flags, thread caps, ``VLLM_*``) through
    the job's ``runtime_env``; secrets are left out of it because Ray logs it."""
    global _start
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if _start is not None and not _start.ready.is_set():
        return
    if ray_running():
        return
    _release()
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        _check_reachable(address)
    else:
        check_address_space()  # `ulimit -v` too small for Ray: one line, exit 3 (not its stack dump)
    main = threading.current_thread() is threading.main_thread()
    if main and not callable(signal.getsignal(signal.SIGTERM)):
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    _start = _Start(address, num_cpus)
    _start.start()


def wait_for_ray() -> str | None:
    """Wait for the start :func:`begin_ray` began (at once when none is under way); raises its error. Returns
    what was started or joined ("local:2cpu", "cluster:host:port"), None when Ray was started elsewhere."""
    start = _start
    if start is None:
        return None
    start.ready.wait()
    if start.error is not None:  # at every use until shutdown_ray: Ray's own auto-start must not follow
        raise start.error
    return start.described


def init_ray(address: str | None = None, num_cpus: int | None = None) -> str:
    """:func:`begin_ray`, then :func:`wait_for_ray`: connected to, or started, when it returns."""
    if ray_running() and (_start is None or _start.ready.is_set()):
        return "already-initialized"
    begin_ray(address, num_cpus)
    return wait_for_ray() or "already-initialized"


def ray_module() -> ModuleType:
    """The ``ray`` module, once a start under way is complete: what the executor and placement call it by."""
    wait_for_ray()
    import ray

    return ray


def ray_running() -> bool:
    """Whether this process is connected to Ray (started here or by a caller), or a start is under way."""
    if _start is not None and not _start.ready.is_set():
        return True
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def _release() -> None:
    """Let the thread of a finished start end (its Ray, if any, is shut down or was never up)."""
    global _start
    if _start is not None:
        _start.released.set()
        _start.join()  # at once: it only waited for this
        _start = None


def _stop_monitor() -> None:
    """Kill a local Ray's autoscaler monitor. Ray's shutdown stops it after the GCS with SIGTERM, whose handler
    then reports the monitor's end to the GCS that is gone, until Ray kills it after a 1 s grace: a second of
    every command. The monitor holds nothing of the job (an embedded Ray does not autoscale); where Ray's
    internals are not as expected, its own shutdown does this as before."""
    try:
        from ray._private import ray_constants, worker

        processes = getattr(worker, "_global_node", None).all_processes.get(ray_constants.PROCESS_TYPE_MONITOR, [])
    except Exception:  # another Ray version: its shutdown stops the monitor
        return
    for info in processes:
        try:
            info.process.kill()
            info.process.wait(timeout=1)
        except Exception as exc:  # gone already, or not reaped within the second Ray would have waited
            log.debug("ray monitor: %s", exc)


def shutdown_ray() -> None:
    """Shut down the Ray this process started or joined (after its start, where one is under way), and end the
    thread that started it. A start that failed has nothing to shut down: its error was or will be raised
    where Ray was used."""
    start = _start
    if start is not None:
        start.ready.wait()
    ray = sys.modules.get("ray")
    try:
        if ray is not None and ray.is_initialized():
            _stop_monitor()
            ray.shutdown()
    finally:
        _release()
