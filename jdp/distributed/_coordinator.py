"""Private: reaching process 0's coordinator (JAX's coordination service).

Where the coordinator listens (`bind_address`: loopback only for a job on one
machine), whether process 0 can listen on its port (`listen_error`; JAX's
process crashes instead), and the wait of the other processes for it to accept
a connection, with warnings while they wait and a clear error, or a clear exit
(`_give_up`), where JAX would abort.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
import sys
import threading
import time

from jdp.distributed._config import _GIVEN_ADDRESS, _split_address
from jdp.distributed._exit import flush_and_exit

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
    "jdp.distributed: process %d of %d is waiting for the coordinator at %s "
    "(address from %s) to accept a connection: %.1f s so far, giving up after "
    "%d s. Process 0 hosts it: is it running?"
)

#: How often a process waiting for the coordinator says so (at most; at least
#: 4 times within `timeout_s`).
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
    except ValueError:  # a host name: where it points may differ between machines
        return False


def bind_address(coordinator_address: str) -> str | None:
    """Where process 0's coordinator listens; None for JAX's default (every address).

    `$JAX_COORDINATOR_BIND_ADDRESS` if set; else, for a loopback coordinator
    address (a job on one machine), that loopback address, so that no other
    machine can reach the coordinator.
    """
    explicit = os.environ.get(ENV_JAX_BIND_ADDRESS)
    if explicit:
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
    """The error that listening on `address` ("host:port") gives now, or None.

    Tried with a socket bound and closed at once, with the options JAX's gRPC
    server uses (`SO_REUSEADDR`: a port in TIME_WAIT is free). JAX itself does not
    report such an error: its process crashes (SIGSEGV).
    """
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
            raise OSError(
                error.errno,
                _CANNOT_LISTEN_MSG.format(
                    reason=listen_reason(error, target), addr=address, where=where
                ),
            )
    return bind


def _wait_for_coordinator(
    address: str, deadline: float, say_waiting=None, every_s: float = 5.0
) -> bool:
    """Tries TCP connections to `address` until one succeeds or `deadline` passes.

    Calls `say_waiting(seconds waited)` every `every_s` seconds while it waits.
    """
    host, port = _split_address(address)
    start = next_say = time.monotonic()
    next_say += every_s
    while True:
        now = time.monotonic()
        left = deadline - now
        if left <= 0:
            return False
        if say_waiting is not None and now >= next_say:
            say_waiting(now - start)
            next_say += every_s
        try:
            with socket.create_connection((host, port), timeout=min(left, 2.0)):
                return True
        except OSError:
            time.sleep(min(0.2, max(deadline - time.monotonic(), 0)))


def _start_watchdog(
    coordinator_address: str | None,
    num_processes: int | None,
    process_id: int | None,
    *,
    timeout_s: int,
    where: str = _GIVEN_ADDRESS,
) -> threading.Timer | None:
    """Waits for the coordinator, then starts the timer that calls `_give_up`.

    Returns None (no watchdog) unless the whole configuration is given. A
    process other than 0 logs a warning every few seconds while the
    coordinator does not accept its connection, and raises `TimeoutError` if
    it never does.
    """
    if coordinator_address is None or num_processes is None or process_id is None:
        return None
    deadline = time.monotonic() + timeout_s

    def say_waiting(waited: float) -> None:
        _log.warning(
            _WAITING_MSG,
            process_id,
            num_processes,
            coordinator_address,
            where,
            waited,
            timeout_s,
        )

    if process_id != 0 and not _wait_for_coordinator(
        coordinator_address,
        deadline,
        say_waiting,
        every_s=min(_WAITING_EVERY_S, timeout_s / 4),
    ):
        raise TimeoutError(
            _UNREACHABLE_MSG.format(
                addr=coordinator_address,
                timeout=timeout_s,
                pid=process_id,
                num=num_processes,
                where=where,
            )
        )
    watchdog = threading.Timer(
        max(deadline - time.monotonic(), 0.0),
        _give_up,
        args=(coordinator_address, num_processes, process_id, timeout_s),
    )
    watchdog.daemon = True
    watchdog.start()
    return watchdog


def _give_up(address: str, num: int, pid: int, timeout: int) -> None:
    print(
        _CONNECT_TIMEOUT_MSG.format(pid=pid, num=num, timeout=timeout, addr=address),
        file=sys.stderr,
        flush=True,
    )
    flush_and_exit(1)
