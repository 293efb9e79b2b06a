"""The plumbing every benchmark script shares, so that each script keeps only its question.

* Timing. Device time: CUDA events around each call, after a first call (lazy state, JIT compilation)
  and a warm-up; the median and the 20th/80th percentiles (``QUANTILES``, as ``triton.testing.do_bench``
  reports them) of many repeats (``device_time``). With ``hide_host=True`` a device sleep queued before
  each call lets the host enqueue the whole call first, so that the events time the device's work and not
  the host's launch overhead (nvbench's blocking kernel). Host time: ``time.perf_counter`` around each
  call in short bursts between synchronisations (``host_time``). Whole training steps: synchronised
  (``time_steps``), back to back (``time_back_to_back``), or several implementations alternately, round
  by round (``time_paired``). The optimizer working sets are 10x or more an H100's L2 cache, so
  back-to-back calls do not hit a warm cache. On the CPU every timer uses ``perf_counter``.
* The floor: bytes that must move / device-to-device copy bandwidth measured in the same run
  (``copy_bandwidth``: ``dst.copy_(src)`` of a large buffer, counting read + write).
* Inputs: random normal parameters and gradients, never zeros (``make_params``); the parameter sets
  (GPT-2 small, 3000 small tensors, Llama-style 1.2B shapes) and their decay / no-decay split.
* Cases: ``run_guarded`` runs one case, records a failure, skip or out-of-memory in its row instead of
  raising, and frees the device memory after it; ``run_worker`` runs one in a subprocess with a timeout.
* Targets: ``target`` (met or not, with the margin) and their markdown table.
* Records: ``new_record`` (device name, library versions, date, git commit and command in every result),
  ``write_json``, markdown helpers, the command-line options every script takes (``parser``) and the
  tail of every ``main()`` (``main``, ``finish``).
* flatopt's internals: ``internals(opt)`` is the one place in benchmarks/ that reads a private attribute
  of a flatopt optimizer or imports a private module of flatopt.

Import only; nothing here changes global state.
"""

import argparse
import datetime
import gc
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import flatopt

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "benchmarks" / "results"
PROFILES_DIR = RESULTS_DIR / "profiles"
SCHEMA = 1  # of every result this harness writes; plot.py and report.py read it
QUANTILES = (0.5, 0.2, 0.8)
SMOKE_NOTE = (
    "SMOKE RUN: tiny parameter sets, few repeats; checks that the benchmark code runs and measures nothing. "
    "Do not present these numbers as results."
)

# Bytes each optimizer must move per parameter element, in units of the element size:
# (tensors read, tensors written). AdamW reads p, g, m, v and writes p, m, v; SGD with momentum reads
# p, g, buf and writes p, buf; Lion reads p, g, m and writes p, m. States have the parameter's dtype.
TENSOR_PASSES = {"adamw": (4, 3), "sgd": (3, 2), "lion": (3, 2)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def element_size(dtype):
    """Bytes of one element of ``dtype`` (a torch dtype or a key of DTYPES)."""
    return torch.empty((), dtype=DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype).element_size()


def bytes_per_element(optimizer, dtype, grad_write=False):
    """Bytes that must move per parameter element in one step: AdamW fp32 28, SGD-momentum/Lion fp32 20.
    ``grad_write=True`` adds the write of the gradient that a backward pass must make (a training loop's
    landing: AdamW fp32 32)."""
    reads, writes = TENSOR_PASSES[optimizer]
    return (reads + writes + bool(grad_write)) * element_size(dtype)


def floor_ms(numel, bytes_per_el, copy_gbps):
    """Milliseconds to move ``numel * bytes_per_el`` bytes at the copy bandwidth (GB/s, 1 GB = 1e9 B)."""
    return numel * bytes_per_el / (copy_gbps * 1e6)


def gbps(nbytes, ms):
    """Achieved bandwidth in GB/s (1e9 bytes per second)."""
    return nbytes / (ms * 1e6)


def pct_of_floor(floor, ms):
    """How close a time is to the floor, in percent (100 = at the floor)."""
    return 100.0 * floor / ms


def quantiles(values, qs=QUANTILES):
    """Quantiles with linear interpolation between order statistics (numpy's default method)."""
    xs = sorted(values)
    if not xs:
        raise ValueError("quantiles of an empty sequence")
    out = []
    for q in qs:
        pos = q * (len(xs) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(xs) - 1)
        out.append(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))
    return out


def median_interval(values, level=0.95):
    """A distribution-free confidence interval for the median of ``values`` (independent draws): the order statistics
    ``k`` and ``n - 1 - k`` of the sorted values, ``k`` the largest index with P(Binomial(n, 1/2) <= k) <= (1 -
    level) / 2 (so that the interval holds the median with at least that probability). None when there are too
    few values for it (fewer than 6 at 95 %: even their range holds the median with less)."""
    xs = sorted(values)
    n = len(xs)
    if not n:
        raise ValueError("an interval of an empty sequence")
    tail, cum, k = (1.0 - level) / 2, 0.0, -1
    for i in range(n):
        cum += math.comb(n, i) / 2.0**n
        if cum > tail:
            break
        k = i
    if k < 0:
        return None
    return xs[k], xs[n - 1 - k]


