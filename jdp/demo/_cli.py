"""Private: the command line of `python -m jdp.demo`.

Runs before JAX's backend starts: checks the arguments (a bad one is a one-line
error, exit code 2), sets the number of simulated CPU devices, and turns Ctrl-C
into a request to stop after the current step (and save a checkpoint).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile

from jdp import _allocator
from jdp.launch._setup import cpu_device_flags

#: Simulated CPU devices when there is no accelerator and no `--devices`.
DEFAULT_CPU_DEVICES = 8
ALGOS = ("sync", "bmuf", "zero")
BACKENDS = ("shard_map", "pmap")
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """A bad argument found after start-up: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage block
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The demo's options."""
    p = _Parser(
        prog="python -m jdp.demo",
        description="Data-parallel training of a small CNN (BatchNorm) on "
        "scikit-learn's 8x8 digits with jdp, on every local device (8 simulated CPU "
        "devices when there is no accelerator). Prints a summary table and writes "
        "metrics.json and loss_accuracy.png to --out.",
    )
    add, dflt = p.add_argument, " Default: %(default)s."
    add("--algo", choices=ALGOS, default="sync", help="sync: synchronous SGD "
        "(gradients all-reduced every step); bmuf: blockwise model-update filtering "
        "(replicas train alone, models merged every --sync-period steps); zero: "
        "synchronous SGD with the optimizer state sharded across devices."
        + dflt)  # fmt: skip
    add("--backend", choices=BACKENDS, default="shard_map",
        help="How jdp maps the step over devices." + dflt)  # fmt: skip
    add("--devices", type=int, metavar="N", help="Use N devices: the first N "
        "accelerators, or N simulated CPU devices on a CPU-only machine. Default: all "
        f"accelerators, or {DEFAULT_CPU_DEVICES} simulated CPU devices.")  # fmt: skip
    add("--steps", type=int, default=300, help="Total training steps." + dflt)
    add("--batch-size", type=int, default=128,
        help="Global batch size, split across devices." + dflt)  # fmt: skip
    add("--lr", type=float, default=0.05, help="Learning rate of SGD (momentum "
        "0.9 for sync and zero; for bmuf the block momentum replaces it)."
        + dflt)  # fmt: skip
    add("--sync-period", type=int, default=8, metavar="K",
        help="BMUF: steps per block (models merged every K)." + dflt)  # fmt: skip
    add("--block-momentum", type=float,
        help="BMUF: block momentum in [0, 1). Default: 1 - 1/devices.")  # fmt: skip
    add("--eval-every", type=int, default=25, metavar="STEPS",
        help="Test accuracy is measured every STEPS steps." + dflt)  # fmt: skip
    add("--checkpoint-dir", metavar="DIR", help="Save checkpoints to DIR (every "
        "--checkpoint-every steps, at the end, and on Ctrl-C).")  # fmt: skip
    add("--checkpoint-every", type=int, default=100, metavar="STEPS",
        help="Steps between checkpoints (BMUF saves at the end of a block, when the "
        "replicas agree)." + dflt)  # fmt: skip
    add("--resume", action="store_true",
        help="Continue from the latest checkpoint in --checkpoint-dir.")  # fmt: skip
    add("--out", default="demo_out", metavar="DIR",
        help="Where metrics.json and the plot go." + dflt)  # fmt: skip
    add("--seed", type=int, default=0,
        help="Seed of the initial model and of the batch order." + dflt)  # fmt: skip
    add("--no-progress", action="store_true", help="Do not show the progress bar.")
    return p


def _check_writable_dir(option: str, path: str) -> str | None:
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        return f"{option} {path!r} is not a writable directory ({e.strerror or e})."
    return None


def check_args(args: argparse.Namespace) -> str | None:
    """Returns a one-line complaint about the arguments, or None if they are fine."""
    positive = ["steps", "batch_size", "sync_period", "eval_every", "checkpoint_every"]
    if args.devices is not None:
        positive.append("devices")
    for name in positive:
        if (value := getattr(args, name)) < 1:
            option = "--" + name.replace("_", "-")
            return f"{option} must be a positive integer, got {value}."
    if not args.lr > 0:
        return f"--lr must be positive, got {args.lr}."
    if args.block_momentum is not None and not 0 <= args.block_momentum < 1:
        return f"--block-momentum must be in [0, 1), got {args.block_momentum}."
    if args.devices is not None and args.batch_size % args.devices:
        return (
            f"--batch-size {args.batch_size} is not divisible by --devices "
            f"{args.devices}; use a batch size that is a multiple of {args.devices}."
        )
    if args.resume and not args.checkpoint_dir:
        return "--resume needs --checkpoint-dir DIR (where to resume from)."
    if args.resume and not os.path.isdir(args.checkpoint_dir):
        return (
            f"--resume: --checkpoint-dir {args.checkpoint_dir!r} does not exist; "
            "nothing to resume from."
        )
    problem = _check_writable_dir("--out", args.out)
    if problem is None and args.checkpoint_dir:
        problem = _check_writable_dir("--checkpoint-dir", args.checkpoint_dir)
    return problem


def simulate_cpu_devices(num: int) -> None:
    """Asks XLA for `num` CPU devices (replacing any count in `XLA_FLAGS`).

    Must run before JAX's backend starts; accelerators are unaffected.
    """
    os.environ["XLA_FLAGS"] = cpu_device_flags(os.environ.get("XLA_FLAGS", ""), num)
    if "JAX_NUM_CPU_DEVICES" in os.environ:  # read by jax at import: overrides it
        import jax

        jax.config.update("jax_num_cpu_devices", num)


class _StopRequest:
    """SIGINT handler: the first Ctrl-C asks to stop cleanly, a second one aborts."""

    def __init__(self):
        self.requested = False

    def __call__(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\nCtrl-C: stopping after this step (press Ctrl-C again to abort now).",
              file=sys.stderr, flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Runs the demo on `argv` (default: `sys.argv[1:]`); returns the exit code.

    0 when training finished, 130 when stopped by Ctrl-C (after saving a
    checkpoint if `--checkpoint-dir` is set), 2 for bad arguments.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if problem := check_args(args):
        parser.error(problem)
    stop = _StopRequest()
    previous = signal.signal(signal.SIGINT, stop)
    simulate_cpu_devices(args.devices or DEFAULT_CPU_DEVICES)
    _allocator.tune()  # before the model exists (see `jdp._allocator`)

    from jdp.demo import _train  # imports JAX: after the device count is set

    try:
        finished = _train.run(args, stop_requested=lambda: stop.requested)
    except UsageError as e:
        parser.error(str(e))
    except KeyboardInterrupt:  # the second Ctrl-C
        print("Aborted: nothing saved since the last checkpoint.", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGINT, previous)
    return 0 if finished else EXIT_INTERRUPTED
