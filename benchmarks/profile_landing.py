"""Question: how much host time does each way of landing gradients cost per layer of a training step?

A stack of ``--layers`` ``nn.Linear(--width, --width)`` layers with a small batch, so that the device work is
small and the host's is what is measured, trained with AdamW by:

    torch-fused      native nn.Linear, torch.optim.AdamW(fused=True): no Python per layer in forward or backward
    python-function  the same layers through a minimal Python autograd.Function (F.linear forward, torch's three
                     gradient formulas backward) and torch's fused AdamW: the floor of any landing made of
                     Python autograd Functions
    flatopt-hooks    flatopt.AdamW(model, direct_grads=False): on a GPU a Python hook per parameter copies each
                     gradient into the flat buffer; on the CPU step() gathers them (no hook)
    flatopt-direct   flatopt.AdamW(model, direct_grads=True): the covered layers' Functions write the gradients
                     into the flat buffer (flatopt's default on a GPU)
    flatopt-gather   flatopt.AdamW(model, direct_grads="gather"): no Function and no hook; step() reads every
                     gradient where autograd left it (on the CPU the same as flatopt-hooks)

Each round times one training step of every implementation, in turn (harness.round_orders): perf_counter
around ``zero_grad()`` + forward, around ``backward()`` and around ``step()``, then a synchronisation, so
each phase's number is the host time to issue it (on a GPU the device runs behind; keep ``--layers`` small
enough that the launch queue does not fill). Reported per layer in microseconds (medians over ``--rounds``),
with the difference to torch-fused. It explains the eager benchmark (bench_eager.py) on models of many small
layers, where the host time per layer is the step's time; it is not a result of its own.

Runs on a GPU, or on the CPU (host time is what it measures):

    PYTHONPATH=. python3 benchmarks/profile_landing.py [--device cpu] [--layers 64 --width 64 --batch 8]

Writes ``profiles/profile-landing-STAMP.json``. Smoke run (4 layers, 3 rounds; measures nothing):

    PYTHONPATH=. python3 benchmarks/profile_landing.py --device cpu --smoke --out /tmp/flatopt-smoke
"""

