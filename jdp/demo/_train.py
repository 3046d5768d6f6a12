"""Private: the demo's training run (imports JAX; `_cli` sets the devices first)."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
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
LOG_EVERY = 10  # steps between reads of the loss (each read waits for the device)
METRICS_FILE = "metrics.json"
PLOT_FILE = "loss_accuracy.png"
HISTORY_FILE = "history.json"  # in --checkpoint-dir, next to the checkpoints
STATE_SUBDIR = "state"


@dataclasses.dataclass
class Algo:
    """What `--algo` selects: optimizer, per-replica step, what to evaluate."""

    name: str
    tx: optax.GradientTransformation
    train_step: Callable
    sync_period: int = 1  # steps between the conditional collectives (BMUF)
    eval_params: Callable | None = None  # replicated state -> replicated params


def pick_devices(num: int | None) -> list:
    """The first `num` devices of the default backend (all of them if None)."""
    devices = jax.devices()
    if num is not None and num > len(devices):
        raise UsageError(
            f"--devices {num} asks for more devices than the {len(devices)} "
            f"{devices[0].platform} devices this machine has."
        )
    return devices[:num] if num else devices


def build_algo(args: argparse.Namespace, num_devices: int) -> Algo:
    """The optimizer and the per-replica step for `--algo`."""
    inner = optax.sgd(args.lr, momentum=MOMENTUM)
    if args.algo == "sync":
        return Algo("sync", inner, jdp.make_train_step(_model.loss_fn, inner))
    if args.algo == "zero":
        params = inspect.signature(jdp.make_train_step).parameters
        if "shard_optimizer_state" not in params:
            raise UsageError(
                "--algo zero needs `jdp.make_train_step(..., "
                "shard_optimizer_state=True)`, which this version of jdp lacks."
            )
        step = jdp.make_train_step(_model.loss_fn, inner, shard_optimizer_state=True)
        return Algo("zero", inner, step)
    if not hasattr(jdp, "bmuf"):
        raise UsageError(
            "--algo bmuf needs `jdp.bmuf`, which this version of jdp lacks."
        )
    # The block momentum (1 - 1/devices by default) plays the part of momentum:
    # inner momentum on top of it overshoots, so the local optimizer is plain SGD.
    tx = jdp.bmuf(
        optax.sgd(args.lr),
        sync_period=args.sync_period,
        block_momentum=args.block_momentum,
    )
    step = jdp.make_train_step(_model.loss_fn, tx, all_reduce=False)
    return Algo(
        "bmuf", tx, step, sync_period=args.sync_period, eval_params=_bmuf_global_params
    )


def _bmuf_global_params(state):
    return jdp.bmuf_global_params(state)


def communication(step: jdp.Parallel, state, batch, *, sync_period: int) -> dict:
    """Bytes one step communicates on average, read from the compiled step's HLO.

    Collectives inside a conditional branch run once every `sync_period` steps
    (BMUF's block sync), so they count `1 / sync_period` of their bytes.
    """
    ops = step.collectives(state, batch)
    every = sum(c.bytes for c in ops if not c.in_conditional)
    cond = sum(c.bytes for c in ops if c.in_conditional)
    return {
        "bytes_per_step": every + cond / sync_period,
        "bytes_every_step": every,
        "bytes_at_sync": cond,
        "collectives": [
            {
                "kind": c.kind,
                "dtype": c.dtype,
                "bytes": c.bytes,
                "in_conditional": c.in_conditional,
            }
            for c in ops
        ],
    }


def sync_reference_bytes(devices, backend, variables, batch_host) -> float:
    """Bytes per step of synchronous SGD for the same model, to compare against."""
    tx = optax.sgd(0.1)
    step = jdp.parallelize(
        jdp.make_train_step(_model.loss_fn, tx), devices=devices, backend=backend
    )
    state = step.replicate(
        jdp.TrainState.create(
            params=variables["params"], tx=tx, batch_stats=variables["batch_stats"]
        )
    )
    return communication(step, state, step.shard(batch_host), sync_period=1)[
        "bytes_per_step"
    ]


class _Checkpoints:
    """`--checkpoint-dir`: orbax checkpoints in DIR/state, the loss history beside."""

    def __init__(self, directory: str):
        try:
            from jdp.checkpoint import CheckpointManager
        except ImportError as e:
            raise UsageError(
                "--checkpoint-dir needs `jdp.checkpoint.CheckpointManager`, which "
                f"this version of jdp lacks ({e})."
            ) from None
        self.directory = os.path.abspath(directory)
        self.manager = CheckpointManager(
            os.path.join(self.directory, STATE_SUBDIR), max_to_keep=2
        )

    def save(self, step: int, state, record: dict) -> None:
        self.manager.save(step, state)
        _report.write_json(os.path.join(self.directory, HISTORY_FILE), record)

    def restore(self, like, config: dict):
        latest = self.manager.latest_step()
        if latest is None:
            raise UsageError(
                f"--resume: no checkpoint in {self.directory!r}; run once with "
                "--checkpoint-dir to create one."
            )
        record = {}
        path = os.path.join(self.directory, HISTORY_FILE)
        if os.path.exists(path):
            with open(path) as f:
                record = json.load(f)
        saved = record.get("config", {})
        for key in ("algo", "batch_size", "seed"):
            if key in saved and saved[key] != config[key]:
                raise UsageError(
                    f"--resume: the checkpoint in {self.directory!r} was made with "
                    f"--{key.replace('_', '-')} {saved[key]}, not {config[key]}."
                )
        state = self.manager.restore(like, step=latest)
        return latest, state, record

    def close(self) -> None:
        close = getattr(self.manager, "close", None)
        if close is not None:
            close()


def _trim(record: dict, key: str, upto: int) -> dict[str, list]:
    part = record.get(key) or {}
    steps = part.get("step", [])
    keep = [i for i, s in enumerate(steps) if s <= upto]
    return {k: [v[i] for i in keep] for k, v in part.items()}


def run(args: argparse.Namespace, *, stop_requested: Callable[[], bool]) -> bool:
    """Trains, evaluates and reports; returns False if stopped by Ctrl-C."""
    from tqdm.auto import tqdm

    t_begin = time.perf_counter()
    devices = pick_devices(args.devices)
    num = len(devices)
    if args.batch_size % num:
        raise UsageError(
            f"--batch-size {args.batch_size} is not divisible by the {num} devices; "
            f"use a multiple of {num} or pick the device count with --devices."
        )
    config = {k: v for k, v in vars(args).items() if k != "no_progress"}
    data = _data.load_digits()
    variables = _model.init_variables(args.seed, data.x_train)
    algo = build_algo(args, num)

    step = jdp.parallelize(algo.train_step, devices=devices, backend=args.backend)
    evaluator = jdp.parallelize(
        _model.eval_step, devices=devices, backend=args.backend, donate_state=False
    )
    state = step.replicate(
        jdp.TrainState.create(
            params=variables["params"], tx=algo.tx, batch_stats=variables["batch_stats"]
        )
    )
    test_batch, mask = evaluator.shard({"x": data.x_test, "y": data.y_test}, pad=True)
    test_batch["mask"] = mask

    def evaluate(state) -> float:
        params = state.params if algo.eval_params is None else algo.eval_params(state)
        m = evaluator({"params": params, "batch_stats": state.batch_stats}, test_batch)
        return float(m["correct"]) / float(m["count"])

    ckpt = _Checkpoints(args.checkpoint_dir) if args.checkpoint_dir else None
    start = 0
    history: dict[str, list] = {"step": [], "loss": []}
    evals: dict[str, list] = {"step": [], "test_accuracy": []}
    if args.resume:
        start, state, record = ckpt.restore(state, config)
        history = _trim(record, "history", start) or history
        evals = _trim(record, "eval", start) or evals

    def batch_at(i: int):
        return _data.train_batch(
            data, step=i, batch_size=args.batch_size, seed=args.seed
        )

    platform = devices[0].platform
    print(
        f"jdp demo: {algo.name} on {num} {platform} device(s) "
        f"({devices[0].device_kind}), backend {args.backend}, global batch "
        f"{args.batch_size}, steps {start} -> {args.steps}"
        + (f", checkpoints in {ckpt.directory} (Ctrl-C saves one)" if ckpt else ""),
        flush=True,
    )
    comm = None
    pending: list[tuple[int, Any]] = []
    postfix: dict[str, str] = {}
    train_seconds, timed_steps = 0.0, 0
    last_eval_step = evals["step"][-1] if evals["step"] else None
    i = start
    bar = tqdm(
        total=args.steps,
        initial=start,
        desc=f"{algo.name} x{num}",
        unit="step",
        dynamic_ncols=True,
        disable=args.no_progress,
        file=sys.stderr,
    )

    def flush():
        nonlocal pending
        if not pending:
            return
        losses = jax.device_get([loss for _, loss in pending])
        history["step"].extend(s for s, _ in pending)
        history["loss"].extend(float(x) for x in losses)
        pending = []
        postfix["loss"] = f"{history['loss'][-1]:.4f}"
        if train_seconds:
            postfix["ex/s"] = f"{timed_steps * args.batch_size / train_seconds:,.0f}"
        bar.set_postfix(postfix)

    def record() -> dict:
        return {"config": config, "history": history, "eval": evals}

    with bar:
        t_mark = time.perf_counter()
        while i < args.steps and not stop_requested():
            batch = step.shard(batch_at(i))
            state, metrics = step(state, batch)
            i += 1
            pending.append((i, metrics["loss"]))
            if comm is None:  # first step: compiled now; read what it communicates
                jax.block_until_ready(metrics)
                comm = communication(
                    step,
                    state,
                    step.shard(batch_at(i - 1)),
                    sync_period=algo.sync_period,
                )
                t_mark = time.perf_counter()
            else:
                timed_steps += 1
            bar.update(1)
            if i % LOG_EVERY == 0 or i % args.eval_every == 0 or i == args.steps:
                jax.block_until_ready(metrics)
                train_seconds += time.perf_counter() - t_mark
                flush()
                if i % args.eval_every == 0 or i == args.steps:
                    evals["step"].append(i)
                    evals["test_accuracy"].append(evaluate(state))
                    last_eval_step = i
                    postfix["test acc"] = f"{100 * evals['test_accuracy'][-1]:.1f}%"
                    bar.set_postfix(postfix)
                if ckpt and i % args.checkpoint_every == 0:
                    ckpt.save(i, state, record())
                t_mark = time.perf_counter()
        if pending:
            jax.block_until_ready(state)
            train_seconds += time.perf_counter() - t_mark
            flush()
    interrupted = i < args.steps
    if last_eval_step != i:
        evals["step"].append(i)
        evals["test_accuracy"].append(evaluate(state))
    if ckpt:
        if ckpt.manager.latest_step() != i:
            ckpt.save(i, state, record())
        ckpt.close()
    if comm is None:  # nothing trained in this run (resumed at the end, or stopped)
        comm = communication(
            step, state, step.shard(batch_at(i)), sync_period=algo.sync_period
        )
    if algo.name == "sync":
        comm["sync_bytes_per_step"] = comm["bytes_per_step"]
    else:
        comm["sync_bytes_per_step"] = sync_reference_bytes(
            devices, args.backend, variables, batch_at(0)
        )
    comm["reduction_vs_sync"] = (
        comm["sync_bytes_per_step"] / comm["bytes_per_step"]
        if comm["bytes_per_step"]
        else None
    )
    tail = history["loss"][-LOG_EVERY:]
    metrics = {
        "config": config,
        "jax_version": jax.__version__,
        "jdp_version": jdp.__version__,
        "platform": platform,
        "device_kind": devices[0].device_kind,
        "num_devices": num,
        "start_step": start,
        "steps": i,
        "interrupted": interrupted,
        "final_train_loss": float(np.mean(tail)) if tail else None,
        "test_accuracy": evals["test_accuracy"][-1] if evals["test_accuracy"] else None,
        "examples_per_second": (
            timed_steps * args.batch_size / train_seconds if timed_steps else None
        ),
        "train_seconds": train_seconds,
        "wall_seconds": time.perf_counter() - t_begin,
        "communication": comm,
        "history": history,
        "eval": evals,
    }
    _report.write_json(os.path.join(args.out, METRICS_FILE), metrics)
    _report.plot(metrics, os.path.join(args.out, PLOT_FILE))
    print(_report.format_table([_report.table_row(metrics)]))
    print(_report.describe_communication(metrics))
    if interrupted:
        where = (
            f"checkpoint saved in {ckpt.directory}; continue with --resume"
            if (ckpt)
            else "no --checkpoint-dir, so no checkpoint was saved"
        )
        print(f"Stopped at step {i} of {args.steps} ({where}).")
    print(
        f"Wrote {os.path.join(args.out, METRICS_FILE)} and "
        f"{os.path.join(args.out, PLOT_FILE)} ({time.perf_counter() - t_begin:.1f} s)."
    )
    if not math.isfinite(metrics["final_train_loss"] or 0.0):
        print("warning: the training loss is not finite; try a smaller --lr.")
    return not interrupted
