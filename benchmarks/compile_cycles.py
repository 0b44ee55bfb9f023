"""RSS over compile-and-drop cycles: does a long job that recompiles grow? (issue 46, item 4)

Each cycle builds a one-layer tiny Llama with LoRA, compiles it, runs one training step (a second with static
calibration, which freezes its slots), drops the model and its compiled code (``torch._dynamo.reset()``) and
reads the process's resident memory. Each backend runs in its own process, so one's allocations do not shift the
next's baseline. The growth per cycle is the least-squares slope over the cycles after the first ten (the
allocator's and the caches' warm-up).

    python benchmarks/compile_cycles.py --cycles 100 --json benchmarks/results/compile-cycles-COMMIT-DATE.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import shlex
import subprocess
import sys

BACKENDS = {
    "inductor": {},
    "fxmem": {"preset": "hyclora-4bit"},
    "fxmem-static": {"preset": "hyclora-4bit", "calibration": "static", "calibration_steps": 2},
}
WARMUP = 10


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status (this script reads Linux's)")


def _cycles(name: str, cycles: int) -> list[float]:
    import torch

    from tests.conftest import tiny_model

    options = BACKENDS[name]
    rss = []
    for _ in range(cycles):
        model, batch = tiny_model("llama", lora=True, layers=1)
        if name == "inductor":
            compiled = torch.compile(model)
        else:
            compiled = torch.compile(model, backend="fxmem", options=options)
        for _ in range(2 if options.get("calibration") == "static" else 1):
            compiled(**batch).loss.backward()
        del model, compiled, batch
        torch._dynamo.reset()
        gc.collect()
        rss.append(_rss_mib())
    return rss


def _slope(values: list[float]) -> float:
    xs = range(len(values))
    mean_x, mean_y = sum(xs) / len(values), sum(values) / len(values)
    return (sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, values))
            / sum((x - mean_x) ** 2 for x in xs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=100)
    parser.add_argument("--backends", nargs="+", choices=sorted(BACKENDS), default=list(BACKENDS))
    parser.add_argument("--json", help="write the RSS series and slopes here")
    parser.add_argument("--child", choices=sorted(BACKENDS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cycles <= WARMUP + 1:
        parser.error(f"--cycles must be above {WARMUP + 1}: the slope is fitted after {WARMUP} warm-up cycles")
    if args.child:
        print(json.dumps(_cycles(args.child, args.cycles)))
        return
    results = {}
    for name in args.backends:
        run = subprocess.run([sys.executable, __file__, "--child", name, "--cycles", str(args.cycles)],
                             capture_output=True, text=True, check=True)
        rss = json.loads(run.stdout.strip().splitlines()[-1])
        growth = _slope(rss[WARMUP:]) * 1024
        results[name] = {"options": BACKENDS[name], "rss_mib": rss, "growth_kib_per_cycle": growth}
        print(f"{name:14} RSS {rss[0]:7.1f} -> {rss[-1]:7.1f} MiB, {growth:8.1f} KiB a cycle after cycle {WARMUP}",
              flush=True)
    if args.json:
        from fxmem.cli.common import machine_description, source_commit
        with open(args.json, "w") as out:
            json.dump({"command": shlex.join(["python", *sys.argv]), "date": datetime.date.today().isoformat(),
                       "machine": machine_description("cpu"), "commit": source_commit(), "cycles": args.cycles,
                       "warmup": WARMUP, "backends": results}, out, indent=1)


if __name__ == "__main__":
    main()
