"""Where the daemon's UNIX socket is, for the daemon that creates it and the clients
(`edgemm status`, `edgemm doctor`) that look for it."""
from __future__ import annotations

import os
import stat

from edgemm.config import ServerConfig

SYSTEM_SOCKET = "/run/edgemm/edgemm.sock"  # in systemd's RuntimeDirectory=edgemm; edgemm.socket creates it


def socket_choices() -> list[str]:
    """Where the socket goes when server.socket is null, most preferred first: systemd's
    /run/edgemm, then the user's own $XDG_RUNTIME_DIR (set by a login session)."""
    choices = [SYSTEM_SOCKET]
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR")
    if runtime_dir:
        choices.append(os.path.join(runtime_dir, "edgemm.sock"))
    return choices


def creatable_socket() -> str | None:
    """The first of socket_choices() whose folder exists and this user may create files in."""
    return next((path for path in socket_choices()
                 if os.access(os.path.dirname(path), os.W_OK | os.X_OK)), None)


def client_socket(cfg: ServerConfig) -> str:
    """The socket a client tries: server.socket, else the first choice a daemon listens on,
    else the one a daemon would create (for the message when nothing answers)."""
    if cfg.socket is not None:
        return cfg.socket
    for path in socket_choices():
        try:
            if stat.S_ISSOCK(os.stat(path).st_mode):
                return path
        except OSError:
            continue
    return creatable_socket() or SYSTEM_SOCKET
