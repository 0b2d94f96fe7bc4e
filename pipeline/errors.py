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
