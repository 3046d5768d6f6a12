"""Many hosts on paper: an alpha-beta model of synchronous SGD and BMUF step times.

A ring all-reduce of B bytes over n hosts takes

    T_ar(n, B) = 2 (n - 1) alpha + 2 (n - 1) / n * B / beta

(alpha: the latency of one message, beta: a host's bandwidth). A synchronous step
costs `T_compute + T_ar` (no overlap of communication with the backward pass: the
pessimistic end; PyTorch DDP and XLA's async collectives overlap part of it), and a
BMUF step with sync period k costs `T_compute + T_ar / k` on average. The model
predicts both for a 100M and a 1B parameter model (f32 gradients) on 1-1024 hosts and
three kinds of link, and checks itself against what was measured on this machine
(2 processes over gloo, an 8.9M parameter MLP).

Assumptions, stated rather than measured here:

- compute per step: 6 FLOPs per parameter per token, 16k tokens per host per step,
  at 400 TFLOP/s (about 40% of an H100's dense bf16 peak), the same on every host
  (weak scaling: the global batch grows with the hosts);
- links, from published figures: NVLink 4 inside a node (NCCL all-reduce bus
  bandwidth ~ 450 GB/s, alpha ~ 10 us; beyond one node it stands for an NVLink
  switch fabric), InfiniBand NDR between nodes (50 GB/s per host, alpha ~ 20 us),
  100 Gb/s Ethernet (12.5 GB/s, alpha ~ 50 us);
- gloo on this machine's loopback, measured: one 36 MiB buffer in 62 ms between 2
  processes (beta ~ 0.6 GB/s) and ~4 ms per collective (alpha).

    python benchmarks/scale_model.py [--plot PATH.png]
"""

from __future__ import annotations

import argparse

LINKS = {  # name: (alpha seconds, beta bytes per second)
    "NVLink 4": (10e-6, 450e9),
    "InfiniBand NDR": (20e-6, 50e9),
    "100 GbE": (50e-6, 12.5e9),
    "gloo loopback (measured)": (4e-3, 36 * 2**20 / 0.062),
}
MODELS = {"100M": 100e6, "1B": 1e9}
TOKENS_PER_HOST = 16_384
FLOPS = 400e12
HOSTS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
SYNC_PERIOD = 16


def all_reduce_s(n: int, nbytes: float, alpha: float, beta: float) -> float:
    """Ring all-reduce time of `nbytes` over `n` hosts."""
    if n == 1:
        return 0.0
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / beta


def compute_s(params: float) -> float:
    return 6 * params * TOKENS_PER_HOST / FLOPS


def step_times(params: float, n: int, alpha: float, beta: float) -> tuple[float, float]:
    """`(synchronous, BMUF k=16)` seconds per step."""
    comm = all_reduce_s(n, 4 * params, alpha, beta)
    base = compute_s(params)
    return base + comm, base + comm / SYNC_PERIOD


def check_against_measurement() -> str:
    """The model for this machine's 2-process measurement (PLATFORM.md figures)."""
    alpha, beta = LINKS["gloo loopback (measured)"]
    local_ms = 45.0  # measured: the step without its all-reduce
    comm_ms = 1e3 * all_reduce_s(2, 4 * 8.9e6, alpha, beta)
    return (
        f"check, 8.9M parameters on 2 processes over gloo: predicted sync "
        f"{local_ms + comm_ms:.0f} ms (measured 116-134 ms for the hand-written "
        f"tree all-reduce), BMUF k=16 {local_ms + comm_ms / SYNC_PERIOD:.0f} ms "
        "(measured 75 ms: the model leaves out BMUF's own per-step work)"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plot", default=None, help="write a PNG figure here")
    args = parser.parse_args(argv)

    print(
        f"\nalpha-beta model: ring all-reduce of f32 gradients, {TOKENS_PER_HOST} "
        f"tokens per host per step at {FLOPS / 1e12:.0f} TFLOP/s; ms per step, "
        f"sync / BMUF k={SYNC_PERIOD}\n"
    )
    for model, params in MODELS.items():
        print(f"{model} parameters (compute {1e3 * compute_s(params):.0f} ms per step)")
        header = f"{'hosts':>6} " + " ".join(f"{name:>26}" for name in LINKS)
        print(header)
        print("-" * len(header))
        for n in HOSTS:
            cells = []
            for alpha, beta in LINKS.values():
                sync, bmuf = step_times(params, n, alpha, beta)
                cells.append(f"{1e3 * sync:12.0f} / {1e3 * bmuf:11.0f}")
            print(f"{n:6d} " + " ".join(f"{c:>26}" for c in cells))
        print()
    print(check_against_measurement())
    print(
        "\nReading it: the bandwidth term 2 (n-1)/n B / beta saturates at 2 B / beta, "
        "so a ring's\nsync step stops growing with hosts; the latency term grows "
        "linearly and matters only\nfor slow links or very many hosts. BMUF divides "
        "both by its sync period."
    )
    if args.plot:
        plot(args.plot)


def plot(path: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.6), layout="constrained")
    for ax, (model, params) in zip(fig.subplots(1, 2), MODELS.items(), strict=True):
        for name, (alpha, beta) in list(LINKS.items())[:3]:
            sync = [1e3 * step_times(params, n, alpha, beta)[0] for n in HOSTS]
            bmuf = [1e3 * step_times(params, n, alpha, beta)[1] for n in HOSTS]
            (line,) = ax.plot(HOSTS, sync, label=f"sync, {name}")
            ax.plot(
                HOSTS, bmuf, "--", color=line.get_color(), label=f"BMUF k=16, {name}"
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{model} parameters")
        ax.set_xlabel("hosts")
        ax.set_ylabel("ms per step")
    fig.axes[0].legend(fontsize=6)
    fig.savefig(path, dpi=110)
    print(f"figure: {path}")


if __name__ == "__main__":
    main()
