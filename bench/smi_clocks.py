"""The SM clock a GPU held under load, phase by phase, from a device run's one-second `nvidia-smi` samples.

    python bench/smi_clocks.py SMI.csv LOG.txt --phase training='training throughput|fp8' \
        --phase gemm_table='hardware profile' [--power-limit 700] [--out OUT.json]

`SMI.csv` is `nvidia-smi --query-gpu=timestamp,clocks.current.sm,...,power.draw,... --format=csv -l 1` (the
columns are found by name); `LOG.txt` the run's log, whose lines `== HH:MM:SS ...` start each step (the
layout `bench/device_check.sh` and the first H200 run's `device_log.txt` write). A step belongs to a phase
when its line matches the phase's regular expression; a sample belongs to the step running at its time.
Only samples drawing at least `--load-fraction` (default 0.85) of the board's power limit count: the device
is then working and held at its power cap, not idling or compiling between steps.

Prints and writes, per phase, the number of such samples and their SM clock (min / median / max, MHz) and
power; and the ratio of each phase's median clock to the first phase's. The planner's datasheet peaks are
quoted at a fixed clock (H100/H200 bf16: 989.4 TFLOP/s = 132 SMs x 4 tensor cores x 1024 FLOP x 1.83 GHz),
so the clocks say whether a measured rate and a training step ran at the same clock.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import shlex
import statistics
import sys
from pathlib import Path


def read_samples(path: Path) -> list[dict]:
    """[{"time": "HH:MM:SS", "clock": MHz, "power": W, "util": %}, ...] from an nvidia-smi CSV."""
    rows = list(csv.reader(path.read_text().splitlines()))
    header = [h.strip() for h in rows[0]]

    def col(prefix):
        return next(i for i, h in enumerate(header) if h.startswith(prefix))

    t, clock, power, util = col("timestamp"), col("clocks.current.sm"), col("power.draw"), col("utilization.gpu")
    out = []
    for row in rows[1:]:
        if len(row) < len(header):
            continue
        number = lambda s: float(s.strip().split()[0])  # noqa: E731 - "1800 MHz" -> 1800.0
        out.append({"time": row[t].strip().split()[1][:8], "clock": number(row[clock]),
                    "power": number(row[power]), "util": number(row[util])})
    return out


def read_steps(path: Path) -> list[tuple[str, str]]:
    """[(start "HH:MM:SS", the step's line), ...] from a device run's log."""
    steps = []
    for line in path.read_text().splitlines():
        m = re.match(r"== (\d\d:\d\d:\d\d) (.*)", line)
        if m:
            steps.append((m.group(1), m.group(2)))
    return steps


def phase_clocks(samples: list[dict], steps: list[tuple[str, str]], phases: dict, power_limit: float,
                 load_fraction: float = 0.85) -> dict:
    """Per phase name: the loaded samples' clocks and power, as the module docstring says."""
    out = {}
    for name, pattern in phases.items():
        chosen = []
        for i, (start, label) in enumerate(steps):
            if not re.search(pattern, label):
                continue
            end = steps[i + 1][0] if i + 1 < len(steps) else "99:99:99"
            chosen += [s for s in samples if start <= s["time"] < end and s["power"] >= load_fraction * power_limit]
        clocks = sorted(s["clock"] for s in chosen)
        out[name] = {"samples": len(clocks), "steps": pattern,
                     **({"clock_mhz": {"min": clocks[0], "median": statistics.median(clocks), "max": clocks[-1]},
                         "power_w_median": statistics.median(s["power"] for s in chosen),
                         "clocks": clocks} if clocks else {})}
    first = next(iter(out.values()), {})
    for entry in out.values():
        if "clock_mhz" in entry and "clock_mhz" in first:
            entry["median_over_first_phase"] = round(entry["clock_mhz"]["median"] / first["clock_mhz"]["median"], 4)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("smi", type=Path)
    p.add_argument("log", type=Path)
    p.add_argument("--phase", action="append", default=[], metavar="NAME=REGEX",
                   help="steps whose log line matches REGEX form phase NAME (repeatable; the first is the reference)")
    p.add_argument("--power-limit", type=float, default=700.0, help="board power limit, W (nvidia-smi power.limit)")
    p.add_argument("--load-fraction", type=float, default=0.85)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    phases = dict(item.split("=", 1) for item in args.phase)
    command = "python bench/smi_clocks.py " + " ".join(map(shlex.quote, sys.argv[1:] if argv is None else argv))
    result = {"command": command, "smi": str(args.smi), "log": str(args.log), "power_limit_w": args.power_limit,
              "load_fraction": args.load_fraction,
              "phases": phase_clocks(read_samples(args.smi), read_steps(args.log), phases, args.power_limit,
                                     args.load_fraction)}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
