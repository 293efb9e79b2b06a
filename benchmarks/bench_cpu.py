"""Question: on the CPU, does flatopt's step (``backend="cpu"``, the default there) cost less than torch.optim's
fastest implementation, and than lion-pytorch, alone and as a training loop pays for it?

One run, on the CPU with a fixed number of torch threads (``--threads``, recorded), over parameter sets from many
small tensors to 10M+ parameters, fp32 and bf16 (states in the parameter's dtype), one param group:

    many-small   1000 tensors of 1024 elements (1.0M)
    gpt-4m       GPT-2-style shapes, vocab 4096, context 256, width 256, 4 layers (52 tensors, 4.3M)
    gpt-14m      GPT-2-style shapes, vocab 8192, context 512, width 384, 6 layers (76 tensors, 14.0M)

Implementations:

    torch-foreach   torch.optim, foreach=True                                    AdamW, SGD
    torch-fused     torch.optim, fused=True (torch's CPU kernels)                AdamW, SGD
    lion-pytorch    lion_pytorch.Lion (the ``bench`` extra)                      Lion
    flatopt         flatopt, backend="cpu"                                       AdamW, SGD, Lion

SGD with momentum 0.9. Two variants: ``step``, ``opt.step()`` alone with the gradients in place (random normal: in
``.grad`` for torch.optim and lion-pytorch, in flatopt's flat gradient buffer, where covered layers would write them);
``loop``, what a training loop pays: ``opt.zero_grad()`` (set_to_none=True), a cheap backward that lands every
gradient as autograd lands it (``loss = sum((p * c).sum())``, ``c`` a non-zero number that changes from call to
call: each parameter's gradient is a new tensor, which ``.grad`` takes; flatopt's step copies the small ones into its
flat buffer and reads the others where they lie, as on any CPU model without covered layers), then ``opt.step()``.

Timing: per case (set, dtype, optimizer, variant) every implementation is built and warmed up, then timed in rounds,
each giving every implementation one call in turn in a shuffled order (harness.time_paired: drift and other tenants
fall on all of them alike), ``time.perf_counter`` around each call, the garbage collector paused, glibc's malloc
set as a long-running training process has it (see steady_allocator; recorded). Reported: the
median ms (20th-80th percentile) and, computed in the same run, flatopt's ratio to the fastest torch implementation
that steps correctly (AdamW, SGD) or to lion-pytorch (Lion), of the medians; the target is a ratio <= 1 in every case.
Beside it, the rounds' ratio: the median over rounds of each round's flatopt time over the baseline's time in that
round, with a distribution-free 95% confidence interval (harness.median_interval): an interval that holds 1 says the
two are not told apart on this machine, whichever side of 1 the ratio of the medians fell. Each
torch implementation is first checked against torch.optim's for-loop implementation on a small input: torch 2.13's
fused CPU SGD leaves most bf16 parameters unchanged, and such an implementation is timed and shown but flagged and
left out of the ratio.

A run from the repository root, on an otherwise idle machine (a few minutes at the default sizes):

    PYTHONPATH=. python3 benchmarks/bench_cpu.py [--threads N] [--out benchmarks/results]
    python3 benchmarks/plot.py benchmarks/results/cpu-<stamp>.json      # the PNG again, from the JSON

``--quick`` runs tiny sets with few rounds (a code-path check whose numbers are not results; the test suite runs it).
"""

import gc
import itertools
import math
import os
import platform
import sys
import time
import warnings
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable (after any installed flatopt)
    sys.path.append(str(Path(__file__).resolve().parents[1]))

import torch

import flatopt
from benchmarks import harness
from benchmarks.harness import num

OPTIMIZERS = ("adamw", "sgd", "lion")
OPTIMIZER_TITLES = {"adamw": "AdamW", "sgd": "SGD (momentum)", "lion": "Lion"}
VARIANTS = ("step", "loop")
DTYPES = ("fp32", "bf16")
HPARAMS = {
    "adamw": dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2),
    "sgd": dict(lr=1e-2, momentum=0.9, weight_decay=0.0),
    "lion": dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1),
}
IMPLS = {
    "adamw": ("torch-foreach", "torch-fused", "flatopt"),
    "sgd": ("torch-foreach", "torch-fused", "flatopt"),
    "lion": ("lion-pytorch", "flatopt"),
}
IMPL_NOTES = {
    "torch-foreach": "torch.optim, foreach=True",
    "torch-fused": "torch.optim, fused=True (torch's fused CPU kernels)",
    "lion-pytorch": "lion_pytorch.Lion",
    "flatopt": 'flatopt, backend="cpu"',
}
GRAD_VALUES = (0.5, -0.25, 1.0, -0.75)  # the loop's c, in turn (never zero)
MIN_ROUNDS, MAX_ROUNDS = 7, 100
CASE_S = 3.0  # seconds of timed calls per case: at 1.5 s the ratios of a 2-core VM moved by several % from run to run
TARGET_RATIO = 1.0  # flatopt / the fastest torch implementation (lion-pytorch for Lion), every case


