"""Draw a stored step-benchmark result: a PNG of percent of the floor per parameter set and implementation,
and a markdown table of every result and target.

Reads only the JSON that ``bench_step.py`` wrote, so figures and tables always come from stored results:

    python3 benchmarks/plot.py benchmarks/results/step-<stamp>.json                # PNG next to the JSON
    python3 benchmarks/plot.py RESULT.json --png out.png --markdown out.md
    python3 benchmarks/plot.py RESULT.json --no-png --markdown                      # table to stdout

Smoke runs are refused unless ``--allow-smoke`` is given; their PNG and markdown are then labelled
as smoke runs across the figure and at the top of the table. The PNG needs matplotlib; without it the
PNG is skipped with a message and the markdown is still written.
"""

import argparse
import json
import sys
from pathlib import Path

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
SMOKE_LABEL = "SMOKE RUN: NOT A MEASUREMENT"


def load(path):
    record = json.loads(Path(path).read_text())
    if "results" not in record or "env" not in record:
        raise ValueError(f"{path} is not a bench_step.py result (no 'results'/'env')")
    return record


def _order(rows, record=None):
    """Optimizer, then parameter set in run order, dtype (fp32 first), implementation."""
    impl_rank = {n: i for i, n in enumerate(IMPL_ORDER)}
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
    lines += [
        "| optimizer | set | dtype | implementation | median ms (p20-p80) | GB/s | % of floor | host us |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in _order(record["results"], record):
        if r["status"] != "ok":
            continue
        spread = f"{_num(r.get('median_ms'), '.3f')} ({_num(r.get('q20_ms'), '.3f')}-{_num(r.get('q80_ms'), '.3f')})"
        title = OPTIMIZER_TITLES.get(r["optimizer"], r["optimizer"])
        numbers = f"{_num(r.get('gbps'), '.0f')} | {_num(r.get('pct_floor'), '.1f')} | {_num(r.get('host_us'), '.1f')}"
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


def plot_png(record, path):
    """Bars of percent of the floor: one panel per optimizer, groups = (set, dtype), one bar per implementation."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    rows = [r for r in record["results"] if r["status"] == "ok" and r.get("pct_floor") is not None]
    optimizers = [o for o in OPTIMIZER_TITLES if any(r["optimizer"] == o for r in record["results"])]
    fig, axes = plt.subplots(len(optimizers), 1, figsize=(12, 3.6 * max(1, len(optimizers))), squeeze=False)
    cmap = plt.get_cmap("tab10")
    colors = {n: cmap(i % 10) for i, n in enumerate(IMPL_ORDER)}
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", type=Path, help="a JSON written by bench_step.py")
    p.add_argument("--png", type=Path, default=None, help="PNG path (default: the JSON path with .png)")
    p.add_argument("--no-png", action="store_true", help="do not draw the PNG")
    p.add_argument("--markdown", nargs="?", const="-", default=None, help="write the markdown table (default: stdout)")
    p.add_argument("--allow-smoke", action="store_true", help="draw a smoke run (labelled as such)")
    args = p.parse_args(argv)
    record = load(args.json)
    if record.get("smoke") and not args.allow_smoke:
        print(
            f"{args.json} is a smoke run (a code-path check, not a measurement); refusing to draw it as a result. "
            "Pass --allow-smoke to draw it, labelled as a smoke run.",
            file=sys.stderr,
        )
        return 2
    if args.markdown is not None:
        text = markdown(record)
        if args.markdown == "-":
            print(text, end="")
        else:
            Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
            Path(args.markdown).write_text(text)
            print(f"wrote {args.markdown}")
    if not args.no_png:
        png = args.png or args.json.with_suffix(".png")
        try:
            plot_png(record, png)
        except ImportError as e:
            print(f"PNG skipped: matplotlib is not importable ({e}); the JSON and markdown are complete")
        else:
            print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
