"""Benchmark of verl_mas.sandbox: runs/s at concurrency 1, 8, 64 and per-run overhead versus bare subprocess.

    .venv/bin/python bench/bench_sandbox.py            # ~1-2 min on 2 cores
    .venv/bin/python bench/bench_sandbox.py --quick    # fewer runs

Two programs: a trivial one (``pass``) and a ~100 ms CPU-bound loop (calibrated on this machine).
Overhead: sequential runs of the sandbox and of ``subprocess.run([sys.executable, "-c", code])``, interleaved
in small blocks so both see the same machine load; the ratio of medians is reported (target <= 1.5x for the
trivial program). Throughput: ``N`` submissions at once through the default pool (size = CPU count).
Not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from verl_mas.sandbox import LocalSandbox, SandboxConfig


def calibrate_cpu_program(target_s: float = 0.1) -> str:
    """A loop that takes ~``target_s`` of CPU in this interpreter."""
    n = 100_000
    while True:
        t0 = time.process_time()
        total = 0
        for i in range(n):
            total += i
        took = time.process_time() - t0
        if took > 0.02:
            break
        n *= 2
    n = int(n * target_s / took)
    return f"total = 0\nfor i in range({n}):\n    total += i\n"


def bare_run(code: str) -> None:
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


async def overhead(box: LocalSandbox, code: str, rounds: int, block: int) -> tuple[float, float]:
    """Median seconds per run: (bare subprocess, sandbox), measured in interleaved blocks."""
    bare, boxed = [], []
    for _ in range(rounds):
        for _ in range(block):
            t0 = time.perf_counter()
            await asyncio.to_thread(bare_run, code)
            bare.append(time.perf_counter() - t0)
        for _ in range(block):
            t0 = time.perf_counter()
            result = await box.run_python(code)
            boxed.append(time.perf_counter() - t0)
            if not result.ok:
                raise RuntimeError(f"benchmark program failed in the sandbox: {result}")
    return statistics.median(bare), statistics.median(boxed)


async def throughput(box: LocalSandbox, code: str, concurrency: int, total: int) -> float:
    """Runs/s with ``concurrency`` submissions in flight at all times."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(total):
        queue.put_nowait(i)

    async def worker() -> None:
        while not queue.empty():
            queue.get_nowait()
            result = await box.run_python(code)
            if not result.ok:
                raise RuntimeError(f"benchmark program failed in the sandbox: {result}")

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return total / (time.perf_counter() - t0)


def bare_throughput(code: str, concurrency: int, total: int, pool: int) -> float:
    """Runs/s of bare subprocesses, at most ``min(concurrency, pool)`` at once (same bound as the sandbox)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=min(concurrency, pool)) as ex:
        list(ex.map(bare_run, [code] * total))
    return total / (time.perf_counter() - t0)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer runs (noisier)")
    args = parser.parse_args()
    rounds, block = (4, 5) if args.quick else (8, 5)
    box = LocalSandbox(SandboxConfig(timeout_s=60))
    await box.start()
    cpu_code = calibrate_cpu_program()
    load = os.getloadavg()
    print(f"machine: {os.cpu_count()} CPUs, load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}; "
          f"pool_size={box.config.pool_size}; protections={dict(box.protections)}")
    programs = {"trivial": "pass", "cpu 100ms": cpu_code}

    print("\nper-run latency (sequential, medians of interleaved blocks)")
    print(f"{'program':<11} {'bare ms':>9} {'sandbox ms':>11} {'overhead ms':>12} {'ratio':>7}")
    for name, code in programs.items():
        bare, boxed = await overhead(box, code, rounds, block)
        print(f"{name:<11} {bare * 1e3:9.1f} {boxed * 1e3:11.1f} {(boxed - bare) * 1e3:12.1f} {boxed / bare:7.2f}x")

    print("\nthroughput (runs/s)")
    print(f"{'program':<11} {'concurrency':>11} {'runs':>5} {'sandbox':>9} {'bare':>9}")
    for name, code in programs.items():
        for concurrency in (1, 8, 64):
            total = max(2 * concurrency, 16 if args.quick else 32)
            boxed = await throughput(box, code, concurrency, total)
            bare = await asyncio.to_thread(bare_throughput, code, concurrency, total, box.config.pool_size)
            print(f"{name:<11} {concurrency:>11} {total:>5} {boxed:9.1f} {bare:9.1f}")
    await box.aclose()


if __name__ == "__main__":
    asyncio.run(main())
