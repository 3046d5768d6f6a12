"""Runs every benchmark in this folder, one fresh process each, and keeps the tables.

`make bench` runs this script: every `benchmarks/*.py` in quick mode (small
models, few rounds), so that the whole set finishes within 10 minutes on a 2-core
CPU. `--full` runs each benchmark with its own defaults (the configurations the
README's tables quote; much longer). Each benchmark's output goes to the console as
it runs and to `OUT/NAME.txt`, headed by the command, the machine and the date;
`--update-readme` also pastes it into `benchmarks/README.md` between the markers
`<!-- bench:NAME -->` and `<!-- /bench:NAME -->`.

    python benchmarks/run_all.py [--full] [--only NAME ...] [--out DIR]
                                 [--budget SECONDS] [--update-readme]
    python benchmarks/run_all.py --paste DIR   # README blocks from saved outputs

Exits non-zero if a benchmark fails or runs out of time.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import pathlib
import platform
import re
import subprocess
import sys
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent
README = HERE / "README.md"

#: Arguments for quick mode, chosen from each benchmark's argparse. A benchmark not
#: listed gets `--quick` if it has that option, else its defaults.
QUICK_ARGS = {
    "bmuf": ["--quick"],
    "compression": ["bytes"],
    "checkpoint": ["--mb", "20", "--rounds", "1"],
    "live": ["--processes", "3", "--steps", "1500", "--kill-after", "10"],
    "memory": ["--params", "5e6", "--steps", "2", "--rounds", "2"],
    "multihost": ["--quick"],
    "overhead": ["--quick"],
    "sparse": ["--rows", "100000", "--steps", "2"],
}
#: Benchmarks left out of quick mode (`make bench`): they take minutes however small.
NOT_QUICK = {"goodput"}
#: Third line of a saved output: date, duration, status, load when it started.
HEADER = re.compile(r"# (.+?); (\d+) s; (.+?); load average ([\d.]+) at start")
#: Seconds the whole quick run may take (`make bench` promises 10 minutes).
QUICK_BUDGET_S = 600


def benchmarks() -> list[pathlib.Path]:
    """Every benchmark script here, in name order."""
    this = pathlib.Path(__file__).name
    return sorted(
        p for p in HERE.glob("*.py") if p.name != this and not p.name.startswith("_")
    )


def quick_args(path: pathlib.Path) -> list[str]:
    """The arguments that make `path` quick."""
    if path.stem in QUICK_ARGS:
        return QUICK_ARGS[path.stem]
    return ["--quick"] if '"--quick"' in path.read_text() else []


def machine() -> str:
    """One line describing where the numbers come from."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = re.findall(r"^model name\s*:\s*(.+)$", f.read(), re.M)
        cpu = names[0].strip() if names else cpu
    except OSError:
        pass
    try:
        jax_version = importlib.metadata.version("jax")
    except importlib.metadata.PackageNotFoundError:
        jax_version = "not installed"
    gpus = ""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        names = [line.strip() for line in out.stdout.splitlines() if line.strip()]
        if out.returncode == 0 and names:
            gpus = f", {len(names)} x {names[0]}"
    except (OSError, subprocess.SubprocessError):
        pass
    return (
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores "
        f"({cpu}){gpus}, Python {platform.python_version()}, jax {jax_version}"
    )


def run_one(cmd: list[str], timeout: float) -> tuple[int | None, str, float]:
    """Runs `cmd`, echoing its output; returns (exit code or None, output, seconds)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=HERE.parent,
        start_new_session=True,  # so a timeout can stop its child processes too
    )
    lines: list[str] = []

    def pump():
        for line in proc.stdout:
            lines.append(line)
            sys.stdout.write(line)
            sys.stdout.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        code: int | None = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the benchmark's own process group
        proc.wait()
        code = None
    reader.join(timeout=10)
    return code, "".join(lines), time.monotonic() - t0


def readme_block(
    shown: str, where: str, date: str, mode: str, seconds: float, load: str, output: str
) -> str:
    """The README text for one benchmark's run."""
    output = output.strip("\n")
    return (
        f"Last run: {date}, {mode} mode (`{shown}`), {seconds:.0f} s, on {where}; "
        f"load average {load} when it started.\n\n```\n{output}\n```\n"
    )


