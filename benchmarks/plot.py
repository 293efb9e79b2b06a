"""Draw a stored benchmark result as a PNG, and print its markdown tables.

Reads only the JSON that a benchmark script wrote, so figures and tables always come from stored results. The
kind of result is read from the JSON's "benchmark" field (results of bench_step.py written before it had one are
"step"), and its "schema" (1):

    step      bench_step.py: percent of the copy-bandwidth floor per case and implementation, one panel per variant
              (step alone; zero_grad + gradient landing + step) and optimizer, with a copy of the same bytes as each
              case's reference (a thick black line across the group, with its value) and the target as a dashed
              line; in the loop variant a marker on each bar gives its back-to-back (host included) percent
    memory    bench_memory.py: per dtype, peak memory per case against params + states and flatopt's target
              (params + states + input + activations + largest bucket), then step time with kernel launches per step
    capture   bench_capture.py: per model, median ms per training step and implementation (20th-80th percentile),
              with flatopt's targets
    eager     bench_eager.py: per model, ms per training step of each implementation (paired timing, synchronised
              and back to back) with flatopt's ratio to torch-fused, and the peak memory of each
    cpu       bench_cpu.py: per variant (step alone; zero_grad + backward + step) and optimizer, each implementation's
              median time relative to the case's fastest baseline that steps right, flatopt's ratio written above
              its bar, the target (1.0) dashed; an implementation found to step wrong in a case is hatched there
    fsdp      bench_fsdp.py: per group of ranks, the training step of each case alone, opt.step() (CUDA events in
              the step), the time each case adds to forward + backward (paired) and the peak memory per rank, with
              in-backward mode's peak target; flatopt's targets under the panels
    convergence  convergence.py: per precision mode, the smoothed training loss of every seed, the validation loss
              (mean over the seeds, their range shaded), and each seed's final validation loss against fp32's
              spread and the 2 % band, with each mode's verdict

    python3 benchmarks/plot.py benchmarks/results/step-<stamp>.json                # PNG next to the JSON
    python3 benchmarks/plot.py RESULT.json --png out.png --markdown out.md
    python3 benchmarks/plot.py RESULT.json --no-png --markdown                      # tables to stdout

Cases that did not run (skipped, failed, out of memory, timed out) are drawn as labelled gaps, never as zeros. A
capture JSON may carry published torch numbers to compare with, added by hand as
``"torch_reference_ms": {model: {implementation: ms}}`` (and ``"torch_reference_source": "..."``); they are drawn
as markers when present, and nothing is drawn when absent.

Smoke runs are refused unless ``--allow-smoke`` is given; their PNG and markdown are then labelled
as smoke runs across the figure and at the top of the table. The PNG needs matplotlib; without it the
PNG is skipped with a message and the markdown is still written. The markdown of a result is the benchmark
script's own (``--report``).
"""

import argparse
import importlib
import json
import math
import sys
import textwrap
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable (after any installed flatopt)
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from benchmarks import harness

OPTIMIZER_TITLES = {"adamw": "AdamW", "sgd": "SGD (momentum)", "lion": "Lion"}
IMPL_ORDER = (
    "torch-foreach",
    "torch-fused",
    "torch-fused-graph",
    "torch-compile",
    "apex",
    "lion-pytorch",
    "foreach-lion",
    "flatopt",
    "flatopt-keep-grads",
    "flatopt-launch",
    "flatopt-graph",
    "gradients-only",
)
SAME_BYTES = "copy-same-bytes"  # bench_step.py's reference row: dst.copy_(src) of the bytes the floor counts
SMOKE_LABEL = "SMOKE RUN: NOT A MEASUREMENT"


KINDS = ("step", "memory", "capture", "eager", "cpu", "fsdp", "convergence")
MODULES = {"convergence": "benchmarks.convergence"}  # the script of a kind, where it is not benchmarks.bench_KIND
SCHEMAS = (1,)


def kind_of(record, path="the JSON"):
    """The kind of result (KINDS) from the record's "benchmark" and "schema" fields (bench_step.py's results written
    before it had a "benchmark" field are "step"); ValueError for anything else."""
    if not isinstance(record, dict) or "results" not in record or "env" not in record:
        raise ValueError(f"{path} is not a benchmark result (no 'results'/'env')")
    kind = record.get("benchmark", "step")
    if kind not in KINDS:
        raise ValueError(f"{path}: unknown benchmark {kind!r}; plot.py draws {', '.join(KINDS)}")
    if record.get("schema") not in SCHEMAS:
        raise ValueError(f"{path}: {kind} result of schema {record.get('schema')!r}; plot.py reads schema {SCHEMAS}")
    return kind


def load(path):
    record = json.loads(Path(path).read_text())
    kind_of(record, path)
    return record


def markdown(record, kind=None):
    """The benchmark script's own markdown tables of ``record``."""
    kind = kind or kind_of(record)
    module = importlib.import_module(MODULES.get(kind, f"benchmarks.bench_{kind}"))
    return module.markdown(record)


# ------------------------------------------------------------------------------------------- step result
def _variant(r):
    return r.get("variant", "step")


def _groups(r):
    return r.get("groups", 1)


def _order(rows, record=None):
    """Variant, optimizer, then parameter set in run order, dtype (fp32 first), param groups, implementation."""
    impl_rank = {n: i for i, n in enumerate(IMPL_ORDER)} | {SAME_BYTES: 100}  # the reference after the rest
    opt_rank = {n: i for i, n in enumerate(OPTIMIZER_TITLES)}
    set_rank = {n: i for i, n in enumerate((record or {}).get("sets", {}))}
    dtype_rank = {"fp32": 0, "bf16": 1, "fp16": 2}

    def key(r):
        return (
            _variant(r) != "step",
            opt_rank.get(r["optimizer"], 9),
            set_rank.get(r["set"], 99),
            r["set"],
            dtype_rank.get(r["dtype"], 9),
            _groups(r),
            impl_rank.get(r["impl"], 99),
        )

    return sorted(rows, key=key)


def same_bytes_pct(record):
    """{(variant, optimizer, set, dtype, groups): percent of the floor} of the copy of the same bytes; {} in
    results written before it was measured."""
    out = {}
    for r in record["results"]:
        key = (_variant(r), r["optimizer"], r["set"], r["dtype"], _groups(r))
        if r["impl"] == SAME_BYTES and r["status"] == "ok" and r.get("pct_floor") is not None:
            out[key] = r["pct_floor"]
        elif r.get("same_bytes_copy_pct_of_floor") is not None:
            out.setdefault(key, r["same_bytes_copy_pct_of_floor"])
    return out