# ---------------------------------------------------------------------------------------------- the sets
def shape_sets(quick):
    """The parameter sets: (name, title, rule, shapes)."""
    if quick:
        return [
            ("many-small", "tiny stand-in for 1000 tensors of 1024 elements", "20 tensors of 64 elements",
             [(f"t{i}", (64,)) for i in range(20)]),
            ("gpt-4m", "tiny stand-in for GPT-2-style shapes (4.3M)", "vocab 67, context 16, width 8, 1 layer",
             harness.gpt2_shapes(vocab=67, n_ctx=16, d=8, layers=1)),
        ]  # fmt: skip
    return [
        ("many-small", "1000 tensors of 1024 elements", "1000 1-D tensors of 1024 elements",
         [(f"t{i}", (1024,)) for i in range(1000)]),
        ("gpt-4m", "GPT-2-style shapes, 4.3M", "vocab 4096, context 256, width 256, 4 layers",
         harness.gpt2_shapes(vocab=4096, n_ctx=256, d=256, layers=4)),
        ("gpt-14m", "GPT-2-style shapes, 14.0M", "vocab 8192, context 512, width 384, 6 layers",
         harness.gpt2_shapes(vocab=8192, n_ctx=512, d=384, layers=6)),
    ]  # fmt: skip


# ------------------------------------------------------------------------------------- implementations
def build(impl, optimizer, params):
    """The optimizer ``impl`` over ``params`` (which have gradients), after one step (its state exists)."""
    hp = HPARAMS[optimizer]
    if impl == "flatopt":
        opt = {"adamw": flatopt.AdamW, "sgd": flatopt.SGD, "lion": flatopt.Lion}[optimizer](params, **hp)
        if opt.backend != "cpu":
            raise RuntimeError(f"flatopt chose backend {opt.backend!r} for CPU parameters, not 'cpu'")
    elif impl == "lion-pytorch":
        opt = harness_optional("lion_pytorch", "Lion")(params, **hp)
    else:
        cls = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[optimizer]
        opt = cls(params, **hp, **({"foreach": True} if impl == "torch-foreach" else {"fused": True}))
    with warnings.catch_warnings():
        # the gradients were set by hand, not by backward(): flatopt's no-gradient warning does not apply
        warnings.filterwarnings("ignore", message=".*received no gradient.*")
        opt.step()
    if impl == "flatopt":  # the gradients where flatopt keeps them, its buffer's views, as torch's are in .grad
        grads = [p.grad.clone() for p in params]
        opt.zero_grad(set_to_none=False)
        for p, g in zip(params, grads):
            p.grad.copy_(g)
    return opt


def harness_optional(module, attr):
    """``module.attr``, or harness.Skip saying why it is not importable."""
    import importlib

    try:
        return getattr(importlib.import_module(module), attr)
    except Exception as e:  # ImportError, or a broken install
        raise harness.Skip(f"{module}.{attr} is not importable ({type(e).__name__}: {e}); pip install lion-pytorch "
                           "(the bench extra)") from None  # fmt: skip


