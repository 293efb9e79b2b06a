"""Question: where does the time of one flatopt step go, on the host and on the device?

Host: the burst-timed cost of ``step()`` (internal step graph, a changing lr as an LR scheduler makes,
GradScaler's tensors, direct Triton launches) and of its parts (binding check, hyper-parameter refresh, graph key, graph
replay, one bare kernel launch), plus a cProfile listing of ``step()``. Device: flatopt's step against
a copy of the same bytes (the achievable time for a buffer of that size, launch and tail included) and
against the floor from a large copy, for kernel block sizes and warp counts around the defaults.

GPU run from the repository root (about one minute on an H100):

    PYTHONPATH=. python3 benchmarks/profile_step.py [--out benchmarks/results/profiles] [--sections gather]

Writes ``profile-step-STAMP.json`` (and prints everything). It explains results; bench_step.py measures them.
CPU smoke run (tiny sets, the torch backend; the device section and the CUDA-graph rows are recorded as skipped,
the gather section runs under the Triton interpreter when TRITON_INTERPRET=1; measures nothing):

    PYTHONPATH=. python3 benchmarks/profile_step.py --device cpu --smoke --out /tmp/flatopt-smoke
"""

import cProfile
import functools
import io
import os
import pstats
import sys
import time
import warnings
from pathlib import Path

if __package__ in (None, ""):
    sys.path.append(str(Path(__file__).resolve().parents[1]))

import torch

import flatopt
from benchmarks import harness

OPTS = {"adamw": flatopt.AdamW, "sgd": flatopt.SGD, "lion": flatopt.Lion}
HP = {
    "adamw": dict(lr=1e-3, weight_decay=1e-2),
    "sgd": dict(lr=1e-2, momentum=0.9),
    "lion": dict(lr=1e-4, weight_decay=0.1),
}


def build(set_name, dtype, optimizer, device, smoke=False, **kw):
    params = harness.make_params(harness.shape_set(set_name, smoke=smoke).shapes, dtype, device)
    opt = OPTS[optimizer](params, **HP[optimizer], **kw)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*received no gradient.*")
        opt.step()
        opt.step()
        opt.step()
    return params, opt


def host_us(fn, device, settings, before=None):
    med, q20, q80, n = harness.host_time(fn, device, settings, before=before)
    return dict(median_us=med, q20_us=q20, q80_us=q80, calls=n)


def host_section(device, settings, smoke=False):
    out = {}
    for set_name in ("gpt2", "many-small"):
        out[set_name] = host_rows(set_name, device, settings, smoke)
        harness.free_memory(device)
    return out


def host_rows(set_name, device, settings, smoke=False):
    params, opt = build(set_name, torch.float32, "adamw", device, smoke)
    inside = harness.internals(opt)
    buf = inside.buffers[0]
    rows = {}
    rows["step (internal graph)"] = host_us(opt.step, device, settings)

    lrs = iter(range(10**9))

    def step_new_lr():
        opt.param_groups[0]["lr"] = 1e-3 * (1 + (next(lrs) % 1000) * 1e-4)
        opt.step()

    rows["step, lr changed every call"] = host_us(step_new_lr, device, settings)
    rows["check_bindings (amortised)"] = host_us(inside.check_bindings_at_step, device, settings)
    rows["refresh_hparams (unchanged)"] = host_us(inside.refresh_hparams, device, settings)
    rows["step graph key"] = host_us(inside.step_graph_key, device, settings)
    if inside.step_graph.graph is not None:
        rows["graph.replay()"] = host_us(inside.step_graph.graph.replay, device, settings)
    if triton_runs(device):
        kernel = inside.kernels().adamw_step
        hp = inside.hparams(buf.device)

        def bare():
            kernel(buf.data, buf.grad, buf.states["exp_avg"], buf.states["exp_avg_sq"], hparams=hp, meta=buf.meta)

        rows["one Triton launch (adamw_step)"] = host_us(bare, device, settings)
    zero = functools.partial(opt.zero_grad, set_to_none=False)  # untimed: step() then compares every .grad
    rows["step after zero_grad() (untimed)"] = host_us(opt.step, device, settings, before=zero)
    rows["zero_grad() (set_to_none=True)"] = host_us(opt.zero_grad, device, settings)
    for p in params:  # gradients again for what follows (set by hand: the next step copies them into their views)
        p.grad = torch.randn_like(p)
    amp = amp_rows(opt, device, settings)
    rows.update(amp.pop("host"))
    opt.use_step_graph = False
    rows["step, direct launch"] = host_us(opt.step, device, settings)
    calls = 10 if smoke else 200
    listing = profile(opt.step, device, calls)
    opt.use_step_graph = True
    listing = profile(opt.step, device, calls) + "\n-- step, direct launch --\n" + listing
    for k, v in rows.items():
        print(f"host {set_name:10s} {k:36s} {v['median_us']:8.1f} us (p20 {v['q20_us']:.1f}, p80 {v['q80_us']:.1f})")
    print(listing)
    return dict(params=len(params), host=rows, grad_scaler_graph=amp, cprofile_step=listing)


