"""The two systemd protocols a service speaks, without libsystemd.

sd_notify: state changes are datagrams ("READY=1", "STATUS=…", "WATCHDOG=1",
"STOPPING=1") sent to the socket named by $NOTIFY_SOCKET. Outside systemd the
variable is unset and every notification is a no-op.

Socket activation: systemd opens the listening sockets itself, starts the service
on the first connection, and hands them over as file descriptors 3, 4, … with
$LISTEN_FDS (how many) and $LISTEN_PID (for whom: a child must not take them).
See sd_notify(3) and sd_listen_fds(3).
"""
from __future__ import annotations

import os
import socket

LISTEN_FDS_START = 3


class Notifier:
    """Sends sd_notify messages; does nothing when not run by systemd (Type=notify)."""

    def __init__(self, address: str | None):
        # A leading '@' names a socket in the abstract namespace.
        self.address = "\0" + address[1:] if address and address.startswith("@") else address

    @classmethod
    def from_env(cls) -> "Notifier":
        return cls(os.environ.get("NOTIFY_SOCKET") or None)

    @property
    def active(self) -> bool:
        return self.address is not None

    def send(self, *fields: str) -> bool:
        """One datagram of newline-separated fields; False if it could not be sent."""
        if self.address is None:
            return False
        message = "\n".join(f.replace("\n", " ") for f in fields).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto(message, self.address)
        except OSError:
            return False  # systemd going away must never take the service down with it
        return True

    def ready(self, status: str) -> bool:
        return self.send("READY=1", f"STATUS={status}")

    def status(self, status: str) -> bool:
        return self.send(f"STATUS={status}")

    def watchdog(self, status: str) -> bool:
        return self.send("WATCHDOG=1", f"STATUS={status}")

    def stopping(self, status: str) -> bool:
        return self.send("STOPPING=1", f"STATUS={status}")


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WatchdogSec=), or None if there is no watchdog."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2e6 if int(usec) > 0 else None
    except ValueError:
        return None


def listen_sockets() -> list[socket.socket]:
    """The sockets systemd passed to this process (empty when not socket-activated).

    The variables are removed afterwards, as sd_listen_fds(1) does, so a process
    started from here does not think the sockets are its own.
    """
    pid, count = os.environ.get("LISTEN_PID"), os.environ.get("LISTEN_FDS")
    if pid != str(os.getpid()) or not count:
        return []
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(name, None)
    try:
        fds = range(LISTEN_FDS_START, LISTEN_FDS_START + int(count))
    except ValueError:
        return []
    sockets = []
    for fd in fds:
        os.set_inheritable(fd, False)
        sockets.append(socket.socket(fileno=fd))  # family and type are read from the descriptor
    return sockets