def steps_right(impl, optimizer, dtype):
    """Whether ``impl`` steps like a reference over three tensors of ``dtype`` (3 steps, lr 0.05 so that each update
    is larger than a bfloat16 rounding): torch.optim's for-loop implementation for torch.optim, flatopt's
    ``backend="torch"`` for flatopt and lion-pytorch. Returns (ok, the fraction of elements whose value differs from
    the reference's by more than half of the reference's change); a few percent differ by roundings (bfloat16) or a
    sign (Lion, near zero), an implementation that leaves parameters unchanged differs almost everywhere."""
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(n, generator=gen).to(dtype) for n in (1000, 77, 64)]
    grads = [[torch.randn(v.shape, generator=gen).to(dtype) for v in values] for _ in range(3)]
    hp = dict(HPARAMS[optimizer], lr=0.05)

    def run(make):
        params = [torch.nn.Parameter(v.clone()) for v in values]
        opt = None
        for gs in grads:
            for p, g in zip(params, gs):
                p.grad = g.clone()
            opt = opt or make(params)
            opt.step()
        return [p.detach().float() for p in params]

    flat = {"adamw": flatopt.AdamW, "sgd": flatopt.SGD, "lion": flatopt.Lion}[optimizer]
    if impl in ("lion-pytorch", "flatopt"):
        cls = harness_optional("lion_pytorch", "Lion") if impl == "lion-pytorch" else flat
        ours = run(lambda ps: cls(ps, **hp))
        ref = run(lambda ps: flat(ps, **hp, backend="torch"))
    else:
        cls = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[optimizer]
        flags = {"foreach": True} if impl == "torch-foreach" else {"fused": True}
        ours = run(lambda ps: cls(ps, **hp, **flags))
        ref = run(lambda ps: cls(ps, **hp, foreach=False))
    off = sum(int(((a - r).abs() > 0.5 * (r - v.float()).abs()).sum()) for a, r, v in zip(ours, ref, values))
    frac = off / sum(v.numel() for v in values)
    return frac < 0.1, frac


# ---------------------------------------------------------------------------------------------- timing
def make_params(shapes, dtype, seed):
    return harness.make_params(shapes, dtype, "cpu", seed=seed, grads=True)


def loop_call(opt, params):
    """zero_grad + a backward landing every gradient + step, as a training loop calls them."""
    values = itertools.cycle(GRAD_VALUES)

    def call():
        opt.zero_grad()
        c = next(values)
        loss = torch.stack([(p * c).sum() for p in params]).sum()
        loss.backward()
        opt.step()

    return call


def time_case(calls, rounds, quick):
    """Warm every call up, then time them in ``rounds`` rounds (harness.time_paired); name -> list of ms."""
    est = {}
    for name, call in calls.items():
        call()
        t = time.perf_counter()
        for _ in range(2):
            call()
        est[name] = (time.perf_counter() - t) / 2
    if rounds is None:  # about CASE_S of timed calls per case, between MIN_ROUNDS and MAX_ROUNDS rounds
        rounds = max(MIN_ROUNDS, min(MAX_ROUNDS, math.ceil((0.2 if quick else CASE_S) / max(sum(est.values()), 1e-6))))
    was = gc.isenabled()
    gc.disable()
    try:
        out = harness.time_paired(calls, "cpu", rounds)
    finally:
        if was:
            gc.enable()
    return {name: ms for name, (ms, _) in out.items()}, rounds


def run_case(set_, dtype, optimizer, variant, args, correct):
    """Rows of one case: one per implementation."""
    name, _, _, shapes = set_
    numel = sum(math.prod(s) for _, s in shapes)
    base = dict(set=name, dtype=dtype, optimizer=optimizer, variant=variant, elements=numel, tensors=len(shapes))
    rows, calls, keep, times = {}, {}, [], None
    for impl in IMPLS[optimizer]:
        row = dict(base, impl=impl, steps_right=correct.get((impl, optimizer, dtype), (None, None))[0])

        def body(row, impl=impl):
            params = make_params(shapes, harness.DTYPES[dtype], args.seed)
            opt = build(impl, optimizer, params)
            keep.append((params, opt))
            calls[impl] = opt.step if variant == "step" else loop_call(opt, params)

        harness.run_guarded(row, "cpu", body)
        rows[impl] = row
    if calls:
        try:
            times, rounds = time_case(calls, args.rounds, args.quick)
        except Exception as e:  # recorded in every row; the run goes on
            for impl in calls:
                rows[impl].update(status="failed", **harness.error_fields(e))
        else:
            for impl, ms in times.items():
                rows[impl].update(harness.timing_fields(ms), rounds=rounds)
    keep.clear()  # free this case's tensors before the next one
    calls.clear()
    gc.collect()
    add_ratios(list(rows.values()), times)
    return list(rows.values())


