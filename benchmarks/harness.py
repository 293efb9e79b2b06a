"""Shared benchmark harness: timers, the copy-bandwidth floor, parameter sets, environment records.

Every script measures the same way:

* device time: CUDA events around each call, after a first call (lazy state, JIT compilation) and a
  warm-up; the median and the 20th/80th percentiles of many repeats. The optimizer working sets are
  10x or more the size of an H100's L2 cache, so back-to-back calls do not hit a warm cache and no
  flush is needed between them.
* the floor: bytes that must move / device-to-device copy bandwidth measured in the same run
  (``dst.copy_(src)`` of a large buffer, counting read + write bytes).
* host time: ``time.perf_counter`` around each call, no synchronisation inside the timed region, in
  bursts of back-to-back calls between synchronisations (see ``host_time``).
* inputs: random normal parameters and gradients, never zeros.

On the CPU the same functions time with ``time.perf_counter``; that is only for smoke runs, which
check the code path and measure nothing (``SMOKE_NOTE``).

Import only; nothing here changes global state.
"""

import datetime
import gc
import json
import math
import os
import platform
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "benchmarks" / "results"
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


def bytes_per_element(optimizer, dtype):
    """Bytes that must move per parameter element in one step: AdamW fp32 28, SGD-momentum/Lion fp32 20."""
    reads, writes = TENSOR_PASSES[optimizer]
    if isinstance(dtype, str):
        dtype = DTYPES[dtype]
    return (reads + writes) * torch.empty((), dtype=dtype).element_size()


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


def _clamp(x, lo, hi):
    return max(lo, min(hi, x))


def device_time(fn, device, settings):
    """Time ``fn`` on ``device``: CUDA events around each call on CUDA, ``perf_counter`` on the CPU."""
    cuda = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else _no_sync
    sync()
    fn()  # lazy state, compilation
    sync()
    t0 = time.perf_counter()
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            fn()
        end.record()
        end.synchronize()
        est = start.elapsed_time(end) / 3
    else:
        for _ in range(3):
            fn()
        est = (time.perf_counter() - t0) * 1e3 / 3
    est = max(est, 1e-3)
    for _ in range(_clamp(math.ceil(settings.warmup_ms / est), 1, settings.max_reps)):
        fn()
    n = _clamp(math.ceil(settings.rep_ms / est), settings.min_reps, settings.max_reps)
    if cuda:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        sync()
        for s, e in zip(starts, ends, strict=True):
            s.record()
            fn()
            e.record()
        sync()
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
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else _no_sync
    times = []
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        deadline = time.perf_counter() + settings.host_budget_s
        while len(times) < settings.host_calls and (len(times) < 5 or time.perf_counter() < deadline):
            sync()
            if before is not None:
                before()
            fn()  # the burst's first call follows the synchronisation: not timed
            for _ in range(min(HOST_BURST, settings.host_calls - len(times))):
                if before is not None:
                    before()
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e6)
        sync()
    finally:
        if was_enabled:
            gc.enable()
    med, q20, q80 = quantiles(times)
    return med, q20, q80, len(times)


def _no_sync():
    return None


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
    if torch.device(device).type != "cuda":
        return
    torch.cuda.synchronize()
    if baseline is None or torch.cuda.memory_allocated(device) > baseline:
        gc.collect()
    torch.cuda.empty_cache()


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


def make_params(shapes, dtype, device, seed=0):
    """Leaf parameters with random normal values and random normal ``.grad`` (never zeros)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    params = []
    for _, shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=gen, device=device, dtype=dtype))
        p.grad = torch.randn(shape, generator=gen, device=device, dtype=dtype)
        params.append(p)
    return params


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
