"""Question: where does the device time of one captured training step go, flatopt's ``opt.capture`` against torch's
hand-captured CUDA graph (``flatopt-capture`` vs ``torch-fused-graph`` of bench_capture.py; eager ``flatopt`` and
``torch-fused`` for reference)?

Each implementation is made by bench_capture.py's builders on its model, seed and batches (the launch-bound "small" GPT;
``--models small,gpt2`` adds GPT-2 small). After a warm-up: the median ms per step from CUDA events around back-to-back
steps (harness.device_time) and around single steps with a synchronisation after each, as bench_capture.py times them
(host work before a step's first launch then counts); the host us of one step call; for the CUDA-graph cases the ms
and host us of ``graph.replay()`` alone (the call's host time less that: its Python and input copies); and a
torch.profiler trace (CPU + CUDA) of ``--steps`` steps: kernels and kernel us per step,
memset and memcpy us per step, device busy time and span per step, the top kernels, and the us per step of rough kernel
categories side by side, with flatopt-capture minus torch-fused-graph. CUPTI traces the kernels inside CUDA graph
replays on recent CUDA; a trace without kernels is recorded as such (``kernels_traced: false``).

GPU run from the repository root (well under a minute for the small model):

    PYTHONPATH=. python3 benchmarks/profile_capture.py [--models small,gpt2] [--out benchmarks/results/profiles]

Writes ``profile-capture-STAMP.json`` (and prints everything). It explains results; bench_capture.py measures them.
CPU smoke run (tiny models; the CUDA-graph implementations are recorded as skipped and the trace has no kernels;
measures nothing):

    PYTHONPATH=. python3 benchmarks/profile_capture.py --device cpu --smoke --out /tmp/flatopt-smoke
"""

import collections
import itertools
import sys
import time
from dataclasses import asdict
from pathlib import Path

if __package__ in (None, ""):
    sys.path.append(str(Path(__file__).resolve().parents[1]))

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from benchmarks import bench_capture, harness

DEFAULT_IMPLS = [
    "torch-fused",
    "torch-fused-graph",
    "torch-fused-graph-none",
    "flatopt",
    "flatopt-keep-grads",
    "flatopt-capture",
]
MINE, THEIRS = "flatopt-capture", "torch-fused-graph"
CATEGORIES = (  # rough, by lower-cased kernel name: the first match wins
    ("optimizer", ("adam",)),  # torch's FusedAdamMathFunctor, flatopt's adamw_kernel
    ("zeroing", ("memset", "fill", "zero")),  # zero_grad: flatopt's fill, torch's foreach ZeroFunctor
    ("gradcopy", ("copyfunctor",)),  # flatopt's batched gradient copy in a captured step (torch._foreach_copy_)
    ("optimizer", ("multi_tensor",)),  # torch's foreach step-count increment
    ("memcpy", ("memcpy",)),  # the static-input copies
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("gemm", ("gemm", "sm90", "sm80", "cutlass", "nvjet", "cublas")),
    ("add", ("add", "accumulategrad")),  # gradient accumulation (AccumulateGrad), residual adds and other adds
)
CATEGORY_NAMES = list(dict.fromkeys(c for c, _ in CATEGORIES)) + ["other"]


def category(name):
    low = name.lower()
    return next((cat for cat, keys in CATEGORIES if any(k in low for k in keys)), "other")


def profile_steps(one, steps, top, device):
    """Trace ``steps`` back-to-back steps; device time per step, in total, by category and by kernel."""
    harness.sync(device)
    cuda = harness.is_cuda(device)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(steps):
            one()
        harness.sync(device)
    dev = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    by_name, cats, mem = collections.defaultdict(lambda: [0, 0.0]), dict.fromkeys(CATEGORY_NAMES, 0.0), [0.0, 0.0]
    kernels = kernel_us = 0
    for e in dev:
        us, low = e.time_range.elapsed_us(), e.name.lower()
        by_name[e.name][0] += 1
        by_name[e.name][1] += us
        cats[category(e.name)] += us
        if "memset" in low or "memcpy" in low:
            mem["memcpy" in low] += us
        else:
            kernels, kernel_us = kernels + 1, kernel_us + us
    busy, reach = 0.0, float("-inf")  # union of the device intervals
    for start, end in sorted((e.time_range.start, e.time_range.end) for e in dev):
        if end > reach:
            busy, reach = busy + end - max(start, reach), end
    span = (max(e.time_range.end for e in dev) - min(e.time_range.start for e in dev)) if dev else 0.0
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    out = dict(
        steps=steps, kernels_traced=kernels > 0, kernels_per_step=kernels / steps, kernel_us_per_step=kernel_us / steps,
        memset_us_per_step=mem[0] / steps, memcpy_us_per_step=mem[1] / steps, busy_us_per_step=busy / steps,
        span_us_per_step=span / steps, categories={c: us / steps for c, us in cats.items()},
        top=[dict(name=n[:80], per_step=c / steps, us_per_step=us / steps, category=category(n))
             for n, (c, us) in ranked],
    )  # fmt: skip
    if not kernels:
        out["note"] = (
            "no CUDA kernels in the trace: CUPTI did not report the kernels of these steps (graph replays?)"
            if cuda
            else "no CUDA kernels: a CPU run traces host operations only"
        )
    return out


