"""Question: on a model of about 1B parameters, what do in-backward updates save in peak memory, and what do
they cost in step time and kernel launches, against torch's fused AdamW, torch's documented
optimizer-in-backward recipe and flatopt's step mode?

Model: 30 blocks ``x + Linear(8192->2048)(GELU(Linear(2048->8192)(x)))`` (1,006,940,160 parameters),
input 4 x 256 tokens of dimension 2048 (random normal), loss = mean square of the output, AdamW, fp32 and bf16
parameters (states in the parameter's dtype). Cases, each on a fresh model built from the same seed:

    fwd-bwd                     forward + backward only, every gradient freed as it arrives (no optimizer):
                                the activation peak and the kernels of forward + backward
    torch-fused                 torch.optim.AdamW(fused=True), zero_grad(set_to_none=True)
    torch-in-backward           torch's recipe: one AdamW(fused=True) per parameter, step() and zero_grad()
                                from p.register_post_accumulate_grad_hook
    flatopt                     flatopt.AdamW, step mode (flat gradient buffer)
    flatopt-gather              flatopt.AdamW(direct_grads="gather"), step mode: autograd's gradients read in place
    flatopt-in-backward         flatopt.AdamW(in_backward=True), default bucket_size (2**25 elements)
    flatopt-in-backward-small   flatopt.AdamW(in_backward=True, bucket_size=2**22)
    flatopt-bf16-...            flatopt.AdamW in step mode in a storage mode (master_weights, stochastic_rounding,
                                state_dtype; benchmarks/precision_modes.py), bf16 only: peak memory and bytes per
                                parameter held (parameters, masters, states), against the issue's targets (fp32 12,
                                bf16 + remainder + fp32 states 12, bf16 + stochastic rounding + bf16 states 6, with
                                int8 states <= 4.2)

Per case: peak memory (``torch.cuda.max_memory_allocated`` over the timed steps, reset after warm-up, which
allocates the lazy optimizer states and compiles the kernels; the peak including warm-up is kept too), the
memory of parameters and of optimizer states, the memory held between steps, the step time (CUDA events around
zero_grad + forward + backward + step, median of the timed steps) and the kernel launches of one step
(torch.profiler: device kernels and memsets/copies; kernels whose name contains "adam"; flatopt's own launch
counter in in-backward mode, with how many of those launches its buckets replayed from their CUDA graphs and how
many buckets gave up recording). Every byte figure is relative to the memory allocated before the case.

Peak activations are measured, not estimated: the peak of the fwd-bwd case minus the memory it holds between
steps (parameters and input). It includes the one gradient being produced, as every optimizer case does.
``peak(torch-in-backward) - params - states`` is recorded as an upper bound beside it.

flatopt's targets (reported with margins, not asserted): in-backward peak <= params + states + input + peak
activations + the largest bucket (max(bucket_size, the largest bucket's elements) x element size: a parameter
larger than bucket_size is a bucket of its own, so here every 2048x8192 weight is one at either bucket size and
the two in-backward cases have the same 61 buckets); in-backward step time <= step mode x 1.02 (noise margin);
optimizer launches per step <= 1/4 of torch's recipe (kernels beyond forward + backward, and "adam" kernels).

The step time is the median over at least --iters timed steps, more until they add up to --min-time-s (2 s), at
most 20x --iters: a bf16 step takes about 20 ms, and 10 of them spread too widely for a 2 % target.

GPU run from the repository root (about 1-2 minutes on an H100 for fp32 and bf16):

    PYTHONPATH=. python3 benchmarks/bench_memory.py [--dtypes fp32,bf16] [--json PATH] [--markdown PATH]

CPU smoke run (tiny model, CPU timer, no profiler; checks the code path, measures nothing):

    PYTHONPATH=. python3 benchmarks/bench_memory.py --device cpu --smoke --out /tmp/flatopt-smoke

Markdown table of a stored result: ``python3 benchmarks/bench_memory.py --report RESULT.json``.
"""