def step_target(record, variant):
    """The percent-of-floor target of a variant, from the record's targets_definition."""
    defs = record.get("targets_definition", {})
    return defs.get("pct_floor") if variant == "step" else defs.get("loop_pct_floor")


def plot_png(record, path):
    """Bars of percent of the floor: one panel per (variant, optimizer), groups = (set, dtype, param groups), one bar
    per implementation; the copy of the same bytes as a thick black line across its group, where the result has it;
    in the loop variant a black tick on each bar at its back-to-back percent."""
    plt = _pyplot()
    rows = [r for r in record["results"] if r["status"] == "ok" and r.get("pct_floor") is not None]
    panels = list(dict.fromkeys((_variant(r), r["optimizer"]) for r in _order(record["results"], record)))
    fig, axes = plt.subplots(len(panels), 1, figsize=(13, 3.8 * max(1, len(panels))), squeeze=False)
    cmap = plt.get_cmap("tab20")
    colors = {n: cmap(i % 20) for i, n in enumerate(IMPL_ORDER)}
    same = same_bytes_pct(record)
    for ax, (variant, opt) in zip(axes[:, 0], panels, strict=True):
        mine = [r for r in _order(record["results"], record) if (_variant(r), r["optimizer"]) == (variant, opt)]
        groups = list(dict.fromkeys((r["set"], r["dtype"], _groups(r)) for r in mine))
        impls = [n for n in IMPL_ORDER if any(r["impl"] == n for r in mine if r in rows)]
        width = 0.8 / max(1, len(impls))
        for j, impl in enumerate(impls):
            xs, ys, walls = [], [], []
            for g, case in enumerate(groups):
                hit = [r for r in mine if (r["set"], r["dtype"], _groups(r), r["impl"]) == (*case, impl) and r in rows]
                if hit:
                    xs.append(g - 0.4 + width * (j + 0.5))
                    ys.append(hit[0]["pct_floor"])
                    walls.append(hit[0].get("wall_pct_floor"))
            bars = ax.bar(xs, ys, width, label=impl, color=colors.get(impl))
            ax.bar_label(bars, fmt="%.0f", fontsize=6, padding=1)
            for x, w in zip(xs, walls, strict=True):
                if w is not None:
                    ax.plot([x - width / 2, x + width / 2], [w, w], color="black", lw=1.2)
        label = "copy of the same bytes"
        for g, (s, d, n) in enumerate(groups):
            pct = same.get((variant, opt, s, d, n))
            if pct is not None:  # close to the 100 % and target lines: thicker, with its value
                ax.hlines(pct, g - 0.42, g + 0.42, color="black", lw=2.4, label=label)
                y = min(pct, 96.0) - 2.0  # under the 100 % and target lines
                ax.text(g - 0.42, y, f"copy {pct:.1f}", color="black", fontsize=6, ha="left", va="top")
                label = None  # one legend entry
        target = step_target(record, variant)
        ax.axhline(100, color="black", lw=0.8)
        if target:
            ax.axhline(target, color="black", lw=0.8, ls="--", label=f"target {target:g} %")
        ax.set_xticks(range(len(groups)), [f"{s}\n{d}, {n} group{'s' * (n > 1)}" for s, d, n in groups], fontsize=8)
        ax.set_ylim(0, max([115.0] + [r["pct_floor"] * 1.08 for r in mine if r in rows]))
        ax.set_ylabel("% of floor")
        what = "step() alone" if variant == "step" else "zero_grad + gradient landing + step (ticks: back to back)"
        ax.set_title(f"{OPTIMIZER_TITLES.get(opt, opt)}, {what}", loc="left", fontsize=10)
        ax.legend(fontsize=7, ncol=6, loc="upper left", bbox_to_anchor=(0, -0.2), frameon=False)
    title = f"Optimizer step, percent of the copy-bandwidth floor\n{harness.env_line(record)}"
    _finish(fig, record, title, path)
    plt.close(fig)


