"""This machine's network interfaces: the IPv4 address of one (``--network-interface``)."""

from __future__ import annotations

import fcntl
import socket
import struct
import sys

from sumflow.launcher.errors import ConfigError

#: Linux's ioctl that reads an interface's IPv4 address (<linux/sockios.h>).
_SIOCGIFADDR = 0x8915


def ipv4_address(nic: str) -> str:
    """The IPv4 address of the interface ``nic``; ConfigError naming the interfaces there
    are when it has none or does not exist (Linux only)."""
    names = [name for _, name in socket.if_nameindex()]
    if nic not in names:
        raise ConfigError(
            f"--network-interface {nic}: no such interface here (there are: {', '.join(names)})"
        )
    if not sys.platform.startswith("linux"):
        raise ConfigError(
            "--network-interface works on Linux only; give --coordinator-bind ADDR:PORT"
        )
    request = struct.pack("256s", nic.encode()[:15])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            answer = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)
        except OSError:
            raise ConfigError(
                f"--network-interface {nic}: the interface has no IPv4 address"
            ) from None
    return socket.inet_ntoa(answer[20:24])