def paste(directory: str) -> int:
    """Updates the README from the `NAME.txt` files a previous run saved."""
    pasted = 0
    for path in sorted(pathlib.Path(directory).glob("*.txt")):
        lines = path.read_text().split("\n", 3)
        head = HEADER.fullmatch(lines[2]) if len(lines) > 3 else None
        if not (lines[0].startswith("$ ") and lines[1].startswith("# ") and head):
            print(f"{path}: not an output of run_all.py; skipped")
            continue
        date, seconds, status, load = head.groups()
        if status != "ok":
            print(f"{path}: {status}; skipped")
            continue
        shown = lines[0][2:]
        mode = (
            "quick"
            if shown.split()[2:] == quick_args(HERE / f"{path.stem}.py")
            else ("full" if len(shown.split()) == 2 else "custom")
        )
        block = readme_block(
            shown, lines[1][2:], date, mode, float(seconds), load, lines[3]
        )
        if update_readme(path.stem, block):
            pasted += 1
            print(f"README.md: {path.stem} updated")
        else:
            print(f"README.md has no block for {path.stem}; skipped")
    return 0 if pasted else 1


def update_readme(name: str, block: str) -> bool:
    """Replaces the README block of `name`; False if its markers are missing."""
    text = README.read_text()
    pattern = re.compile(
        rf"(<!-- bench:{re.escape(name)} -->\n).*?(<!-- /bench:{re.escape(name)} -->)",
        re.S,
    )
    if not pattern.search(text):
        return False
    README.write_text(pattern.sub(lambda m: m.group(1) + block + m.group(2), text))
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--full", action="store_true", help="each benchmark's own defaults (long)"
    )
    parser.add_argument("--only", nargs="+", metavar="NAME", help="e.g. overhead bmuf")
    parser.add_argument("--out", default=str(HERE / "results"), metavar="DIR")
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help=f"seconds for the whole run (quick: {QUICK_BUDGET_S}; full: none)",
    )
    parser.add_argument("--update-readme", action="store_true")
    parser.add_argument(
        "--paste", metavar="DIR", help="only update the README from DIR's outputs"
    )
    args = parser.parse_args(argv)
    if args.paste:
        return paste(args.paste)

    scripts = benchmarks()
    if args.only:
        unknown = set(args.only) - {p.stem for p in scripts}
        if unknown:
            parser.error(
                f"no benchmark named {sorted(unknown)}; "
                f"have {[p.stem for p in scripts]}"
            )
        scripts = [p for p in scripts if p.stem in args.only]
    elif not args.full:
        scripts = [p for p in scripts if p.stem not in NOT_QUICK]
    budget = args.budget or (None if args.full else QUICK_BUDGET_S)
    mode = "full" if args.full else "quick"
    os.makedirs(args.out, exist_ok=True)
    where = machine()
    print(f"{len(scripts)} benchmarks, {mode} mode, on {where}", flush=True)

    start = time.monotonic()
    summary = []
    for i, path in enumerate(scripts):
        extra = [] if args.full else quick_args(path)
        cmd = [sys.executable, str(path.relative_to(HERE.parent)), *extra]
        shown = " ".join(["python", *cmd[1:]])
        if budget is None:
            timeout = None
        else:  # what is left, shared fairly with the benchmarks still to run
            left = budget - (time.monotonic() - start)
            timeout = max(left / (len(scripts) - i) * 2, 1.0)
            timeout = min(timeout, left)
            if left <= 1:
                summary.append((path.stem, "skipped (out of time)", 0.0))
                continue
        print(f"\n=== {path.stem}: {shown}", flush=True)
        date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
        load = f"{os.getloadavg()[0]:.1f}"
        code, output, seconds = run_one(cmd, timeout)
        status = (
            "ok"
            if code == 0
            else (
                f"timed out after {seconds:.0f} s" if code is None else f"exit {code}"
            )
        )
        summary.append((path.stem, status, seconds))
        header = (
            f"$ {shown}\n# {where}\n# {date}; {seconds:.0f} s; {status}; "
            f"load average {load} at start\n"
        )
        (pathlib.Path(args.out) / f"{path.stem}.txt").write_text(header + output)
        if args.update_readme and code == 0:
            block = readme_block(shown, where, date, mode, seconds, load, output)
            if not update_readme(path.stem, block):
                print(f"(README.md has no block for {path.stem}; not updated)")

    total = time.monotonic() - start
    width = max([len(name) for name, _, _ in summary] + [9])
    print(f"\n{'benchmark':{width}}  seconds  status")
    for name, status, seconds in summary:
        print(f"{name:{width}}  {seconds:7.0f}  {status}")
    print(f"{'total':{width}}  {total:7.0f}  (outputs in {args.out})")
    return 0 if all(s == "ok" for _, s, _ in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