def amp_rows(opt, device, settings):
    """Host cost of GradScaler steps: the training loop's ``scaler.step(opt); scaler.update()`` (torch's
    inf check over every gradient included), and flatopt's step() given new grad_scale / found_inf
    tensors at every call as GradScaler.step makes them, through the step graph and launched directly.
    Also how often the step graph replayed, and how many graphs it recorded, under the real scaler."""
    scaler = torch.amp.GradScaler(device.type)
    scaler.scale(torch.ones((), device=device))  # creates the scale tensor, as the first scale(loss) does
    graph = harness.internals(opt).new_step_graph()
    calls = [0]

    def scaler_step():
        calls[0] += 1
        scaler.step(opt)
        scaler.update()

    rows = {"scaler.step(opt) + scaler.update()": host_us(scaler_step, device, settings)}
    stats = dict(scaler_steps=calls[0], replays=graph.reused, recorded=graph.recorded, stopped=graph.failed)
    scale = scaler._scale

    def step_amp():
        opt.grad_scale = scale * 1
        opt.found_inf = torch.zeros(1, device=device)
        opt.step()
        del opt.grad_scale, opt.found_inf

    def alloc_only():
        return scale * 1, torch.zeros(1, device=device)

    rows["new grad_scale/found_inf alone (subtract from the next two)"] = host_us(alloc_only, device, settings)
    rows["step, new grad_scale/found_inf (graph)"] = host_us(step_amp, device, settings)
    opt.use_step_graph = False
    rows["step, new grad_scale/found_inf (direct)"] = host_us(step_amp, device, settings)
    opt.use_step_graph = True
    return dict(host=rows, **stats)


def triton_runs(device):
    """Whether flatopt's Triton kernels can be launched on ``device``: on CUDA, or under the Triton interpreter."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def profile(fn, device, calls=200):
    """cProfile's listing of ``calls`` calls of ``fn``, by own time."""
    prof = cProfile.Profile()
    harness.sync(device)
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    harness.sync(device)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(22)
    return text.getvalue()


def gather_section(device, settings, copy_gbps, smoke=False):
    """Device time of landing the gradients and stepping, two ways, AdamW: a batched copy of gradients lying
    elsewhere (one tensor each, as autograd leaves them in a captured step's pool) into the flat buffer and then
    the step (what capture() records now), against one launch that reads them where they lie and stores them
    into the flat buffer as it steps (GradSources): a read of every gradient's bytes less. Also the step alone,
    gradients already in the buffer. Floors: 7 reads and writes per element for the step, 9 for the copy and
    step, 8 for the gathering step (of the parameters' elements, padding left out). The GPT-2 shapes allow
    16-byte gathered loads (GradSources.vec 4 or 8); the 3000 random sizes do not (vec 1, one element per load),
    so the two sets differ in that too."""
    out = []
    for set_name, dtype_name in (("gpt2", "fp32"), ("gpt2", "bf16"), ("many-small", "bf16")):
        out += gather_rows(set_name, dtype_name, device, settings, copy_gbps, smoke)
        harness.free_memory(device)
    return out


