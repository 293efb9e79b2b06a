"""How the demo measures: clocks, the steps it counts, CPU threads, a progress bar, the machine."""

import importlib.metadata
import math
import os
import platform
import sys
import time

import torch

import flatopt


class Progress:
    """A progress bar on ``stream``: on a terminal one line redrawn with ``\\r`` at most ten times a
    second; elsewhere (a log file, a pipe) one line per tenth of the work."""

    def __init__(self, total, enabled=True, stream=None, width=28):
        self.total, self.enabled, self.width = total, enabled, width
        self.stream = sys.stderr if stream is None else stream
        self.tty = enabled and getattr(self.stream, "isatty", lambda: False)()
        self.start = time.perf_counter()
        self.last, self.tenths = -math.inf, 0

    def update(self, done, text=""):
        now = time.perf_counter()
        if not self.enabled:
            return
        if self.tty and done < self.total and now - self.last < 0.1:
            return
        if not self.tty and 10 * done // self.total == self.tenths:
            return
        self.last, self.tenths = now, 10 * done // self.total
        filled = self.width * done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = now - self.start
        eta = elapsed / done * (self.total - done) if done else 0.0
        width = len(str(self.total))
        line = f"step {done:{width}}/{self.total} [{bar}] {text} | {elapsed:.0f}s elapsed, {eta:.0f}s left "
        self.stream.write(f"\r{line}" if self.tty else f"{line}\n")
        self.stream.flush()

    def close(self):
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def make_clock(device):
    """``time.perf_counter`` that first waits for the device's queued work."""
    if device.type == "cuda":

        def clock():
            torch.cuda.synchronize(device)
            return time.perf_counter()

        return clock
    return time.perf_counter


def timed_steps(steps):
    """Steps counted in the mean step times: the first ones (lazy state, kernel compilation,
    autotuning, allocator warm-up) are left out."""
    skip = min(10, max(1, steps // 10)) if steps > 1 else 0
    return slice(skip, steps)


class CpuThreads:
    """torch's CPU threads while the demo runs, restored by :meth:`close`: ``fixed`` if given, else
    the CPUs this process may use that other work leaves idle, measured from ``/proc/stat`` (less
    this process's own CPU time) and measured again every ``interval_s`` seconds of training.

    torch's threads wait for each other at every operation, so with more threads than idle cores a
    step gets several times slower (seen on 2 cores: 50 ms alone, 120-210 ms beside one busy
    process, against 80 ms with one thread). Without ``/proc/stat`` the count is the CPUs this
    process may use.

    Args:
        fixed (int, optional): the thread count, never changed (default: None)
        interval_s (float, optional): seconds between measurements (default: 2.0)
    """

    def __init__(self, fixed=None, interval_s=2.0):
        self.cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.fixed, self.interval_s = fixed, interval_s
        self.previous = torch.get_num_threads()
        self.threads, self.changes = None, []  # changes: [step, threads] from that step on
        self.last = None if fixed is not None else self._read()
        if self.last is not None:
            time.sleep(0.25)
        self.update(0, force=True)

    @staticmethod
    def _read():
        """(clock, busy CPU-seconds of the machine, elapsed CPU-seconds of the machine, this process's
        CPU-seconds), or None where there is no ``/proc/stat``."""
        try:
            with open("/proc/stat") as f:
                ticks = [int(v) for v in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
            hz = os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, AttributeError):
            return None
        total, idle = sum(ticks) / hz, (ticks[3] + ticks[4]) / hz
        return time.perf_counter(), total - idle, total, time.process_time()

    def update(self, step, force=False):
        """Measure again if ``interval_s`` has passed (or ``force``) and set the thread count."""
        if self.fixed is not None:
            n = self.fixed
        elif self.last is None:
            n = self.cpus
        else:
            if not force and time.perf_counter() - self.last[0] < self.interval_s:
                return
            now = self._read()
            elapsed = max((now[2] - self.last[2]) / (os.cpu_count() or self.cpus), 1e-9)  # wall seconds
            others = (now[1] - self.last[1] - (now[3] - self.last[3])) / elapsed  # CPUs other work kept busy
            self.last = now
            n = max(1, min(self.cpus, self.cpus - round(others)))
        if n != self.threads:
            torch.set_num_threads(n)
            self.threads = n
            self.changes.append([step, n])

    def close(self):
        torch.set_num_threads(self.previous)


def resolve_device(device):
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def versions():
    """The versions of Python and of the packages the demo runs with (read from the installed
    distributions: importing triton only to name its version would cost seconds on the CPU)."""
    found = {"python": platform.python_version(), "torch": torch.__version__, "flatopt": flatopt.__version__}
    for name in ("triton", "numpy", "matplotlib"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()
