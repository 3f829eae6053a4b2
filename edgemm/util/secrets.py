"""Secrets edgemm sends (the offload API key, webhooks' bearer tokens): from an environment
variable or a file only its owner may read, never from the YAML."""
from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

from edgemm.util.errors import CredentialsError


def read_secret(env_name: str | None, file: str | None, env_key: str, file_key: str,
                environ: Mapping[str, str] = os.environ) -> str | None:
    """The secret in the environment variable `env_name` if it is set, else in `file`
    (read_key_file), else None when neither is named. `env_key` / `file_key` are the config
    keys that named them (offload.api_key_env …), for the messages."""
    if env_name and environ.get(env_name, "").strip():
        return environ[env_name].strip()
    if file:
        return read_key_file(Path(file), file_key)
    if env_name:
        raise CredentialsError(f"{env_key}: the environment variable {env_name} is not set")
    return None


def read_key_file(path: Path, key_name: str = "offload.api_key_file") -> str:
    """The key in `path`, which must be a regular file no group or other user can access.
    `key_name` is the config key that named the file, for the messages (webhooks use this too)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block the start
    except OSError as e:
        raise CredentialsError(f"{key_name}: cannot open {path}: {e.strerror}") from None
    try:
        info = os.fstat(fd)  # the file opened, not whatever the path names by now
        if not stat.S_ISREG(info.st_mode):
            raise CredentialsError(f"{key_name}: {path} is not a regular file")
        if info.st_mode & 0o077:
            raise CredentialsError(f"{key_name}: refusing {path}: mode {stat.S_IMODE(info.st_mode):04o} "
                                   f"lets group or others access it (chmod 600 {path})")
        key = os.read(fd, 64 * 1024).decode("utf-8", errors="replace").strip()
    finally:
        os.close(fd)
    if not key:
        raise CredentialsError(f"{key_name}: {path} is empty")
    return key
