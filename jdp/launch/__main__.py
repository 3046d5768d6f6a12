"""`python -m jdp.launch --num-processes N [options] script.py [args...]`.

`--nprocs` is accepted as an alias of `--num-processes` (the flag's former name).
"""

from __future__ import annotations

import argparse
import sys

from jdp.launch._command import launch_command
from jdp.launch._stall import DEFAULT_STALL_TIMEOUT_S

_DESCRIPTION = """\
Run a training script as N processes of one job on this machine (127.0.0.1).
Every process runs the same script; `jdp.distributed.initialize()` in the script
reads the job from the JDP_COORDINATOR_ADDRESS, JDP_NUM_PROCESSES and
JDP_PROCESS_ID variables set here, and fails fast (JDP_FAIL_FAST=1: a process
with an uncaught exception exits at once). Output lines are prefixed with
"[process_id]".
If one process fails, the others are stopped and the launcher exits non-zero.
If the processes furthest behind report no progress (a jdp step) for
--stall-timeout seconds while the others wait for them, the job is stopped and
the stuck processes are named, with where they were last seen (exit status 124).
If a process has finished while the others wait in a step it never started (it
made fewer step calls, e.g. its data ran out first), the job is stopped after
15 s without progress (or --stall-timeout, if shorter), naming it (status 124).
With --max-restarts K, a failed or stalled job is started again, up to K times
(a line per restart names the process that failed and how); every process sees
JDP_RESTART_COUNT (0, 1, ...) and resumes from its latest checkpoint. With
--min-processes M (which needs --max-restarts 2 or more), a process index that
fails first in two attempts in a row makes the next attempt run one process
fewer, down to M.
"""


def _int_at_least(minimum: int):
    """An argparse type: an integer >= `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer, got {text!r}"
            ) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(
                f"expected an integer >= {minimum}, got {value}"
            )
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _float(text: str, *, zero_ok: bool) -> float:
    """A number > 0 (>= 0 with `zero_ok`), for argparse."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value >= 0 if zero_ok else value > 0):
        bound = ">= 0" if zero_ok else "> 0"
        raise argparse.ArgumentTypeError(f"expected a number {bound}, got {text}")
    return value


def _positive_float(text: str) -> float:
    return _float(text, zero_ok=False)


def _non_negative_float(text: str) -> float:
    return _float(text, zero_ok=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jdp.launch",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--num-processes",
        "--nprocs",  # the former name, kept so that existing command lines work
        dest="num_processes",
        metavar="N",
        type=_positive_int,
        required=True,
        help="number of processes (--nprocs is an alias)",
    )
    p.add_argument(
        "--devices-per-process",
        type=_positive_int,
        default=None,
        help="simulated CPU devices per process (default: the environment's)",
    )
    p.add_argument(
        "--timeout",
        type=_positive_float,
        default=None,
        help="stop the job after this many seconds, restarts included (exit "
        "status 124)",
    )
    p.add_argument(
        "--stall-timeout",
        type=_non_negative_float,
        default=DEFAULT_STALL_TIMEOUT_S,
        metavar="SECONDS",
        help="stop the job (exit status 124) when the processes furthest behind "
        "have reported no progress for this many seconds; a process reports "
        "progress as each jdp step starts (default: %(default)g; 0 turns it off)",
    )
    p.add_argument(
        "--port",
        type=_positive_int,
        default=None,
        help="coordinator port on 127.0.0.1 (default: a free one); one in use "
        "is an error (exit status 2)",
    )
    p.add_argument(
        "--max-restarts",
        type=_non_negative_int,
        default=0,
        metavar="K",
        help="when a process fails (or the job stalls), stop the others and "
        "start the job again, up to K times (default: %(default)s), on a fresh "
        "port; JDP_RESTART_COUNT tells the script which attempt it is, and it "
        "resumes from its latest checkpoint",
    )
    p.add_argument(
        "--min-processes",
        type=_positive_int,
        default=None,
        metavar="M",
        help="with --max-restarts 2 or more: when the same process index fails "
        "first in two attempts in a row, restart with one process fewer, down to M "
        "(default: --num-processes, never fewer); JDP_NUM_PROCESSES says how "
        "many run",
    )
    p.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="run the target as a module (`python -m target`)",
    )
    p.add_argument("target", help="the script (or, with -m, the module) to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the script")
    return p


def main(argv: list[str] | None = None) -> int:
    """Parses the command line, runs the job and returns its exit status."""
    parser = _parser()
    ns = parser.parse_args(argv)
    if ns.min_processes is not None and ns.min_processes > ns.num_processes:
        parser.error(
            f"argument --min-processes: {ns.min_processes} is more than "
            f"--num-processes ({ns.num_processes}); it is the fewest processes "
            "a restarted job may shrink to"
        )
    if ns.min_processes is not None and ns.max_restarts < 2:
        parser.error(
            f"argument --min-processes: {ns.min_processes} needs --max-restarts "
            f"2 or more (now {ns.max_restarts}): a job shrinks only when the "
            "same process fails first in two attempts in a row, which takes two "
            "restarts; add `--max-restarts K`, or drop --min-processes"
        )
    return launch_command(
        ns.target,
        ns.args,
        num_processes=ns.num_processes,
        module=ns.module,
        devices_per_process=ns.devices_per_process,
        timeout_s=ns.timeout,
        port=ns.port,
        stall_timeout_s=ns.stall_timeout,
        max_restarts=ns.max_restarts,
        min_processes=ns.min_processes,
    )


if __name__ == "__main__":
    sys.exit(main())