# ---------------------------------------------------------------------------------------------- timers
@dataclass
class Timing:
    median_ms: float
    q20_ms: float
    q80_ms: float
    reps: int

    def as_dict(self):
        return asdict(self)


@dataclass
class TimerSettings:
    warmup_ms: float = 25.0  # warm-up time after the first call and a 3-call estimate
    rep_ms: float = 100.0  # time spent on timed repeats ...
    min_reps: int = 20  # ... but never fewer repeats than this
    max_reps: int = 1000
    host_calls: int = 200  # host-side timing: at most this many calls ...
    host_budget_s: float = 0.4  # ... or this long, whichever comes first (at least 5 calls)


def timer_settings(smoke=False, quick=False):
    """The timer settings of a smoke run (a code-path check), a quick run (about half the repeats) or a full one."""
    if smoke:
        return TimerSettings(warmup_ms=1.0, rep_ms=2.0, min_reps=3, max_reps=10, host_calls=5, host_budget_s=0.01)
    if quick:
        return TimerSettings(warmup_ms=10.0, rep_ms=40.0, min_reps=10, max_reps=500, host_calls=100, host_budget_s=0.2)
    return TimerSettings()


def is_cuda(device):
    return torch.device(device).type == "cuda"


def sync(device):
    """Wait for the device (nothing to wait for on the CPU)."""
    if is_cuda(device):
        torch.cuda.synchronize(device)


def allocated(device):
    """Bytes allocated on ``device`` by torch's caching allocator (0 on the CPU, which has no such count)."""
    return torch.cuda.memory_allocated(device) if is_cuda(device) else 0


def _clamp(x, lo, hi):
    return max(lo, min(hi, x))


_SLEEP_CYCLES_PER_MS = {}


def sleep_cycles_per_ms(device):
    """Clock cycles of ``torch.cuda._sleep`` per millisecond on ``device``, measured once."""
    key = torch.device(device).index or 0
    if key not in _SLEEP_CYCLES_PER_MS:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)  # load the kernel
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize(device)
            start.record()
            torch.cuda._sleep(2_000_000)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end))
        _SLEEP_CYCLES_PER_MS[key] = 2_000_000 / best
    return _SLEEP_CYCLES_PER_MS[key]


def device_time(fn, device, settings, hide_host=False):
    """Time ``fn`` on ``device``: CUDA events around each call on CUDA, ``perf_counter`` on the CPU.

    The calls run back to back, so a call whose host work takes longer than its device work is timed at its
    host time. ``hide_host=True`` (CUDA): each call is preceded by a device sleep longer than twice the call's
    host time, with a synchronisation before it, so the host has enqueued the whole call before the device
    reaches the first event and the events time the device's work alone (a call that launches more kernels
    than the launch queue holds still waits on the device for the rest).
    """
    cuda = is_cuda(device)
    sync(device)
    fn()  # lazy state, compilation
    sync(device)
    t0 = time.perf_counter()
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            fn()
        host_ms = (time.perf_counter() - t0) * 1e3 / 3
        end.record()
        end.synchronize()
        est = start.elapsed_time(end) / 3
    else:
        for _ in range(3):
            fn()
        est = host_ms = (time.perf_counter() - t0) * 1e3 / 3
    est = max(est, 1e-3)
    for _ in range(_clamp(math.ceil(settings.warmup_ms / est), 1, settings.max_reps)):
        fn()
    n = _clamp(math.ceil(settings.rep_ms / est), settings.min_reps, settings.max_reps)
    if cuda:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        sync(device)
        if hide_host:
            cycles = int(sleep_cycles_per_ms(device) * (2.0 * host_ms + 0.05))
            for s, e in zip(starts, ends, strict=True):
                torch.cuda._sleep(cycles)
                s.record()
                fn()
                e.record()
                e.synchronize()
        else:
            for s, e in zip(starts, ends, strict=True):
                s.record()
                fn()
                e.record()
        sync(device)
        times = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
    else:
        times = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    med, q20, q80 = quantiles(times)
    return Timing(med, q20, q80, n)


# Calls timed back to back between synchronisations. Short enough that no call waits for the device: a
# queue of pending CUDA graph launches blocks the host early (in 64-call bursts of GPT-2's 1.2 ms step,
# H100, the median call took 65 us and the 80th percentile 156 us against 28 us at the 20th: waiting, not
# host work). A training loop never queues more than a step or two of optimizer launches ahead.
HOST_BURST = 16


