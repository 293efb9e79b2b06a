"""What the demo reports: the summary, the printed comparison and the plot."""

import platform
from dataclasses import asdict

from flatopt.demo.measure import device_name, timed_steps, versions

PLOT_NAME = "loss_curves.png"

RESULTS_NAME = "results.json"


def plot(path, results, title):
    """Write the two loss curves and their difference to ``path``; returns False when matplotlib is missing."""
    try:
        from matplotlib.figure import Figure  # the object API: no pyplot, no global backend change
    except ImportError:
        return False
    (name_a, a), (name_b, b) = results["runs"].items()
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    ax_loss, ax_diff = fig.subplots(1, 2, width_ratios=[3, 2])
    steps = range(1, len(a["train_losses"]) + 1)
    for name, r, style in ((name_a, a, dict(lw=2.0)), (name_b, b, dict(lw=1.0, ls="--"))):
        label = f"{name}: train {r['final_train_loss']:.3f}, val {r['val_loss']:.3f}"
        ax_loss.plot(steps, r["train_losses"], label=label, **style)
    ax_loss.set(xlabel="step", ylabel="training loss (nats per character)")
    ax_loss.set_title(title, fontsize=9)
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    diff = [abs(x - y) for x, y in zip(a["train_losses"], b["train_losses"], strict=True)]
    floor = min([d for d in diff if d > 0], default=1e-7) / 4
    differ = [(i + 1, d) for i, d in enumerate(diff) if d > 0]
    same = [i + 1 for i, d in enumerate(diff) if d == 0]
    if differ:
        ax_diff.scatter(*zip(*differ, strict=True), s=4, color="tab:green", label="|difference|")
    if same:
        ax_diff.scatter(same, [floor] * len(same), s=4, color="tab:gray", label=f"equal ({len(same)} steps)")
    ax_diff.set(yscale="log", xlabel="step", ylabel="|flatopt loss - torch.optim loss|")
    ax_diff.legend(loc="lower right", fontsize=8)
    ax_diff.set_title(
        f"max difference {results['max_abs_loss_difference']:.2e}; median optimizer step\n"
        f"{name_a} {a['median_optimizer_step_ms']:.2f} ms, {name_b} {b['median_optimizer_step_ms']:.2f} ms",
        fontsize=9,
    )
    ax_diff.grid(alpha=0.3, which="both")
    fig.savefig(path, dpi=120)
    return True


def _ms(seconds):
    """Mean and median of a list of durations, in milliseconds."""
    if not seconds:
        return float("nan"), float("nan")
    ordered = sorted(seconds)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return 1e3 * sum(ordered) / len(ordered), 1e3 * median


def summarize(config, device, threads, source, data, runs, n_params, warmup):
    """Everything the demo measured, as written to ``results.json``."""
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
        "runs": summary,
        "max_abs_loss_difference": max(abs(a - b) for a, b in zip(runs[0].losses, runs[1].losses, strict=True)),
        "val_loss_difference": abs(runs[0].val_loss - runs[1].val_loss),
    }


def report(results, log):
    """Print the comparison table and the closing lines."""
    log("")
    log(f"{'':18} {'first':>7} {'final train':>11} {'val':>7}   {'optimizer step (ms)':>19}   {'train step (ms)':>17}")
    log(f"{'':18} {'loss':>7} {'loss':>11} {'loss':>7}   {'mean':>9} {'median':>9}   {'mean':>8} {'median':>8}")
    for name, r in results["runs"].items():
        log(
            f"{name:18} {r['train_losses'][0]:7.4f} {r['final_train_loss']:11.4f} {r['val_loss']:7.4f}   "
            f"{r['mean_optimizer_step_ms']:9.3f} {r['median_optimizer_step_ms']:9.3f}   "
            f"{r['mean_train_step_ms']:8.2f} {r['median_train_step_ms']:8.2f}"
        )
    timed = results["timed_steps"]
    left_out = timed["first"] - 1
    plural = "s" if left_out != 1 else ""
    log(
        f"step times over steps {timed['first']}-{timed['last']} ({left_out} warm-up step{plural} left out); "
        "a train step is zero_grad + forward + backward + optimizer step + scheduler step"
    )
    ours, theirs = results["runs"].values()
    if timed["count"]:
        ratios = [theirs[f"{k}_optimizer_step_ms"] / ours[f"{k}_optimizer_step_ms"] for k in ("median", "mean")]
        log(f"optimizer step time, torch.optim.AdamW / flatopt.AdamW: {ratios[0]:.2f}x median, {ratios[1]:.2f}x mean")
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
