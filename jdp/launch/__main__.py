"""`python -m jdp.launch --num-processes N [options] script.py [args...]`."""

from __future__ import annotations

import argparse
import sys

from jdp.launch._command import launch_command
from jdp.launch._stall import DEFAULT_STALL_TIMEOUT_S

_DESCRIPTION = """\
Run a training script as N processes of one job on this machine (127.0.0.1).
`jdp.distributed.initialize()` in the script reads the job from the JDP_*
variables set here. Output lines are prefixed with "[process_id]". If one
process fails, the others are stopped and the launcher exits non-zero; a job
that stalls is stopped with exit status 124. --max-restarts starts it again.
See docs/guides/multihost.md and docs/guides/restarts.md.
"""


def _number(kind: type, minimum: int, *, strict: bool = False, maximum=None):
    """An argparse type: a number >= `minimum` (> with `strict`), <= `maximum`."""
    noun = "an integer" if kind is int else "a number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None
        if not (value > minimum if strict else value >= minimum):
            bound = f"{'>' if strict else '>='} {minimum}"
            raise argparse.ArgumentTypeError(f"expected {noun} {bound}, got {text}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(
                f"expected {noun} <= {maximum}, got {text}"
            )
        return value

    return parse


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
        type=_number(int, 1),
        required=True,
        help="number of processes (--nprocs is an alias)",
    )
    p.add_argument(
        "--devices-per-process",
        type=_number(int, 1),
        help="simulated CPU devices per process (default: the environment's)",
    )
    p.add_argument(
        "--timeout",
        dest="timeout_s",
        metavar="SECONDS",
        type=_number(float, 0, strict=True),
        help="stop the job after this many seconds, restarts included (exit "
        "status 124)",
    )
    p.add_argument(
        "--stall-timeout",
        dest="stall_timeout_s",
        type=_number(float, 0),
        default=DEFAULT_STALL_TIMEOUT_S,
        metavar="SECONDS",
        help="stop the job (exit status 124) when the processes furthest behind "
        "have reported no progress for this many seconds; a process reports "
        "progress as each jdp step starts (default: %(default)g; 0 turns it off)",
    )
    p.add_argument(
        "--port",
        type=_number(int, 1, maximum=65535),
        help="coordinator port on 127.0.0.1 (default: a free one); one in use "
        "is an error (exit status 2)",
    )
    p.add_argument(
        "--max-restarts",
        type=_number(int, 0),
        default=0,
        metavar="K",
        help="when a process fails (or the job stalls), stop the others and "
        "start the job again, up to K times (default: %(default)s), on a fresh "
        "port; JDP_RESTART_COUNT tells the script which attempt it is, and it "
        "resumes from its latest checkpoint",
    )
    p.add_argument(
        "--min-processes",
        type=_number(int, 1),
        metavar="M",
        help="with --max-restarts 2 or more: when the same process index fails "
        "first in two attempts in a row, restart with one process fewer, down to M "
        "(default: --num-processes, never fewer); JDP_NUM_PROCESSES says how "
        "many run",
    )
    p.add_argument(
        "--live",
        action="store_true",
        help="with --max-restarts K: start a failed process other than 0 again "
        "alone while the others train on, for a script that trains with "
        "`jdp.distributed.live` (each counts as a restart); a failed process 0 "
        "restarts the whole job",
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
    if ns.live and ns.max_restarts < 1:
        parser.error(
            "argument --live: it starts failed processes again, which needs "
            "--max-restarts 1 or more (now 0); add `--max-restarts K`"
        )
    return launch_command(**vars(ns))  # the options' names are its arguments


if __name__ == "__main__":
    sys.exit(main())