def stepper(step, batches):
    """One training step per call, cycling through the batches as bench_capture.py does."""
    counter = itertools.count()
    return lambda: step(*batches[next(counter) % len(batches)])


def run_impl(model_name, impl, device, args):
    """Build, warm up, time and profile one implementation; never raises (failures are recorded in the row)."""
    row = dict(model=model_name, impl=impl, note=bench_capture.IMPL_BY_NAME[impl].note, status=None)
    if bench_capture.IMPL_BY_NAME[impl].needs_cuda and device.type != "cuda":
        return dict(row, status="skipped", reason="CUDA graphs need a CUDA device")
    cfg = (bench_capture.SMOKE_MODELS if args.smoke else bench_capture.MODELS)[model_name]
    settings = harness.timer_settings(args.smoke)

    def body(row):
        batches = bench_capture.make_batches(cfg, device, args.seed)
        model = bench_capture.make_model(cfg, device, args.seed)
        step, keep, release = bench_capture.build(impl, model, batches, device, args.compile_backend)
        try:
            one = stepper(step, batches)
            for _ in range(args.warmup):
                one()
            harness.sync(device)
            row["event_ms"] = harness.device_time(one, device, settings).as_dict()
            times = harness.time_steps(one, device, args.iters)
            row["synced_ms"] = dict(harness.timing_fields(times), iters=args.iters)
            med, q20, q80, n = harness.host_time(one, device, settings)
            row["host_us"] = dict(median_us=med, q20_us=q20, q80_us=q80, calls=n)
            graph = getattr(step, "graph", None) or next((k for k in keep if isinstance(k, torch.cuda.CUDAGraph)), None)
            if graph is not None:
                row["replay_ms"] = harness.device_time(graph.replay, device, settings).as_dict()
                med, q20, q80, n = harness.host_time(graph.replay, device, settings)  # the call's host time less
                row["replay_host_us"] = dict(median_us=med, q20_us=q20, q80_us=q80, calls=n)  # this: its Python
            row["profile"] = profile_steps(one, args.steps, args.top, device)
        finally:
            if release is not None:
                release()

    return harness.run_guarded(row, device, body)


def print_row(r):
    print(f"\n== {r['model']} {r['impl']}: {r['note']}")
    if r["status"] != "ok":
        print(f"  {r['status'].upper()}: {r['reason']}")
        return
    replay = ""
    if "replay_ms" in r:
        replay = (
            f", replay alone {r['replay_ms']['median_ms']:.4f} ms (host {r['replay_host_us']['median_us']:.1f} us, "
            f"the call's other host work {r['host_us']['median_us'] - r['replay_host_us']['median_us']:.1f} us)"
        )
    print(
        f"  events {r['event_ms']['median_ms']:.4f} ms back-to-back, {r['synced_ms']['median_ms']:.4f} ms synchronised "
        f"per step (as bench_capture){replay}; host {r['host_us']['median_us']:.1f} us per call"
    )
    p = r["profile"]
    print(
        f"  profile per step: {p['kernels_per_step']:.1f} kernels, {p['kernel_us_per_step']:.1f} us kernels, memset "
        f"{p['memset_us_per_step']:.1f} us, memcpy {p['memcpy_us_per_step']:.1f} us; device busy "
        f"{p['busy_us_per_step']:.1f} us of a {p['span_us_per_step']:.1f} us span"
    )
    if p.get("note"):
        print(f"  NOTE: {p['note']}")
    print(f"  {'us/step':>9} {'n/step':>7}  {'category':9} kernel")
    for k in p["top"]:
        print(f"  {k['us_per_step']:9.2f} {k['per_step']:7.2f}  {k['category']:9} {k['name']}")


def _get(r, *keys):
    for k in keys:
        r = r.get(k) if isinstance(r, dict) else None
    return r