def host_time(fn, device, settings, before=None):
    """Host-side microseconds of one call of ``fn``, each call timed on its own, no synchronisation inside
    the timed region, in bursts of back-to-back calls as a training loop makes them (the host runs ahead
    of the device). The device is synchronised only between bursts, so no call starts right after a
    blocking wait (a thread that has just slept in a synchronisation runs its next call slower, the more
    so the longer the wait), and a burst is too short to fill the launch queue. ``before``, when given,
    is called (untimed) before every call of ``fn``: what a training loop does between two calls.

    Returns (median, 20th, 80th percentile, calls). The garbage collector is paused while timing.
    """
    times = []
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        deadline = time.perf_counter() + settings.host_budget_s
        while len(times) < settings.host_calls and (len(times) < 5 or time.perf_counter() < deadline):
            sync(device)
            if before is not None:
                before()
            fn()  # the burst's first call follows the synchronisation: not timed
            for _ in range(min(HOST_BURST, settings.host_calls - len(times))):
                if before is not None:
                    before()
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e6)
        sync(device)
    finally:
        if was_enabled:
            gc.enable()
    med, q20, q80 = quantiles(times)
    return med, q20, q80, len(times)


def time_steps(step, device, iters, min_s=0.0, max_iters=None):
    """Per-step milliseconds of synchronised steps: CUDA events around each call and a wait for the second, so
    every step starts on an idle device and its host work before the first kernel counts (perf_counter on the
    CPU). At least ``iters`` steps, and more until they add up to ``min_s`` seconds, up to ``max_iters``."""
    times = []
    max_iters = max(iters, max_iters or iters)
    while len(times) < iters or (sum(times) < min_s * 1e3 and len(times) < max_iters):
        if is_cuda(device):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            step()
            times.append((time.perf_counter() - t) * 1e3)
    return times


def b2b_steps_per_round(iters):
    """Steps per back-to-back round for a run of ``iters`` timed steps."""
    return max(5, iters // 4)


def time_back_to_back(step, device, rounds, per_round):
    """Per-step milliseconds of ``rounds`` rounds of ``per_round`` back-to-back calls: one CUDA event before and one
    after each round, no synchronisation inside a round (perf_counter on the CPU); synchronised between rounds.
    The training loop's throughput with the host running ahead of the device."""
    times = []
    for _ in range(rounds):
        sync(device)
        if is_cuda(device):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(per_round):
                step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / per_round)
        else:
            t = time.perf_counter()
            for _ in range(per_round):
                step()
            times.append((time.perf_counter() - t) * 1e3 / per_round)
    return times


def round_orders(names, rounds, seed=0):
    """The order of each round: every name once, and never the same name twice in a row, also across rounds (a step
    run right after itself may find its data still in the L2 cache). Two names alternate (ABAB: each always runs
    right after the other); more are shuffled with a fixed seed, so that position and predecessor are spread over
    them alike."""
    import random

    rng, orders, last = random.Random(seed), [], None
    for _ in range(rounds):
        if len(names) == 2:
            order = list(names) if last != names[0] else list(names[::-1])
        else:
            order = list(names)
            rng.shuffle(order)
            while len(names) > 1 and order[0] == last:
                rng.shuffle(order)
        orders.append(order)
        last = order[-1]
    return orders


def time_paired(steps, device, rounds, per_turn=1):
    """Time the ``steps`` (name -> callable) alternately, so that drift (clocks, temperature, other tenants) falls
    on all of them alike: each round gives every step one turn, in the order of round_orders. A turn is
    ``per_turn`` calls back to back after a synchronisation, with a CUDA event before and after them and a wait
    for the second (perf_counter on the CPU): ``per_turn=1`` times synchronised steps, more times back-to-back
    steps. Returns name -> (device ms per call, host us per call: from the first call to the last one's return)."""
    out = {n: ([], []) for n in steps}
    cuda = is_cuda(device)
    for order in round_orders(list(steps), rounds):
        for name in order:
            ms, us = out[name]
            sync(device)
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t = time.perf_counter()
            for _ in range(per_turn):
                steps[name]()
            host = time.perf_counter() - t
            if cuda:
                end.record()
                end.synchronize()
                ms.append(start.elapsed_time(end) / per_turn)
            else:
                ms.append(host * 1e3 / per_turn)
            us.append(host * 1e6 / per_turn)
    return out


def timing_fields(times, prefix=""):
    """{prefix + median_ms, q20_ms, q80_ms}: the quantiles of a list of milliseconds."""
    med, q20, q80 = quantiles(times)
    return {f"{prefix}median_ms": med, f"{prefix}q20_ms": q20, f"{prefix}q80_ms": q80}


def copy_bandwidth(device, nbytes, settings):
    """Device-to-device copy bandwidth of ``dst.copy_(src)`` over ``nbytes`` buffers, counting read + write."""
    n = nbytes // 4
    t = _time_copy(n, device, settings)
    free_memory(device)
    moved = 2 * n * 4
    return dict(bytes_moved=moved, buffer_bytes=n * 4, gbps=gbps(moved, t.median_ms), **t.as_dict())


def _time_copy(n, device, settings):
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    return device_time(lambda: dst.copy_(src), device, settings)