import gc
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable (after any installed flatopt)
    sys.path.append(str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from torch import nn

import flatopt
from benchmarks import harness, precision_modes
from benchmarks.harness import num

GIB = 2**30
HPARAMS = dict(lr=1e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
TARGET_TIME_RATIO = 1.02  # in-backward step time / step mode time, noise margin included
TARGET_LAUNCH_FRACTION = 0.25  # in-backward optimizer launches / torch recipe's ("far fewer")
MAX_ITERS_FACTOR = 20  # --min-time-s adds timed steps up to this many times --iters


@dataclass(frozen=True)
class Sizes:
    blocks: int
    dim: int
    hidden: int
    batch: int
    tokens: int
    small_bucket: int  # bucket_size of the flatopt-in-backward-small case

    @property
    def numel(self):
        return model_numel(self.blocks, self.dim, self.hidden)


FULL = Sizes(blocks=30, dim=2048, hidden=8192, batch=4, tokens=256, small_bucket=2**22)
SMOKE = Sizes(blocks=2, dim=64, hidden=256, batch=2, tokens=8, small_bucket=2**12)


def model_numel(blocks=30, dim=2048, hidden=8192):
    """Parameters of the block stack: each block has a dim x hidden and a hidden x dim weight and their biases."""
    return blocks * (2 * dim * hidden + hidden + dim)


def param_bytes(numel, dtype):
    return numel * harness.element_size(dtype)


def adamw_state_bytes(numel, dtype):
    """exp_avg and exp_avg_sq in the parameter's dtype (the step counters are negligible)."""
    return 2 * numel * harness.element_size(dtype)


def bucket_bytes(bucket_size, dtype):
    """Bytes of an in-backward bucket's gradient: bucket_size elements of the parameter's dtype."""
    return bucket_size * harness.element_size(dtype)


class Block(nn.Module):
    def __init__(self, dim, hidden, dtype):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, dtype=dtype)
        self.fc2 = nn.Linear(hidden, dim, dtype=dtype)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class BlockStack(nn.Module):
    def __init__(self, sizes, dtype):
        super().__init__()
        self.blocks = nn.ModuleList(Block(sizes.dim, sizes.hidden, dtype) for _ in range(sizes.blocks))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def loss_of(model, x):
    return model(x).float().square().mean()


# ------------------------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    name: str
    note: str
    ours: bool = False
    bucket: str = None  # "default" or "small": flatopt in-backward
    precision: str = None  # a storage mode of precision_modes.MODES (its parameters' dtype only)
    landing: object = None  # flatopt's direct_grads, when not its default


CASES = (
    Case("fwd-bwd", "forward + backward only, each gradient freed by its post-accumulate-grad hook (no optimizer)"),
    Case("torch-fused", "torch.optim.AdamW(fused=True), zero_grad(set_to_none=True) before each forward"),
    Case(
        "torch-in-backward",
        "torch's optimizer-in-backward recipe: one torch.optim.AdamW(fused=True) per parameter, step() and "
        "zero_grad() from p.register_post_accumulate_grad_hook",
    ),
    Case(
        "flatopt",
        "flatopt.AdamW(model), step mode: zero_grad() (.grad None, the gradient storage released), forward, "
        "backward (covered layers write their gradients into the buffer, hooks copy the others), step()",
        ours=True,
    ),
    Case(
        "flatopt-gather",
        'flatopt.AdamW(model, direct_grads="gather"), step mode: no covered layer nor hook, step() reads autograd\'s '
        "gradients where they lie (the flat gradient buffer keeps no storage)",
        ours=True,
        landing="gather",
    ),
    Case(
        "flatopt-in-backward",
        "flatopt.AdamW(model, in_backward=True), default bucket_size; step() and zero_grad() called as in step mode",
        ours=True,
        bucket="default",
    ),
    Case(
        "flatopt-in-backward-small",
        "flatopt.AdamW(model, in_backward=True, bucket_size=small_bucket)",
        ours=True,
        bucket="small",
    ),
)
CASES += tuple(
    Case(
        f"flatopt-{mode}",
        f"flatopt.AdamW(model, {', '.join(f'{k}={v!r}' for k, v in kwargs.items())}), step mode ({dtype} only)",
        ours=True,
        precision=mode,
    )
    for mode, (dtype, kwargs) in precision_modes.MODES.items()
    if kwargs
)
CASE_BY_NAME = {c.name: c for c in CASES}


def _free_grad(p):
    p.grad = None


def build(case, model, x, device, sizes):
    """Set up ``case`` on ``model`` with input ``x``; returns (train step, what to keep alive, a function giving the
    bytes of optimizer state, the flatopt optimizer or None)."""
    params = list(model.parameters())
    if case.name == "fwd-bwd":
        hooks = [p.register_post_accumulate_grad_hook(_free_grad) for p in params]

        def step():
            loss_of(model, x).backward()

        return step, hooks, None, None
    if case.name == "torch-fused":
        opt = torch.optim.AdamW(params, **HPARAMS, fused=True)

        def step():
            opt.zero_grad(set_to_none=True)
            loss_of(model, x).backward()
            opt.step()

        return step, [opt], lambda: harness.state_bytes(opt), None
    if case.name == "torch-in-backward":
        opts = {p: torch.optim.AdamW([p], **HPARAMS, fused=True) for p in params}

        def hook(p):
            opts[p].step()
            opts[p].zero_grad(set_to_none=True)

        hooks = [p.register_post_accumulate_grad_hook(hook) for p in params]

        def step():
            loss_of(model, x).backward()

        return step, [opts, hooks], lambda: harness.state_bytes(opts.values()), None
    kwargs = dict(precision_modes.MODES[case.precision][1]) if case.precision else {}
    if case.landing is not None:
        kwargs["direct_grads"] = case.landing
    if case.bucket is not None:
        kwargs["in_backward"] = True
        if case.bucket == "small":
            kwargs["bucket_size"] = sizes.small_bucket
    backend = "triton" if torch.device(device).type == "cuda" else "torch"
    opt = flatopt.AdamW(model, **HPARAMS, backend=backend, **kwargs)

    def step():
        opt.zero_grad()
        loss_of(model, x).backward()
        opt.step()

    return step, [opt], lambda: harness.state_bytes(opt), opt


def count_device_events(events):
    """Device work in profiler events: kernels, memsets/copies, and kernels whose name contains 'adam'."""
    out = dict(kernels=0, memops=0, adam_kernels=0)
    for e in events:
        if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        name = str(e.name)
        if name.startswith(("Memset", "Memcpy", "memset", "memcpy")):
            out["memops"] += 1
        else:
            out["kernels"] += 1
            out["adam_kernels"] += "adam" in name.lower()
    return out


def profile_step(step, device):
    """Device events of one call of ``step`` (CUDA only)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize(device)
    return count_device_events(prof.events())


def run_case(case, dtype_name, sizes, device, args):
    """Build, measure and free one case; never raises (failures and OOMs are recorded in the row)."""
    row = dict(case=case.name, dtype=dtype_name, ours=case.ours, status=None)
    if case.bucket is not None:
        row["bucket_size"] = (
            sizes.small_bucket if case.bucket == "small" else harness.FlatoptInternals.default_bucket_size()
        )
    dtype = harness.DTYPES[dtype_name]
    cuda = device.type == "cuda"

    def body(row):
        harness.free_memory(device)
        base = harness.allocated(device)
        torch.manual_seed(args.seed)
        with torch.device(device):
            model = BlockStack(sizes, dtype)
        harness.sync(device)
        row["params_bytes"] = harness.allocated(device) - base if cuda else param_bytes(sizes.numel, dtype)
        gen = torch.Generator(device=device).manual_seed(args.seed + 1)
        x = torch.randn(sizes.batch, sizes.tokens, sizes.dim, generator=gen, device=device, dtype=dtype)
        row["input_bytes"] = x.numel() * x.element_size()
        step, keep, states, opt = build(case, model, x, device, sizes)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        before = harness.in_backward_stats(opt) if opt is not None else None
        if before is not None:
            row.update(buckets=before["buckets"], largest_bucket_elements=before["largest_bucket_elements"])
        for _ in range(args.warmup):
            step()
        harness.sync(device)
        if before is not None:
            launches = harness.in_backward_stats(opt)["launches"] - before["launches"]
            row["flatopt_launches_per_step"] = launches / args.warmup
        row["states_bytes"] = states() if states else 0
        if opt is not None:  # parameters, masters and states the optimizer holds, per parameter (gradients apart)
            row["bytes_per_param"] = precision_modes.held_bytes(opt) / sizes.numel
            mode = case.precision or dtype_name
            row["expected_bytes_per_param"] = precision_modes.held_bytes_per_element("adamw", mode)
        if cuda:
            row["warmup_peak_bytes"] = torch.cuda.max_memory_allocated(device) - base
            row["held_bytes"] = harness.allocated(device) - base
            torch.cuda.reset_peak_memory_stats(device)
        times = harness.time_steps(step, device, args.iters, args.min_time_s, MAX_ITERS_FACTOR * args.iters)
        if cuda:
            row["peak_bytes"] = torch.cuda.max_memory_allocated(device) - base
        row.update(harness.timing_fields(times), iters=len(times))
        if before is not None:  # how the buckets' launches went: replayed from their CUDA graphs, or not
            stats = harness.in_backward_stats(opt)
            row.update({k: stats[k] for k in ("bucket_graph_replays", "bucket_graphs_recorded",
                                              "buckets_launching_directly")})  # fmt: skip
        if cuda and not args.no_profile:
            try:
                row.update(profile_step(step, device))
            except Exception as e:  # the measurement goes on without the launch count
                row["profile_error"] = f"{type(e).__name__}: {e}"[:500]
        elif not cuda:
            row["profile_error"] = "kernels are counted with torch.profiler on a CUDA device"
        with torch.no_grad():
            row["final_loss"] = loss_of(model, x).item()
        del keep  # the hooks and optimizers, before the models they refer to

    harness.run_guarded(row, device, body)
    gc.collect()
    harness.free_memory(device)
    return row


def warm_libraries(device, dtypes):
    """One small GEMM forward + backward per dtype, so that cuBLAS workspaces exist before the first case's
    baseline (they persist, and would otherwise be counted in the first case only)."""
    for name in dtypes:
        lin = nn.Linear(64, 64, device=device, dtype=harness.DTYPES[name])
        lin(torch.randn(8, 64, device=device, dtype=harness.DTYPES[name])).float().square().mean().backward()
    harness.sync(device)


# ------------------------------------------------------------------------------------------ targets
def _target(what, dtype, value, threshold, unit, why_missing=None):
    """Lower is better for every target here; margin > 0: met by that much."""
    return harness.target(what, value, threshold, unit, note=why_missing, dtype=dtype)


def derive(rows, dtypes):
    """Peak activations per dtype, and flatopt's targets."""
    idx = {(r["case"], r["dtype"]): r for r in rows if r["status"] == "ok"}
    activations, targets = {}, []
    for dt in dtypes:
        fb, recipe = idx.get(("fwd-bwd", dt)), idx.get(("torch-in-backward", dt))
        act = None
        if fb and fb.get("peak_bytes") is not None:
            act = fb["peak_bytes"] - fb["held_bytes"]
        bound = None
        if recipe and recipe.get("peak_bytes") is not None:
            bound = recipe["peak_bytes"] - recipe["params_bytes"] - recipe["states_bytes"]
        activations[dt] = dict(measured_bytes=act, recipe_upper_bound_bytes=bound)
        step_mode = idx.get(("flatopt", dt))
        for name in ("flatopt-in-backward", "flatopt-in-backward-small"):
            r = idx.get((name, dt))
            value = threshold = None
            if r and r.get("peak_bytes") is not None and act is not None:
                # a parameter larger than bucket_size is a bucket of its own: the largest bucket bounds the staging
                one_bucket = bucket_bytes(max(r["bucket_size"], r.get("largest_bucket_elements", 0)), dt)
                threshold = (r["params_bytes"] + r["states_bytes"] + r["input_bytes"] + act + one_bucket) / GIB
                value = r["peak_bytes"] / GIB
            what = f"{name} peak <= params + states + input + activations + largest bucket"
            targets.append(_target(what, dt, value, threshold, "GiB", "needs the fwd-bwd case and a CUDA peak"))
            ratio = r["median_ms"] / step_mode["median_ms"] if r and step_mode else None
            what = f"{name} time / flatopt step mode <= {TARGET_TIME_RATIO:g}"
            targets.append(_target(what, dt, ratio, TARGET_TIME_RATIO, "x"))
            for key, label in (("extra_kernels", "kernels beyond fwd+bwd"), ("adam_kernels", "adam kernels")):
                mine, theirs = _launches(r, fb, key), _launches(recipe, fb, key)
                frac = mine / theirs if mine is not None and theirs else None
                what = f"{name} {label} / torch recipe's <= {TARGET_LAUNCH_FRACTION:g}"
                targets.append(_target(what, dt, frac, TARGET_LAUNCH_FRACTION, "x", "needs profiler counts"))
        for mode, limit in precision_modes.HELD_TARGETS.items():
            name = "flatopt" if mode == dt else f"flatopt-{mode}"
            r = idx.get((name, dt))
            if r is None and precision_modes.MODES[mode][0] != dt:
                continue
            what = f"{name} bytes per parameter (parameters, masters, states) <= {limit:g}"
            targets.append(_target(what, dt, r.get("bytes_per_param") if r else None, limit, "B"))
    return activations, targets


def _launches(row, fwd_bwd, key):
    if row is None or row.get("kernels") is None:
        return None
    if key == "adam_kernels":
        return row["adam_kernels"]
    if fwd_bwd is None or fwd_bwd.get("kernels") is None:
        return None
    return row["kernels"] + row["memops"] - fwd_bwd["kernels"] - fwd_bwd["memops"]


# ------------------------------------------------------------------------------------------- output
def _gib(x):
    return f"{x / GIB:.2f}" if isinstance(x, (int, float)) else "-"


def markdown(record):
    lines = harness.smoke_banner(record)
    s = record["sizes"]
    lines += [
        f"In-backward memory benchmark: {harness.env_line(record)}. Model: {s['blocks']} blocks "
        f"{s['dim']}->{s['hidden']}->{s['dim']} ({record['params']:,} parameters), batch {s['batch']}x{s['tokens']}, "
        "AdamW. GiB = 2**30 bytes.",
        "",
        f"Command: `{record.get('command')}`",
        "",
    ]
    held = any(r.get("bytes_per_param") is not None for r in record["results"])  # results before the column: none
    head = ["dtype", "case", "peak GiB", "params GiB", "states GiB", "held between steps GiB",
            *(["B / param"] if held else []), "step ms (p20-p80)", "kernels+memops / step", "adam kernels",
            "flatopt launches"]  # fmt: skip
    rows = []
    for r in record["results"]:
        if r["status"] != "ok":
            rows.append([r["dtype"], r["case"], f"{r['status'].upper()}: {harness.first_line(r.get('reason'), 120)}"]
                        + [""] * (len(head) - 3))  # fmt: skip
            continue
        launches = r["kernels"] + r["memops"] if r.get("kernels") is not None else None
        rows.append([r["dtype"], r["case"], _gib(r.get("peak_bytes")), _gib(r["params_bytes"]),
                     _gib(r["states_bytes"]), _gib(r.get("held_bytes")),
                     *([num(r.get("bytes_per_param"), ".3f")] if held else []), harness.spread(r, spec=".1f"),
                     num(launches, "d"), num(r.get("adam_kernels"), "d"),
                     num(r.get("flatopt_launches_per_step"), ".0f")])  # fmt: skip
    lines += harness.md_table(head, rows)
    lines += ["", "Peak activations (fwd-bwd peak minus what it holds between steps; the torch recipe's peak minus "
              "params and states is an upper bound):", ""]  # fmt: skip
    for dt, a in record["activations"].items():
        lines.append(
            f"- {dt}: {_gib(a['measured_bytes'])} GiB measured; upper bound {_gib(a['recipe_upper_bound_bytes'])} GiB"
        )
    lines += [""] + harness.targets_markdown(record["targets"], ("dtype",))
    return "\n".join(lines) + "\n"


def print_row(r):
    if r["status"] == "ok":
        detail = (
            f"peak {_gib(r.get('peak_bytes'))} GiB, params {_gib(r['params_bytes'])}, states {_gib(r['states_bytes'])}"
            f", held {_gib(r.get('held_bytes'))}; {r['median_ms']:.2f} ms; kernels {num(r.get('kernels'), 'd')} "
            f"memops {num(r.get('memops'), 'd')} adam {num(r.get('adam_kernels'), 'd')}"
        )
        if r.get("flatopt_launches_per_step") is not None:
            detail += f"; flatopt launches {r['flatopt_launches_per_step']:.0f}"
    else:
        detail = f"{r['status'].upper()}: {r.get('reason', '')}"
    print(f"  {r['dtype']:4} {r['case']:26} {detail}  ({r['seconds']:.1f} s)", flush=True)


# ---------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = harness.parser(__doc__, budget_s=150.0)
    add = p.add_argument
    add("--dtypes", type=harness.csv_list(("fp32", "bf16")), default=["fp32", "bf16"], help="default: fp32,bf16")
    add("--cases", type=harness.csv_list(tuple(CASE_BY_NAME)), default=list(CASE_BY_NAME), help="default: all")
    add("--warmup", type=int, default=None, help="steps before timing (default 3; smoke 2)")
    add("--iters", type=int, default=None, help="timed steps, at least (default 10; smoke 2)")
    add(
        "--min-time-s",
        type=float,
        default=None,
        help=f"more timed steps until they add up to this, up to {MAX_ITERS_FACTOR}x --iters (default 2; smoke 0)",
    )
    add("--no-profile", action="store_true", help="do not count kernels with torch.profiler")
    args = p.parse_args(argv)
    harness.check_device(p, args)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.smoke else 3)
    args.iters = args.iters if args.iters is not None else (2 if args.smoke else 10)
    args.min_time_s = args.min_time_s if args.min_time_s is not None else (0.0 if args.smoke else 2.0)
    return args


