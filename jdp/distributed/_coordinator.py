"""Private: reaching process 0's coordinator, with a clear error where JAX aborts."""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
import threading
import time

from jdp.distributed._config import _split_address
from jdp.distributed._exit import exit_timer, print_and_exit

_log = logging.getLogger("jdp.distributed")

#: JAX's own setting of the coordinator's listening address (it wins over jdp's).
ENV_JAX_BIND_ADDRESS = "JAX_COORDINATOR_BIND_ADDRESS"

_CONNECT_TIMEOUT_MSG = (
    "jdp.distributed.initialize: process {pid} of {num} gave up after {timeout} s "
    "waiting for all {num} processes to connect to the coordinator at {addr}. Check "
    "that exactly num_processes={num} processes were started, each with its own "
    "process_id in [0, {num}) and the same coordinator address, and that process 0 "
    "(which hosts the coordinator) is running. Raise `timeout_s` if processes start "
    "slowly."
)

_UNREACHABLE_MSG = (
    "`jdp.distributed.initialize`: the coordinator at {addr} did not accept a "
    "connection within {timeout} s (this is process {pid} of {num}). Process 0 "
    "hosts the coordinator: start it, check that the address (from {where}) "
    "names its host and a port it can bind, and that no firewall blocks the "
    "port. Raise `timeout_s` if process 0 starts slowly."
)

_WAITING_MSG = (
    "jdp.distributed: process {pid} of {num} is waiting for the coordinator at "
    "{addr} (address from {where}) to accept a connection: {waited:.1f} s so far, "
    "giving up after {timeout} s. Process 0 hosts it: is it running?"
)

#: How often (at most) a process waiting for the coordinator says so.
_WAITING_EVERY_S = 5.0

_CANNOT_LISTEN_MSG = (
    "`jdp.distributed.initialize`: process 0 hosts the job's coordinator, but "
    "{reason}. Pick a free port in the address (now {addr!r}, from {where}), "
    "or start the job with `python -m jdp.launch` without `--port`, which picks "
    "a free one."
)


def _is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address: 127.x.y.z, ::1 or "localhost"."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name may point elsewhere on another machine
        return False


def bind_address(coordinator_address: str) -> str | None:
    """Where process 0's coordinator listens: the env's, a loopback one, or None."""
    if explicit := os.environ.get(ENV_JAX_BIND_ADDRESS):
        return explicit
    host, port = _split_address(coordinator_address)
    if not _is_loopback(host):
        return None
    if host.lower().rstrip(".") == "localhost":
        host = "127.0.0.1"  # what JAX's gRPC server binds for "localhost" too
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _split_bind(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _bind_candidates(host: str, port: int) -> list[tuple[int, tuple]]:
    """(family, socket address) to try binding, as JAX's gRPC server would."""
    if host in ("", "::", "0.0.0.0", "*"):
        # Every address: an IPv6 socket that also takes IPv4, else IPv4 alone.
        return [(socket.AF_INET6, ("::", port)), (socket.AF_INET, ("0.0.0.0", port))]
    try:
        infos = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror:
        return []  # JAX reports an unknown host itself
    return [(family, address) for family, _, _, _, address in infos[:1]]


def listen_error(address: str) -> OSError | None:
    """The error that listening on `address` gives now, as JAX's gRPC server."""
    try:
        host, port = _split_bind(address)
    except ValueError:
        return None  # malformed: JAX reports it
    candidates = _bind_candidates(host, port)
    for i, (family, sockaddr) in enumerate(candidates):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6 and sockaddr[0] == "::":
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                sock.bind(sockaddr)
            return None
        except OSError as e:
            no_ipv6 = e.errno in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL)
            if not (no_ipv6 and family == socket.AF_INET6 and i + 1 < len(candidates)):
                return e
    return None


def listen_reason(error: OSError, address: str) -> str:
    """Why listening on `address` failed, for an error message."""
    host, port = _split_bind(address)
    where = f"port {port} on {host if host not in ('', '::') else 'every address'}"
    if error.errno == errno.EADDRINUSE:
        return (
            f"{where} is already in use (another program, or the coordinator of "
            "another job, listens on it)"
        )
    return f"it cannot listen on {where} ({error.strerror or error})"


def _check_coordinator_port(requested: dict, where: str) -> str | None:
    """The coordinator's bind address; on process 0, raises if it cannot listen."""
    address = requested["coordinator_address"]
    if address is None:
        return None
    bind = bind_address(address)
    if requested["process_id"] == 0:
        target = bind or f"[::]:{_split_address(address)[1]}"  # JAX's default
        error = listen_error(target)
        if error is not None:
            reason = listen_reason(error, target)
            msg = _CANNOT_LISTEN_MSG.format(reason=reason, addr=address, where=where)
            raise OSError(error.errno, msg)
    return bind


def _wait_for_coordinator(address: str, deadline: float, names: dict) -> bool:
    """Tries TCP connections to `address` until `deadline`, warning as it waits."""
    host, port = _split_address(address)
    start = time.monotonic()
    every_s = min(_WAITING_EVERY_S, names["timeout"] / 4)
    next_say = start + every_s
    while (left := deadline - time.monotonic()) > 0:
        now = time.monotonic()
        if now >= next_say:
            _log.warning(_WAITING_MSG.format(waited=now - start, **names))
            next_say += every_s
        try:
            with socket.create_connection((host, port), timeout=min(left, 2.0)):
                return True
        except OSError:
            time.sleep(min(0.2, max(deadline - time.monotonic(), 0)))
    return False


def _start_watchdog(
    requested: dict, *, timeout_s: int, where: str
) -> threading.Timer | None:
    """Waits for the coordinator, then starts the timer that ends this process."""
    if None in requested.values():
        return None
    deadline = time.monotonic() + timeout_s
    address, pid = requested["coordinator_address"], requested["process_id"]
    num = requested["num_processes"]
    names = dict(pid=pid, num=num, addr=address, timeout=timeout_s, where=where)
    if pid != 0 and not _wait_for_coordinator(address, deadline, names):
        raise TimeoutError(_UNREACHABLE_MSG.format(**names))
    message = _CONNECT_TIMEOUT_MSG.format(**names)
    return exit_timer(max(deadline - time.monotonic(), 0.0), print_and_exit, message)
