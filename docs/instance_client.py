#!/usr/bin/env python3
"""Client of lodger's instance protocol (docs/instance-protocol.md), for model servers in Python.

A model server that lodger starts as an inference instance imports this module, sizes itself
from what lodger planned, and reports every batch it serves:

    from instance_client import Instance

    inst = Instance()                  # reads LODGER_* from the environment
    torch.set_num_threads(inst.threads)
    inst.stop_on_sigterm()
    while not inst.stopping:
        requests = queue.take(inst.batch)
        with inst.batch_timer(len(requests), oldest_arrival=requests[0].arrival):
            model(requests)

Outside lodger (no LODGER_REPORT_FD) report lines go to stdout, so the same server runs by hand.
Standard library only. Run this file to get a small demo instance (pure-Python matrix work, no
numpy): `python3 docs/instance_client.py --seconds 5`.
"""

import argparse
import json
import os
import random
import signal
import sys
import time
from contextlib import contextmanager

__all__ = ["Instance", "parse_cpulist"]


def parse_cpulist(text):
    """'0-3,8' -> [0, 1, 2, 3, 8] (the kernel's cpulist format, as in LODGER_CPUS)."""
    cpus = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def _positive_int(environ, names, default):
    for name in names:
        value = environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return default


class Instance:
    """One inference instance as lodger started it."""

    def __init__(self, environ=None):
        env = os.environ if environ is None else environ
        self.threads = _positive_int(env, ("LODGER_THREADS", "OMP_NUM_THREADS"), 1)
        self.batch = _positive_int(env, ("LODGER_BATCH",), 1)
        self.index = int(env.get("LODGER_INSTANCE", "0") or 0)
        self.job = env.get("LODGER_JOB", "")
        self.cpus = parse_cpulist(env.get("LODGER_CPUS", ""))
        fd = env.get("LODGER_REPORT_FD", "").strip()
        self._fd = int(fd) if fd else None
        self._broken = False
        self.stopping = False

    @property
    def under_lodger(self):
        return self._fd is not None

    def report(self, items, latency_ms, queue_ms=None):
        """Reports one batch: `items` served, the batch's latency (its slowest request) and,
        optionally, how long its requests waited before it started."""
        if self._broken:
            return
        line = {"items": int(items), "latency_ms": round(float(latency_ms), 3)}
        if queue_ms is not None:
            line["queue_ms"] = round(float(queue_ms), 3)
        data = (json.dumps(line, separators=(",", ":")) + "\n").encode()
        try:
            if self._fd is None:
                sys.stdout.buffer.write(data)
                sys.stdout.flush()
            else:
                # One write per line: lines shorter than PIPE_BUF reach lodger whole.
                os.write(self._fd, data)
        except OSError as e:  # lodger is gone: keep serving, stop reporting
            print(f"instance_client: cannot report any more ({e})", file=sys.stderr)
            self._broken = True

    @contextmanager
    def batch_timer(self, items, oldest_arrival=None):
        """Times the enclosed batch and reports it. `oldest_arrival` (a time.monotonic() value)
        makes the latency arrival-to-completion and adds queue_ms."""
        start = time.monotonic()
        yield
        end = time.monotonic()
        if oldest_arrival is None:
            self.report(items, (end - start) * 1000.0)
        else:
            self.report(items, (end - oldest_arrival) * 1000.0, (start - oldest_arrival) * 1000.0)

    def stop_on_sigterm(self):
        """lodger stops an instance with SIGTERM (then SIGKILL after its grace period): finish
        the current batch and leave."""

        def handler(_signum, _frame):
            self.stopping = True

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)


def _demo(seconds):
    """A tiny model: two dense layers of 64x64 in pure Python, a batch at a time."""
    inst = Instance()
    inst.stop_on_sigterm()
    rng = random.Random(inst.index)
    n = 64
    layers = [[[rng.uniform(-0.3, 0.3) for _ in range(n)] for _ in range(n)] for _ in range(2)]
    print(
        f"instance_client demo: job={inst.job or '-'} instance={inst.index} "
        f"threads={inst.threads} batch={inst.batch} cpus={inst.cpus} "
        f"reporting to {'fd %d' % inst._fd if inst.under_lodger else 'stdout'}",
        file=sys.stderr,
    )
    deadline = time.monotonic() + seconds if seconds > 0 else None
    served = 0
    while not inst.stopping and (deadline is None or time.monotonic() < deadline):
        items = [[rng.random() for _ in range(n)] for _ in range(inst.batch)]
        with inst.batch_timer(len(items)):
            for w in layers:
                items = [
                    [max(0.0, sum(x[k] * w[k][j] for k in range(n))) for j in range(n)]
                    for x in items
                ]
        served += len(items)
    print(f"instance_client demo: served {served} items", file=sys.stderr)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Demo instance speaking lodger's protocol.")
    parser.add_argument("--seconds", type=float, default=0, help="0: until SIGTERM")
    sys.exit(_demo(parser.parse_args().seconds))
