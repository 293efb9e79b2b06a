"""Generate docs/performance.md from the results stored under benchmarks/results/, so that the page says only what
a stored result measured, with the device, library versions, date, commit and command it was measured with.

For each kind of benchmark (step, eager, capture, memory, fsdp, cpu, convergence) the page takes the latest stored
result (by the date in its environment record), links its JSON and its plot, counts flatopt's targets met, missed and
not evaluated, and gives the benchmark script's own tables (percent of the floor, timings, targets). A kind with no
stored result says so and gives the command that produces one. Then the other stored records: profiles (latest per
kind), the test run's JUnit XML and the GPU run's log. Smoke runs are never reported as results (``--allow-smoke``
includes them, labelled, for checks of this script).

    python3 benchmarks/report.py                 # writes docs/performance.md
    python3 benchmarks/report.py --check         # exit status 1 if docs/performance.md is not what it would write
    python3 benchmarks/report.py --results DIR --out PATH [--allow-smoke]
"""

import argparse
import json
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable (after any installed flatopt)
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from benchmarks import harness, plot

DOC = harness.REPO / "docs" / "performance.md"
SECTIONS = (  # kind, title, the command that produces a result of that kind (on a GPU machine but cpu's)
    ("step", "Optimizer step: percent of the memory-bandwidth floor", None),
    ("eager", "Eager training step: flatopt.AdamW against torch.optim.AdamW",
     "FLATOPT_SECTIONS=\"loop eager\" bash benchmarks/run_gpu.sh"),
    ("capture", "Captured training step: optimizer.capture against CUDA graphs and torch.compile",
     "FLATOPT_SECTIONS=\"tests capture\" bash benchmarks/run_gpu.sh"),
    ("memory", "In-backward mode: peak memory on a 1B-parameter model",
     "FLATOPT_SECTIONS=\"step memory\" bash benchmarks/run_gpu.sh"),
    ("fsdp", "FSDP2 on one GPU: flatopt.AdamW against torch's fused AdamW on the same shards (see docs/distributed.md)",
     "FLATOPT_SECTIONS=fsdp bash benchmarks/run_gpu.sh"),
    ("cpu", "On the CPU: backend='cpu' against torch.optim and lion-pytorch (see docs/optimizers.md)",
     "pip install lion-pytorch; PYTHONPATH=. python3 benchmarks/bench_cpu.py --threads N --out benchmarks/results"),
    ("convergence", "Convergence of the precision modes: final loss against float32 AdamW (see docs/precision.md)",
     "FLATOPT_SECTIONS=convergence bash benchmarks/run_gpu.sh"),
)  # fmt: skip
PROFILE_KINDS = ("profile-step", "profile-gather", "profile-capture", "profile-landing")


def _date(record):
    env = record.get("env") or record.get("environment") or {}
    return str(env.get("date") or "")


def load_results(results_dir, allow_smoke=False):
    """{kind: [(path, record)]} of the benchmark results directly under ``results_dir``, latest first; files that are
    not results of a known kind are left out, smoke runs too unless ``allow_smoke``."""
    out = {}
    for path in sorted(Path(results_dir).glob("*.json")):
        try:
            record = json.loads(path.read_text())
            kind = plot.kind_of(record, path)
        except (ValueError, json.JSONDecodeError):
            continue
        if record.get("smoke") and not allow_smoke:
            continue
        out.setdefault(kind, []).append((path, record))
    for rows in out.values():
        rows.sort(key=lambda pr: (_date(pr[1]), pr[0].name), reverse=True)
    return out


def profile_kind(path, record):
    """profile-step, profile-gather, profile-capture or profile-landing: the record's "benchmark", else from the file
    name (profiles written before they had one: profile-STAMP is a step profile, profile-gather-STAMP its gather
    section alone)."""
    if record.get("benchmark") in PROFILE_KINDS:
        return record["benchmark"]
    for kind in ("profile-capture", "profile-gather", "profile-landing"):
        if path.name.startswith(kind + "-"):
            return kind
    return "profile-step"


