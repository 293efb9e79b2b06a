"""Draw a stored benchmark result: a PNG, and a markdown table of every result and target.

Reads only the JSON that a benchmark script wrote, so figures and tables always come from stored results. The
kind of result is read from the JSON's "benchmark" field (bench_step.py writes none; the others write "memory"
and "capture"), and its "schema" (1):

    step      bench_step.py: percent of the copy-bandwidth floor per parameter set and implementation, with a
              copy of the same bytes as each case's reference (a thick black line across the group, with its value;
              results from before it was measured are drawn without it)
    memory    bench_memory.py: per dtype, peak memory per case against params + states and flatopt's target
              (params + states + input + activations + largest bucket), then step time with kernel launches per step
    capture   bench_capture.py: per model, median ms per training step and implementation (20th-80th percentile),
              with flatopt's targets

    python3 benchmarks/plot.py benchmarks/results/step-<stamp>.json                # PNG next to the JSON
    python3 benchmarks/plot.py RESULT.json --png out.png --markdown out.md
    python3 benchmarks/plot.py RESULT.json --no-png --markdown                      # table to stdout

Cases that did not run (skipped, failed, out of memory, timed out) are drawn as labelled gaps, never as zeros. A
capture JSON may carry published torch numbers to compare with, added by hand as
``"torch_reference_ms": {model: {implementation: ms}}`` (and ``"torch_reference_source": "..."``); they are drawn
as markers when present, and nothing is drawn when absent.

Smoke runs are refused unless ``--allow-smoke`` is given; their PNG and markdown are then labelled
as smoke runs across the figure and at the top of the table. The PNG needs matplotlib; without it the
PNG is skipped with a message and the markdown is still written. The markdown of a memory or capture result
is the benchmark script's own (``--report``), which imports torch and flatopt.
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
    "flatopt-graph",
)
SAME_BYTES = "copy-same-bytes"  # bench_step.py's reference row: dst.copy_(src) of the bytes the floor counts
SMOKE_LABEL = "SMOKE RUN: NOT A MEASUREMENT"


KINDS = ("step", "memory", "capture")
SCHEMAS = (1,)


def kind_of(record, path="the JSON"):
    """The kind of result, step, memory or capture, from the record's "benchmark" and "schema" fields
    (bench_step.py writes no "benchmark" field); ValueError for anything else."""
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


def _order(rows, record=None):
    """Optimizer, then parameter set in run order, dtype (fp32 first), implementation."""
    impl_rank = {n: i for i, n in enumerate(IMPL_ORDER)} | {SAME_BYTES: 100}  # the reference after the rest
    opt_rank = {n: i for i, n in enumerate(OPTIMIZER_TITLES)}
    set_rank = {n: i for i, n in enumerate((record or {}).get("sets", {}))}
    dtype_rank = {"fp32": 0, "bf16": 1, "fp16": 2}

    def key(r):
        return (
            opt_rank.get(r["optimizer"], 9),
            set_rank.get(r["set"], 99),
            r["set"],
            dtype_rank.get(r["dtype"], 9),
            impl_rank.get(r["impl"], 99),
        )

    return sorted(rows, key=key)


def _num(x, spec):
    return format(x, spec) if isinstance(x, (int, float)) else "-"


def headline(record):
    env = record["env"]
    return (
        f"{env.get('device_name', env.get('device'))}, torch {env.get('torch')}, triton {env.get('triton')}, "
        f"CUDA {env.get('cuda')}, {env.get('date')}"
    )


def markdown(record):
    """Markdown: a header with the environment and copy bandwidth, the results, the targets, what did not run."""
    lines = []
    if record.get("smoke"):
        lines += [f"> **{record.get('note') or SMOKE_LABEL}**", ""]
    copy = record.get("copy") or {}
    lines += [f"Step benchmark: {headline(record)}.", ""]
    if copy.get("gbps"):
        lines += [
            f"Floor = bytes that must move / copy bandwidth {copy['gbps']:.0f} GB/s "
            "(`dst.copy_(src)`, read + write, measured in the same run).",
            "",
        ]
    if any(r["impl"] == SAME_BYTES for r in record["results"]):
        lines += [
            f"`{SAME_BYTES}`: a `dst.copy_(src)` moving exactly the bytes the floor counts for the case, a launch's "
            "fixed cost included; the column % of same-bytes copy is its time / the implementation's time.",
            "",
        ]
    same = any(r.get("pct_of_same_bytes_copy") is not None for r in record["results"])  # not in older results
    loop = any(r.get("host_after_zero_grad_us") is not None for r in record["results"])  # nor in these
    head = ["optimizer", "set", "dtype", "implementation", "median ms (p20-p80)", "GB/s", "% of floor"]
    head += ["% of same-bytes copy", "host us"] if same else ["host us"]
    head += ["host us after zero_grad()", "host us, new lr"] if loop else []
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in _order(record["results"], record):
        if r["status"] != "ok":
            continue
        spread = f"{_num(r.get('median_ms'), '.3f')} ({_num(r.get('q20_ms'), '.3f')}-{_num(r.get('q80_ms'), '.3f')})"
        title = OPTIMIZER_TITLES.get(r["optimizer"], r["optimizer"])
        cells = [_num(r.get("gbps"), ".0f"), _num(r.get("pct_floor"), ".1f")]
        cells += [_num(r.get("pct_of_same_bytes_copy"), ".1f")] if same else []
        cells += [_num(r.get("host_us"), ".1f")]
        cells += [_num(r.get("host_after_zero_grad_us"), ".1f"), _num(r.get("host_new_lr_us"), ".1f")] if loop else []
        numbers = " | ".join(cells)
        lines.append(f"| {title} | {r['set']} | {r['dtype']} | {r['impl']} | {spread} | {numbers} |")
    if record.get("targets"):
        lines += [
            "",
            "| flatopt target | optimizer | set | dtype | value | met | margin |",
            "|---|---|---|---|---|---|---|",
        ]
        for t in record["targets"]:
            if t["met"] is None:
                met, value, margin = "n/a", "-", t.get("note") or "-"
            else:
                met = "yes" if t["met"] else "**no**"
                value = f"{t['value']:.3f} {t['unit']}"
                margin = f"{t['margin']:+.3f} {'pp' if t['unit'] == '%' else t['unit']}"
            lines.append(
                f"| {t['target']} | {t['optimizer']} | {t['set']} | {t['dtype']} | {value} | {met} | {margin} |"
            )
        whys = [t for t in record["targets"] if t.get("why")]
        if whys:
            lines += ["", "Why missed:", ""]
            lines += [f"- {t['optimizer']} {t['set']} {t['dtype']}, {t['target']}: {t['why']}" for t in whys]
    missing = {}
    for r in _order(record["results"], record):
        if r["status"] != "ok":
            reason = (r.get("reason") or "").splitlines()[0] if r.get("reason") else ""
            missing.setdefault((r["impl"], r["status"], reason), []).append(f"{r['optimizer']} {r['set']} {r['dtype']}")
    if missing:
        lines += ["", "Not measured:", ""]
        attempted = {}
        for r in record["results"]:
            attempted[r["impl"]] = attempted.get(r["impl"], 0) + 1
        for (impl, status, reason), cases in missing.items():
            which = f"all {len(cases)} cases" if len(cases) == attempted[impl] else "; ".join(cases)
            lines.append(f"- {impl}, {status} ({which}): {reason}")
    return "\n".join(lines) + "\n"


def same_bytes_pct(record):
    """{(optimizer, set, dtype): percent of the floor} of the copy of the same bytes; {} in older results."""
    out = {}
    for r in record["results"]:
        key = (r["optimizer"], r["set"], r["dtype"])
        if r["impl"] == SAME_BYTES and r["status"] == "ok" and r.get("pct_floor") is not None:
            out[key] = r["pct_floor"]
        elif r.get("same_bytes_copy_pct_of_floor") is not None:
            out.setdefault(key, r["same_bytes_copy_pct_of_floor"])
    return out


def plot_png(record, path):
    """Bars of percent of the floor: one panel per optimizer, groups = (set, dtype), one bar per implementation;
    the copy of the same bytes as a thick black line across its group, where the result has it."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    rows = [r for r in record["results"] if r["status"] == "ok" and r.get("pct_floor") is not None]
    optimizers = [o for o in OPTIMIZER_TITLES if any(r["optimizer"] == o for r in record["results"])]
    fig, axes = plt.subplots(len(optimizers), 1, figsize=(12, 3.6 * max(1, len(optimizers))), squeeze=False)
    cmap = plt.get_cmap("tab10")
    colors = {n: cmap(i % 10) for i, n in enumerate(IMPL_ORDER)}
    same = same_bytes_pct(record)
    for ax, opt in zip(axes[:, 0], optimizers, strict=True):
        groups = list(
            dict.fromkeys((r["set"], r["dtype"]) for r in _order(record["results"], record) if r["optimizer"] == opt)
        )
        impls = [n for n in IMPL_ORDER if any(r["optimizer"] == opt and r["impl"] == n for r in rows)]
        width = 0.8 / max(1, len(impls))
        for j, impl in enumerate(impls):
            xs, ys = [], []
            for g, (s, d) in enumerate(groups):
                hit = [r for r in rows if (r["optimizer"], r["set"], r["dtype"], r["impl"]) == (opt, s, d, impl)]
                if hit:
                    xs.append(g - 0.4 + width * (j + 0.5))
                    ys.append(hit[0]["pct_floor"])
            bars = ax.bar(xs, ys, width, label=impl, color=colors.get(impl))
            ax.bar_label(bars, fmt="%.0f", fontsize=6, padding=1)
        label = "copy of the same bytes"
        for g, (s, d) in enumerate(groups):
            pct = same.get((opt, s, d))
            if pct is not None:  # close to the 100 % and target lines: thicker, with its value
                ax.hlines(pct, g - 0.42, g + 0.42, color="black", lw=2.4, label=label)
                y = min(pct, 96.0) - 2.0  # under the 100 % and target lines
                ax.text(g - 0.42, y, f"copy {pct:.1f}", color="black", fontsize=6, ha="left", va="top")
                label = None  # one legend entry
        target = record.get("targets_definition", {}).get("pct_floor")
        ax.axhline(100, color="black", lw=0.8)
        if target:
            ax.axhline(target, color="black", lw=0.8, ls="--", label=f"target {target:g} %")
        ax.set_xticks(range(len(groups)), [f"{s}\n{d}" for s, d in groups])
        ax.set_ylim(0, max([115.0] + [r["pct_floor"] * 1.08 for r in rows if r["optimizer"] == opt]))
        ax.set_ylabel("% of floor")
        ax.set_title(OPTIMIZER_TITLES.get(opt, opt), loc="left", fontsize=10)
        ax.legend(fontsize=7, ncol=5, loc="upper left", bbox_to_anchor=(0, -0.18), frameon=False)
    title = f"Optimizer step, percent of the copy-bandwidth floor: {headline(record)}"
    if record.get("smoke"):
        title = f"{SMOKE_LABEL}\n{title}"
        fig.text(0.5, 0.5, SMOKE_LABEL, fontsize=40, color="red", alpha=0.35, ha="center", va="center", rotation=25)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
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
    fig.suptitle(title, fontsize=10)
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
    "flatopt-in-backward",
    "flatopt-in-backward-small",
)
MEMORY_LABELS = {
    "fwd-bwd": "fwd + bwd\n(no optimizer)",
    "torch-fused": "torch\nfused",
    "torch-in-backward": "torch\nin-backward\nrecipe",
    "flatopt": "flatopt\nstep mode",
    "flatopt-in-backward": "flatopt\nin-backward",
    "flatopt-in-backward-small": "flatopt\nin-backward",
}
MEMORY_COLORS = {
    "fwd-bwd": "#b0b0b0",
    "torch-fused": "tab:orange",
    "torch-in-backward": "tab:red",
    "flatopt": "tab:blue",
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
    _finish(fig, record, f"In-backward AdamW, {model}\n{headline(record)}", path, memory_caption(record))
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
        f"{record.get('steps', '?')} steps per implementation\n{headline(record)}"
    )
    _finish(fig, record, title, path, capture_caption(record))
    plt.close(fig)


def memory_or_capture_markdown(record, kind):
    """The benchmark script's own markdown for a memory or capture result (imports torch and flatopt)."""
    module = importlib.import_module(f"benchmarks.bench_{kind}")
    return module.markdown(record)


def draw(record, path, kind=None):
    """Draw ``record`` (of any kind) to the PNG ``path``."""
    kind = kind or kind_of(record)
    {"step": plot_png, "memory": plot_memory_png, "capture": plot_capture_png}[kind](record, path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", type=Path, help="a JSON written by bench_step.py, bench_memory.py or bench_capture.py")
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
        text = markdown(record) if kind == "step" else memory_or_capture_markdown(record, kind)
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
