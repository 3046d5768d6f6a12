"""Private: the demo's training run (imports JAX; `_cli` sets the devices first)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

import jdp
from jdp.demo import _data, _model, _report
from jdp.demo._cli import UsageError

MOMENTUM = 0.9
LOG_EVERY = 10  # steps between reads of the loss (each waits for the device)
METRICS_FILE = "metrics.json"
PLOT_FILE = "loss_accuracy.png"
STATE_SUBDIR = "state"
#: Options a resumed run must share with the run that saved the checkpoint.
RESUME_KEYS = ("algo", "batch_size", "seed", "sync_period")


@dataclasses.dataclass
class Algo:
    """What `--algo` selects: optimizer, per-replica step, what to evaluate."""

    name: str
    tx: optax.GradientTransformation
    train_step: Callable
    #: Steps per BMUF block: replicas agree (a checkpoint is exact) at its end.
    sync_period: int = 1
    #: Replicated state -> replicated params to evaluate (None: `state.params`).
    eval_params: Callable | None = None


def pick_devices(num: int | None) -> list:
    """The first `num` devices of the default backend (all of them if None)."""
    devices = jax.devices()
    if num is not None and num > len(devices):
        raise UsageError(
            f"--devices {num} asks for more devices than the {len(devices)} "
            f"{devices[0].platform} devices this machine has."
        )
    return devices[:num] if num else devices


def build_algo(args: argparse.Namespace) -> Algo:
    """The optimizer and the per-replica step for `--algo`."""
    sgd = optax.sgd(args.lr, momentum=MOMENTUM)
    if args.algo == "sync":
        return Algo("sync", sgd, jdp.make_train_step(_model.loss_fn, sgd))
    if args.algo == "zero":
        zero = jdp.zero(sgd)
        step = jdp.make_train_step(_model.loss_fn, zero, sync=jdp.local())
        return Algo("zero", zero, step)
    # The block momentum (1 - 1/devices by default) plays the part of momentum:
    # inner momentum on top of it overshoots, so the local optimizer is plain SGD.
    outer = jdp.block_momentum(momentum=args.block_momentum)
    tx = jdp.bmuf(optax.sgd(args.lr), sync_period=args.sync_period, outer=outer)
    step = jdp.make_train_step(_model.loss_fn, tx, sync=jdp.local())
    return Algo("bmuf", tx, step, args.sync_period, jdp.bmuf_global_params)


def _sent_fraction(kind: str, num: int) -> float:
    """Bytes a device sends per buffer byte with ring algorithms (NCCL's busbw)."""
    if num <= 1:
        return 0.0
    if kind == "collective-permute":
        return 1.0
    return (2 if kind == "all-reduce" else 1) * (num - 1) / num


def communication(
    step: jdp.Parallel, state, batch, *, sync_period: int, stage: str = "compiled"
) -> dict:
    """What one step communicates on average, read from the compiled step's HLO.

    `bytes_per_step` is what each device sends per step with ring algorithms
    (`_sent_fraction`); collectives inside a conditional branch (BMUF's block
    sync) run once every `sync_period` steps.
    """
    collectives = [
        {"kind": c.kind, "dtype": c.dtype, "bytes": c.bytes,
         "in_conditional": c.in_conditional,
         "runs_every": sync_period if c.in_conditional else 1}
        for c in step.collectives(state, batch, stage=stage)
    ]  # fmt: skip
    sent = sum(
        _sent_fraction(c["kind"], step.num_replicas) * c["bytes"] / c["runs_every"]
        for c in collectives
    )
    return {"bytes_per_step": sent, "collectives": collectives}


def _train_state(step: jdp.Parallel, variables: dict, tx) -> jdp.TrainState:
    """The replicated initial state of the CNN."""
    return step.replicate(jdp.TrainState.create(
        params=variables["params"], tx=tx, batch_stats=variables["batch_stats"]
    ))  # fmt: skip


def sync_reference_bytes(devices, backend, variables, data, batch_size) -> float:
    """Bytes per step of synchronous SGD for the same model, to compare against."""
    tx = optax.sgd(0.1)
    step = jdp.parallelize(
        jdp.make_train_step(_model.loss_fn, tx), devices=devices, backend=backend
    )
    host = _data.train_batch(data, step=0, batch_size=batch_size, seed=0)
    # The lowered module lists the same bytes as the compiled one, uncompiled.
    state, batch = _train_state(step, variables, tx), step.shard(host)
    comm = communication(step, state, batch, sync_period=1, stage="lowered")
    return comm["bytes_per_step"]


class _Checkpoints:
    """`--checkpoint-dir`: orbax checkpoints in DIR/state, with config and history."""

    def __init__(self, directory: str):
        from jdp.checkpoint import CheckpointManager

        self.directory = os.path.abspath(directory)
        self.manager = CheckpointManager(
            os.path.join(self.directory, STATE_SUBDIR), max_to_keep=2
        )
        self.last_saved = self.manager.latest_step()

    def save(self, step: int, state, parallel: jdp.Parallel, record: dict) -> None:
        self.manager.save(step, state, parallel=parallel, extra=record)
        self.last_saved = step

    def restore(self, like, config: dict) -> tuple[int, Any, dict]:
        if self.last_saved is None:
            raise UsageError(
                f"--resume: no checkpoint in {self.directory!r}; run once with "
                "--checkpoint-dir to create one."
            )
        record = self.manager.metadata(self.last_saved).get("extra", {})
        saved = record.get("config", {})
        for key in RESUME_KEYS:
            if key in saved and saved[key] != config[key]:
                raise UsageError(
                    f"--resume: the checkpoint in {self.directory!r} was made with "
                    f"--{key.replace('_', '-')} {saved[key]}, not {config[key]}; "
                    "use the same value or another --checkpoint-dir."
                )
        return self.last_saved, self.manager.restore(like, step=self.last_saved), record


class _Run:
    """One training run: set-up, the loop, and the final report."""

    def __init__(self, args: argparse.Namespace, stop_requested: Callable[[], bool]):
        self.t_begin = time.perf_counter()
        self.args, self.stop_requested = args, stop_requested
        self.devices = pick_devices(args.devices)
        num = self.num = len(self.devices)
        if args.batch_size % num:
            raise UsageError(
                f"--batch-size {args.batch_size} is not divisible by the {num} "
                f"devices; use a multiple of {num} or set the count with --devices."
            )
        self.config = {k: v for k, v in vars(args).items() if k != "no_progress"}
        self.data = _data.load_digits()
        self.variables = _model.init_variables(args.seed, self.data.x_train)
        self.algo = build_algo(args)
        parallel = functools.partial(
            jdp.parallelize, devices=self.devices, backend=args.backend
        )
        self.step = parallel(self.algo.train_step)
        self.evaluator = parallel(_model.eval_step, donate_state=False)
        test = {"x": self.data.x_test, "y": self.data.y_test}
        self.test_batch, mask = self.evaluator.shard(test, pad=True)
        self.test_batch["mask"] = mask  # padding does not count (see eval_step)
        self.state = _train_state(self.step, self.variables, self.algo.tx)
        self.ckpt = _Checkpoints(args.checkpoint_dir) if args.checkpoint_dir else None
        self.start = 0
        self.history: dict[str, list] = {"step": [], "loss": []}
        self.evals: dict[str, list] = {"step": [], "test_accuracy": []}
        if self.ckpt and not args.resume and self.ckpt.last_saved is not None:
            raise UsageError(
                f"--checkpoint-dir {self.ckpt.directory!r} already holds checkpoints "
                f"(latest: step {self.ckpt.last_saved}); add --resume to continue "
                "from it, or use an empty directory."
            )
        if args.resume:
            self.start, self.state, record = self.ckpt.restore(self.state, self.config)
            self.history = record.get("history") or self.history
            self.evals = record.get("eval") or self.evals
        self.i = self.start
        self.comm: dict | None = None
        self.train_seconds, self.timed_steps = 0.0, 0
        self._pending: list[tuple[int, Any]] = []

    def batch(self, i: int):
        """Training batch of step `i`, placed on the devices."""
        host = _data.train_batch(
            self.data, step=i, batch_size=self.args.batch_size, seed=self.args.seed
        )
        return self.step.shard(host)

    def evaluate(self) -> None:
        """Records the test accuracy of the model now (BMUF: the global model `g`)."""
        state, algo = self.state, self.algo
        params = state.params if algo.eval_params is None else algo.eval_params(state)
        variables = {"params": params, "batch_stats": state.batch_stats}
        m = self.evaluator(variables, self.test_batch)
        self.evals["step"].append(self.i)
        self.evals["test_accuracy"].append(float(m["correct"]) / float(m["count"]))

    def step_communication(self) -> dict:
        """What a step communicates (`communication`)."""
        batch, period = self.batch(self.i), self.algo.sync_period
        return communication(self.step, self.state, batch, sync_period=period)

    def record(self) -> dict:
        """What `--resume` needs besides the state: config and history."""
        return {"config": self.config, "history": self.history, "eval": self.evals}

    def read_losses(self) -> None:
        """Moves the losses of the steps run since the last read to the history."""
        if self._pending:
            losses = jax.device_get([loss for _, loss in self._pending])
            self.history["step"].extend(s for s, _ in self._pending)
            self.history["loss"].extend(float(x) for x in losses)
            self._pending = []

    def at_block_end(self) -> bool:
        """Whether replicas agree now (always, except inside a BMUF block)."""
        return self.i % self.algo.sync_period == 0

    def train(self) -> None:
        """Runs steps until `--steps`, or until Ctrl-C at a block end."""
        from tqdm import tqdm

        args = self.args
        bar = tqdm(
            total=args.steps, initial=self.start, desc=f"{self.algo.name} x{self.num}",
            unit="step", dynamic_ncols=True, disable=args.no_progress, file=sys.stderr,
        )  # fmt: skip
        postfix: dict[str, str] = {}
        told = False
        with bar:
            t_mark = time.perf_counter()
            while self.i < args.steps:
                if self.stop_requested():
                    if self.at_block_end():
                        break
                    if not told:
                        period = self.algo.sync_period
                        end = min(args.steps, -(-self.i // period) * period)
                        bar.write(f"Finishing the BMUF block first (replicas agree "
                                  f"at its end), at step {end}.")  # fmt: skip
                        told = True
                self.state, metrics = self.step(self.state, self.batch(self.i))
                self.i += 1
                self._pending.append((self.i, metrics["loss"]))
                bar.update(1)
                if self.comm is None:  # compiled by now: read what it communicates
                    jax.block_until_ready(metrics)
                    self.comm = self.step_communication()
                    t_mark = time.perf_counter()  # the first step (compile) is untimed
                else:
                    self.timed_steps += 1
                eval_now = self.i % args.eval_every == 0 or self.i == args.steps
                save_now = (
                    self.ckpt is not None
                    and self.i - (self.ckpt.last_saved or 0) >= args.checkpoint_every
                    and self.at_block_end()
                )
                if self.i % LOG_EVERY and not (eval_now or save_now):
                    continue
                jax.block_until_ready(metrics)
                self.train_seconds += time.perf_counter() - t_mark
                self.read_losses()
                postfix["loss"] = f"{self.history['loss'][-1]:.4f}"
                if self.examples_per_second():
                    postfix["ex/s"] = f"{self.examples_per_second():,.0f}"
                if eval_now:
                    self.evaluate()
                    acc = self.evals["test_accuracy"][-1]
                    postfix["test acc"] = f"{100 * acc:.1f}%"
                if save_now:
                    self.ckpt.save(self.i, self.state, self.step, self.record())
                bar.set_postfix(postfix)
                t_mark = time.perf_counter()
            if self._pending:
                jax.block_until_ready(self.state)
                if self.comm is not None and self.timed_steps:
                    self.train_seconds += time.perf_counter() - t_mark
                self.read_losses()

    def examples_per_second(self) -> float | None:
        """Training throughput, without the first (compiling) step and evaluations."""
        if not (self.timed_steps and self.train_seconds):
            return None
        return self.timed_steps * self.args.batch_size / self.train_seconds

    def finish(self) -> dict:
        """Final evaluation and checkpoint; returns the metrics written to --out."""
        args = self.args
        if not self.evals["step"] or self.evals["step"][-1] != self.i:
            self.evaluate()
        if self.ckpt:
            if self.ckpt.last_saved != self.i:
                self.ckpt.save(self.i, self.state, self.step, self.record())
            self.ckpt.manager.close()
        comm = self.comm or self.step_communication()  # None if no step ran here
        if self.algo.name == "sync":
            comm["sync_bytes_per_step"] = comm["bytes_per_step"]
        else:
            comm["sync_bytes_per_step"] = sync_reference_bytes(
                self.devices, args.backend, self.variables, self.data, args.batch_size
            )
        sent = comm["bytes_per_step"]
        comm["reduction_vs_sync"] = comm["sync_bytes_per_step"] / sent if sent else None
        tail = self.history["loss"][-LOG_EVERY:]
        return {
            "config": self.config, "jax_version": jax.__version__,
            "jdp_version": jdp.__version__, "platform": self.devices[0].platform,
            "device_kind": self.devices[0].device_kind, "num_devices": self.num,
            "start_step": self.start, "steps": self.i,
            "interrupted": self.i < args.steps,
            "final_train_loss": float(np.mean(tail)) if tail else None,
            "test_accuracy": self.evals["test_accuracy"][-1],
            "examples_per_second": self.examples_per_second(),
            "train_seconds": self.train_seconds,
            "wall_seconds": time.perf_counter() - self.t_begin,
            "communication": comm, "history": self.history, "eval": self.evals,
        }  # fmt: skip


def run(args: argparse.Namespace, *, stop_requested: Callable[[], bool]) -> bool:
    """Trains, evaluates and reports; returns False if stopped by Ctrl-C."""
    r = _Run(args, stop_requested)
    print(
        f"jdp demo: {r.algo.name} on {r.num} {r.devices[0].platform} device(s) "
        f"({r.devices[0].device_kind}), backend {args.backend}, global batch "
        f"{args.batch_size}, steps {r.start} -> {args.steps}"
        + (f"; checkpoints in {r.ckpt.directory} (Ctrl-C saves one)" if r.ckpt else ""),
        flush=True,
    )
    r.train()
    metrics = r.finish()
    metrics_path = os.path.join(args.out, METRICS_FILE)
    plot_path = os.path.join(args.out, PLOT_FILE)
    _report.write_json(metrics_path, metrics)
    _report.plot(metrics, plot_path)
    print(_report.format_table([_report.table_row(metrics)]))
    print(_report.describe_communication(metrics))
    if metrics["interrupted"]:
        where = "no --checkpoint-dir, so no checkpoint was saved"
        if r.ckpt:
            where = f"checkpoint saved in {r.ckpt.directory}; continue with --resume"
        print(f"Stopped at step {r.i} of {args.steps} ({where}).")
    elif r.ckpt and not r.at_block_end():
        print(
            f"Note: step {r.i} is inside a BMUF block; the checkpoint holds replica "
            "0's params, so resuming from it is not exact (use a multiple of "
            "--sync-period for --steps)."
        )
    seconds = time.perf_counter() - r.t_begin
    print(f"Wrote {metrics_path} and {plot_path} ({seconds:.1f} s).")
    if not np.isfinite(metrics["final_train_loss"] or 0.0):
        print("warning: the training loss is not finite; try a smaller --lr.")
    return not metrics["interrupted"]