def latest_profiles(results_dir):
    """{kind: (path, record)}: the latest profile of each kind under ``results_dir``/profiles."""
    out = {}
    for path in sorted((Path(results_dir) / "profiles").glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except json.JSONDecodeError:
            continue
        if record.get("smoke"):
            continue
        kind = profile_kind(path, record)
        if kind not in out or (_date(record), path.name) > (_date(out[kind][1]), out[kind][0].name):
            out[kind] = (path, record)
    return out


def _link(path, doc_dir):
    rel = os.path.relpath(path, doc_dir)
    return f"[`{Path(path).name}`]({rel})"


def step_variants(record):
    """The variants of bench_step.py a result holds (results written before the loop variant: step)."""
    return {r.get("variant", "step") for r in record["results"]}


def only_variant(record, variant):
    """A step result reduced to one variant's rows and targets."""
    keep = [r for r in record["results"] if r.get("variant", "step") == variant]
    targets = [t for t in record.get("targets") or [] if t.get("variant", "step") == variant]
    return dict(record, results=keep, targets=targets)


STEP_VARIANTS = (  # bench_step.py's variants: each shown from the latest result that has it
    ("step", "`opt.step()` alone", "FLATOPT_SECTIONS=\"step memory\" bash benchmarks/run_gpu.sh"),
    ("loop", "The training loop's step: zero_grad() + gradient landing + step()",
     "FLATOPT_SECTIONS=\"loop eager\" bash benchmarks/run_gpu.sh"),
)  # fmt: skip


def on_cuda(record):
    env = record.get("env") or {}
    return str(env.get("device", "cuda")).startswith("cuda")


def section(kind, title, command, found, doc_dir):
    if kind == "eager":  # the GPU models, then flatopt.demo's model on the CPU
        lines = result_section(kind, f"## {title}", command, [f for f in found if on_cuda(f[1])], doc_dir)
        cpu = [f for f in found if not on_cuda(f[1])]
        if cpu:
            lines += result_section(kind, "### On the CPU: flatopt.demo's model", None, cpu, doc_dir)
        return lines
    if kind != "step":
        return result_section(kind, f"## {title}", command, found, doc_dir)
    lines = [f"## {title}", ""]
    for variant, subtitle, cmd in STEP_VARIANTS:
        mine = [(path, only_variant(record, variant)) for path, record in found if variant in step_variants(record)]
        lines += result_section(kind, f"### {subtitle}", cmd, mine, doc_dir)
    return lines


def result_section(kind, heading, command, found, doc_dir):
    lines = [heading, ""]
    if not found:
        where = "On an idle machine (no other work on its cores)" if kind == "cpu" else "On a GPU machine"
        return lines + [f"No stored result yet. {where}: `{command}`, then commit the JSON and PNG it "
                        f"writes to `benchmarks/results/` and run `python3 benchmarks/report.py`.", ""]  # fmt: skip
    path, record = found[0]
    met, missed, none = harness.targets_summary(record.get("targets") or [])
    lines += [
        f"Result: {_link(path, doc_dir)} ({harness.env_line(record)}).",
        "",
        f"flatopt's targets in this result: {met} met, {missed} missed, {none} not evaluated.",
        "",
    ]
    png = path.with_suffix(".png")
    if png.exists():
        lines += [f"![{kind} plot]({os.path.relpath(png, doc_dir)})", ""]
    else:
        lines += [f"No plot stored beside it (`python3 benchmarks/plot.py {path.name}` draws one).", ""]
    older = len(found) - 1
    if older:
        lines += [f"({older} older {kind} result(s) stored beside it are not shown.)", ""]
    return lines + [plot.markdown(record, kind).rstrip("\n"), ""]


def other_records(results_dir, doc_dir):
    lines = ["## Other stored records", ""]
    profiles = latest_profiles(results_dir)
    for kind in PROFILE_KINDS:
        if kind in profiles:
            path, record = profiles[kind]
            lines.append(f"- {kind}: {_link(path, doc_dir)} ({harness.env_line(record)})")
    for pattern, what in (("junit-*.xml", "test run (JUnit XML)"), ("run-*.log", "GPU run log")):
        files = sorted(Path(results_dir).glob(pattern))
        if files:
            lines.append(f"- {what}: {_link(files[-1], doc_dir)}")
    return lines + [""] if len(lines) > 2 else []


def render(results_dir=harness.RESULTS_DIR, doc_path=DOC, allow_smoke=False):
    """The text of docs/performance.md for the results under ``results_dir``."""
    doc_dir = Path(doc_path).resolve().parent
    results = load_results(results_dir, allow_smoke)
    lines = [
        "# Performance",
        "",
        "<!-- Generated by `python3 benchmarks/report.py` from the results stored under benchmarks/results/; "
        "edit that script, not this file. -->",
        "",
        "Every number on this page comes from a result file stored under `benchmarks/results/`, named with the "
        "device, library versions, date, commit and command it was measured with. Results of CPU smoke runs are "
        "never shown. How the benchmarks measure (CUDA events, median and 20th-80th percentiles, warm-up, inputs "
        "that are not zeros, the floor from a copy bandwidth measured in the same run) is described in "
        "`benchmarks/harness.py`; each benchmark's question and cases in its script's docstring.",
        "",
    ]
    for kind, title, command in SECTIONS:
        lines += section(kind, title, command, results.get(kind, []), doc_dir)
    lines += other_records(results_dir, doc_dir)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=harness.RESULTS_DIR, help="default: benchmarks/results")
    p.add_argument("--out", type=Path, default=DOC, help="default: docs/performance.md")
    p.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    p.add_argument("--allow-smoke", action="store_true", help="include smoke runs (labelled as such)")
    args = p.parse_args(argv)
    if not args.results.is_dir():
        print(f"no results folder {args.results}; pass --results DIR", file=sys.stderr)
        return 2
    text = render(args.results, args.out, args.allow_smoke)
    if args.check:
        if not args.out.exists() or args.out.read_text() != text:
            print(
                f"{args.out} is not up to date with {args.results}; run python3 benchmarks/report.py", file=sys.stderr
            )
            return 1
        print(f"{args.out} is up to date")
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