# ------------------------------------------------------------------------------------ shared drawing helpers
GIB = 2**30
GAP_LABELS = {"skipped": "skipped", "failed": "FAILED", "oom": "out of memory", "timeout": "timed out"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def gap_label(row, what="not measured"):
    """The label of a bar that has no value: why the case did not run (or did not measure ``what``)."""
    if row is None:
        return "not run"
    status = row.get("status")
    if status == "ok":
        return what
    label = GAP_LABELS.get(status, str(status))
    reason = (row.get("reason") or "").strip().splitlines()
    if reason:
        lines = textwrap.wrap(reason[0], 30)
        if len(lines) > 2:
            lines = [lines[0], lines[1][:27] + "..."]
        label += ":\n" + "\n".join(lines)
    return label


def _draw_bars(ax, slots, colors, top):
    """One bar per slot (name, value or None, lower error, upper error, gap label); a slot without a value is left
    empty and labelled (a gap, never a zero bar). ``top`` is the y-axis top. Returns the bar of each drawn slot."""
    drawn = {}
    for x, (name, value, lo, hi, gap) in enumerate(slots):
        if value is None:
            ax.text(x, 0.03 * top, gap, rotation=90, ha="center", va="bottom", fontsize=7, color="0.35")
            ax.bar(x, top * 0.84, 0.7, color="none", edgecolor="0.75", ls=":", lw=0.8)  # below a legend at the top
            continue
        err = None
        if lo is not None and hi is not None:
            err = [[max(0.0, value - lo)], [max(0.0, hi - value)]]
        drawn[name] = ax.bar(x, value, 0.7, color=colors.get(name, "0.5"), yerr=err, capsize=3, ecolor="0.2")[0]
    return drawn


def _finish(fig, record, title, path, caption=None, caption_size=7.5):
    """Title (smoke runs labelled across the figure), an optional caption under the panels, layout, PNG."""
    if record.get("smoke"):
        title = f"{SMOKE_LABEL}\n{title}"
        fig.text(0.5, 0.5, SMOKE_LABEL, fontsize=40, color="red", alpha=0.35, ha="center", va="center", rotation=25)
    width = max(40, int(fig.get_figwidth() * 72 / 6))  # characters of 10-point text across the figure
    fig.suptitle("\n".join(textwrap.fill(line, width) for line in title.split("\n")), fontsize=10)
    bottom = 0.0
    if caption:
        lines = caption.count("\n") + 1
        bottom = (lines + 1.5) * caption_size * 1.35 / 72 / fig.get_figheight()
        fig.text(0.012, bottom - 0.4 * caption_size / 72 / fig.get_figheight(), caption, ha="left", va="top",
                 fontsize=caption_size)  # fmt: skip
    fig.tight_layout(rect=(0, bottom, 1, 1))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def _met(t):
    return "n/a" if t.get("met") is None else ("met" if t["met"] else "missed")


def _gib(v):
    return f"{v:.2f} GiB" if v >= 0.1 else f"{_fmt3(v * 1024)} MiB"


def _fmt3(v):
    """Three significant digits, trailing zeros kept: 0.725, 5.61, 28.0, 138."""
    if v == 0 or not math.isfinite(v):
        return f"{v:g}"
    return f"{v:.{max(0, 2 - math.floor(math.log10(abs(v))))}f}"


# ------------------------------------------------------------------------------------------ memory result
MEMORY_CASES = (
    "fwd-bwd",
    "torch-fused",
    "torch-in-backward",
    "flatopt",
    "flatopt-gather",
    "flatopt-in-backward",
    "flatopt-in-backward-small",
)
MEMORY_LABELS = {
    "fwd-bwd": "fwd + bwd\n(no optimizer)",
    "torch-fused": "torch\nfused",
    "torch-in-backward": "torch\nin-backward\nrecipe",
    "flatopt": "flatopt\nstep mode",
    "flatopt-gather": "flatopt\nstep mode\ngather",
    "flatopt-in-backward": "flatopt\nin-backward",
    "flatopt-in-backward-small": "flatopt\nin-backward",
}
MEMORY_COLORS = {
    "fwd-bwd": "#b0b0b0",
    "torch-fused": "tab:orange",
    "torch-in-backward": "tab:red",
    "flatopt": "tab:blue",
    "flatopt-gather": "tab:cyan",
    "flatopt-in-backward": "tab:green",
    "flatopt-in-backward-small": "tab:olive",
}
MEMORY_TARGET_SHORT = (
    ("time / flatopt step mode", "time / step mode"),
    ("kernels beyond fwd+bwd / torch recipe's", "extra kernels / recipe"),
    ("adam kernels / torch recipe's", "adam kernels / recipe"),
)


def _memory_cases(record):
    seen = list(dict.fromkeys(r["case"] for r in record["results"]))
    return [c for c in MEMORY_CASES if c in seen] + [c for c in seen if c not in MEMORY_CASES]


def _memory_label(case, row):
    label = MEMORY_LABELS.get(case, case.replace("-", "\n", 1))
    bucket = (row or {}).get("bucket_size")
    if bucket:
        exp = math.log2(bucket)
        label += f"\nbucket 2^{exp:.0f}" if exp.is_integer() else f"\nbucket {bucket:,}"
    return label


def memory_peak_targets(record, dtype):
    """{case: target} of the peak-memory targets of ``dtype``, whose threshold (GiB) is params + states + input +
    activations + the largest bucket (one bucket, in results written before that rule) as the JSON's targets
    computed it; cases without a threshold are left out."""
    out = {}
    for t in record.get("targets", []):
        if t.get("dtype") == dtype and t.get("unit") == "GiB" and t.get("threshold") is not None:
            out[t["target"].split()[0]] = t
    return out


def memory_params_states(record, dtype):
    """Params + states in GiB: the record's expected bytes, or else the first measured case with states."""
    exp = (record.get("expected_bytes") or {}).get(dtype)
    if exp:
        return (exp["params"] + exp["states"]) / GIB
    for r in record["results"]:
        if r["dtype"] == dtype and r["status"] == "ok" and r.get("states_bytes"):
            return (r["params_bytes"] + r["states_bytes"]) / GIB
    return None


def memory_slots(record, dtype, key):
    """Bars of one dtype: (case, value or None, low, high, gap label); ``key`` "peak" (GiB) or "time" (ms)."""
    rows = {r["case"]: r for r in record["results"] if r["dtype"] == dtype}
    slots = []
    for case in _memory_cases(record):
        r = rows.get(case)
        ok = r is not None and r["status"] == "ok"
        if key == "peak":
            value = r["peak_bytes"] / GIB if ok and r.get("peak_bytes") is not None else None
            slots.append((case, value, None, None, gap_label(r, "no peak:\nnot a CUDA run")))
        else:
            value = r.get("median_ms") if ok else None
            lo, hi = (r.get("q20_ms"), r.get("q80_ms")) if ok else (None, None)
            slots.append((case, value, lo, hi, gap_label(r)))
    return slots


def _launches_text(row):
    if row is None or row.get("status") != "ok":
        return None
    if row.get("kernels") is None:
        return "launches n/a"
    text = f"{row['kernels'] + row.get('memops', 0)} launches"
    if row.get("adam_kernels"):
        text += f"\n{row['adam_kernels']} adam"
    return text


def memory_caption(record):
    """flatopt's time and launch targets, one line per (dtype, in-backward case)."""
    lines = []
    for t in record.get("targets", []):
        if t.get("unit") != "x":
            continue
        key = (t["dtype"], t["target"].split()[0])
        name = next((short for long, short in MEMORY_TARGET_SHORT if long in t["target"]), t["target"])
        value = "-" if t.get("value") is None else f"{_fmt3(t['value'])}x"
        part = f"{name} {value} (\u2264 {t['threshold']:g}: {_met(t)})"
        if lines and lines[-1][0] == key:
            lines[-1][1].append(part)
        else:
            lines.append((key, [part]))
    if not lines:
        return None
    body = [f"{dt}, {case}: " + "; ".join(parts) for (dt, case), parts in lines]
    head = (
        "flatopt targets (lower is better; launches = kernels + memsets/copies counted by torch.profiler, "
        "extra kernels = launches beyond the fwd + bwd case):"
    )
    return "\n".join([head, *body])


def plot_memory_png(record, path):
    """Per dtype (columns): peak memory per case with params + states and flatopt's peak target, then step time
    with kernel launches per step."""
    dtypes = list(dict.fromkeys(r["dtype"] for r in record["results"]))
    if not dtypes:
        raise ValueError("the memory result has no cases: nothing to draw")
    plt = _pyplot()
    fig, axes = plt.subplots(2, len(dtypes), figsize=(8 * len(dtypes), 11.5), squeeze=False)
    for col, dt in enumerate(dtypes):
        rows = {r["case"]: r for r in record["results"] if r["dtype"] == dt}
        cases = _memory_cases(record)
        labels = [_memory_label(c, rows.get(c)) for c in cases]
        ax = axes[0, col]
        slots = memory_slots(record, dt, "peak")
        base = memory_params_states(record, dt)
        targets = memory_peak_targets(record, dt)
        values = [v for _, v, *_ in slots if v is not None] + [t["threshold"] for t in targets.values()]
        values += [base] if base else []
        top = 1.3 * max(values) if values else 1.0
        drawn = _draw_bars(ax, slots, MEMORY_COLORS, top)
        for case, bar in drawn.items():
            text = f"{bar.get_height():.2f}"
            y = bar.get_height()
            t = targets.get(case)
            if t is not None:
                if t.get("met") is not None:
                    text += f"\ntarget {t['threshold']:.2f}\n{_met(t)}, {t['margin']:+.3f}"
                y = max(y, t["threshold"])
            ax.text(bar.get_x() + bar.get_width() / 2, y + 0.012 * top, text, ha="center", va="bottom", fontsize=7)
        if base:
            ax.axhline(base, color="black", lw=0.9, ls="--", label=f"params + states = {_gib(base)}")
        label = "target: params + states + input\n+ activations + largest bucket"
        for i, case in enumerate(cases):
            if case in targets:
                ax.hlines(targets[case]["threshold"], i - 0.45, i + 0.45, color="crimson", lw=2.0, label=label)
                label = None  # one legend entry
        ax.set_xticks(range(len(cases)), labels, fontsize=8)
        ax.set_xlim(-0.6, len(cases) - 0.4)
        ax.set_ylim(0, top)
        ax.set_ylabel("peak memory over the timed steps (GiB)")
        ax.set_title(f"{dt}: peak memory per case (GiB = 2^30 bytes)", loc="left", fontsize=10)
        ax.legend(fontsize=7, loc="upper left", frameon=False)

        ax = axes[1, col]
        slots = memory_slots(record, dt, "time")
        values = [hi if hi is not None else v for _, v, _, hi, _ in slots if v is not None]
        top = 1.32 * max(values) if values else 1.0
        drawn = _draw_bars(ax, slots, MEMORY_COLORS, top)
        for case, bar in drawn.items():
            r = rows[case]
            ms = bar.get_height()
            text = f"{ms:.1f} ms" if ms >= 10 else f"{_fmt3(ms)} ms"
            launches = _launches_text(r)
            if launches:
                text += "\n" + launches
            y = max(bar.get_height(), r.get("q80_ms") or 0)
            ax.text(bar.get_x() + bar.get_width() / 2, y + 0.012 * top, text, ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(cases)), labels, fontsize=8)
        ax.set_xlim(-0.6, len(cases) - 0.4)
        ax.set_ylim(0, top)
        ax.set_ylabel("step time, median (ms; bars: p20-p80)")
        ax.set_title(f"{dt}: step time and kernel launches per step", loc="left", fontsize=10)
    s = record.get("sizes", {})
    model = (
        f"{record.get('params', 0):,} parameters ({s.get('blocks')} blocks {s.get('dim')}->{s.get('hidden')}->"
        f"{s.get('dim')}, batch {s.get('batch')}x{s.get('tokens')})"
        if s
        else ""
    )
    _finish(fig, record, f"In-backward AdamW, {model}\n{harness.env_line(record)}", path, memory_caption(record))
    plt.close(fig)