def main(argv=None):
    return harness.main(argv, parse_args, run, markdown)


def run(args, argv):
    start = time.monotonic()
    device = torch.device(args.device)
    sizes = SMOKE if args.smoke else FULL
    path = harness.output_path(args, "memory")
    record = harness.new_record(
        "memory",
        "in-backward AdamW on a ~1B-parameter model: peak memory, step time and kernel launches per step",
        "bench_memory", args, argv, device,
        settings=dict(warmup=args.warmup, iters=args.iters, min_time_s=args.min_time_s, budget_s=args.budget_s,
                      seed=args.seed, profile=not args.no_profile),
        hparams=HPARAMS,
        sizes=asdict(sizes),
        params=sizes.numel,
        expected_bytes={dt: dict(params=param_bytes(sizes.numel, dt), states=adamw_state_bytes(sizes.numel, dt),
                                 default_bucket=bucket_bytes(harness.FlatoptInternals.default_bucket_size(), dt),
                                 small_bucket=bucket_bytes(sizes.small_bucket, dt)) for dt in args.dtypes},
        cases={c.name: c.note for c in CASES},
        targets_definition=dict(time_ratio=TARGET_TIME_RATIO, launch_fraction=TARGET_LAUNCH_FRACTION),
        results=[],
        activations={},
        targets=[],
    )  # fmt: skip
    harness.announce(record, path)
    print(f"{sizes.numel:,} parameters")
    if device.type == "cuda":
        warm_libraries(device, args.dtypes)
    for dt in args.dtypes:
        for name in args.cases:
            case = CASE_BY_NAME[name]
            if case.precision is not None and precision_modes.MODES[case.precision][0] != dt:
                continue  # a storage mode of another dtype's parameters
            if time.monotonic() - start > args.budget_s:
                row = harness.budget_spent(dict(case=name, dtype=dt, ours=case.ours, seconds=0.0), args)
            else:
                row = run_case(case, dt, sizes, device, args)
            record["results"].append(row)
            print_row(row)
            harness.write_json(path, record)
    record["activations"], record["targets"] = derive(record["results"], args.dtypes)
    failed = [r for r in record["results"] if r["ours"] and r["status"] in ("failed", "oom")]
    return harness.finish(record, path, args, markdown, failed, start)


if __name__ == "__main__":
    sys.exit(main())
