"""A stand-in for ``vllm_placement``'s socket module: UDP sockets that record the route they are
asked for, answer a fixed local address (10.1.2.3) and never send (shared by the placement and
full-push tests)."""

from __future__ import annotations

import socket
from types import SimpleNamespace
from typing import ClassVar

ROUTE_ADDRESS = "10.1.2.3"


class UDPSocket:
    """A UDP socket that records ``connect`` targets and sends nothing."""

    targets: ClassVar[list] = []

    def __init__(self, family, kind):
        assert kind == socket.SOCK_DGRAM

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def connect(self, target):
        self.targets.append(target)

    def getsockname(self):
        return (ROUTE_ADDRESS, 40000)

    def send(self, *args):  # pragma: no cover - would be a bug
        raise AssertionError("trainer_address must not send anything")


def route_only_socket() -> SimpleNamespace:
    """The module to put in place of ``vllm_placement.socket`` (its targets reset)."""
    UDPSocket.targets = []
    return SimpleNamespace(
        socket=UDPSocket, getaddrinfo=socket.getaddrinfo, SOCK_DGRAM=socket.SOCK_DGRAM
    )