# ----------------------------------------------------------------------------------------- capture result
CAPTURE_IMPLS = (
    "torch-fused",
    "torch-fused-graph",
    "torch-fused-graph-none",
    "torch-compile-ro",
    "flatopt",
    "flatopt-keep-grads",
    "flatopt-capture",
    "flatopt-capture-compiled",
)
CAPTURE_LABELS = {
    "torch-fused": "torch fused\n(eager)",
    "torch-fused-graph": "torch fused\nCUDA graph\n(by hand)",
    "torch-fused-graph-none": "torch fused\nCUDA graph\nset_to_none",
    "torch-compile-ro": "torch.compile\nreduce-\noverhead",
    "flatopt": "flatopt\n(eager)",
    "flatopt-keep-grads": "flatopt\n(eager,\nset_to_none\n=False)",
    "flatopt-capture": "flatopt\ncapture",
    "flatopt-capture-compiled": "flatopt\ncapture +\ntorch.compile",
}
CAPTURE_COLORS = {
    "torch-fused": "tab:orange",
    "torch-fused-graph": "tab:green",
    "torch-fused-graph-none": "tab:brown",
    "torch-compile-ro": "tab:purple",
    "flatopt": "tab:gray",
    "flatopt-keep-grads": "tab:pink",
    "flatopt-capture": "tab:olive",
    "flatopt-capture-compiled": "tab:cyan",
}


def capture_references(record):
    """{model: {impl: ms}}: torch reference numbers stored in the JSON (none unless added there)."""
    refs = record.get("torch_reference_ms") or {}
    return {m: {i: float(v) for i, v in d.items() if isinstance(v, (int, float))} for m, d in refs.items()}


def capture_slots(record, model):
    """Bars of one model: (impl, median ms or None, p20, p80, gap label), in the benchmark's order."""
    rows = {r["impl"]: r for r in record["results"] if r["model"] == model}
    names = list(dict.fromkeys([*CAPTURE_IMPLS, *record.get("impls", {}), *rows]))
    names += [i for i in capture_references(record).get(model, {}) if i not in names]
    keep = [n for n in names if n in rows or n in capture_references(record).get(model, {})]
    slots = []
    for impl in keep:
        r = rows.get(impl)
        ok = r is not None and r["status"] == "ok" and r.get("median_ms") is not None
        slots.append((impl, r["median_ms"] if ok else None, r.get("q20_ms") if ok else None,
                      r.get("q80_ms") if ok else None, gap_label(r)))  # fmt: skip
    return slots


def capture_caption(record):
    """flatopt's targets, one line each: value against threshold, met or missed, margin."""
    lines = []
    for t in record.get("targets", []):
        head = f"{t.get('model')}, {t['target']}:"
        if t.get("met") is None:
            note = t.get("note") or "not measured"
            lines.append(f"{head} n/a ({note if len(note) <= 150 else note[:149] + '...'})")
        else:
            pct = 100 * t["margin"] / t["threshold"] if t["threshold"] else float("nan")
            lines.append(
                f"{head} {t['value']:.3f} ms against {t['threshold']:.3f} ms, {_met(t)} "
                f"({t['margin']:+.3f} ms, {pct:+.1f} %)"
            )
    return "\n".join(["flatopt targets (ms per step, lower is better):", *lines]) if lines else None