def add_ratios(rows, times=None):
    """flatopt's ratio to the fastest baseline of its case that steps right (``baseline``, ``ratio``: of the medians).
    With ``times`` (impl -> ms of each round, in round order), also the ratio of each round's two calls, paired:
    ``round_ratio_median`` and its 95 % confidence interval ``round_ratio_ci95`` (harness.median_interval), which
    says whether a ratio near 1 is a difference or noise of the machine."""
    ours = next((r for r in rows if r["impl"] == "flatopt" and r.get("median_ms") is not None), None)
    others = [r for r in rows if r["impl"] != "flatopt" and r.get("median_ms") is not None and r.get("steps_right")]
    if ours is None or not others:
        return
    best = min(others, key=lambda r: r["median_ms"])
    ours.update(baseline=best["impl"], baseline_ms=best["median_ms"], ratio=ours["median_ms"] / best["median_ms"])
    if times is not None and "flatopt" in times and best["impl"] in times:
        paired = [a / b for a, b in zip(times["flatopt"], times[best["impl"]])]
        ci = harness.median_interval(paired)  # None for fewer than 6 rounds (--quick)
        ours.update(round_ratio_median=harness.quantiles(paired, (0.5,))[0], round_ratio_ci95=ci and list(ci))


def targets(rows):
    out = []
    for r in rows:
        if r["impl"] != "flatopt":
            continue
        where = dict(variant=r["variant"], optimizer=r["optimizer"], set=r["set"], dtype=r["dtype"])
        what = f"flatopt / fastest ({r.get('baseline') or 'none'}) <= {TARGET_RATIO:g}"
        out.append(harness.target(what, r.get("ratio"), TARGET_RATIO, "x", note=harness.why_not(r)
                                  if r.get("median_ms") is None else "no baseline measured", **where))  # fmt: skip
    return out


# ------------------------------------------------------------------------------------------ machine
MMAP_THRESHOLD = 32 << 20  # bytes: glibc's largest dynamic mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX, 64-bit)


def steady_allocator():
    """Put glibc's malloc, which torch's CPU allocator calls, in the state of a long-running training process,
    before any case runs, and return what was set (recorded in the JSON), or None where it is not glibc.

    glibc serves a large request with a mapping of its own (page faults on every first touch, and an munmap when
    freed) until a block of that size has been freed once; then its mmap threshold rises to that size (up to 32 MiB)
    and its trim threshold to twice that, and such requests come from its heap. A training loop frees large tensors
    at every step, so after its first steps every tensor up to 32 MiB is served from the heap. In one process
    running case after case, that state depended on the cases before: the gradients autograd allocates at every
    backward, and lion-pytorch's temporaries, came from fresh mappings in one case and from the heap in the next,
    and a case's times moved with the cases run before it (lion-pytorch's loop most). Setting both thresholds here
    (M_MMAP_THRESHOLD 32 MiB, M_TRIM_THRESHOLD 64 MiB: the values the dynamic rule reaches once the process has
    freed a block of 32 MiB or more; set so, they stay fixed for the run) gives every case the long-running state
    (not in a ``--quick`` run). flatopt's flat buffers are mapped by flatopt itself
    (see flat_zeros in its layout module) and are not concerned."""
    import ctypes
    import ctypes.util

    if sys.platform != "linux" or not platform.libc_ver()[0] == "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    mmap_set = bool(libc.mallopt(m_mmap_threshold, MMAP_THRESHOLD))
    trim_set = bool(libc.mallopt(m_trim_threshold, 2 * MMAP_THRESHOLD))
    if not (mmap_set or trim_set):
        return None
    return dict(malloc="glibc", mmap_threshold=MMAP_THRESHOLD if mmap_set else None,
                trim_threshold=2 * MMAP_THRESHOLD if trim_set else None)  # fmt: skip


