"""Reading a file a user names (an image, a config, a model folder's yaml/json, a
tokenizer) without letting the name stall or bloat the process.

A FIFO would block open() for ever, /dev/zero never ends and a 20 GB file is read whole
by read_text(): the path is stat-ed first, and only a regular file at most `max_bytes`
long is opened, with O_NONBLOCK (so a FIFO swapped in after the stat does not block),
then checked again by fstat and read at most `max_bytes` + 1 bytes.
"""
from __future__ import annotations

import os
import stat
import sys
from typing import Callable

import yaml

MakeError = Callable[[str], Exception]  # detail → the caller's exception (ImageError, ConfigError …)

# a model folder's text files: model.yaml and the JSON files are KB, tokenizer.json up to ~20 MB
MAX_MODEL_FILE_BYTES = 64 * 1024 * 1024

_FILE_KINDS = ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
               (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def file_kind(mode: int) -> str:
    """What a `stat` mode names, for messages: "a FIFO", "a folder", "a character device" …"""
    return next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")


# `error(detail)` makes the exception, `detail` being e.g. "path is a FIFO, not a regular
# file" or "is 3000 bytes, above the 2048 byte limit (<limit>)"; `limit` names the setting.

def check_regular_file(path: str | os.PathLike, max_bytes: int, error: MakeError, limit: str) -> int:
    """The size of the regular file at `path`, by stat alone; `error(detail)` raised otherwise."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise error("not found") from None
    except (OSError, ValueError) as e:  # ValueError: e.g. a NUL byte in the path
        raise error(f"not readable ({getattr(e, 'strerror', None) or e})") from None
    _check_regular(info, max_bytes, error, limit)
    return info.st_size


def _check_regular(info: os.stat_result, max_bytes: int, error: MakeError, limit: str) -> None:
    if not stat.S_ISREG(info.st_mode):
        kind = file_kind(info.st_mode)
        if kind == "a folder":
            raise error("path is a directory, not a file")
        raise error(f"path is {kind}, not a regular file")
    if info.st_size > max_bytes:
        raise error(f"is {info.st_size} bytes, above the {max_bytes} byte limit ({limit})")


def regular_file_present(path: str | os.PathLike, error: MakeError) -> bool:
    """Whether a file is at `path`: False where nothing is (a folder's optional file), True
    for a regular file, `error(detail)` for anything else there (a link to /dev/zero, a FIFO,
    a folder, a dangling link), which is_file() would have passed off as absent."""
    if not os.path.lexists(path):
        return False
    check_regular_file(path, sys.maxsize, error, "")  # no size cap here: ONNX graphs are GBs
    return True


def read_regular_file(path: str | os.PathLike, max_bytes: int, error: MakeError, limit: str) -> bytes:
    """The bytes of the regular file at `path`, at most `max_bytes` (see check_regular_file).

    O_NONBLOCK: should the path become a FIFO after the stat, open() does not wait for a writer."""
    check_regular_file(path, max_bytes, error, limit)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise error("not found") from None
    except PermissionError:
        raise error("not readable (permission denied)") from None
    except (OSError, ValueError) as e:
        raise error(f"not readable ({getattr(e, 'strerror', None) or e})") from None
    try:
        _check_regular(os.fstat(fd), max_bytes, error, limit)  # what was opened, not what was stat-ed
        with open(fd, "rb", closefd=False) as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise error(f"not readable ({e.strerror or e})") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:  # it grew after the stat
        raise error(f"is more than {max_bytes} bytes ({limit})")
    return data


def read_model_file(path: str | os.PathLike) -> str:
    """A model folder's text file (model.yaml, config.json, tokenizer.json …) as UTF-8, at
    most MAX_MODEL_FILE_BYTES; ModelError naming the file for anything else."""
    from edgemm.errors import ModelError
    shown = os.fspath(path)
    data = read_regular_file(path, MAX_MODEL_FILE_BYTES, lambda detail: ModelError(f"{shown}: {detail}"),
                             "for a model file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ModelError(f"{shown}: not UTF-8 text") from None


# ---- YAML -----------------------------------------------------------------------------------

# A config, model.yaml, scheduler.yaml or engine manifest nests a few levels and holds small
# numbers. PyYAML composes nodes recursively (`[` x 500 → RecursionError) and int() refuses
# more than 4300 decimal digits (ValueError): both would escape as internal errors, so they are
# refused while parsing, as YAML errors with a line:column, before the recursion or the int().
MAX_YAML_DEPTH = 64
MAX_YAML_INT_CHARS = 100  # far above any setting (2**64 has 20 digits); hex and 0b counted too


class _BoundedLoader(yaml.SafeLoader):
    _depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                mark = self.peek_event().start_mark
                raise yaml.composer.ComposerError(
                    None, None, f"nests more than {MAX_YAML_DEPTH} levels deep", mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_yaml_int(self, node):
        if len(node.value) > MAX_YAML_INT_CHARS:
            raise yaml.constructor.ConstructorError(
                None, None, f"an integer longer than {MAX_YAML_INT_CHARS} characters", node.start_mark)
        return super().construct_yaml_int(node)


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_yaml_int)


def load_yaml(text: str | bytes):
    """yaml.safe_load, with nesting and integer length bounded (a yaml.YAMLError beyond them)."""
    return yaml.load(text, Loader=_BoundedLoader)