import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.append(str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from torch import nn

import flatopt
from benchmarks import harness

IMPLS = ("torch-fused", "python-function", "flatopt-hooks", "flatopt-direct", "flatopt-gather")
PHASES = ("forward", "backward", "step", "total")


class _PlainLinear(torch.autograd.Function):
    """F.linear with torch's gradient formulas, in Python: what any Function-based landing pays at least."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        return gy.mm(weight), gy.t().mm(x), gy.sum(0)


class _FunctionLinear(nn.Linear):
    def forward(self, x):
        return _PlainLinear.apply(x, self.weight, self.bias)


def make_model(impl, args, device):
    """The layer stack for ``impl``, initialised from ``args.seed``."""
    torch.manual_seed(args.seed)
    cls = _FunctionLinear if impl == "python-function" else nn.Linear
    layers = [cls(args.width, args.width) for _ in range(args.layers)]
    return nn.Sequential(*[m for layer in layers for m in (layer, nn.Tanh())]).to(device)


def make_optimizer(impl, model):
    if impl.startswith("flatopt"):
        direct = {"flatopt-hooks": False, "flatopt-direct": True, "flatopt-gather": "gather"}[impl]
        return flatopt.AdamW(model, lr=1e-3, weight_decay=1e-2, direct_grads=direct)
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2, fused=True)


def measure(args, device):
    """Per implementation and phase, the per-round host times (microseconds per layer)."""
    torch.manual_seed(args.seed + 1)
    x = torch.randn(args.batch, args.width, device=device)
    runs = {}
    for impl in IMPLS:
        model = make_model(impl, args, device)
        runs[impl] = (model, make_optimizer(impl, model))
    times = {impl: {ph: [] for ph in PHASES} for impl in IMPLS}

    def one(impl, record):
        model, opt = runs[impl]
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = model(x).square().mean()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        harness.sync(device)
        if record:
            for ph, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                times[impl][ph].append(dt * 1e6 / args.layers)

    for _ in range(args.warmup):
        for impl in IMPLS:
            one(impl, False)
    for order in harness.round_orders(list(IMPLS), args.rounds):
        for impl in order:
            one(impl, True)
    return times


def summarise(times):
    """impl -> phase -> median microseconds per layer, and the same less torch-fused's."""
    med = {impl: {ph: statistics.median(v) for ph, v in phases.items()} for impl, phases in times.items()}
    base = med["torch-fused"]
    return {
        impl: {ph: dict(us=round(m[ph], 3), over_torch_fused=round(m[ph] - base[ph], 3)) for ph in PHASES}
        for impl, m in med.items()
    }


def parse_args(argv=None):
    p = harness.parser(__doc__, budget_s=600.0, report=True)
    p.set_defaults(out=harness.PROFILES_DIR)
    add = p.add_argument
    add("--layers", type=int, default=None, help="Linear layers in the stack (default 64; smoke 4)")
    add("--width", type=int, default=64, help="features of each layer (default 64)")
    add("--batch", type=int, default=8, help="rows of the input (default 8)")
    add("--warmup", type=int, default=None, help="untimed steps of each implementation (default 20; smoke 2)")
    add("--rounds", type=int, default=None, help="timed rounds (default 300; smoke 3)")
    args = p.parse_args(argv)
    harness.check_device(p, args, cpu_ok=True)
    args.layers = max(1, args.layers if args.layers is not None else (4 if args.smoke else 64))
    args.warmup = args.warmup if args.warmup is not None else (2 if args.smoke else 20)
    args.rounds = max(1, args.rounds if args.rounds is not None else (3 if args.smoke else 300))
    return args


def markdown(record):
    lines = harness.smoke_banner(record) + [f"Landing host-time profile: {harness.env_line(record)}.", ""]
    lines += [f"Command: `{record['command']}`", ""]
    s = record.get("settings", {})
    lines += [
        f"Host microseconds per layer ({s.get('layers')} x nn.Linear({s.get('width')}, {s.get('width')}), batch "
        f"{s.get('batch')}; medians of {s.get('rounds')} paired rounds), and the difference to torch-fused:",
        "",
    ]
    rows = [
        [impl] + [f"{v[ph]['us']:.2f} ({v[ph]['over_torch_fused']:+.2f})" for ph in PHASES]
        for impl, v in (record.get("summary") or {}).items()
    ]
    lines += harness.md_table(["implementation", "zero_grad + forward", "backward", "step()", "whole step"], rows)
    return "\n".join(lines) + "\n"


def main(argv=None):
    return harness.main(argv, parse_args, run, markdown)


def run(args, argv):
    start = time.monotonic()
    device = torch.device(args.device)
    path = harness.output_path(args, "profile-landing")
    record = harness.new_record(
        "profile-landing",
        "host time per layer of each way of landing gradients: native layers, a Python autograd.Function, "
        "flatopt's hooks, flatopt's covered layers and flatopt's gathering step",
        "profile_landing", args, argv, device,
        settings=dict(layers=args.layers, width=args.width, batch=args.batch, warmup=args.warmup,
                      rounds=args.rounds, seed=args.seed),
        impls=list(IMPLS), summary=None,
    )  # fmt: skip
    harness.announce(record, path)
    row = {}

    def body(row):
        row["times_us_per_layer"] = measure(args, device)

    harness.run_guarded(row, device, body)
    failed = [row] if row.get("status") == "failed" else []
    if not failed:
        record["summary"] = summarise(row["times_us_per_layer"])
    record["result"] = row
    return harness.finish(record, path, args, markdown, failed, start)


if __name__ == "__main__":
    sys.exit(main())
