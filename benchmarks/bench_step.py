"""Question: per optimizer step, how close does each implementation come to the memory-bandwidth floor, alone and
as a training loop pays for it, and what does ``step()`` cost on the host?

AdamW, SGD with momentum and Lion over three parameter sets (GPT-2 small shapes, 3000 small tensors, Llama-style
1.2B shapes), fp32 and bf16 parameters (states in the parameter's dtype), one param group or two (``--groups``:
weight decay on the 2-D tensors, none on the 1-D ones, harness.DECAY_RULE), on one GPU in one run. Two variants
(``--variants``):

``step``: ``opt.step()`` alone, the gradients already in place (random normal). Floor: the step's bytes (AdamW fp32
reads p, g, m, v and writes p, m, v: 28 B per element).

    torch-foreach      torch.optim, foreach=True                                        AdamW, SGD
    torch-fused        torch.optim, fused=True                                          AdamW, SGD
    torch-fused-graph  torch.optim fused (AdamW capturable=True) replayed from a CUDA graph  AdamW, SGD
    torch-compile      torch.compile(opt.step) of a foreach AdamW, in a subprocess with a timeout (one group)
    apex               apex.optimizers.FusedAdam(adam_w_mode=True), when apex is importable
    lion-pytorch       lion_pytorch.Lion, when importable
    foreach-lion       Lion written here with torch._foreach_* ops (torch.optim has no Lion)
    flatopt            flatopt's opt.step() (replays its launches from an internal CUDA graph)  all three
    flatopt-launch     flatopt's opt.step() with use_step_graph=False: one Triton launch per buffer  all three
    flatopt-graph      flatopt's opt.step() captured once, replayed from a CUDA graph   all three
    flatopt-bf16-...   flatopt's opt.step() in a storage mode (master_weights, stochastic_rounding, state_dtype;
                       benchmarks/precision_modes.py), bf16 rows only, each against its own floor: the bytes
                       that mode must read + write (AdamW bf16 + remainder + fp32 states: 26 B per element)

``loop``: what a training loop pays for the optimizer: ``opt.zero_grad()``, then the gradients landing, then
``opt.step()``. The landing is a real backward pass reduced to what every backward must do for the optimizer,
write each parameter's gradient once: ``GradientSource``, an autograd Function over every parameter whose
backward writes all the gradients with one write-only kernel (``fill_`` with a non-zero value that changes from
call to call) into a fresh buffer and hands each parameter its view, as a layer's backward hands over its weight
gradient. AccumulateGrad then does what it does in training: torch.optim's ``zero_grad()`` leaves ``.grad`` None
and the view is stolen (no copy); flatopt's post-accumulate-grad hooks copy it into the flat buffer. Timed:
``zero_grad()`` + the forward node + ``backward()`` + ``step()``. Floor: the step's bytes plus one write of every
gradient (AdamW fp32 32 B per element). Implementations: torch-foreach, torch-fused (AdamW, SGD), foreach-lion and
lion-pytorch (Lion), flatopt, and flatopt-keep-grads (``zero_grad(set_to_none=False)``: the buffer is zeroed and
autograd adds each gradient into its view). Two timings each: ``median_ms``, the device's work, with the host's
launch overhead hidden behind a device sleep queued first (harness.device_time(hide_host=True)); and ``wall_ms``,
calls back to back, host included (a loop with no other work to overlap pays it). References per case:
``gradients-only`` (zero_grad + the landing into torch's stolen views, no optimizer: floor one write per element)
and ``copy-same-bytes``.

For each: median ms (20th-80th percentile) from CUDA events, GB/s, percent of the floor (bytes that must move /
copy bandwidth measured in this run) and, on the GPT-2 and 3000-tensor sets, the host-side microseconds of one
call; for flatopt's ``step`` also of a call that follows ``zero_grad()`` (every ``.grad`` compared with its view)
and of one with a new lr (hyper-parameters validated and copied to the device), as in a training loop with an LR
scheduler. flatopt's targets (step: >= 97 % of the floor, host step() <= 40 us and no slower with 3000 parameters
than with 148; loop: >= 95 % of the floor, on the device time and on the back-to-back time) are reported as met or
not, with the margin; they are not asserted. Failures and skips are recorded per implementation; the exit status is
1 when a flatopt case failed.

The reference a step can reach: per case, a ``dst.copy_(src)`` moving exactly the bytes the floor counts (row
``copy-same-bytes``, same timer); every row of the case records ``same_bytes_copy_ms`` and
``same_bytes_copy_pct_of_floor``, and every measured row ``pct_of_same_bytes_copy``. The floor's 1 GiB copy
amortises a launch's fixed cost of a few microseconds; a short step (bf16, 3000 small tensors, ~0.2 ms) cannot, and
even a copy of its bytes misses 97 % of the floor. A missed percent-of-floor target says why: the fixed cost
(flatopt within 1.5 % of the same-bytes copy, which itself misses the target) or the kernel (slower than a copy of
its bytes by the stated percent).

GPU run from the repository root (the step variant with one group, about 2-4 minutes of measurements on an H100,
then the torch.compile section within what is left of --budget-s; --quick halves the repeats):

    PYTHONPATH=. python3 benchmarks/bench_step.py --variants step --groups 1 [--quick] [--out benchmarks/results]
    PYTHONPATH=. python3 benchmarks/bench_step.py --variants loop --groups 1,2 --quick

CPU smoke run (tiny sets, CPU timer, flatopt's torch backend; checks the code path, measures nothing):

    PYTHONPATH=. python3 benchmarks/bench_step.py --device cpu --smoke --out /tmp/flatopt-smoke
"""

import argparse
import functools
import importlib
import itertools
import sys
import time
import traceback
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable (after any installed flatopt)
    sys.path.append(str(Path(__file__).resolve().parents[1]))

import torch

import flatopt
from benchmarks import harness, precision_modes
from benchmarks.harness import Skip, num

