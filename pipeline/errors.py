"""Errors a user sees as one line (the CLI prints them without a traceback)."""

from __future__ import annotations


class MemgasError(Exception):
    """Base class: anything the CLI reports as a one-line message and exit code 2."""


class DataError(MemgasError):
    """Bad input data: names the file, the record (index and id), the field and what was expected."""

    def __init__(
        self,
        file: str,
        message: str,
        *,
        index: int | None = None,
        record_id: str | None = None,
        field: str | None = None,
    ) -> None:
        self.file, self.index, self.record_id, self.field = file, index, record_id, field
        where = [str(file)]
        if index is not None:
            where.append(f"record {index}" + (f" (id={record_id})" if record_id is not None else ""))
        elif record_id is not None:
            where.append(f"id={record_id}")
        if field is not None:
            where.append(f"field {field!r}")
        super().__init__(": ".join(where) + ": " + message)


class BankError(MemgasError):
    """A memory bank is missing, incomplete or of another schema version."""


class ConfigError(MemgasError):
    """A configuration value is missing or invalid."""


class LLMCallsFailed(MemgasError):
    """LLM calls failed in the backend after the client's own retries (connection refused, 5xx, 429, timeout)
    and the stages after this one would read what they did not produce: the run stops with exit 4 ("run
    incomplete, failures counted"); finished work is kept and the next run retries the rest."""

    exit_code = 4


class ResourceLimit(MemgasError):
    """A limit of this process (``ulimit``) is too small for what the command must start: exit 3, the
    environment's fault, as a full disk."""

    exit_code = 3


class EnvironmentFailure(MemgasError):
    """The environment, not the input, is wrong (cluster unreachable, a device or package missing): exit 3."""

    exit_code = 3


#: the exit code of a bug (an internal error): the one the command line returns for any exception it did not expect
EXIT_BUG = 1


class Bug(MemgasError):
    """A unit failed from an exception of the code itself (not I/O, not a resource, not a backend): the same
    input fails the same way, so the message says "a bug" instead of advising a re-run. Exit 1."""

    exit_code = EXIT_BUG


#: modules whose exceptions are a backend's failure (a cluster, a worker, an HTTP server), not a bug
BACKEND_MODULES = ("ray", "grpc", "httpx", "httpcore", "openai", "vllm")


def is_environmental(exc: BaseException) -> bool:
    """Whether ``exc`` is an I/O, resource or backend failure (a re-run may succeed), or memgas's own
    one-line error; anything else raised by a unit is a bug."""
    if isinstance(exc, (OSError, MemoryError, MemgasError, KeyboardInterrupt)):
        return True
    return (type(exc).__module__ or "").split(".")[0] in BACKEND_MODULES