def cpu_model():
    """The CPU's model name from /proc/cpuinfo (Linux), else platform's."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# -------------------------------------------------------------------------------------------- markdown
def _cell(row):
    if row is None:
        return "-"
    if row.get("median_ms") is None:
        return row["status"]
    text = harness.spread(row)
    if row.get("steps_right") is False:
        text += " (wrong)"
    return text


def _interval(row):
    """ "median (low-high)" of a row's paired per-round ratios, "median (too few rounds)" without an interval; "-"
    where none was measured."""
    if row.get("round_ratio_median") is None:
        return "-"
    ci = row.get("round_ratio_ci95")
    spread = "too few rounds" if not ci else f"{num(ci[0], '.2f')}-{num(ci[1], '.2f')}"
    return f"{num(row['round_ratio_median'], '.2f')} ({spread})"


def _allocator_line(allocator, recorded=True):
    if not recorded:
        return "Allocator: not recorded (a run from before bench_cpu set glibc's thresholds: as the process found it)."
    if not allocator:
        return "Allocator: as the process found it (a smoke run, not glibc, or its thresholds could not be set)."

    def mib(key):
        value = allocator.get(key)
        return "as the process found it" if value is None else f"at {value >> 20} MiB"

    return (f"Allocator: glibc malloc with its mmap threshold {mib('mmap_threshold')} and its trim threshold "
            f"{mib('trim_threshold')}, a long-running training process's state "
            "(bench_cpu.steady_allocator).")  # fmt: skip


def markdown(record):
    rows = record["results"]
    lines = harness.smoke_banner(record)
    cpu = record.get("cpu") or {}
    lines += [f"CPU step benchmark: {cpu.get('model')}, {cpu.get('cores')} cores, {cpu.get('threads')} torch "
              f"thread(s); {harness.env_line(record)}.", "", f"Command: `{record.get('command')}`", "",
              "Cells: median ms (20th-80th percentile). Ratio: flatopt / the fastest implementation that steps right "
              "(torch.optim for AdamW and SGD, lion-pytorch for Lion), measured in the same run, of the medians; "
              "rounds' ratio: the median of each round's flatopt call over its call of that implementation, with a "
              "95% confidence interval (an interval holding 1: the two are not told apart on this machine).",
              "", _allocator_line(cpu.get("allocator"), "allocator" in cpu), ""]  # fmt: skip
    sets = record.get("sets") or {}
    if sets:
        lines += harness.md_table(
            ["set", "what", "tensors", "elements"],
            [[k, v["title"], v["tensors"], f"{v['elements']:,}"] for k, v in sets.items()],
        )
        lines += [""]  # fmt: skip
    for variant in VARIANTS:
        for opt in OPTIMIZERS:
            mine = [r for r in rows if r["variant"] == variant and r["optimizer"] == opt]
            if not mine:
                continue
            cols = [c for c in IMPLS[opt] if any(r["impl"] == c for r in mine)]
            cases = list(dict.fromkeys((r["set"], r["dtype"]) for r in mine))
            idx = {(r["set"], r["dtype"], r["impl"]): r for r in mine}
            table = []
            for s, dt in cases:
                ours = idx.get((s, dt, "flatopt")) or {}
                table.append([s, dt, *(_cell(idx.get((s, dt, c))) for c in cols),
                              num(ours.get("ratio"), ".2f"), _interval(ours), ours.get("baseline") or "-"])  # fmt: skip
            what = "`step()` alone" if variant == "step" else "`zero_grad()` + backward + `step()`"
            lines += [f"{OPTIMIZER_TITLES[opt]}, {what}:", ""]
            lines += harness.md_table(["set", "dtype", *cols, "ratio", "rounds' ratio (95% CI)", "against"], table)
            lines += [""]
    wrong = [r for r in rows if r.get("steps_right") is False and r["impl"] != "flatopt"]
    if wrong:
        lines += ["(wrong): this implementation's step differs from torch.optim's for-loop one on a check run before "
                  "timing, so it is left out of the ratio:", ""]  # fmt: skip
        lines += sorted({f"- {r['impl']} {OPTIMIZER_TITLES[r['optimizer']]} {r['dtype']}" for r in wrong}) + [""]
    if record.get("targets"):
        lines += harness.targets_markdown(record["targets"], ("variant", "optimizer", "set", "dtype"))
    bad = [r for r in rows if r["status"] != "ok"]
    if bad:
        lines += ["", "Not measured:", ""]
        lines += [f"- {r['impl']} {r['variant']} {r['optimizer']} {r['set']} {r['dtype']}: {r['status']} "
                  f"({harness.first_line(r.get('reason'), 300)})" for r in bad]  # fmt: skip
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = harness.parser(__doc__, budget_s=1800.0)
    p.set_defaults(device="cpu")
    add = p.add_argument
    add("--quick", action="store_true", help="tiny sets, few rounds: a code-path check (the test suite runs it)")
    add("--threads", type=int, default=None, help="torch threads (default: every core, os.cpu_count(); --quick: 1)")
    add("--rounds", type=int, default=None, help=f"timed rounds per case (default: {MIN_ROUNDS}-{MAX_ROUNDS} by time)")
    add("--variants", type=harness.csv_list(VARIANTS), default=list(VARIANTS), help="default: step,loop")
    add("--dtypes", type=harness.csv_list(DTYPES), default=list(DTYPES), help="default: fp32,bf16")
    add("--optimizers", type=harness.csv_list(OPTIMIZERS), default=list(OPTIMIZERS), help="default: all")
    add("--no-png", action="store_true", help="write the JSON (and markdown) only")
    args = p.parse_args(argv)
    if torch.device(args.device).type != "cpu":
        p.error("bench_cpu.py measures the CPU; drop --device (bench_step.py measures GPUs)")
    args.smoke = args.smoke or args.quick
    args.quick = args.smoke
    if args.threads is None:
        args.threads = 1 if args.quick else (os.cpu_count() or 1)  # quick: beside other work (the test suite)
    if args.threads < 1:
        p.error(f"--threads must be at least 1, got {args.threads}")
    return args


def main(argv=None):
    return harness.main(argv, parse_args, run, markdown)


def run(args, argv):
    start = time.monotonic()
    with harness.cpu_threads("cpu", args.threads):
        return _run(args, argv, start)


def _run(args, argv, start):
    deadline = start + args.budget_s
    sets = shape_sets(args.quick)
    path = harness.output_path(args, "cpu")
    allocator = None if args.quick else steady_allocator()  # a smoke run (the test suite's) leaves its process alone
    record = harness.new_record(
        "cpu",
        "on the CPU, flatopt's step (backend='cpu') against torch.optim's fastest implementation and lion-pytorch, "
        "step() alone and zero_grad + backward + step",
        "bench_cpu", args, argv, "cpu",
        cpu=dict(model=cpu_model(), cores=os.cpu_count(), threads=torch.get_num_threads(),
                 interop_threads=torch.get_num_interop_threads(), python=platform.python_version(),
                 torch=torch.__version__, torch_config_parallel=torch.__config__.parallel_info().splitlines()[:4],
                 allocator=allocator),
        settings=dict(quick=args.quick, rounds=args.rounds, variants=args.variants, dtypes=args.dtypes,
                      optimizers=args.optimizers, budget_s=args.budget_s, seed=args.seed),
        hparams=HPARAMS,
        implementations=IMPL_NOTES,
        sets={name: dict(title=title, rule=rule, tensors=len(shapes), elements=sum(math.prod(s) for _, s in shapes))
              for name, title, rule, shapes in sets},
        results=[],
    )  # fmt: skip
    harness.announce(record, path)
    print(f"{record['cpu']['model']}, {record['cpu']['cores']} cores, {record['cpu']['threads']} torch thread(s)")
    correct = {}
    for opt in args.optimizers:
        for impl in IMPLS[opt]:
            for dtype in args.dtypes:
                try:
                    ok, rel = steps_right(impl, opt, harness.DTYPES[dtype])
                except harness.Skip:
                    ok, rel = None, None
                correct[(impl, opt, dtype)] = (ok, rel)
    record["steps_right"] = [dict(impl=i, optimizer=o, dtype=d, ok=ok, fraction_off=rel)
                             for (i, o, d), (ok, rel) in correct.items()]  # fmt: skip
    failed = []
    for variant in args.variants:
        for set_ in sets:
            for dtype in args.dtypes:
                for opt in args.optimizers:
                    if time.monotonic() > deadline:
                        for impl in IMPLS[opt]:
                            record["results"].append(
                                harness.budget_spent(
                                    dict(set=set_[0], dtype=dtype, optimizer=opt, variant=variant, impl=impl), args
                                )
                            )
                        continue  # fmt: skip
                    rows = run_case(set_, dtype, opt, variant, args, correct)
                    record["results"] += rows
                    ours = next((r for r in rows if r["impl"] == "flatopt"), {})
                    if ours.get("status") not in ("ok", None):
                        failed.append(ours)
                    print(f"{variant:4s} {set_[0]:10s} {dtype} {opt:5s} " + "  ".join(
                        f"{r['impl']} {num(r.get('median_ms'), '.3f')}" for r in rows)
                        + f"  ratio {num(ours.get('ratio'), '.3f')}", flush=True)  # fmt: skip
    record["targets"] = targets(record["results"])
    code = harness.finish(record, path, args, markdown, failed, start)
    if not args.no_png:  # drawn from the record alone, as plot.py draws it from the stored JSON
        from benchmarks import plot

        try:
            plot.draw(record, path.with_suffix(".png"), "cpu")
            print(f"wrote {path.with_suffix('.png')}")
        except ImportError as e:
            print(f"PNG skipped: matplotlib is not importable ({e}); the JSON and markdown are complete")
    return code


if __name__ == "__main__":
    sys.exit(main())