OPTIMIZERS = ("adamw", "sgd", "lion")
OPTIMIZER_TITLES = {"adamw": "AdamW", "sgd": "SGD (momentum)", "lion": "Lion"}
VARIANTS = ("step", "loop")
HOST_SETS = ("gpt2", "many-small")  # host-side step() time is measured on these
HPARAMS = {
    "adamw": dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2),
    "sgd": dict(lr=1e-2, momentum=0.9, weight_decay=0.0),
    "lion": dict(lr=1e-4, betas=(0.9, 0.99), weight_decay=0.1),
}
DECAY = {"adamw": 1e-2, "sgd": 5e-4, "lion": 0.1}  # the decay group's weight_decay with two groups; the other: 0
TARGET_PCT = 97.0  # flatopt step: percent of the floor, every set and dtype
TARGET_LOOP_PCT = 95.0  # flatopt loop (zero_grad + landing + step): percent of the floor
TARGET_HOST_US = 40.0  # flatopt: host-side step() on the GPT-2 and 3000-tensor sets
TARGET_HOST_RATIO = 1.10  # flatopt: host step() with 3000 parameters / with 148 ("the same")
MIN_COMPILE_S = 20.0  # a compile case is not started with less time than this left
SAME_BYTES_TOLERANCE_PCT = 1.5  # flatopt this close to a copy of its bytes: a miss is the launch's fixed cost
GRAD_ALIGN = 64  # elements: where GradientSource starts each gradient in its buffer (as flatopt's layout does)
GRAD_VALUES = (0.5, -0.25, 1.0, -0.75)  # the gradient values GradientSource writes in turn (never zero)


@dataclass
class Context:
    device: torch.device
    backend: str  # flatopt backend
    seed: int


# ------------------------------------------------------------------------------------------ param groups
def param_groups(params, optimizer, groups, shapes):
    """torch-style param groups: one (the optimizer's HPARAMS), or two split by harness.decay_split, the decay
    group with DECAY[optimizer] and the other with weight_decay 0."""
    if groups == 1:
        return [dict(params=list(params))]
    decay, rest = harness.decay_split(shapes)
    return [
        dict(params=[params[i] for i in decay], weight_decay=DECAY[optimizer]),
        dict(params=[params[i] for i in rest], weight_decay=0.0),
    ]


# ------------------------------------------------------------------------------------ implementations
def torch_optimizer(optimizer, groups, **flags):
    cls = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[optimizer]
    return cls(groups, **HPARAMS[optimizer], **flags)


def build_torch_foreach(groups, optimizer, ctx):
    return torch_optimizer(optimizer, groups, foreach=True)


def build_torch_fused(groups, optimizer, ctx):
    return torch_optimizer(optimizer, groups, fused=True)


def build_torch_fused_graph(groups, optimizer, ctx):
    flags = dict(fused=True, capturable=True) if optimizer == "adamw" else dict(fused=True)
    return torch_optimizer(optimizer, groups, **flags)


def optional_attr(module, attr):
    """``module.attr``, or Skip with the reason it cannot be imported."""
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # ImportError, or an extension that fails to load
        raise Skip(f"{module} is not importable ({type(e).__name__}: {e})") from None
    if not hasattr(mod, attr):
        raise Skip(f"{module} has no {attr}")
    return getattr(mod, attr)


def build_apex(groups, optimizer, ctx):
    return optional_attr("apex.optimizers", "FusedAdam")(groups, **HPARAMS["adamw"], adam_w_mode=True)


def build_lion_pytorch(groups, optimizer, ctx):
    return optional_attr("lion_pytorch", "Lion")(groups, **HPARAMS["lion"])


class ForeachLion:
    """Lion (decoupled weight decay, as lion-pytorch) with torch._foreach_* ops over each param group's list."""

    def __init__(self, groups, lr, betas, weight_decay):
        self.param_groups = [dict(g, weight_decay=g.get("weight_decay", weight_decay)) for g in groups]
        self.lr, (self.beta1, self.beta2) = lr, betas
        self.exp_avgs = [[torch.zeros_like(p) for p in g["params"]] for g in self.param_groups]

    @torch.no_grad()
    def step(self):
        for group, exp_avgs in zip(self.param_groups, self.exp_avgs):
            params = group["params"]
            grads = [p.grad for p in params]
            if group["weight_decay"]:
                torch._foreach_mul_(params, 1.0 - self.lr * group["weight_decay"])
            update = torch._foreach_lerp(exp_avgs, grads, 1.0 - self.beta1)  # beta1 * m + (1 - beta1) * g
            torch._foreach_sign_(update)
            torch._foreach_add_(params, update, alpha=-self.lr)
            torch._foreach_lerp_(exp_avgs, grads, 1.0 - self.beta2)

    def zero_grad(self, set_to_none=True):
        for g in self.param_groups:
            for p in g["params"]:
                p.grad = None


def build_foreach_lion(groups, optimizer, ctx):
    return ForeachLion(groups, **HPARAMS["lion"])


FLATOPT = {"adamw": flatopt.AdamW, "sgd": flatopt.SGD, "lion": flatopt.Lion}


def build_flatopt(groups, optimizer, ctx, precision=None):
    """flatopt over ``groups``, after its first step; ``precision``: a storage mode of precision_modes.MODES."""
    kwargs = precision_modes.MODES[precision][1] if precision else {}
    opt = FLATOPT[optimizer](groups, **HPARAMS[optimizer], backend=ctx.backend, **kwargs)
    with warnings.catch_warnings():
        # the gradients were set by hand, not by backward(): the first step's no-gradient warning does not apply
        warnings.filterwarnings("ignore", message=".*received no gradient.*")
        opt.step()
    return opt


@dataclass(frozen=True)
class Impl:
    name: str
    optimizers: tuple
    build: object  # (param groups, optimizer, ctx) -> optimizer; None: a subprocess (torch-compile)
    note: str
    variants: tuple = ("step",)
    needs_cuda: bool = False
    ours: bool = False
    host_variants: bool = False  # also time step() as a training loop calls it (see flatopt_host_variants)
    mode: str = "step"  # step: opt.step; launch: use_step_graph=False; graph: captured; keep: set_to_none=False
    precision: str = None  # a storage mode (precision_modes.MODES): its parameters' dtype only, its own floor


