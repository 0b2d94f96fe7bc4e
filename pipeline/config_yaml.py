"""Reading a config file: bounded, regular files only, UTF-8 YAML whose mappings name each key once (the
one-line errors of :class:`memgas.pipeline.errors.ConfigError`). :mod:`memgas.pipeline.config` validates
what it reads."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import yaml

from memgas.pipeline.errors import ConfigError


#: Largest config file read (bytes). The shipped configs are ~2 KB; a bound keeps `--config /dev/zero`-like
#: input (a huge or endless file) from reading until memory runs out.
MAX_CONFIG_BYTES = 1 << 20


class DuplicateKey(yaml.YAMLError):
    """A mapping that names one key twice (YAML forbids it; PyYAML silently keeps the last value)."""

    def __init__(self, key: Any, first: yaml.Mark, again: yaml.Mark) -> None:
        super().__init__(f"duplicate key {key!r}")
        self.key, self.first, self.again = key, first, again


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key repeated in one mapping: a second ``retrieval:`` section
    would otherwise replace the first one's settings without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, yaml.Mark] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` overrides are the point of merges
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: the base class reports it
                    continue
                if first is not None:
                    raise DuplicateKey(key, first, key_node.start_mark)
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def safe_load(text: str) -> Any:
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    if stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{path}: is a directory, expected a YAML config file")
    if not stat.S_ISREG(st.st_mode):  # a FIFO would block the open for ever, /dev/zero never ends
        raise ConfigError(f"{path}: not a regular file ({_file_kind(st.st_mode)}); expected a YAML config file")
    if st.st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: {st.st_size} bytes, larger than a config can be ({MAX_CONFIG_BYTES} bytes)")
    with open(p, "rb") as f:
        data = f.read(MAX_CONFIG_BYTES + 1)  # bounded even if the file grows while it is read
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than a config can be ({MAX_CONFIG_BYTES} bytes)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a text file (invalid UTF-8 at byte {exc.start}); expected a YAML config") from None
    if "\x00" in text:
        raise ConfigError(f"{path}: not a text file (NUL bytes); expected a YAML config")
    try:
        raw = safe_load(text)
    except DuplicateKey as exc:
        raise ConfigError(f"{path}: duplicate key {exc.key!r} on line {exc.again.line + 1} (first on line "
                          f"{exc.first.line + 1}); the second would replace the first's settings: keep one") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {yaml_problem(exc)}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections (data:, retrieval:, ...) at the top level, "
                          f"got {type(raw).__name__}")
    return raw


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a file"


def yaml_problem(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{problem}"