def gather_rows(set_name, dtype_name, device, settings, copy_gbps, smoke=False):
    dtype = harness.DTYPES[dtype_name]
    _, opt = build(set_name, dtype, "adamw", device, smoke, backend="triton")
    inside = harness.internals(opt)
    buf = inside.buffers[0]
    grads = [torch.randn_like(v) for v in buf.grad_views]
    sources = inside.grad_sources(buf, grads)
    hp = inside.hparams(buf.device)
    args = (buf.data, buf.grad, buf.states["exp_avg"], buf.states["exp_avg_sq"])
    kernel = inside.kernels().adamw_step

    def step(gather=None):
        kernel(*args, hparams=hp, meta=buf.meta, sources=gather)

    def copy_then_step():
        torch._foreach_copy_(buf.grad_views, grads)
        step()

    elements = sum(v.numel() for v in buf.grad_views)
    rows = []
    for variant, fn, accesses in (
        ("step alone", step, 7),
        ("foreach copy + step", copy_then_step, 9),
        ("gathering step (sources=)", lambda: step(sources), 8),
    ):
        for _ in range(3):
            fn()
        t = harness.device_time(fn, device, settings).median_ms
        floor = harness.floor_ms(elements, accesses * dtype.itemsize, copy_gbps)
        rows.append(
            dict(set=set_name, dtype=dtype_name, variant=variant, ms=t, floor_ms=floor, pct_of_floor=100 * floor / t)
        )
        print(f"gather {set_name:10s} {dtype_name} {variant:26s} {t:.4f} ms {100 * floor / t:5.1f} % of its floor")
    return rows


def device_section(device, settings, copy_gbps):
    out = []
    for set_name, dtype_name in (("many-small", "bf16"), ("many-small", "fp32"), ("gpt2", "bf16")):
        for optimizer in ("adamw", "sgd"):
            out += device_rows(set_name, dtype_name, optimizer, device, settings, copy_gbps)
            harness.free_memory(device)
    return out