IMPLS = (
    Impl("torch-foreach", ("adamw", "sgd"), build_torch_foreach, "torch.optim, foreach=True", VARIANTS),
    Impl("torch-fused", ("adamw", "sgd"), build_torch_fused, "torch.optim, fused=True", VARIANTS),
    Impl(
        "torch-fused-graph",
        ("adamw", "sgd"),
        build_torch_fused_graph,
        "torch.optim fused (AdamW with capturable=True), step captured once and replayed from a CUDA graph",
        needs_cuda=True,
        mode="graph",
    ),
    Impl(
        "torch-compile",
        ("adamw",),
        None,
        "torch.compile(opt.step) of torch.optim.AdamW(foreach=True), timed after warm-up, in a subprocess",
    ),
    Impl("apex", ("adamw",), build_apex, "apex.optimizers.FusedAdam(adam_w_mode=True)"),
    Impl("lion-pytorch", ("lion",), build_lion_pytorch, "lion_pytorch.Lion (default arguments)", VARIANTS),
    Impl(
        "foreach-lion",
        ("lion",),
        build_foreach_lion,
        "Lion with torch._foreach_* ops, written in bench_step.py",
        VARIANTS,
    ),
    Impl(
        "flatopt",
        OPTIMIZERS,
        build_flatopt,
        "flatopt opt.step(): one launch per flat buffer, replayed from flatopt's internal CUDA graph on CUDA; in the "
        "loop, zero_grad() (set_to_none=True) and the post-accumulate-grad hooks' copies into the flat buffer",
        VARIANTS,
        ours=True,
        host_variants=True,
    ),
    Impl(
        "flatopt-keep-grads",
        OPTIMIZERS,
        build_flatopt,
        "flatopt in the loop with zero_grad(set_to_none=False): the buffer zeroed, autograd adds each gradient into "
        "its view",
        ("loop",),
        ours=True,
        mode="keep",
    ),
    Impl(
        "flatopt-launch",
        OPTIMIZERS,
        build_flatopt,
        "flatopt opt.step() with use_step_graph=False: one Triton launch per flat buffer, no graph",
        ours=True,
        mode="launch",
    ),
    Impl(
        "flatopt-graph",
        OPTIMIZERS,
        build_flatopt,
        "flatopt opt.step() captured once on a side stream, replayed from a CUDA graph",
        needs_cuda=True,
        ours=True,
        mode="graph",
    ),
)
IMPLS += tuple(
    Impl(
        f"flatopt-{mode}",
        OPTIMIZERS,
        functools.partial(build_flatopt, precision=mode),
        f"flatopt opt.step() with {', '.join(f'{k}={v!r}' for k, v in kwargs.items())} ({dtype} parameters only); "
        "floor: the bytes this mode must move (precision_modes.moved_bytes_per_element)",
        ours=True,
        precision=mode,
    )
    for mode, (dtype, kwargs) in precision_modes.MODES.items()
    if kwargs
)
IMPL_BY_NAME = {i.name: i for i in IMPLS}
# References, not implementations (not in IMPLS nor --impls): timed once per case.
SAME_BYTES_COPY = Impl(
    "copy-same-bytes",
    OPTIMIZERS,
    None,
    "dst.copy_(src) of float32 buffers reading + writing the bytes the floor counts for the case: what a step "
    "of that size can reach, a launch's fixed cost included",
    VARIANTS,
)
GRADIENTS_ONLY = Impl(
    "gradients-only",
    OPTIMIZERS,
    None,
    "loop variant without an optimizer: .grad set to None, then GradientSource's backward, whose views "
    "AccumulateGrad steals (floor: one write of every gradient)",
    ("loop",),
)


# -------------------------------------------------------------------------------------- the loop's landing
class GradientSource(torch.autograd.Function):
    """A backward pass reduced to what every backward must do for the optimizer: write each parameter's gradient.

    ``forward(spec, *params)`` returns an empty scalar that depends on every parameter. ``backward`` allocates one
    buffer, writes every gradient into it with a single ``fill_`` (write-only, non-zero) and returns each
    parameter's view (GRAD_ALIGN-aligned, the parameter's shape and strides). Nothing else references the views,
    so AccumulateGrad takes each one as the parameter's ``.grad`` when ``.grad`` is None (no copy), and adds it
    into ``.grad`` in place otherwise, as it does with a layer's weight gradient.
    """

    @staticmethod
    def forward(ctx, spec, *params):
        ctx.spec = spec
        return params[0].new_empty(())

    @staticmethod
    def backward(ctx, _):
        spec = ctx.spec
        flat = torch.empty(spec.total, dtype=spec.dtype, device=spec.device)
        flat.fill_(next(spec.values))
        return (None, *(flat[start : start + n].view(shape) for start, n, shape in spec.spans))