METRICS = [
    ("events ms, back-to-back", ("event_ms", "median_ms")), ("events ms, synchronised", ("synced_ms", "median_ms")),
    ("graph.replay() alone ms", ("replay_ms", "median_ms")), ("host us per call", ("host_us", "median_us")),
    ("graph.replay() alone host us", ("replay_host_us", "median_us")),
] + [(f"{k.replace('_', ' ')}", ("profile", k)) for k in ("kernels_per_step", "kernel_us_per_step",
     "memset_us_per_step", "memcpy_us_per_step", "busy_us_per_step", "span_us_per_step")
] + [(f"{c} us", ("profile", "categories", c)) for c in CATEGORY_NAMES]  # fmt: skip


def summary(rows, model):
    """Every metric and category side by side, with flatopt-capture minus torch-fused-graph; printed and returned."""
    ok = {r["impl"]: r for r in rows if r["model"] == model and r["status"] == "ok"}
    diff, w = f"{MINE} - {THEIRS}", max([len(i) + 2 for i in ok] + [12])
    print(f"\n== {model}, per step; diff: {diff}\n{'':40}" + "".join(f"{i:>{w}}" for i in ok) + f"{'diff':>{w}}")
    out = {}
    for label, path in METRICS:
        vals = {i: _get(r, *path) for i, r in ok.items()}
        d = vals[MINE] - vals[THEIRS] if vals.get(MINE) is not None and vals.get(THEIRS) is not None else None
        out[label] = dict(vals, **{diff: d})
        cells = [("-" if v is None else f"{v:.4f}") for v in vals.values()] + ["-" if d is None else f"{d:+.4f}"]
        print(f"{label:40}" + "".join(f"{c:>{w}}" for c in cells))
    return out


def parse_args(argv=None):
    p = harness.parser(__doc__, budget_s=600.0, report=False)
    p.set_defaults(out=harness.PROFILES_DIR)
    add = p.add_argument
    add("--models", type=harness.csv_list(tuple(bench_capture.MODELS)), default=["small"], help="default: small")
    add("--impls", type=harness.csv_list(tuple(bench_capture.IMPL_BY_NAME)), default=DEFAULT_IMPLS,
        help=f"default: {','.join(DEFAULT_IMPLS)}")  # fmt: skip
    add("--warmup", type=int, default=None, help="training steps before any timing (default: 20; smoke 1)")
    add("--iters", type=int, default=None, help="steps timed with a synchronisation after each (default: 40; smoke 2)")
    add("--steps", type=int, default=None, help="steps traced by torch.profiler (default: 20; smoke 2)")
    add("--top", type=int, default=15, help="kernels listed per implementation (default: 15)")
    add("--compile-backend", default="inductor", help="for the torch.compile implementations (default: inductor)")
    args = p.parse_args(argv)
    harness.check_device(p, args, measures="profiles CUDA graphs and kernels")
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 20)
    args.iters = args.iters if args.iters is not None else (2 if args.smoke else 40)
    args.steps = args.steps if args.steps is not None else (2 if args.smoke else 20)
    return args


def markdown(record):
    """Per model, the summary's metrics side by side."""
    lines = harness.smoke_banner(record) + [f"Capture profile: {harness.env_line(record)}.", ""]
    for model, summary in (record.get("summary") or {}).items():
        impls = list(dict.fromkeys(k for v in summary.values() for k in v))
        rows = [[label] + [harness.num(vals.get(i), ".4f") for i in impls] for label, vals in summary.items()]
        lines += [f"{model}, per step:", ""] + harness.md_table(["metric", *impls], rows) + [""]
    return "\n".join(lines) + "\n"


def main(argv=None):
    return harness.main(argv, parse_args, run, markdown)


def run(args, argv):
    start = time.monotonic()
    device = torch.device(args.device)
    path = harness.output_path(args, "profile-capture")
    models = bench_capture.SMOKE_MODELS if args.smoke else bench_capture.MODELS
    record = harness.new_record(
        "profile-capture",
        "where the device time of one captured training step goes: flatopt-capture vs torch-fused-graph",
        "profile_capture", args, argv, device,
        settings={k: str(v) for k, v in vars(args).items()},
        models={m: asdict(models[m]) for m in args.models}, categories=CATEGORIES, results=[], summary={},
    )  # fmt: skip
    harness.announce(record, path)
    for m in args.models:
        for impl in args.impls:
            record["results"].append(run_impl(m, impl, device, args))
            print_row(record["results"][-1])
            harness.write_json(path, record)
        record["summary"][m] = summary(record["results"], m)
    failed = [r for r in record["results"] if r["status"] == "failed"]
    return harness.finish(record, path, args, markdown, failed, start)


if __name__ == "__main__":
    sys.exit(main())