def device_rows(set_name, dtype_name, optimizer, device, settings, copy_gbps):
    out = []
    dtype = harness.DTYPES[dtype_name]
    _, opt = build(set_name, dtype, optimizer, device)
    inside = harness.internals(opt)
    defaults = inside.launch_config()
    numel = inside.buffers[0].numel
    bpe = harness.bytes_per_element(optimizer, dtype)
    nbytes = numel * bpe
    floor = harness.floor_ms(numel, bpe, copy_gbps)
    src = torch.randn(nbytes // 8, device=device)  # a copy reading and writing nbytes in all
    dst = torch.empty_like(src)
    same = harness.device_time(lambda: dst.copy_(src), device, settings).median_ms
    src = dst = None
    base = dict(set=set_name, dtype=dtype_name, optimizer=optimizer, numel=numel, floor_ms=floor)
    print(
        f"device {set_name} {dtype_name} {optimizer}: floor {floor:.4f} ms, same-bytes copy {same:.4f} ms "
        f"({100 * floor / same:.1f} % of floor)"
    )
    out.append(dict(base, variant="same-bytes copy", ms=same, pct_of_floor=100 * floor / same))
    configs = [(True, b, w) for b in (2048, 4096, 8192) for w in (4, 8)] + [(False, *defaults)]
    try:
        for graph, block, warps in configs:
            opt.use_step_graph = graph
            inside.set_launch_config(block, warps)
            inside.new_step_graph()  # its key does not cover the block size: record again
            for _ in range(3):  # compile, record, replay
                opt.step()
            t = harness.device_time(opt.step, device, settings).median_ms
            v = f"{'graph' if graph else 'launch'} block {block} elements, {warps} warps"
            print(
                f"    {v:36s} {t:.4f} ms  {100 * floor / t:5.1f} % of floor, {100 * same / t:5.1f} % of same-bytes copy"
            )
            out.append(dict(base, variant=v, ms=t, pct_of_floor=100 * floor / t, pct_of_copy=100 * same / t))
    finally:
        inside.set_launch_config(*defaults)
    return out


SECTIONS = ("host", "device", "gather")


def parse_args(argv=None):
    p = harness.parser(__doc__, budget_s=600.0, report=False)
    p.set_defaults(out=harness.PROFILES_DIR)
    p.add_argument("--sections", type=harness.csv_list(SECTIONS), default=list(SECTIONS),
                   help="comma-separated, some of host,device,gather (default: all three)")  # fmt: skip
    args = p.parse_args(argv)
    harness.check_device(p, args, measures="profiles Triton launches and CUDA graphs")
    return args


def markdown(record):
    """The host rows of each set, and the device and gather sections' percent of the floor."""
    lines = harness.smoke_banner(record) + [f"Step profile: {harness.env_line(record)}.", ""]
    for set_name, part in (record.get("host") or {}).items():
        rows = [[k, f"{v['median_us']:.1f} ({v['q20_us']:.1f}-{v['q80_us']:.1f})"] for k, v in part["host"].items()]
        lines += [f"Host, {set_name} ({part['params']} parameters), us:", ""]
        lines += harness.md_table(["call", "median (p20-p80)"], rows) + [""]
    for key in ("device", "gather"):
        part = record.get(key)
        if isinstance(part, list) and part:
            rows = [[r["set"], r["dtype"], r.get("optimizer", "adamw"), r["variant"], f"{r['ms']:.4f}",
                     f"{r['pct_of_floor']:.1f}"] for r in part]  # fmt: skip
            lines += [f"{key}:", ""]
            lines += harness.md_table(["set", "dtype", "optimizer", "variant", "ms", "% of floor"], rows) + [""]
        elif isinstance(part, dict):
            lines += [f"{key}: {part.get('status')}: {part.get('reason')}", ""]
    return "\n".join(lines) + "\n"


def main(argv=None):
    return harness.main(argv, parse_args, run, markdown)


def run(args, argv):
    start = time.monotonic()
    device = torch.device(args.device)
    settings = harness.timer_settings(args.smoke)
    path = harness.output_path(args, "profile-step")
    copy = harness.copy_bandwidth(device, (4 if args.smoke else 1024) * 2**20, settings)
    record = harness.new_record(
        "profile-step", "where the time of one flatopt step goes, on the host and on the device", "profile_step",
        args, argv, device, copy=copy, sections=args.sections,
    )  # fmt: skip
    harness.announce(record, path)
    print(f"copy bandwidth {copy['gbps']:.0f} GB/s")
    if "host" in args.sections:
        record["host"] = host_section(device, settings, args.smoke)
    for name, needs, fn in (
        ("device", device.type == "cuda", lambda: device_section(device, settings, copy["gbps"])),
        ("gather", triton_runs(device), lambda: gather_section(device, settings, copy["gbps"], args.smoke)),
    ):
        if name not in args.sections:
            continue
        if not needs:
            record[name] = dict(
                status="skipped",
                reason="launch configurations are measured on a CUDA GPU"
                if name == "device"
                else "the Triton kernels need a CUDA GPU or TRITON_INTERPRET=1",
            )
            continue  # fmt: skip
        try:
            record[name] = fn()
        except Exception as e:  # a kernel mode's failure is a result, and the rest is kept
            record[name] = dict(status="failed", **harness.error_fields(e))
            print(f"{name} section failed: {record[name]['reason']}")
    failed = [record[k] for k in ("device", "gather") if isinstance(record.get(k), dict)
              and record[k].get("status") == "failed"]  # fmt: skip
    return harness.finish(record, path, args, markdown, failed, start)


if __name__ == "__main__":
    sys.exit(main())