class GradientSpec:
    """Where GradientSource puts each gradient: (start, numel, shape) per parameter in one buffer of ``total``."""

    def __init__(self, params):
        self.spans, start = [], 0
        for p in params:
            if not p.is_contiguous():
                raise ValueError("GradientSource hands out contiguous gradients; the parameters must be contiguous")
            self.spans.append((start, p.numel(), tuple(p.shape)))
            start += -(-p.numel() // GRAD_ALIGN) * GRAD_ALIGN
        self.total = start
        self.dtype, self.device = params[0].dtype, params[0].device
        self.values = itertools.cycle(GRAD_VALUES)


def landing(params):
    """A callable that lands one gradient in every parameter as a backward pass does (GradientSource)."""
    spec = GradientSpec(params)
    one = torch.ones((), dtype=params[0].dtype, device=params[0].device)

    def land():
        torch.autograd.backward(GradientSource.apply(spec, *params), one)

    return land


# ------------------------------------------------------------------------------------------ one case
def new_row(sset, dtype_name, optimizer, impl, variant="step", groups=1):
    row = dict(
        variant=variant,
        groups=groups,
        set=sset.name,
        dtype=dtype_name,
        optimizer=optimizer,
        impl=impl.name,
        ours=impl.ours,
        tensors=sset.tensors,
        elements=sset.numel,
        status=None,
    )
    if impl.precision is not None:
        row["precision"] = impl.precision
    return row


def row_variant(row):
    return row.get("variant", "step")  # results written before the loop variant have none


def row_groups(row):
    return row.get("groups", 1)


def add_derived(row, copy_gbps):
    """Bytes that must move, the floor, GB/s and percent of the floor of a result row (and of its back-to-back
    time ``wall_ms``, where it has one)."""
    loop = row_variant(row) == "loop"
    if row.get("impl") == GRADIENTS_ONLY.name:
        bpe = harness.element_size(row["dtype"])  # one write of every gradient
    elif row.get("precision"):  # a storage mode: the bytes it must move
        bpe = precision_modes.moved_bytes_per_element(row["optimizer"], row["precision"], grad_write=loop)
    else:
        bpe = harness.bytes_per_element(row["optimizer"], row["dtype"], grad_write=loop)
    row["bytes_per_element"] = bpe
    row["bytes"] = row["elements"] * bpe
    row["floor_ms"] = harness.floor_ms(row["elements"], bpe, copy_gbps)
    if row.get("status") == "ok" and row.get("median_ms"):
        row["gbps"] = harness.gbps(row["bytes"], row["median_ms"])
        row["pct_floor"] = harness.pct_of_floor(row["floor_ms"], row["median_ms"])
    if row.get("status") == "ok" and row.get("wall_ms"):
        row["wall_pct_floor"] = harness.pct_of_floor(row["floor_ms"], row["wall_ms"])
    same = row.get("same_bytes_copy_ms")  # set by with_same_bytes_copy
    if same:
        row["same_bytes_copy_pct_of_floor"] = harness.pct_of_floor(row["floor_ms"], same)
        if row.get("status") == "ok" and row.get("median_ms"):
            row["pct_of_same_bytes_copy"] = 100.0 * same / row["median_ms"]
    return row


def with_same_bytes_copy(row, copy_row):
    """Attach the same-bytes copy's median to a row of its case (add_derived turns it into percentages)."""
    if (
        copy_row is not None
        and copy_row.get("status") == "ok"
        and row.get("impl") != GRADIENTS_ONLY.name
        and not row.get("precision")  # the copy moves the default mode's bytes, not a storage mode's
    ):
        row["same_bytes_copy_ms"] = copy_row["median_ms"]
    return row


def build_case(sset, dtype_name, optimizer, impl, groups, ctx):
    """Parameters and the implementation's optimizer over them; returns (params, optimizer, step callable)."""
    params = harness.make_params(sset.shapes, harness.DTYPES[dtype_name], ctx.device, ctx.seed)
    opt = impl.build(param_groups(params, optimizer, groups, sset.shapes), optimizer, ctx)
    step = opt.step
    if impl.mode == "launch":
        opt.use_step_graph = False
    elif impl.mode == "graph":
        # Valid because the buffers never move and the kernels advance the step counts on the device;
        # hyper-parameters must not change between replays.
        step = harness.capture_cuda_graph(opt.step).replay
    return params, opt, step


def run_case(sset, dtype_name, optimizer, impl, ctx, settings, host, variant="step", groups=1):
    """Build, time and free one implementation; never raises (failures are recorded in the row)."""
    row = new_row(sset, dtype_name, optimizer, impl, variant, groups)
    if impl.needs_cuda and ctx.device.type != "cuda":
        row.update(status="skipped", reason="CUDA graphs need a CUDA device")
        return row
    if impl.precision is not None and precision_modes.MODES[impl.precision][0] != dtype_name:
        row.update(status="skipped", reason=f"{impl.precision} is a mode of {precision_modes.MODES[impl.precision][0]} "
                   "parameters")  # fmt: skip
        return row

    def body(row):
        t0 = time.perf_counter()
        params, opt, step = build_case(sset, dtype_name, optimizer, impl, groups, ctx)
        if variant == "loop":
            land = landing(params)
            zero = functools.partial(opt.zero_grad, set_to_none=impl.mode != "keep")

            def step():  # noqa: F811 (the loop: zero_grad, the gradients landing, step)
                zero()
                land()
                opt.step()

        row["setup_s"] = time.perf_counter() - t0
        time_row(row, step, ctx.device, settings, host, variant)
        if host and impl.host_variants and variant == "step":
            row.update(flatopt_host_variants(opt, ctx.device, settings))

    return harness.run_guarded(row, ctx.device, body)


def time_row(row, fn, device, settings, host, variant):
    """Device time of ``fn`` (loop: host hidden, and back to back as ``wall_ms``) and, if ``host``, its host time."""
    row.update(harness.device_time(fn, device, settings, hide_host=variant == "loop").as_dict())
    if variant == "loop":
        wall = harness.device_time(fn, device, settings)
        row.update(wall_ms=wall.median_ms, wall_q20_ms=wall.q20_ms, wall_q80_ms=wall.q80_ms)
    if host:
        row["host_us"], row["host_us_q20"], row["host_us_q80"], row["host_calls"] = harness.host_time(
            fn, device, settings
        )


def flatopt_host_variants(opt, device, settings):
    """Host microseconds of ``opt.step()`` as a training loop calls it, beside the bare call's ``host_us``:
    after ``opt.zero_grad(set_to_none=False)`` (untimed), so that step() compares every ``.grad`` with its
    view, as it does after every zero_grad() and backward pass (the hooks' copies, which the backward pass
    pays for, are not in it); and with the lr changed before each call (untimed), as an LR scheduler
    does, so that step() validates the hyper-parameters again and copies the table to the device."""
    out = {}
    med, q20, q80, n = harness.host_time(opt.step, device, settings, before=lambda: opt.zero_grad(set_to_none=False))
    out.update(host_after_zero_grad_us=med, host_after_zero_grad_us_q20=q20, host_after_zero_grad_us_q80=q80)
    group, lr, flip = opt.param_groups[0], opt.param_groups[0]["lr"], [False]

    def new_lr():
        flip[0] = not flip[0]
        group["lr"] = lr * (1.0 + 1e-3 * flip[0])

    med, q20, q80, n = harness.host_time(opt.step, device, settings, before=new_lr)
    group["lr"] = lr
    out.update(host_new_lr_us=med, host_new_lr_us_q20=q20, host_new_lr_us_q80=q80)
    return out


def run_gradients_only(sset, dtype_name, optimizer, ctx, settings, host, groups):
    """The loop's landing alone: every ``.grad`` set to None, then GradientSource's backward; never raises."""
    row = new_row(sset, dtype_name, optimizer, GRADIENTS_ONLY, "loop", groups)

    def body(row):
        params = harness.make_params(sset.shapes, harness.DTYPES[dtype_name], ctx.device, ctx.seed, grads=False)
        land = landing(params)

        def fn():
            for p in params:
                p.grad = None
            land()

        time_row(row, fn, ctx.device, settings, host, "loop")

    return harness.run_guarded(row, ctx.device, body)


def run_same_bytes_copy(sset, dtype_name, optimizer, ctx, settings, variant="step", groups=1):
    """Time a ``dst.copy_(src)`` moving the bytes the floor counts for this case; never raises. No parameters
    are allocated (the Llama set leaves little room), and the buffers are freed before the next case."""
    row = new_row(sset, dtype_name, optimizer, SAME_BYTES_COPY, variant, groups)

    def body(row):
        bpe = harness.bytes_per_element(optimizer, dtype_name, grad_write=variant == "loop")
        n = sset.numel * bpe // 8  # float32: 4 B read + 4 B written
        src = torch.randn(n, device=ctx.device)
        dst = torch.empty_like(src)
        row.update(harness.device_time(functools.partial(dst.copy_, src), ctx.device, settings).as_dict())
        row.update(copy_elements=n, copy_bytes_moved=8 * n)

    return harness.run_guarded(row, ctx.device, body)


# ----------------------------------------------------------------------------------- torch.compile
def compile_worker(args):
    """Subprocess entry: time torch.compile(opt.step) of a foreach AdamW on one set and dtype; print one result line."""
    device = torch.device(args.device)
    sset = harness.shape_set(args.worker_set, smoke=args.smoke)
    settings = harness.timer_settings(args.smoke, args.quick)
    row = {}
    try:
        params = harness.make_params(sset.shapes, harness.DTYPES[args.worker_dtype], device, args.seed)
        opt = torch.optim.AdamW(params, **HPARAMS["adamw"], foreach=True)
        step = torch.compile(opt.step, backend=args.compile_backend)
        t0 = time.perf_counter()
        for _ in range(3):  # the first calls compile (state initialisation may trigger a recompile)
            step()
        harness.free_memory(device)
        row["compile_s"] = time.perf_counter() - t0
        row.update(harness.device_time(step, device, settings).as_dict())
        if args.worker_set in HOST_SETS:
            row["host_us"], row["host_us_q20"], row["host_us_q80"], row["host_calls"] = harness.host_time(
                step, device, settings
            )
        row["status"] = "ok"
    except Exception as e:
        row.update(status="failed", reason=f"{type(e).__name__}: {e}"[:2000], traceback=traceback.format_exc()[-4000:])
    harness.print_result(row)
    return 0


def compile_command(args, set_name, dtype_name):
    cmd = [sys.executable, str(Path(__file__).resolve()), "--compile-worker", "--worker-set", set_name]
    cmd += ["--worker-dtype", dtype_name, "--device", args.device, "--seed", str(args.seed)]
    cmd += ["--compile-backend", args.compile_backend]
    return cmd + (["--quick"] if args.quick else []) + (["--smoke"] if args.smoke else [])


def compile_order(sets, dtypes):
    """fp32 before bf16; the 3000-tensor set, the slowest to compile, last within a dtype."""
    rank = {"gpt2": 0, "llama": 1, "many-small": 2}
    return [(s, d) for d in dtypes for s in sorted(sets, key=lambda s: rank.get(s.name, 9))]


def run_compile_cases(args, sets, dtypes, deadline, copies):
    """torch.compile rows (step variant, one group); ``copies``: the same-bytes copy row of each case."""
    impl = IMPL_BY_NAME["torch-compile"]
    rows = []
    for i, (sset, dtype_name) in enumerate(compile_order(sets, dtypes)):
        row = new_row(sset, dtype_name, "adamw", impl)
        left = deadline - time.monotonic()
        if args.no_compile:
            row.update(status="skipped", reason="--no-compile")
        elif args.smoke and i > 0:
            row.update(status="skipped", reason="a smoke run compiles one case only")
        elif left < MIN_COMPILE_S:
            row.update(status="skipped", reason=f"time budget (--budget-s {args.budget_s:g}) spent before this case")
        else:
            t0 = time.perf_counter()
            timeout = min(args.compile_timeout_s, left)
            row.update(harness.run_worker(compile_command(args, sset.name, dtype_name), timeout))
            row["seconds"] = time.perf_counter() - t0
        rows.append(with_same_bytes_copy(row, copies.get(("step", 1, sset.name, dtype_name, "adamw"))))
        print_row(row)
    return rows


# ------------------------------------------------------------------------------------------- targets
def pct_floor_why(row, copy_row=None, threshold=TARGET_PCT):
    """Why a flatopt row missed the percent-of-floor target, from the copy of the same bytes; None if not missed."""
    if row is None or row.get("pct_floor") is None or row["pct_floor"] >= threshold:
        return None
    of_copy, copy_pct = row.get("pct_of_same_bytes_copy"), row.get("same_bytes_copy_pct_of_floor")
    if of_copy is None or copy_pct is None:
        return f"no copy of the same bytes to compare with ({harness.why_not(copy_row)})"
    text = f"a copy of the same bytes reaches {copy_pct:.1f} % of the floor; "
    text += f"flatopt reaches {of_copy:.1f} % of that copy"
    if of_copy >= 100.0 - SAME_BYTES_TOLERANCE_PCT and copy_pct < threshold:
        return text + ": the shortfall is the fixed cost of a launch this short"
    return text + f": the kernel itself is slower than a copy of its bytes by {100.0 * (100.0 / of_copy - 1.0):.1f} %"


def evaluate_targets(rows, set_names, dtypes, optimizers, variants=("step",), groups=(1,)):
    """flatopt's targets, met or not and by how much (margin > 0: met by that much)."""
    idx = {(row_variant(r), row_groups(r), r["set"], r["dtype"], r["optimizer"], r["impl"]): r for r in rows}
    out = []
    for variant in variants:
        for g in groups:
            for opt in optimizers:
                for dt in dtypes:
                    if variant == "step":
                        out += _step_targets(idx, g, set_names, dt, opt)
                    else:
                        out += _loop_targets(idx, g, set_names, dt, opt)
    return out


def _step_targets(idx, g, set_names, dt, opt):
    out = []
    where = dict(variant="step", groups=g, optimizer=opt, dtype=dt)
    for s in set_names:
        r = idx.get(("step", g, s, dt, opt, "flatopt"))
        why = pct_floor_why(r, idx.get(("step", g, s, dt, opt, SAME_BYTES_COPY.name)))
        out.append(harness.target(f">= {TARGET_PCT:g}% of floor", r.get("pct_floor") if r else None, TARGET_PCT, "%",
                                  higher_is_better=True, note=harness.why_not(r), why=why, set=s, **where))  # fmt: skip
    host = {}
    for s in [s for s in HOST_SETS if s in set_names]:
        r = idx.get(("step", g, s, dt, opt, "flatopt"))
        host[s] = r.get("host_us") if r else None
        out.append(harness.target(f"host step() <= {TARGET_HOST_US:g} us", host[s], TARGET_HOST_US, "us",
                                  note=harness.why_not(r), set=s, **where))  # fmt: skip
    if len(host) == 2:
        a, b = host["gpt2"], host["many-small"]
        ratio = b / a if a and b else None
        what = f"host step() 3000 vs 148 params <= {TARGET_HOST_RATIO:g}x"
        out.append(harness.target(what, ratio, TARGET_HOST_RATIO, "x", note="host times missing", set="many-small/gpt2",
                                  **where))  # fmt: skip
    return out


def _loop_targets(idx, g, set_names, dt, opt):
    out = []
    where = dict(variant="loop", groups=g, optimizer=opt, dtype=dt)
    for s in set_names:
        r = idx.get(("loop", g, s, dt, opt, "flatopt"))
        why = pct_floor_why(r, idx.get(("loop", g, s, dt, opt, SAME_BYTES_COPY.name)), TARGET_LOOP_PCT)
        out.append(harness.target(f">= {TARGET_LOOP_PCT:g}% of floor (device)", r.get("pct_floor") if r else None,
                                  TARGET_LOOP_PCT, "%", higher_is_better=True, note=harness.why_not(r), why=why, set=s,
                                  **where))  # fmt: skip
        out.append(harness.target(f">= {TARGET_LOOP_PCT:g}% of floor (back-to-back)",
                                  r.get("wall_pct_floor") if r else None, TARGET_LOOP_PCT, "%", higher_is_better=True,
                                  note=harness.why_not(r), set=s, **where))  # fmt: skip
    return out


# ------------------------------------------------------------------------------------------- output
def print_row(row):
    if row["status"] == "ok":
        line = (
            f"{num(row['median_ms'], '10.3f')} ms [{num(row['q20_ms'], '.3f')}-{num(row['q80_ms'], '.3f')}]"
            f" {num(row.get('gbps'), '7.0f')} GB/s {num(row.get('pct_floor'), '6.1f')} % floor"
        )
        if row.get("wall_ms") is not None:
            line += f"; back-to-back {row['wall_ms']:.3f} ms {num(row.get('wall_pct_floor'), '.1f')} %"
        if row.get("pct_of_same_bytes_copy") is not None:
            line += f" {row['pct_of_same_bytes_copy']:6.1f} % same-bytes copy"
        if row.get("host_us") is not None:
            line += f"  host {row['host_us']:8.1f} us"
        if row.get("host_after_zero_grad_us") is not None:
            line += f" (after zero_grad {row['host_after_zero_grad_us']:.1f}, new lr {row['host_new_lr_us']:.1f})"
        if row.get("compile_s") is not None:
            line += f"  (compile {row['compile_s']:.1f} s)"
    else:
        line = f"{row['status'].upper()}: {row.get('reason', '')}"
    case = f"{row_variant(row)} {row_groups(row)}g {row['set']:10} {row['dtype']:4} {row['optimizer']:5}"
    print(f"  {case} {row['impl']:18} {line}", flush=True)


IMPL_ORDER = [
    "flatopt",
    "flatopt-keep-grads",
    "flatopt-launch",
    "flatopt-graph",
    "torch-fused",
    "torch-foreach",
    "torch-fused-graph",
    "torch-compile",
    "apex",
    "lion-pytorch",
    "foreach-lion",
]
REFERENCES = [SAME_BYTES_COPY.name, GRADIENTS_ONLY.name]


def _cell(r, loop):
    if r is None:
        return ""
    if r["status"] != "ok":
        return r["status"]
    text = f"{num(r.get('median_ms'), '.3f')} ({num(r.get('pct_floor'), '.1f')} %)"
    if loop and r.get("wall_ms") is not None:
        text += f"; b2b {num(r['wall_ms'], '.3f')} ({num(r.get('wall_pct_floor'), '.1f')} %)"
    return text


def markdown(record):
    """Per variant and optimizer, one table: a row per (set, dtype, groups), a column per implementation with
    its median ms and percent of the floor (loop: device time, then back-to-back time); then flatopt's host
    times, the targets, and what did not run."""
    rows = record["results"]
    lines = harness.smoke_banner(record)
    lines += [f"Optimizer step benchmark: {harness.env_line(record)}.", "", f"Command: `{record.get('command')}`", ""]
    copy = record.get("copy") or {}
    if copy.get("gbps"):
        lines += [f"Floor = bytes that must move / copy bandwidth {copy['gbps']:.0f} GB/s (`dst.copy_(src)`, read + "
                  "write, measured in the same run). Cells: median ms (% of floor).", ""]  # fmt: skip
    sets = list(record.get("sets") or dict.fromkeys(r["set"] for r in rows))
    for variant in [v for v in VARIANTS if any(row_variant(r) == v for r in rows)]:
        if variant == "step":
            lines += ["Variant `step`: `opt.step()` alone, the gradients in place (floor: the step's bytes).", ""]
        else:
            lines += ["Variant `loop`: `zero_grad()` + the gradients landing (GradientSource's backward) + `step()` "
                      "(floor: the step's bytes + one write of every gradient). Cells: device time with the host "
                      "hidden (% of floor); b2b: calls back to back, host included.", ""]  # fmt: skip
        for opt in OPTIMIZERS:
            mine = [r for r in rows if row_variant(r) == variant and r["optimizer"] == opt]
            if not mine:
                continue
            present = {r["impl"] for r in mine}
            cols = [n for n in IMPL_ORDER + REFERENCES if n in present]
            cols += sorted(present - set(cols))
            cases = sorted(dict.fromkeys((r["set"], r["dtype"], row_groups(r)) for r in mine),
                           key=lambda c: (sets.index(c[0]) if c[0] in sets else 99, c[1] != "fp32", c[2]))  # fmt: skip
            idx = {(r["set"], r["dtype"], row_groups(r), r["impl"]): r for r in mine}
            table = []
            for s, dt, g in cases:
                floor = next((r.get("floor_ms") for r in mine if (r["set"], r["dtype"], row_groups(r)) == (s, dt, g)
                              and r["impl"] not in REFERENCES), None)  # fmt: skip
                table.append([s, dt, g, num(floor, ".3f")] + [_cell(idx.get((s, dt, g, c)), variant == "loop")
                                                              for c in cols])  # fmt: skip
            lines += [f"{OPTIMIZER_TITLES[opt]}, `{variant}`:", ""]
            lines += harness.md_table(["set", "dtype", "groups", "floor ms", *cols], table) + [""]
    host = [r for r in rows if r.get("host_us") is not None and r["impl"] == "flatopt" and row_variant(r) == "step"]
    if host:
        lines += ["flatopt's host time of `step()` (us, median): bare; after `zero_grad(set_to_none=False)`; with a "
                  "new lr.", ""]  # fmt: skip
        lines += harness.md_table(
            ["optimizer", "set", "dtype", "groups", "step()", "after zero_grad()", "new lr"],
            [[OPTIMIZER_TITLES[r["optimizer"]], r["set"], r["dtype"], row_groups(r), num(r["host_us"], ".1f"),
              num(r.get("host_after_zero_grad_us"), ".1f"), num(r.get("host_new_lr_us"), ".1f")] for r in host],
        ) + [""]  # fmt: skip
    if record.get("targets"):
        lines += harness.targets_markdown(record["targets"], ("variant", "groups", "optimizer", "set", "dtype"))
    missing = {}
    for r in rows:
        if r["status"] != "ok":
            key = (r["impl"], r["status"], harness.first_line(r.get("reason"), 300))
            missing.setdefault(key, []).append(f"{row_variant(r)} {r['optimizer']} {r['set']} {r['dtype']}")
    if missing:
        lines += ["", "Not measured:", ""]
        attempted = {}
        for r in rows:
            attempted[r["impl"]] = attempted.get(r["impl"], 0) + 1
        for (impl, status, reason), cases in missing.items():
            which = f"all {len(cases)} cases" if len(cases) == attempted[impl] else "; ".join(cases)
            lines.append(f"- {impl}, {status} ({which}): {reason}")
    return "\n".join(lines) + "\n"


@contextmanager
def section(record, name):
    print(f"\n== {name}", flush=True)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        dt = time.perf_counter() - t0
        record["sections"].append(dict(name=name, seconds=round(dt, 2)))
        print(f"-- {name}: {dt:.1f} s", flush=True)


# ---------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = harness.parser(__doc__, budget_s=480.0)
    add = p.add_argument
    add("--quick", action="store_true", help="fewer repeats (about half the time)")
    add("--variants", type=harness.csv_list(VARIANTS), default=list(VARIANTS), help="default: step,loop")
    add("--groups", type=harness.csv_list(("1", "2")), default=["1", "2"], help="param groups (default: 1,2)")
    add("--sets", type=harness.csv_list(harness.SET_NAMES), default=list(harness.SET_NAMES), help="default: all")
    dtypes = harness.csv_list(("fp32", "bf16", "fp16"))
    add("--dtypes", type=dtypes, default=["fp32", "bf16"], help="default: fp32,bf16")
    add("--optimizers", type=harness.csv_list(OPTIMIZERS), default=list(OPTIMIZERS), help="default: all")
    add("--impls", type=harness.csv_list(tuple(IMPL_BY_NAME)), default=list(IMPL_BY_NAME), help="default: all")
    add("--compile-timeout-s", type=float, default=None, help="per torch.compile case (default: 150, quick 90)")
    add("--compile-backend", default=None, help="torch.compile backend (default: inductor; smoke runs: eager)")
    add("--no-compile", action="store_true", help="skip the torch.compile cases")
    add("--copy-mib", type=int, default=None, help="copy-bandwidth buffer size (default: 1024; smoke: 4)")
    add("--compile-worker", action="store_true", help=argparse.SUPPRESS)
    add("--worker-set", help=argparse.SUPPRESS)
    add("--worker-dtype", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    harness.check_device(p, args)
    args.groups = [int(g) for g in args.groups]
    if args.compile_timeout_s is None:
        args.compile_timeout_s = 90.0 if args.quick or args.smoke else 150.0
    if args.compile_backend is None:
        args.compile_backend = "eager" if args.smoke else "inductor"
    if args.copy_mib is None:
        args.copy_mib = 4 if args.smoke else 1024
    return args


def main(argv=None):
    return harness.main(argv, parse_args, run, markdown)


def run(args, argv):
    if args.compile_worker:
        return compile_worker(args)
    start = time.monotonic()
    deadline = start + args.budget_s
    device = torch.device(args.device)
    ctx = Context(device=device, backend="triton" if device.type == "cuda" else "torch", seed=args.seed)
    settings = harness.timer_settings(args.smoke, args.quick)
    sets = [harness.shape_set(name, smoke=args.smoke) for name in args.sets]
    path = harness.output_path(args, "step" if "step" in args.variants else "step-loop")
    record = harness.new_record(
        "step",
        "per optimizer step, alone and as a training loop pays for it (zero_grad + gradient landing + step): time "
        "as a fraction of the memory-bandwidth floor, and host-side step() cost",
        "bench_step", args, argv, device,
        settings=dict(vars(settings), quick=args.quick, budget_s=args.budget_s, seed=args.seed,
                      compile_backend=args.compile_backend, compile_timeout_s=args.compile_timeout_s,
                      flatopt_backend=ctx.backend, variants=args.variants, groups=args.groups),
        hparams=HPARAMS,
        decay=dict(weight_decay=DECAY, rule=harness.DECAY_RULE),
        bytes_per_element={v: {o: {d: harness.bytes_per_element(o, d, grad_write=v == "loop") for d in args.dtypes}
                               for o in OPTIMIZERS} for v in VARIANTS},
        impls={i.name: i.note for i in (*IMPLS, SAME_BYTES_COPY, GRADIENTS_ONLY)},
        sets={s.name: s.summary() for s in sets},
        targets_definition=dict(pct_floor=TARGET_PCT, loop_pct_floor=TARGET_LOOP_PCT, host_us=TARGET_HOST_US,
                                host_ratio=TARGET_HOST_RATIO, host_sets=list(HOST_SETS)),
        sections=[],
        copy=None,
        results=[],
        targets=[],
    )  # fmt: skip
    harness.announce(record, path)

    with section(record, "copy bandwidth"):
        copy = harness.copy_bandwidth(device, args.copy_mib * 2**20, settings)
        record["copy"] = dict(start=copy, end=None, gbps=copy["gbps"])
        print(f"  dst.copy_(src) of {args.copy_mib} MiB: {copy['median_ms']:.3f} ms, {copy['gbps']:.0f} GB/s (r+w)")
    harness.write_json(path, record)

    rows = record["results"]
    copies = {}  # (variant, groups, set, dtype, optimizer): the same-bytes copy row
    for variant in args.variants:
        for groups in args.groups:
            for sset in sets:
                for dtype_name in args.dtypes:
                    name = f"{variant}, {groups} group(s), {sset.name} {dtype_name} ({sset.tensors} tensors, "
                    with section(record, name + f"{sset.numel:,} elements)"):
                        for optimizer in args.optimizers:
                            rows += run_optimizer_cases(args, ctx, settings, sset, dtype_name, optimizer, variant,
                                                        groups, deadline, copies, record["copy"]["gbps"])  # fmt: skip
                    harness.write_json(path, record)

    if "torch-compile" in args.impls and "adamw" in args.optimizers and "step" in args.variants and 1 in args.groups:
        with section(record, f"torch.compile ({args.compile_backend}), one subprocess per case"):
            for row in run_compile_cases(args, sets, args.dtypes, deadline, copies):
                rows.append(add_derived(row, record["copy"]["gbps"]))
        harness.write_json(path, record)

    with section(record, "copy bandwidth, again"):
        end = harness.copy_bandwidth(device, args.copy_mib * 2**20, settings)
        record["copy"].update(end=end, gbps=max(copy["gbps"], end["gbps"]))
        print(f"  {end['gbps']:.0f} GB/s; the floor uses the higher of the two: {record['copy']['gbps']:.0f} GB/s")
    for row in rows:
        add_derived(row, record["copy"]["gbps"])
    record["targets"] = evaluate_targets(
        rows, [s.name for s in sets], args.dtypes, args.optimizers, args.variants, args.groups
    )
    failed = [r for r in rows if r["ours"] and r["status"] in ("failed", "timeout", "oom")]
    return harness.finish(record, path, args, markdown, failed, start)


def run_optimizer_cases(args, ctx, settings, sset, dtype_name, optimizer, variant, groups, deadline, copies, copy_gbps):
    """The references and every chosen implementation of one case; returns their rows."""
    impls = [i for i in IMPLS if i.build is not None and optimizer in i.optimizers and i.name in args.impls
             and variant in i.variants]  # fmt: skip
    if not impls:
        return []
    out = []
    host = sset.name in HOST_SETS

    def later(row, fn):
        return harness.budget_spent(row, args) if time.monotonic() > deadline else fn()

    ref = later(new_row(sset, dtype_name, optimizer, SAME_BYTES_COPY, variant, groups),
                lambda: run_same_bytes_copy(sset, dtype_name, optimizer, ctx, settings, variant, groups))  # fmt: skip
    copies[(variant, groups, sset.name, dtype_name, optimizer)] = ref
    out.append(ref)
    if variant == "loop":
        out.append(
            later(
                new_row(sset, dtype_name, optimizer, GRADIENTS_ONLY, variant, groups),
                lambda: run_gradients_only(sset, dtype_name, optimizer, ctx, settings, host, groups),
            )
        )
    for impl in impls:
        row = later(
            new_row(sset, dtype_name, optimizer, impl, variant, groups),
            lambda impl=impl: run_case(sset, dtype_name, optimizer, impl, ctx, settings, host, variant, groups),
        )
        out.append(with_same_bytes_copy(row, ref))  # fmt: skip
    for row in out:
        add_derived(row, copy_gbps)  # again at the end, with the higher of the two copy bandwidths
        print_row(row)
    return out


if __name__ == "__main__":
    sys.exit(main())
