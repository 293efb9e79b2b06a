"""What the demo reports: the summary, the printed comparison and the plot."""

import platform
from dataclasses import asdict

from flatopt.demo.measure import device_name, timed_steps, versions

PLOT_NAME = "loss_curves.png"

RESULTS_NAME = "results.json"


def smoothing_half_width(steps):
    """Half the window of :func:`smooth` in the plot: a 40th of the run, at most 25 steps (0: no smoothing)."""
    return min(25, steps // 40)


def smooth(values, half):
    """Centred moving mean over ``2 * half + 1`` values, the window shrinking evenly near the ends: it does
    not lag behind a falling loss as a trailing average (an EMA) does."""
    sums = [0.0]
    for v in values:
        sums.append(sums[-1] + v)
    out = []
    for i in range(len(values)):
        h = min(half, i, len(values) - 1 - i)
        out.append((sums[i + h + 1] - sums[i - h]) / (2 * h + 1))
    return out


def plot(path, results, title):
    """Write :func:`figure` to ``path``; returns False when matplotlib is missing."""
    try:
        fig = figure(results, title)
    except ImportError:
        return False
    fig.savefig(path, dpi=120)
    return True


def figure(results, title):
    """The loss curves and their differences, as a matplotlib ``Figure`` (raises ImportError without matplotlib).

    Left: each run's training loss, raw (faint) and smoothed (:func:`smooth`), and its validation loss at the
    steps where it was measured. Right: |flatopt - torch.optim| of both, on a log scale; steps where the
    two losses are equal have no point there (their count is in the legend).
    """
    from matplotlib.figure import Figure  # the object API: no pyplot, no global backend change

    (name_a, a), (name_b, b) = results["runs"].items()
    steps = list(range(1, len(a["train_losses"]) + 1))
    val_steps = results["val_steps"]
    half = smoothing_half_width(len(steps))
    fig = Figure(figsize=(12, 4.6), layout="constrained")
    ax_loss, ax_diff = fig.subplots(1, 2, width_ratios=[3, 2])
    # flatopt drawn first and wider, torch.optim over it: where the curves coincide, both stay visible
    styles = (
        (name_a, a, "tab:blue", "-", dict(marker="o", ms=7)),
        (name_b, b, "tab:orange", "--", dict(marker="s", ms=4)),
    )
    for name, r, color, ls, _ in styles:
        ax_loss.plot(steps, r["train_losses"], color=color, lw=0.6, alpha=0.25)
        how = f"centred mean of {2 * half + 1} steps" if half else "per step"
        ax_loss.plot(
            steps, smooth(r["train_losses"], half), color=color, ls=ls, lw=2.4 if ls == "-" else 1.4,
            label=f"{name} train ({how})",
        )  # fmt: skip
    for name, r, color, ls, marker in styles:
        ax_loss.plot(
            val_steps, r["val_losses"], color=color, ls=ls, lw=1.0, mfc=color if ls == "-" else "white", **marker,
            label=f"{name} validation: {r['val_loss']:.3f}",
        )  # fmt: skip
    ax_loss.set(xlabel="step", ylabel="loss (nats per character)")
    ax_loss.set_title(f"{title}\ntraining loss raw (faint) and smoothed; validation loss (markers)", fontsize=9)
    ax_loss.legend(fontsize=8)
    ax_loss.grid(alpha=0.3)

    curves = (
        ("train", steps, a["train_losses"], b["train_losses"], dict(s=4, color="tab:green")),
        ("validation", val_steps, a["val_losses"], b["val_losses"], dict(s=22, color="tab:purple", marker="D")),
    )
    drawn = 0
    for what, xs, ys_a, ys_b, style in curves:
        diff = [abs(x - y) for x, y in zip(ys_a, ys_b, strict=True)]
        points = [(step, d) for step, d in zip(xs, diff) if d > 0]  # log scale: an equal pair has no point
        equal = len(diff) - len(points)
        label = f"{what} |difference|" + (f" ({equal} of {len(diff)} equal, not drawn)" if equal else "")
        if points:
            ax_diff.scatter(*zip(*points), label=label, **style)
            drawn += 1
        else:
            ax_diff.plot([], [], ls="none", marker=style.get("marker", "o"), color=style["color"], label=label)
    if drawn:
        ax_diff.set_yscale("log")
    else:
        ax_diff.text(0.5, 0.5, "equal at every step", ha="center", va="center", transform=ax_diff.transAxes)
        ax_diff.set_yticks([])  # nothing drawn: no scale to read
    ax_diff.set(xlabel="step", ylabel="|flatopt loss - torch.optim loss|", xlim=ax_loss.get_xlim())
    ax_diff.legend(loc="lower right", fontsize=8)
    ratio = results["step_time_ratio"]["optimizer_step_median"]
    backend = a["backend"]
    ax_diff.set_title(
        f"max |difference|: train {results['max_abs_loss_difference']:.2e}, "
        f"validation {results['val_loss_difference']:.2e}\n"
        f"median optimizer step: {name_a} ({backend} backend) {a['median_optimizer_step_ms']:.2f} ms,\n"
        f"{name_b} {b['median_optimizer_step_ms']:.2f} ms\n"
        f"flatopt / torch.optim = {ratio:.2f} (below 1: flatopt faster)",
        fontsize=9,
    )
    ax_diff.grid(alpha=0.3, which="both")
    return fig


def _ms(seconds):
    """Mean and median of a list of durations, in milliseconds."""
    if not seconds:
        return float("nan"), float("nan")
    ordered = sorted(seconds)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return 1e3 * sum(ordered) / len(ordered), 1e3 * median


def _ratio(a, b):
    return a / b if b > 0 else float("nan")


def summarize(config, device, threads, source, data, runs, n_params, warmup, val_steps):
    """Everything the demo measured, as written to ``results.json``. Step-time ratios are flatopt's time
    over torch.optim's: below 1, flatopt is faster."""
    window = timed_steps(config.steps)
    summary = {}
    for r in runs:
        step_mean, step_median = _ms(r.step_s[window])
        train_mean, train_median = _ms(r.train_step_s[window])
        summary[r.name] = {
            "backend": getattr(r.optimizer, "backend", None) or f"torch.optim ({config.torch_impl})",
            "train_losses": r.losses,
            "final_train_loss": r.losses[-1],
            "val_loss": r.val_loss,
            "val_losses": r.val_losses,
            "mean_optimizer_step_ms": step_mean,
            "median_optimizer_step_ms": step_median,
            "mean_train_step_ms": train_mean,
            "median_train_step_ms": train_median,
            "optimizer_step_ms": [1e3 * t for t in r.step_s],
            "train_step_ms": [1e3 * t for t in r.train_step_s],
        }
    return {
        "device": str(device),
        "device_name": device_name(device),
        "cpu_threads": threads.changes,  # [step, threads] from that step on
        "platform": platform.platform(),
        "versions": versions(),
        "config": {**asdict(config), "device": str(device), "threads": config.threads, "warmup_steps": warmup},
        "data": {
            **source,
            "characters": len(data.train) + len(data.val),
            "train_characters": len(data.train),
            "val_characters": len(data.val),
            "vocab_size": data.vocab_size,
        },
        "model": {"parameters": n_params, "layers": config.layers, "dim": config.dim, "heads": config.heads},
        "timed_steps": {"first": window.start + 1, "last": config.steps, "count": len(range(config.steps)[window])},
        "val_steps": val_steps,
        "runs": summary,
        "step_time_ratio": {
            f"{kind}_{stat}": _ratio(
                summary[runs[0].name][f"{stat}_{kind}_ms"], summary[runs[1].name][f"{stat}_{kind}_ms"]
            )
            for kind in ("optimizer_step", "train_step")
            for stat in ("median", "mean")
        },
        "max_abs_loss_difference": max(abs(a - b) for a, b in zip(runs[0].losses, runs[1].losses, strict=True)),
        "val_loss_difference": abs(runs[0].val_loss - runs[1].val_loss),
    }


def report(results, log):
    """Print the comparison table and the closing lines."""
    log("")
    log(
        f"{'':18} {'first':>7} {'final train':>11} {'val':>7}   {'optimizer step (ms)':>19}   {'train step (ms)':>17}"
        "   backend"
    )
    log(f"{'':18} {'loss':>7} {'loss':>11} {'loss':>7}   {'mean':>9} {'median':>9}   {'mean':>8} {'median':>8}")
    for name, r in results["runs"].items():
        log(
            f"{name:18} {r['train_losses'][0]:7.4f} {r['final_train_loss']:11.4f} {r['val_loss']:7.4f}   "
            f"{r['mean_optimizer_step_ms']:9.3f} {r['median_optimizer_step_ms']:9.3f}   "
            f"{r['mean_train_step_ms']:8.2f} {r['median_train_step_ms']:8.2f}   {r['backend']}"
        )
    timed = results["timed_steps"]
    left_out = timed["first"] - 1
    plural = "s" if left_out != 1 else ""
    log(
        f"step times over steps {timed['first']}-{timed['last']} ({left_out} warm-up step{plural} left out); "
        "a train step is zero_grad + forward + backward + optimizer step + scheduler step"
    )
    (name_a, ours), (name_b, _) = results["runs"].items()
    if timed["count"]:
        ratio = results["step_time_ratio"]
        log(
            f"step time, {name_a} ({ours['backend']} backend) / {name_b}, below 1 when flatopt is faster: "
            f"optimizer step {ratio['optimizer_step_median']:.2f} median, {ratio['optimizer_step_mean']:.2f} mean; "
            f"train step {ratio['train_step_median']:.2f} median, {ratio['train_step_mean']:.2f} mean"
        )
    log(
        f"flatopt.AdamW vs torch.optim.AdamW: max |training loss difference| over {timed['last']} steps "
        f"{results['max_abs_loss_difference']:.3e}, validation loss difference {results['val_loss_difference']:.3e}"
    )
    if len(results["cpu_threads"]) > 1:
        changes = ", ".join(f"{n} from step {step + 1}" for step, n in results["cpu_threads"])
        log(f"CPU threads followed the other work on this machine: {changes}")
    if results["max_abs_loss_difference"] > 1e-3:
        log(
            "(float32 rounding differences grow as training goes on; on CUDA, torch's own backward kernels are not all "
            "bit-reproducible, and two torch.optim.AdamW runs of a larger model drift apart about as much)"
        )