def plot_capture_png(record, path):
    """One panel per model: median ms per training step for each implementation (bars: p20-p80), flatopt's targets
    below, torch reference numbers as markers when the JSON has them."""
    models = list(dict.fromkeys([*record.get("models", {}), *(r["model"] for r in record["results"])]))
    models = [m for m in models if any(r["model"] == m for r in record["results"])]
    if not models:
        raise ValueError("the capture result has no cases: nothing to draw")
    plt = _pyplot()
    refs = capture_references(record)
    fig, axes = plt.subplots(1, len(models), figsize=(7.2 * len(models), 6.4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        slots = capture_slots(record, model)
        mrefs = refs.get(model, {})
        values = [hi if hi is not None else v for _, v, _, hi, _ in slots if v is not None] + list(mrefs.values())
        top = 1.25 * max(values) if values else 1.0
        drawn = _draw_bars(ax, slots, CAPTURE_COLORS, top)
        for impl, bar in drawn.items():
            q80 = next(hi for n, _, _, hi, _ in slots if n == impl)
            y = max(bar.get_height(), q80 or 0)
            ax.text(bar.get_x() + bar.get_width() / 2, y + 0.012 * top, _fmt3(bar.get_height()), ha="center",
                    va="bottom", fontsize=8)  # fmt: skip
        names = [n for n, *_ in slots]
        first = True
        for i, impl in enumerate(names):
            if impl in mrefs:
                src = record.get("torch_reference_source")
                label = f"torch reference{f' ({src})' if src else ''}" if first else None
                ax.plot([i + 0.38], [mrefs[impl]], marker="<", color="black", ms=7, ls="none", label=label)
                ax.text(i + 0.47, mrefs[impl], _fmt3(mrefs[impl]), va="center", ha="left", fontsize=7)
                first = False
        ax.set_xticks(range(len(names)), [CAPTURE_LABELS.get(n, n) for n in names], fontsize=8)
        ax.set_xlim(-0.6, len(names) - 0.4)
        ax.set_ylim(0, top)
        ax.set_ylabel("ms per training step, median (bars: p20-p80)")
        cfg = record.get("models", {}).get(model)
        desc = ""
        if cfg:
            n = cfg["params"]
            desc = (
                f": {cfg['layers']} layers, d={cfg['dim']}, vocab {cfg['vocab']}, batch {cfg['batch']}x{cfg['tokens']}"
                f", {_fmt3(n / 1e6) + 'M' if n >= 1e5 else format(n, ',')} parameters"
            )
        ax.set_title(f"{model}{desc}", loc="left", fontsize=10)
        if mrefs:
            ax.legend(fontsize=7, loc="upper right", frameon=False)
    title = (
        f"One training step (zero_grad + forward + backward + AdamW step, bf16 autocast), "
        f"{record.get('steps', '?')} steps per implementation\n{harness.env_line(record)}"
    )
    _finish(fig, record, title, path, capture_caption(record))
    plt.close(fig)


# ------------------------------------------------------------------------------------------- eager result
EAGER_COLORS = {"torch-default": "tab:gray", "torch-foreach": "tab:orange", "torch-fused": "tab:green",
                "flatopt": "tab:blue", "flatopt-hooks": "tab:purple", "flatopt-direct": "tab:olive",
                "flatopt-gather": "tab:cyan"}  # fmt: skip


def eager_slots(record, model, key):
    """Bars of one model: (impl, value or None, low, high, gap label). ``key``: "median_ms" or "b2b_median_ms" (paired
    timing), or "peak" (GiB, alone)."""
    paired = next((p for p in record["paired"] if p["model"] == model), None)
    alone = {r["impl"]: r for r in record["results"] if r["model"] == model}
    names = list(dict.fromkeys([*(paired or {}).get("impls", []), *alone]))
    slots = []
    for impl in names:
        if key == "peak":
            r = alone.get(impl)
            ok = r is not None and r["status"] == "ok" and r.get("peak_bytes") is not None
            gap = gap_label(r, "no peak:\nnot a CUDA run")
            slots.append((impl, r["peak_bytes"] / GIB if ok else None, None, None, gap))
            continue
        prefix = key[: -len("median_ms")]
        t = paired.get(impl) if paired and paired["status"] == "ok" else None
        ok = t is not None and t.get(key) is not None
        slots.append((impl, t[key] if ok else None, t.get(f"{prefix}q20_ms") if ok else None,
                      t.get(f"{prefix}q80_ms") if ok else None, gap_label(paired if not ok else None)))  # fmt: skip
    return slots


def plot_eager_png(record, path):
    """One column per model: ms per training step (paired timing: synchronised, then back to back) with flatopt's ratio
    to each implementation, then the peak memory of each (alone), where it was measured."""
    models = [m for m in record.get("models", {}) if any(p["model"] == m for p in record["paired"])]
    if not models:
        raise ValueError("the eager result has no cases: nothing to draw")
    plt = _pyplot()
    with_peak = any(r.get("peak_bytes") is not None for r in record["results"])
    rows = 3 if with_peak else 2
    fig, axes = plt.subplots(rows, len(models), figsize=(4.6 * len(models), 3.6 * rows), squeeze=False)
    targets = {(t.get("model"), t["target"]): t for t in record.get("targets", [])}
    for col, model in enumerate(models):
        keys = [("median_ms", "synchronised"), ("b2b_median_ms", "back to back")] + ([("peak", "peak")] if with_peak
                                                                                       else [])  # fmt: skip
        for row, (key, label) in enumerate(keys):
            ax = axes[row, col]
            slots = eager_slots(record, model, key)
            values = [hi if hi is not None else v for _, v, _, hi, _ in slots if v is not None]
            top = 1.3 * max(values) if values else 1.0
            drawn = _draw_bars(ax, slots, EAGER_COLORS, top)
            mine = next((v for n, v, *_ in slots if n == "flatopt"), None)
            for impl, bar in drawn.items():
                text = _fmt3(bar.get_height())
                if impl != "flatopt" and mine is not None:
                    text += f"\nflatopt {mine / bar.get_height():.3f}x"
                y = max(bar.get_height(), next(hi for n, _, _, hi, _ in slots if n == impl) or 0)
                ax.text(bar.get_x() + bar.get_width() / 2, y + 0.01 * top, text, ha="center", va="bottom", fontsize=7)
            names = [n for n, *_ in slots]
            ax.set_xticks(range(len(names)), names, fontsize=7)
            ax.set_xlim(-0.6, len(names) - 0.4)
            ax.set_ylim(0, top)
            ax.set_ylabel("GiB" if key == "peak" else "ms per step (p20-p80)", fontsize=8)
            info = record["models"][model]
            title = f"{model} ({info.get('params', 0) / 1e6:.1f}M params, {info.get('tensors')} tensors), {label}"
            ax.set_title(title, loc="left", fontsize=8)
            want = "flatopt peak" if key == "peak" else f"({label.replace(' to ', '-to-')})"
            # flatopt's default: the rows of its other landings start with their own names
            hit = [t for (m, name), t in targets.items() if m == model and want in name and name.startswith("flatopt ")]
            if hit and hit[0].get("threshold") is not None:
                t = hit[0]
                ax.text(0.99, 0.97, f"target {t['threshold']:.2f}x: {_met(t)}", transform=ax.transAxes, ha="right",
                        va="top", fontsize=7)  # fmt: skip
    share = record.get("optimizer_share") or {}
    caption = "; ".join(f"{m}: {100 * s['share']:.1f} %" for m, s in share.items())
    caption = f"optimizer share (torch-fused step() / its training step): {caption}" if caption else None
    title = f"Eager training step (zero_grad, forward, backward, AdamW step)\n{harness.env_line(record)}"
    _finish(fig, record, title, path, caption)
    plt.close(fig)


# ------------------------------------------------------------------------------------------- fsdp result
FSDP_COLORS = {"fwd-bwd": "#b0b0b0", "torch-fused": "tab:orange", "flatopt": "tab:blue",
               "flatopt-in-backward": "tab:green"}  # fmt: skip
FSDP_PANELS = (
    ("median_ms", "training step, alone (ms, p20-p80)"),
    ("step_median_ms", "opt.step(): CUDA events in the step (ms)"),
    ("added", "added to fwd-bwd, paired (ms, p20-p80)"),
    ("peak", "peak memory, the largest rank (GiB)"),
)


def fsdp_slots(record, ranks, key):
    """Bars of one group of ranks: (case, value or None, low, high, gap label). ``key``: "median_ms" (alone),
    "step_median_ms" (opt.step() alone), "added" (paired, against fwd-bwd) or "peak" (GiB)."""
    rows = [r for r in record["results"] if r["ranks"] == ranks]
    paired = next((p for p in record["paired"] if p["ranks"] == ranks), None)
    slots = []
    for r in rows:
        case, ok = r["case"], r["status"] == "ok"
        if key == "peak":
            value = r["peak_bytes"] / GIB if ok and r.get("peak_bytes") is not None else None
            slots.append((case, value, None, None, gap_label(r, "no peak:\nnot a CUDA run")))
            continue
        if key == "added":
            done = paired is not None and paired["status"] == "ok"
            t = ((paired or {}).get("added") or {}).get(case) if done else None
            gap = gap_label(paired) if not done else ("the baseline" if case == "fwd-bwd" else "not measured")
        else:
            prefix = key[: -len("median_ms")]
            t = {f"{q}_ms": r.get(f"{prefix}{q}_ms") for q in ("median", "q20", "q80")} if ok else None
            t = t if t and t["median_ms"] is not None else None
            gap = gap_label(r, "no optimizer" if prefix else "not measured")
        slots.append((case, *((t["median_ms"], t["q20_ms"], t["q80_ms"]) if t else (None, None, None)), gap))
    return slots


def fsdp_caption(record):
    """flatopt's targets, one line each: the group of ranks, value against threshold, met or missed, margin."""
    lines = ["flatopt targets (lower is better):"]
    for t in record.get("targets") or []:
        head = f"{t.get('ranks')} rank(s), {t['target']}:"
        if t.get("met") is None:
            lines.append(f"{head} n/a ({harness.first_line(t.get('note'), 140)})")
        else:
            unit = t["unit"]
            lines.append(f"{head} {_fmt3(t['value'])} {unit} against {_fmt3(t['threshold'])} {unit}, {_met(t)} "
                         f"({t['margin']:+.3f} {unit})")  # fmt: skip
    return "\n".join(lines) if len(lines) > 1 else None


def plot_fsdp_png(record, path):
    """One row per group of ranks: the training step of each case alone, opt.step() alone, the time each case adds to
    forward + backward (paired) and the peak memory, with in-backward mode's peak target as a red line over its bar."""
    worlds = record.get("worlds") or []
    if not worlds:
        raise ValueError("the fsdp result has no group of ranks: nothing to draw")
    plt = _pyplot()
    fig, axes = plt.subplots(len(worlds), len(FSDP_PANELS), figsize=(4.4 * len(FSDP_PANELS), 3.9 * len(worlds)),
                             squeeze=False)  # fmt: skip
    for row, info in enumerate(worlds):
        peak_target = next((t for t in record.get("targets") or [] if t.get("ranks") == info["ranks"]
                            and t["unit"] == "GiB" and t.get("threshold") is not None), None)  # fmt: skip
        for col, (key, label) in enumerate(FSDP_PANELS):
            ax = axes[row, col]
            slots = fsdp_slots(record, info["ranks"], key)
            values = [v for _, v, *_ in slots if v is not None] + [hi for *_, hi, _ in slots if hi is not None]
            values += [peak_target["threshold"]] if key == "peak" and peak_target else []
            top = 1.3 * max(values) if values and max(values) > 0 else 1.0
            drawn = _draw_bars(ax, slots, FSDP_COLORS, top)
            for bar in drawn.values():
                h = bar.get_height()
                ax.text(bar.get_x() + bar.get_width() / 2, max(h, 0) + 0.01 * top, _fmt3(h), ha="center",
                        va="bottom", fontsize=7)  # fmt: skip
            names = [n for n, *_ in slots]
            if key == "peak" and peak_target and "flatopt-in-backward" in names:
                x = names.index("flatopt-in-backward")
                ax.hlines(peak_target["threshold"], x - 0.45, x + 0.45, color="crimson", lw=2.0,
                          label="target: step-mode peak\n- sharded gradients")  # fmt: skip
                ax.legend(fontsize=7, loc="upper left", frameon=False)
            ax.axhline(0, color="black", lw=0.6)
            ax.set_xticks(range(len(names)), [n.replace("-", "\n", 1) for n in names], fontsize=7)
            ax.set_xlim(-0.6, len(names) - 0.4)
            low = min([0.0] + [lo for _, _, lo, _, _ in slots if lo is not None])
            ax.set_ylim(1.3 * low, top)
            title = label if col else f"{info['ranks']} rank(s), {info['backend']}, {info['status']}: {label}"
            ax.set_title(title, loc="left", fontsize=8)
    m = record.get("model") or {}
    title = (f"FSDP2 on one device: AdamW on a sharded GPT ({m.get('params', 0) / 1e6:.1f}M parameters, "
             f"{m.get('tensors')} tensors), bf16 mixed precision\n{harness.env_line(record)}")  # fmt: skip
    _finish(fig, record, title, path, fsdp_caption(record))
    plt.close(fig)


# -------------------------------------------------------------------------------------------- cpu result
CPU_COLORS = {"torch-foreach": "#9ecae1", "torch-fused": "#3182bd", "lion-pytorch": "#fdae6b", "flatopt": "#31a354"}


def plot_cpu_png(record, path):
    """bench_cpu.py: one panel per variant and optimizer; per case (set, dtype) a bar per implementation, its median
    time over the case's baseline (the fastest implementation that steps right), flatopt's ratio written on its bar,
    1.0 dashed; a bar of an implementation that steps wrong in that case (bench_cpu.steps_right) is hatched."""
    from benchmarks import bench_cpu

    plt = _pyplot()
    rows = record["results"]
    variants, optimizers = bench_cpu.VARIANTS, bench_cpu.OPTIMIZERS
    fig, axes = plt.subplots(len(variants), len(optimizers), figsize=(15, 8), squeeze=False)
    for ax in axes.flat:
        ax.set_visible(False)
    for (vi, variant), (oi, opt) in ((v, o) for v in enumerate(variants) for o in enumerate(optimizers)):
        mine = [r for r in rows if r["variant"] == variant and r["optimizer"] == opt]
        if not mine:
            continue
        ax = axes[vi][oi]
        ax.set_visible(True)
        cases = list(dict.fromkeys((r["set"], r["dtype"]) for r in mine))
        impls = [i for i in bench_cpu.IMPLS[opt] if any(r["impl"] == i for r in mine)]
        idx = {(r["set"], r["dtype"], r["impl"]): r for r in mine}
        width = 0.8 / len(impls)
        top, labelled = 0.0, set()
        for k, impl in enumerate(impls):
            for j, (s, dt) in enumerate(cases):
                r, base = idx.get((s, dt, impl)) or {}, (idx.get((s, dt, "flatopt")) or {}).get("baseline_ms")
                x = j + (k - (len(impls) - 1) / 2) * width
                if r.get("median_ms") is None or not base:
                    ax.text(x, 0.05, gap_label(r or None, "no baseline"), rotation=90, ha="center", va="bottom",
                            fontsize=6, color="0.35")  # fmt: skip
                    continue
                y = r["median_ms"] / base
                top = max(top, y)
                wrong = r.get("steps_right") is False
                label = None if impl in labelled else impl
                labelled.add(impl)
                ax.bar(x, y, width, color=CPU_COLORS.get(impl, "0.5"), hatch="//" if wrong else None, label=label)
                if impl == "flatopt":
                    ax.annotate(f"{y:.2f}", (x, y), ha="center", va="bottom", fontsize=7)
        if top > 20:  # a case far above the rest (a per-tensor loop over many small tensors): keep the rest readable
            ax.set_yscale("log")
        ax.axhline(bench_cpu.TARGET_RATIO, color="black", ls="--", lw=1)
        ax.set_xticks(range(len(cases)), [f"{s}\n{dt}" for s, dt in cases], fontsize=7)
        ax.set_ylabel("median time / fastest baseline", fontsize=8)
        what = "step() alone" if variant == "step" else "zero_grad + backward + step"
        ax.set_title(f"{OPTIMIZER_TITLES[opt]}: {what}", fontsize=9)
        ax.legend(fontsize=6)
    cpu = record.get("cpu") or {}
    title = (f"flatopt backend='cpu' against torch.optim and lion-pytorch: {cpu.get('model')}, {cpu.get('cores')} "
             f"cores, {cpu.get('threads')} torch thread(s); hatched: steps wrong, left out of the ratio\n"
             f"{harness.env_line(record)}")  # fmt: skip
    _finish(fig, record, title, path)
    plt.close(fig)


# ------------------------------------------------------------------------------------- convergence result
CONVERGENCE_COLORS = {"fp32": "black", "bf16-remainder": "tab:blue", "bf16-master-fp32": "tab:cyan",
                      "bf16-sr": "tab:green", "bf16-sr-int8": "tab:orange", "bf16": "tab:red"}  # fmt: skip


def convergence_verdicts(record):
    """{mode: short verdict} for the final-loss panel: met / MISSED / n/a from the record's targets, "baseline" and
    "contrast" for the modes without one."""
    out = {m: c for m, c in (record.get("criteria") or {}).items() if c in ("baseline", "contrast")}
    for t in record.get("targets") or []:
        out[t["mode"]] = {True: "met", False: "MISSED", None: "n/a"}[t["met"]]
    return out


def plot_convergence_png(record, path):
    """convergence.py: the training loss of every run (centred moving mean), the validation loss of each mode (mean
    over its finished seeds, their range shaded) and each seed's final validation loss, with fp32's range over the
    seeds shaded and the 2 % band around fp32's mean dashed; each mode's verdict above its points."""
    plt = _pyplot()
    rows = [r for r in record["results"] if r.get("train_losses")]
    if not rows:
        raise ValueError("nothing to draw: no run trained a step")
    modes = [m for m in record["modes"] if any(r["mode"] == m for r in rows)]
    fig, (ax_train, ax_val, ax_final) = plt.subplots(1, 3, figsize=(18, 5.6), width_ratios=[3, 3, 2])
    steps = record["config"]["steps"]
    top, bottom = -math.inf, math.inf
    for mode in modes:
        color = CONVERGENCE_COLORS.get(mode, "0.5")
        mine = [r for r in rows if r["mode"] == mode]
        for i, r in enumerate(mine):
            sm = r["smoothed"]
            ax_train.plot(sm["steps"], sm["values"], color=color, lw=1.0, alpha=0.8, label=mode if i == 0 else None)
            late = [v for s, v in zip(sm["steps"], sm["values"]) if s >= steps // 10 and math.isfinite(v)]
            if late:
                top, bottom = max(top, max(late)), min(bottom, min(late))
        finished = [r for r in mine if r.get("val_losses") and len(r["val_losses"]) == len(mine[0]["val_losses"])]
        if finished:
            xs = finished[0]["val_steps"]
            cols = list(zip(*(r["val_losses"] for r in finished)))
            mean = [sum(c) / len(c) for c in cols]
            ax_val.plot(xs, mean, color=color, marker="o", ms=3, lw=1.2, label=f"{mode} ({len(finished)} seeds)")
            ax_val.fill_between(xs, [min(c) for c in cols], [max(c) for c in cols], color=color, alpha=0.15, lw=0)
    if math.isfinite(top):
        pad = 0.05 * max(top - bottom, 1e-3)
        ax_train.set_ylim(bottom - pad, top + pad)
    half = next((r["smoothed"]["half_width"] for r in rows), 0)
    ax_train.set(xlabel="step", ylabel="training loss (nats per character)")
    ax_train.set_title(f"training loss, every seed (centred mean of {2 * half + 1} steps)", fontsize=9)
    ax_val.set(xlabel="step", ylabel="validation loss (nats per character)")
    ax_val.set_title("validation loss: mean over seeds, their range shaded (zoomed past the first tenth)", fontsize=9)
    late_val = [v for line in ax_val.get_lines() for x, v in zip(*line.get_data()) if x >= steps // 5]
    if len(late_val) > 1:
        lo, hi = min(late_val), max(late_val)
        ax_val.set_ylim(lo - 0.1 * max(hi - lo, 1e-3), hi + 0.1 * max(hi - lo, 1e-3))
    for ax in (ax_train, ax_val):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)

    verdict = convergence_verdicts(record)
    finals = {m: [(r["seed"], r["final_val_loss"]) for r in rows if r["mode"] == m and r.get("final_val_loss")
                  is not None] for m in modes}  # fmt: skip
    base = [v for _, v in finals.get("fp32", [])]
    if base:
        mean = sum(base) / len(base)
        ax_final.axhspan(min(base), max(base), color="0.85", label="fp32's range over the seeds")
        rel = record.get("relative_tolerance", 0.02)
        for k, y in enumerate((mean * (1 - rel), mean * (1 + rel))):
            ax_final.axhline(y, color="tab:orange", ls="--", lw=0.8, label=f"fp32's mean +- {100 * rel:g} %" if k == 0
                             else None)  # fmt: skip
    values = []
    for x, mode in enumerate(modes):
        color = CONVERGENCE_COLORS.get(mode, "0.5")
        pts = finals[mode]
        for j, (_, v) in enumerate(pts):
            ax_final.plot(x + 0.08 * (j - (len(pts) - 1) / 2), v, "o", color=color, ms=5)
        if pts:
            m = sum(v for _, v in pts) / len(pts)
            ax_final.plot([x - 0.3, x + 0.3], [m, m], color=color, lw=2)
            values += [v for _, v in pts]
    if values:
        lo, hi = min(values + base), max(values + base)
        pad = 0.25 * max(hi - lo, 1e-3)
        ax_final.set_ylim(lo - pad, hi + 2 * pad)
        for x, mode in enumerate(modes):
            missed = verdict.get(mode) == "MISSED"
            ax_final.text(x, hi + 1.2 * pad, f"{verdict.get(mode, 'n/a')}\n({len(finals[mode])} seeds)", ha="center",
                          va="bottom", fontsize=7, color="red" if missed else "black")  # fmt: skip
    ax_final.set_xticks(range(len(modes)), modes, rotation=25, ha="right", fontsize=8)
    ax_final.set_ylabel("final validation loss")
    ax_final.set_title("final validation loss per seed (bar: mean); verdict above", fontsize=9)
    if base:  # its labelled bands
        ax_final.legend(fontsize=7, loc="lower right")
    ax_final.grid(alpha=0.3, axis="y")
    m = record["model"]
    cfg = record["config"]
    title = (f"Convergence of the precision modes: flatopt.demo's model ({m['parameters'] / 1e6:.2f}M parameters), "
             f"{cfg['steps']} steps of {cfg['batch_size']}x{cfg['seq_len']} characters, seeds "
             f"{', '.join(map(str, record['seeds']))}\n{harness.env_line(record)}")  # fmt: skip
    caption = ("verdicts: bf16-remainder met when bit-identical to float32 AdamW fed the same gradients at every "
               "evaluation of every seed; bf16-master-fp32 and bf16-sr when their mean final loss is within fp32's "
               "range over the seeds of fp32's mean; bf16-sr-int8 when within 2 % of fp32's mean; bf16 (no option) is "
               "a contrast")  # fmt: skip
    _finish(fig, record, title, path, caption)
    plt.close(fig)


def draw(record, path, kind=None):
    """Draw ``record`` (of any kind) to the PNG ``path``."""
    kind = kind or kind_of(record)
    draw_kind = {"step": plot_png, "memory": plot_memory_png, "capture": plot_capture_png, "eager": plot_eager_png}
    draw_kind.update(cpu=plot_cpu_png, fsdp=plot_fsdp_png, convergence=plot_convergence_png)
    draw_kind[kind](record, path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", type=Path, help="a JSON written by bench_step.py, bench_memory.py, bench_capture.py, "
                   "bench_eager.py, bench_cpu.py, bench_fsdp.py or convergence.py")  # fmt: skip
    p.add_argument("--png", type=Path, default=None, help="PNG path (default: the JSON path with .png)")
    p.add_argument("--no-png", action="store_true", help="do not draw the PNG")
    p.add_argument("--markdown", nargs="?", const="-", default=None, help="write the markdown table (default: stdout)")
    p.add_argument("--allow-smoke", action="store_true", help="draw a smoke run (labelled as such)")
    args = p.parse_args(argv)
    try:
        record = load(args.json)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    kind = kind_of(record)
    if record.get("smoke") and not args.allow_smoke:
        print(
            f"{args.json} is a smoke run (a code-path check, not a measurement); refusing to draw it as a result. "
            "Pass --allow-smoke to draw it, labelled as a smoke run.",
            file=sys.stderr,
        )
        return 2
    if args.markdown is not None:
        text = markdown(record, kind)
        if args.markdown == "-":
            print(text, end="")
        else:
            Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
            Path(args.markdown).write_text(text)
            print(f"wrote {args.markdown}")
    if not args.no_png:
        png = args.png or args.json.with_suffix(".png")
        try:
            draw(record, png, kind)
        except ImportError as e:
            print(f"PNG skipped: matplotlib is not importable ({e}); the JSON and markdown are complete")
        except ValueError as e:
            print(f"{args.json}: {e}", file=sys.stderr)
            return 2
        else:
            print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