def capture_cuda_graph(fn, warmup=3):
    """Warm ``fn`` up on a side stream, then capture one call of it into a CUDA graph; returns the graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def free_memory(device, baseline=None):
    """Return released device memory to the driver. The (slow) cycle collector runs only when more than
    ``baseline`` bytes are still allocated, i.e. when something the caller dropped is held by a cycle."""
    if not is_cuda(device):
        return
    torch.cuda.synchronize()
    if baseline is None or torch.cuda.memory_allocated(device) > baseline:
        gc.collect()
    torch.cuda.empty_cache()


@contextmanager
def cpu_threads(device, n=1):
    """Runs on the CPU use ``n`` threads: tiny tensors gain nothing from more, and on a busy machine OpenMP's
    spinning threads slow them down by orders of magnitude."""
    if torch.device(device).type != "cpu":
        yield
        return
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


# ----------------------------------------------------------------------------------------------- cases
class Skip(Exception):
    """A case that cannot run here, with the reason."""


def error_fields(e, with_traceback=True):
    """``reason`` (and ``traceback``) of an exception, for a result row."""
    out = dict(reason=f"{type(e).__name__}: {e}"[:2000])
    if with_traceback:
        out["traceback"] = traceback.format_exc()[-4000:]
    return out


def run_guarded(row, device, body):
    """Run ``body(row)``, which fills ``row``; never raises. Sets ``status`` ("ok" unless ``body`` set another),
    or records why not: "skipped" (``Skip``), "oom" (out of device memory) or "failed" (any other exception,
    with its traceback). Frees the device memory ``body`` left (its locals are gone when it returns), and
    records how long the case took in ``seconds``."""
    t0 = time.perf_counter()
    baseline = allocated(device) if is_cuda(device) else None
    try:
        body(row)
        if row.get("status") is None:
            row["status"] = "ok"
    except Skip as e:
        row.update(status="skipped", reason=str(e))
    except torch.cuda.OutOfMemoryError as e:
        row.update(status="oom", reason=f"OutOfMemoryError: {str(e).splitlines()[0]}"[:500])
    except Exception as e:  # recorded; the run goes on
        row.update(status="failed", **error_fields(e))
    finally:
        try:
            free_memory(device, baseline)
        except Exception as e:  # a sticky CUDA error: the next cases will say so too
            row["cleanup_error"] = f"{type(e).__name__}: {e}"[:500]
    row["seconds"] = round(time.perf_counter() - t0, 2)
    return row


def budget_spent(row, args):
    """Mark ``row`` skipped because the run's --budget-s is spent; returns it."""
    row.update(status="skipped", reason=f"time budget (--budget-s {args.budget_s:g}) spent")
    return row


RESULT_PREFIX = "FLATOPT_BENCH_RESULT "  # a worker subprocess's result line on stdout


def print_result(row):
    """A worker subprocess's last word: its result row, on one line of stdout."""
    print(RESULT_PREFIX + json.dumps(row, default=str), flush=True)


def run_worker(cmd, timeout_s):
    """Run a worker command in its own process group; returns the result row it printed (print_result). On
    timeout the whole group (the compiler's worker processes included) is killed."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a process outside the group still holds the pipes
            err = ""
        return dict(
            status="timeout",
            reason=f"did not finish within {timeout_s:g} s (compilation, warm-up and timing); not measured",
            stderr_tail=(err or "")[-2000:],
        )
    for line in reversed(out.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    return dict(
        status="failed",
        reason=f"worker exited with status {proc.returncode} and printed no result",
        stderr_tail=(err or "")[-2000:],
    )


# -------------------------------------------------------------------------------------- parameter sets
@dataclass
class ShapeSet:
    name: str  # key used in results
    title: str
    rule: str  # how the shapes are generated
    shapes: list  # [(name, shape)]

    @property
    def tensors(self):
        return len(self.shapes)

    @property
    def numel(self):
        return sum(math.prod(s) for _, s in self.shapes)

    def summary(self):
        return dict(title=self.title, rule=self.rule, tensors=self.tensors, elements=self.numel)


def gpt2_shapes(vocab=50257, n_ctx=1024, d=768, layers=12):
    """GPT-2 small in Hugging Face naming: wte, wpe, per block ln_1 w/b, attn.c_attn w [d, 3d]/b,
    attn.c_proj w [d, d]/b, ln_2 w/b, mlp.c_fc w [d, 4d]/b, mlp.c_proj w [4d, d]/b, then ln_f w/b:
    4 + 12 * layers tensors (148 and 124,439,808 elements for GPT-2 small)."""
    shapes = [("wte.weight", (vocab, d)), ("wpe.weight", (n_ctx, d))]
    for i in range(layers):
        h = f"h.{i}."
        shapes += [
            (h + "ln_1.weight", (d,)),
            (h + "ln_1.bias", (d,)),
            (h + "attn.c_attn.weight", (d, 3 * d)),
            (h + "attn.c_attn.bias", (3 * d,)),
            (h + "attn.c_proj.weight", (d, d)),
            (h + "attn.c_proj.bias", (d,)),
            (h + "ln_2.weight", (d,)),
            (h + "ln_2.bias", (d,)),
            (h + "mlp.c_fc.weight", (d, 4 * d)),
            (h + "mlp.c_fc.bias", (4 * d,)),
            (h + "mlp.c_proj.weight", (4 * d, d)),
            (h + "mlp.c_proj.bias", (d,)),
        ]
    return shapes + [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]


def llama_shapes(vocab=32000, d=2048, ff=8192, layers=16):
    """Llama-style decoder, untied head, full multi-head attention: embed_tokens [vocab, d], per layer
    q/k/v/o [d, d], gate/up [ff, d], down [d, ff], input/post-attention RMSNorm [d], then norm [d] and
    lm_head [vocab, d]: 3 + 9 * layers tensors (147 and 1,204,881,408 elements with the defaults)."""
    shapes = [("embed_tokens.weight", (vocab, d))]
    for i in range(layers):
        L = f"layers.{i}."
        shapes += [(L + f"self_attn.{x}_proj.weight", (d, d)) for x in "qkvo"]
        shapes += [(L + "mlp.gate_proj.weight", (ff, d)), (L + "mlp.up_proj.weight", (ff, d))]
        shapes += [(L + "mlp.down_proj.weight", (d, ff))]
        shapes += [(L + "input_layernorm.weight", (d,)), (L + "post_attention_layernorm.weight", (d,))]
    return shapes + [("norm.weight", (d,)), ("lm_head.weight", (vocab, d))]


def _splitmix64(seed):
    """A tiny, version-independent random stream (SplitMix64), so the set is the same everywhere."""
    mask = (1 << 64) - 1
    x = seed & mask
    while True:
        x = (x + 0x9E3779B97F4A7C15) & mask
        z = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        yield z ^ (z >> 31)


def many_small_shapes(n=3000, lo=256, hi=32768, seed=7):
    """``n`` 1-D tensors with sizes uniform in [lo, hi] from SplitMix64(seed). With the defaults: 3000
    tensors, 48,843,948 elements (seed 7 puts the total near the design notes' 48.9M)."""
    rng = _splitmix64(seed)
    return [(f"t{i}", (lo + next(rng) % (hi - lo + 1),)) for i in range(n)]


SET_NAMES = ("gpt2", "many-small", "llama")


def shape_set(name, smoke=False):
    """One of the benchmark's parameter sets; ``smoke=True`` gives a tiny set built by the same rule."""
    if name == "gpt2":
        title = "GPT-2 small shapes"
        rule = "wte 50257x768, wpe 1024x768, 12 blocks (ln_1, c_attn 768x2304, c_proj 768x768, ln_2, c_fc 768x3072, "
        rule += "mlp c_proj 3072x768), ln_f"
        shapes = gpt2_shapes(**(dict(vocab=67, n_ctx=16, d=8, layers=2) if smoke else {}))
    elif name == "many-small":
        title = "3000 small tensors (256..32K elements)"
        rule = "3000 1-D tensors, sizes uniform in [256, 32768] from SplitMix64(seed=7)"
        shapes = many_small_shapes(**(dict(n=30, lo=4, hi=64) if smoke else {}))
    elif name == "llama":
        title = "Llama-style 1.2B shapes"
        rule = "vocab 32000, hidden 2048, MLP 8192, 16 layers (q, k, v, o, gate, up, down, 2 norms), norm, untied head"
        shapes = llama_shapes(**(dict(vocab=50, d=8, ff=16, layers=2) if smoke else {}))
    else:
        raise ValueError(f"unknown parameter set {name!r}; expected one of {SET_NAMES}")
    if smoke:
        title, rule = f"tiny stand-in for {title} (smoke run)", f"same rule at tiny sizes; full set: {rule}"
    return ShapeSet(name, title, rule, shapes)


def make_params(shapes, dtype, device, seed=0, grads=True):
    """Leaf parameters with random normal values and (``grads=True``) random normal ``.grad`` (never zeros)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    params = []
    for _, shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=gen, device=device, dtype=dtype))
        if grads:
            p.grad = torch.randn(shape, generator=gen, device=device, dtype=dtype)
        params.append(p)
    return params


DECAY_RULE = (
    "weight decay on the tensors of 2 or more dimensions, none on the 1-D ones (biases, norms), as GPT and Llama "
    "recipes set it; a set of 1-D tensors only (the 3000 small tensors) is split alternately, every other tensor"
)


def decay_split(shapes):
    """Indices of the tensors with weight decay and of those without (DECAY_RULE): two non-empty lists when the
    set has two tensors or more."""
    decay = [i for i, (_, s) in enumerate(shapes) if len(s) >= 2]
    if not decay or len(decay) == len(shapes):
        decay = list(range(0, len(shapes), 2))
    chosen = set(decay)
    return decay, [i for i in range(len(shapes)) if i not in chosen]


# ---------------------------------------------------------------------------------- flatopt's internals
class FlatoptInternals:
    """What a flatopt optimizer builds, read for benchmarks that explain its costs (launches per bucket, the step
    graph, the kernel launch configuration), through ``flatopt.inspect(opt)`` and the engine's own methods. This
    class is the one place in benchmarks/ that reads them."""

    def __init__(self, opt):
        self.opt = opt
        self.look = flatopt.inspect(opt)

    @property
    def buffers(self):
        """The optimizer's flat buffers (flatopt.FlatBuffer: data, grad, states, grad_views, meta, device)."""
        return self.look.buffers

    def hparams(self, device):
        """The device table of hyper-parameters the kernels read on ``device``."""
        return self.look.tables[torch.device(device)]

    @property
    def in_backward(self):
        """In-backward mode's engine (``launches``, ``buckets``), or None in step mode."""
        return self.look.engine if self.opt.in_backward else None

    @property
    def step_graph(self):
        """The CUDA graph step() replays (``graph``, ``reused``, ``recorded``, ``failed``); its key is
        ``step_graph_key()``."""
        return self.look.step_graph

    def step_graph_key(self):
        """The key step() looks its graph up by."""
        from flatopt.step_graph import StepGraph

        return StepGraph.key_of(self.buffers, self.hparams(self.buffers[0].device))

    def new_step_graph(self):
        """Replace the step graph by a fresh one (it records again); returns it."""
        from flatopt.step_graph import StepGraph

        self.look.engine.step_graph = StepGraph()
        return self.look.engine.step_graph

    def check_bindings_at_step(self):
        """The binding check step() runs without a full check (the first and last parameter of each buffer)."""
        return self.opt.check_bindings(full=False)

    def refresh_hparams(self):
        """The hyper-parameter refresh step() runs (a copy to the device only when they changed)."""
        return self.look.engine.refresh_hparams()

    @staticmethod
    def default_bucket_size():
        """In-backward mode's bucket_size when none is given (elements)."""
        from flatopt.options import DEFAULT_BUCKET_SIZE

        return DEFAULT_BUCKET_SIZE

    @staticmethod
    def kernels():
        """flatopt's Triton kernels (``adamw_step``, ``sgd_step``, ``lion_step``)."""
        from flatopt import kernels

        return kernels

    @staticmethod
    def launch_config():
        """(elements per program, warps per program) of the step kernels."""
        from flatopt.kernels import common

        return common.BLOCK_SIZE, common.NUM_WARPS

    @staticmethod
    def set_launch_config(block_size, num_warps):
        from flatopt.kernels import common

        common.BLOCK_SIZE, common.NUM_WARPS = block_size, num_warps

    @staticmethod
    def grad_sources(buf, grads):
        """A gathering launch's ``sources=``: the kernel reads each gradient where it lies (flatopt.layout)."""
        from flatopt.layout import GradSources

        return GradSources.of(buf, grads)


def internals(opt):
    """The private parts of flatopt optimizer ``opt`` that benchmarks read (FlatoptInternals)."""
    return FlatoptInternals(opt)


def state_bytes(opt):
    """Bytes of optimizer state: of every flat state buffer for a flatopt optimizer, of every tensor in ``state``
    for torch.optim ones (an iterable of optimizers is summed)."""
    if hasattr(opt, "flat") and hasattr(opt, "use_step_graph"):  # flatopt
        return sum(t.numel() * t.element_size() for b in internals(opt).buffers for t in b.states.values())
    opts = [opt] if isinstance(opt, torch.optim.Optimizer) else list(opt)
    tensors = [t for o in opts for st in o.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def in_backward_stats(opt):
    """In-backward mode's counters (None in step mode): kernel launches so far, buckets, the largest bucket's
    elements, and how its buckets' launches went (replayed from their CUDA graphs, recorded, or launched
    directly after recording failed)."""
    ib = internals(opt).in_backward
    if ib is None:
        return None
    graphs = [b.graph for b in ib.buckets]
    return dict(
        launches=ib.launches,
        buckets=len(ib.buckets),
        largest_bucket_elements=max(b.end - b.start for b in ib.buckets),
        bucket_graph_replays=sum(g.reused for g in graphs),
        bucket_graphs_recorded=sum(g.recorded for g in graphs),
        buckets_launching_directly=sum(g.failed for g in graphs),
    )


# --------------------------------------------------------------------------------------------- targets
def target(what, value, threshold, unit, *, higher_is_better=False, note=None, why=None, **where):
    """One target: ``met`` and ``margin`` (> 0: met by that much, in ``unit``), or ``met=None`` with ``note``
    saying why it was not evaluated. ``where``: the case's keys (model, set, dtype, ...), stored as fields."""
    met = margin = None
    if value is not None and threshold is not None:
        margin = value - threshold if higher_is_better else threshold - value
        met = margin >= 0
    return dict(
        target=what,
        **where,
        value=value,
        threshold=threshold,
        unit=unit,
        met=met,
        margin=margin,
        note=None if met is not None else (note or "not measured"),
        why=why,
    )


def why_not(row):
    """Why a row has no value: not run, or its status and reason."""
    if row is None:
        return "not run"
    return f"{row['status']}: {row.get('reason') or ''}".strip()


def _unit_value(x, unit):
    return f"{x:.3f} {unit}" if unit != "%" else f"{x:.1f} %"


def targets_markdown(targets, where):
    """The table of ``targets``: columns target, the ``where`` keys, value, threshold, met, margin."""
    head = ["target", *where, "value", "threshold", "met", "margin"]
    rows = []
    for t in targets:
        keys = ["" if t.get(k) is None else str(t[k]) for k in where]
        if t["met"] is None:
            rows.append([t["target"], *keys, "-", num(t.get("threshold"), ".3f"), "n/a", t.get("note") or "-"])
            continue
        unit = t["unit"]
        margin = f"{t['margin']:+.3f} {'pp' if unit == '%' else unit}"
        if unit == "ms" and t["threshold"]:
            margin += f" ({100 * t['margin'] / t['threshold']:+.1f} %)"
        rows.append([t["target"], *keys, _unit_value(t["value"], unit), _unit_value(t["threshold"], unit),
                     "yes" if t["met"] else "**no**", margin])  # fmt: skip
    lines = md_table(head, rows)
    whys = [t for t in targets if t.get("why")]
    if whys:
        lines += ["", "Why missed:", ""]
        lines += [f"- {', '.join(str(t[k]) for k in where if t.get(k) is not None)}, {t['target']}: {t['why']}"
                  for t in whys]  # fmt: skip
    return lines


def targets_summary(targets):
    """(met, missed, not evaluated) counts."""
    return (
        sum(t["met"] is True for t in targets),
        sum(t["met"] is False for t in targets),
        sum(t["met"] is None for t in targets),
    )


# -------------------------------------------------------------------------------------------- markdown
def num(x, spec):
    """``format(x, spec)``, or "-" when x is not a number."""
    return format(x, spec) if isinstance(x, (int, float)) and not isinstance(x, bool) else "-"


def spread(row, prefix="", spec=".3f"):
    """ "median (p20-p80)" of a row's ``{prefix}median_ms``, ``q20_ms``, ``q80_ms``; "-" without a median."""
    med = row.get(f"{prefix}median_ms")
    if med is None:
        return "-"
    return f"{num(med, spec)} ({num(row.get(f'{prefix}q20_ms'), spec)}-{num(row.get(f'{prefix}q80_ms'), spec)})"


def md_table(head, rows):
    """Markdown lines of a table."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def env_line(record):
    """Device, library versions, date and commit of a result, on one line."""
    env = record.get("env") or record.get("environment") or {}
    commit = env.get("git_commit")
    parts = [
        str(env.get("device_name", env.get("device"))),
        f"torch {env.get('torch')}",
        f"triton {env.get('triton')}",
    ]
    if env.get("cuda"):
        parts.append(f"CUDA {env['cuda']}")
    if env.get("cpu_threads"):
        parts.append(f"{env['cpu_threads']} torch thread(s)")
    if env.get("load_average_1_5_15_min"):
        parts.append(f"load average {env['load_average_1_5_15_min'][0]:g} at the start")
    parts.append(str(env.get("date")))
    if commit:
        parts.append(f"commit {commit[:12]}" + (" (with uncommitted changes)" if env.get("git_dirty") else ""))
    return ", ".join(parts)


def smoke_banner(record):
    return [f"> **{record.get('note') or SMOKE_NOTE}**", ""] if record.get("smoke") else []


def first_line(text, most=150):
    return (text or "").strip().splitlines()[0][:most] if (text or "").strip() else ""


# ----------------------------------------------------------------------------------------- environment
GIT_COMMIT_VARIABLE = "FLATOPT_GIT_COMMIT"


def environment(device):
    """What a result must be stored with: device, library versions, date, commit.

    The commit is the repository's (``git rev-parse HEAD``, with ``git_dirty``), recorded with
    ``git_commit_source="repository"``. When the environment variable ``FLATOPT_GIT_COMMIT`` is set and not
    empty, its value is recorded as ``git_commit`` instead, with ``git_commit_source="FLATOPT_GIT_COMMIT"``: a
    copy of the working tree whose git metadata lags behind it (as on a machine the tree was copied to) is then
    recorded with the commit it was copied from, e.g. ``FLATOPT_GIT_COMMIT=$(git rev-parse HEAD) bash
    benchmarks/run_gpu.sh``. What the repository itself reported is kept as ``repository_git_commit`` and
    ``repository_git_dirty``.
    """
    import flatopt

    device = torch.device(device)
    env = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=str(device),
        python=platform.python_version(),
        platform=platform.platform(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        flatopt=flatopt.__version__,
    )
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError as e:  # pragma: no cover - triton is a dependency
        env["triton"] = f"not importable: {e}"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            device_name=props.name,
            device_memory_gib=round(props.total_memory / 2**30, 1),
            sm_count=props.multi_processor_count,
            capability=f"{props.major}.{props.minor}",
        )
    else:
        env["device_name"] = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
        env["cpu_threads"] = torch.get_num_threads()
        if hasattr(os, "getloadavg"):  # other work on the machine slows a CPU run down
            env["load_average_1_5_15_min"] = [round(x, 2) for x in os.getloadavg()]
    repo = _git()
    given = os.environ.get(GIT_COMMIT_VARIABLE, "").strip()
    if given:
        env.update(
            git_commit=given,
            git_commit_source=GIT_COMMIT_VARIABLE,
            repository_git_commit=repo.get("git_commit"),
            repository_git_dirty=repo.get("git_dirty"),
        )
    else:
        env.update(repo, git_commit_source="repository")
    return env


def _git():
    try:
        run = dict(cwd=REPO, capture_output=True, text=True, timeout=10)
        commit = subprocess.run(["git", "rev-parse", "HEAD"], **run)
        status = subprocess.run(["git", "status", "--porcelain"], **run)
    except (OSError, subprocess.SubprocessError):
        return dict(git_commit=None)
    if commit.returncode != 0:
        return dict(git_commit=None)
    return dict(git_commit=commit.stdout.strip(), git_dirty=bool(status.stdout.strip()))


def write_json(path, obj):
    """Write ``obj`` as JSON through a temporary file, so a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def timestamp():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def command_line(script, argv):
    """The command that produced a result, as run from the repository root."""
    args = list(argv if argv is not None else sys.argv[1:])
    return " ".join([f"python3 benchmarks/{script}.py", *args])


def new_record(benchmark, question, script, args, argv, device, **fields):
    """A result's common fields: schema, benchmark (its kind), question, smoke or measurement, environment
    (device, versions, date, commit) and command; then ``fields``."""
    smoke = bool(getattr(args, "smoke", False))
    return dict(
        schema=SCHEMA,
        benchmark=benchmark,
        question=question,
        kind="smoke" if smoke else "measurement",
        smoke=smoke,
        note=SMOKE_NOTE if smoke else None,
        env=environment(device),
        command=command_line(script, argv),
        **fields,
    )


# ------------------------------------------------------------------------------------------- arguments
def csv_list(choices):
    """An argparse type: a comma-separated, non-empty subset of ``choices``."""

    def parse(text):
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {', '.join(choices)}; got {text!r}")
        return items

    return parse


def parser(doc, budget_s, report=True):
    """The options every benchmark takes: --device, --smoke, --out, --json, --markdown, --budget-s, --seed and
    (``report``) --report."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    add = p.add_argument
    add("--device", default="cuda", help="cuda (default), or cpu with --smoke")
    add("--smoke", action="store_true", help="tiny sizes, few repeats: a code-path check whose output is not a result")
    add("--out", type=Path, default=None, help="directory for the JSON (default: benchmarks/results)")
    add("--json", type=Path, default=None, help="exact JSON path (overrides --out)")
    add("--markdown", type=Path, default=None, help="also write the markdown tables to this file")
    add("--budget-s", type=float, default=budget_s, help=f"wall-clock budget; later cases are skipped ({budget_s:g})")
    add("--seed", type=int, default=0)
    if report:
        add("--report", type=Path, default=None, help="print the markdown tables of a stored result and exit")
    return p


def check_device(p, args, cpu_ok=False, measures=None):
    """Refuse a CPU run that is not a smoke run (unless ``cpu_ok``) and a CUDA run without CUDA, saying what to do.
    ``measures``: what the script measures on a GPU, for the CPU refusal's message."""
    if getattr(args, "report", None) is not None:
        return
    if torch.device(args.device).type == "cpu" and not (args.smoke or cpu_ok):
        if measures is not None:
            p.error(f"{p.prog} {measures} and needs a CUDA GPU; none here (--device cpu --smoke runs its code path)")
        p.error("CPU timings answer nothing this benchmark asks; use --device cuda, or --smoke for a code-path check")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but CUDA is not available here; use --device cpu --smoke for a code-path check")


def output_path(args, kind):
    """--json, else ``--out`` (default: benchmarks/results, or a temporary folder for smoke runs) /
    ``[smoke-]KIND-STAMP.json``."""
    if args.json is not None:
        return Path(args.json)
    out = args.out or (Path(tempfile.gettempdir()) / "flatopt-smoke" if args.smoke else RESULTS_DIR)
    return Path(out) / f"{'smoke-' if args.smoke else ''}{kind}-{timestamp()}.json"


# ------------------------------------------------------------------------------------------- main tail
def main(argv, parse_args, run, markdown):
    """Every benchmark's main(): parse (bad arguments: argparse's message and exit status 2, returned); --report
    prints a stored result's tables; otherwise ``run(args, argv)`` (on the CPU with one thread, see cpu_threads)
    and return its exit status."""
    try:
        args = parse_args(argv)
    except SystemExit as e:
        return e.code
    if getattr(args, "report", None) is not None:
        print(markdown(json.loads(Path(args.report).read_text())), end="")
        return 0
    with cpu_threads(args.device):
        return run(args, argv)


def announce(record, path):
    """What a run prints first: the smoke note, the device and versions, where the JSON goes."""
    if record.get("smoke"):
        print(SMOKE_NOTE)
    print(f"{env_line(record)}; JSON: {path}", flush=True)


def finish(record, path, args, markdown, failed, start):
    """Every benchmark's last steps: record whether a flatopt case failed and the run's time, write the JSON,
    print the markdown (and write it to --markdown), say where; exit status 1 when a flatopt case failed."""
    record["flatopt_failed"] = bool(failed)
    record["total_s"] = round(time.monotonic() - start, 1)
    write_json(path, record)
    text = markdown(record)
    print("\n" + text, end="")
    if getattr(args, "markdown", None) is not None:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(text)
    if record.get("smoke"):
        print("\n" + SMOKE_NOTE)
    print(f"\nwrote {path} ({record['total_s']:.0f} s)")
    if failed:
        print(f"flatopt failed in {len(failed)} case(s); exit status 1", file=sys.stderr)
        return 1
    return 0
