"""``flatopt demo`` end to end at a tiny size: outputs, printed results, and flatopt.AdamW giving
torch.optim.AdamW's loss curve from the same initialisation; argument errors."""

import contextlib
import importlib.util
import io
import json
import math
import os
import sys

import pytest
import torch

import flatopt
from flatopt import cli, demo
from flatopt.demo.report import figure, smooth, smoothing_half_width

TINY = ["--steps", "6", "--batch-size", "4", "--seq-len", "32", "--dim", "32", "--layers", "1", "--heads", "2"]
TINY += ["--lr", "1e-2", "--data-mb", "0.2", "--device", "cpu", "--threads", "1", "--seed", "3", "--quiet"]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """Run the demo once for the tests of this module: (exit status, stdout, stderr, results, out folder)."""
    out = tmp_path_factory.mktemp("demo_out")
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        status = cli.main(["demo", *TINY, "--out", str(out)])
    results = json.loads((out / "results.json").read_text())
    return status, stdout.getvalue(), stderr.getvalue(), results, out


def test_demo_writes_its_results_and_a_png(demo_run):
    status, _, _, results, out = demo_run
    assert status == 0
    assert results["device"] == "cpu"
    assert results["versions"]["torch"] and results["versions"]["flatopt"]
    # the backend the optimizer object chose on this device (the CPU backend here)
    assert results["runs"]["flatopt.AdamW"]["backend"] == flatopt.AdamW(torch.nn.Linear(2, 2)).backend == "cpu"
    assert results["config"]["steps"] == 6
    if importlib.util.find_spec("matplotlib") is None:  # no plot then: see test_demo_without_matplotlib
        assert results["plot"] is None and not (out / "loss_curves.png").exists()
        return
    png = out / "loss_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "loss_curves.png is not a PNG file"
    assert png.stat().st_size > 5000, "the plot is suspiciously small"
    assert results["plot"] == "loss_curves.png"


def test_demo_prints_final_losses_and_step_times(demo_run):
    _, stdout, _, results, _ = demo_run
    for name, run in results["runs"].items():
        line = next((ln for ln in stdout.splitlines() if ln.startswith(name)), None)
        assert line is not None, f"no result line for {name} in:\n{stdout}"
        for key, fmt in (("final_train_loss", ".4f"), ("val_loss", ".4f"), ("mean_optimizer_step_ms", ".3f")):
            assert format(run[key], fmt) in line, f"{key} {run[key]} is not printed on the {name} line: {line!r}"
        assert format(run["mean_train_step_ms"], ".2f") in line, f"mean train step not printed: {line!r}"
        assert run["mean_optimizer_step_ms"] > 0 and run["mean_train_step_ms"] > run["mean_optimizer_step_ms"]
    assert f"{results['max_abs_loss_difference']:.3e}" in stdout


def test_demo_flatopt_matches_torch_optim(demo_run):
    _, _, _, results, _ = demo_run
    ours = results["runs"]["flatopt.AdamW"]
    theirs = results["runs"]["torch.optim.AdamW"]
    assert len(ours["train_losses"]) == len(theirs["train_losses"]) == 6
    for run in (ours, theirs):
        assert all(math.isfinite(v) for v in run["train_losses"] + [run["val_loss"]])
    # same initialisation and batch: the first loss is computed before any step, bit for bit equal
    assert ours["train_losses"][0] == theirs["train_losses"][0]
    # the optimizers did train (a demo whose optimizers did nothing would also give equal curves)
    assert ours["train_losses"][-1] < ours["train_losses"][0] - 0.3, ours["train_losses"]
    for step, (a, b) in enumerate(zip(ours["train_losses"], theirs["train_losses"], strict=True)):
        assert a == pytest.approx(b, rel=1e-4), f"step {step}: flatopt loss {a} != torch.optim loss {b}"
    assert ours["val_loss"] == pytest.approx(theirs["val_loss"], rel=1e-4)
    diff = max(abs(a - b) for a, b in zip(ours["train_losses"], theirs["train_losses"], strict=True))
    assert results["max_abs_loss_difference"] == pytest.approx(diff)


def test_demo_validation_curve(demo_run):
    _, _, _, results, _ = demo_run
    assert results["val_steps"] == [1, 2, 3, 4, 5, 6]  # a tenth of 6 steps, rounded down to at least 1
    for run in results["runs"].values():
        assert len(run["val_losses"]) == 6 and run["val_loss"] == run["val_losses"][-1]
        assert run["val_losses"][-1] < run["val_losses"][0] - 0.3, run["val_losses"]


def test_demo_reports_the_step_time_ratio_flatopt_over_torch(demo_run):
    _, stdout, _, results, _ = demo_run
    ours, theirs = results["runs"]["flatopt.AdamW"], results["runs"]["torch.optim.AdamW"]
    ratio = results["step_time_ratio"]
    for kind in ("optimizer_step", "train_step"):
        for stat in ("median", "mean"):
            assert ratio[f"{kind}_{stat}"] == ours[f"{stat}_{kind}_ms"] / theirs[f"{stat}_{kind}_ms"]
    line = next(ln for ln in stdout.splitlines() if ln.startswith("step time,"))
    assert line.startswith(
        f"step time, flatopt.AdamW ({ours['backend']} backend) / torch.optim.AdamW, below 1 when flatopt is faster: "
        f"optimizer step {ratio['optimizer_step_median']:.2f} median, {ratio['optimizer_step_mean']:.2f} mean; "
        f"train step {ratio['train_step_median']:.2f} median"
    ), line
    row = next(ln for ln in stdout.splitlines() if ln.startswith("flatopt.AdamW "))
    assert row.endswith(f"   {ours['backend']}"), row


def test_demo_progress_line_names_each_loss(tmp_path, capsys):
    args = [a for a in TINY if a != "--quiet"] + ["--steps", "4", "--eval-every", "3", "--out", str(tmp_path)]
    assert cli.main(["demo", *args]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["val_steps"] == [3, 4]
    ours, theirs = results["runs"]["flatopt.AdamW"], results["runs"]["torch.optim.AdamW"]
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("step ")]
    assert len(lines) == 4, lines  # not a terminal: one line per tenth of the work, here every step
    for step, line in enumerate(lines, 1):
        train = (
            f"train loss (flatopt) {ours['train_losses'][step - 1]:.3f}  (torch) {theirs['train_losses'][step - 1]:.3f}"
        )
        if step < 3:
            val = "val loss (flatopt) -  (torch) -"
        else:
            i = results["val_steps"].index(step)
            val = f"val loss (flatopt) {ours['val_losses'][i]:.3f}  (torch) {theirs['val_losses'][i]:.3f}"
        assert line.startswith(f"step {step}/4 [") and f"] {train} | {val} | 1 threads |" in line, line


def test_smooth_is_a_centred_mean():
    assert smooth([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 0) == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert smooth([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 2) == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # a line stays put: no lag
    assert smooth([0.0, 3.0, 0.0, 3.0, 0.0], 1) == [0.0, 1.0, 2.0, 1.0, 0.0]
    assert smoothing_half_width(6) == 0 and smoothing_half_width(800) == 20 and smoothing_half_width(10**5) == 25


def _results_for_plot(train_a, train_b, val_a, val_b, val_steps):
    runs = {}
    for name, train, val in (("flatopt.AdamW", train_a, val_a), ("torch.optim.AdamW", train_b, val_b)):
        runs[name] = {
            "backend": "a-backend", "train_losses": train, "val_losses": val, "val_loss": val[-1],
            "median_optimizer_step_ms": 1.0,
        }  # fmt: skip
    diff = max(abs(a - b) for a, b in zip(train_a, train_b))
    return {
        "runs": runs, "val_steps": val_steps, "max_abs_loss_difference": diff,
        "val_loss_difference": abs(val_a[-1] - val_b[-1]), "step_time_ratio": {"optimizer_step_median": 0.5},
    }  # fmt: skip


def test_plot_draws_validation_smoothed_training_and_no_placeholder_points():
    pytest.importorskip("matplotlib")
    n = 200
    train_a = [3.0 + math.sin(i) for i in range(n)]  # noisy: the smoothed curve must differ from it
    train_b = [v + (1e-4 * (1 + i % 3) if i % 2 else 0.0) for i, v in enumerate(train_a)]  # equal at every even step
    val_steps = [50, 100, 150, 200]
    val_a, val_b = [3.5, 3.0, 2.8, 2.7], [3.5, 3.0001, 2.8, 2.7002]
    fig = figure(_results_for_plot(train_a, train_b, val_a, val_b, val_steps), "title")
    ax_loss, ax_diff = fig.axes
    lines = {line.get_label(): line for line in ax_loss.get_lines()}
    val_line = lines["flatopt.AdamW validation: 2.700"]
    assert list(val_line.get_xdata()) == val_steps and list(val_line.get_ydata()) == val_a
    smoothed = next(line for label, line in lines.items() if label.startswith("flatopt.AdamW train (centred mean"))
    assert list(smoothed.get_ydata()) == smooth(train_a, smoothing_half_width(n)) != train_a
    raw = [line for line in ax_loss.get_lines() if list(line.get_ydata()) == train_a]
    assert raw and raw[0].get_alpha() < 0.5, "the raw training curve is drawn faint behind the smoothed one"
    # the difference panel: a point for each step whose losses differ, at that difference, and nothing else
    expected = {(i + 1, abs(a - b)) for i, (a, b) in enumerate(zip(train_a, train_b)) if a != b}
    expected |= {(s, abs(a - b)) for s, a, b in zip(val_steps, val_a, val_b) if a != b}
    drawn = {tuple(map(float, xy)) for c in ax_diff.collections for xy in c.get_offsets()}
    assert drawn == {(float(x), float(y)) for x, y in expected}
    assert ax_diff.get_yscale() == "log"
    labels = [t.get_text() for t in ax_diff.get_legend().get_texts()]
    assert labels == [
        "train |difference| (100 of 200 equal, not drawn)",
        "validation |difference| (2 of 4 equal, not drawn)",
    ]


def test_demo_without_matplotlib(tmp_path, monkeypatch, capsys):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib...` raise ImportError
    args = ["demo", *TINY, "--steps", "2", "--out", str(tmp_path)]
    assert cli.main(args) == 0
    captured = capsys.readouterr()
    assert "matplotlib is not installed" in captured.err
    assert "final train" in captured.out and "\ntorch.optim.AdamW " in captured.out
    assert not (tmp_path / "loss_curves.png").exists()
    assert json.loads((tmp_path / "results.json").read_text())["plot"] is None


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "0"], "argument --steps: must be a positive integer, got 0"),
        (["--batch-size", "two"], "argument --batch-size: expected a positive integer, got 'two'"),
        (["--lr", "-1"], "argument --lr: must be a positive number, got -1.0"),
        (["--device", "tpu"], "argument --device: "),
        (["--dim", "30", "--heads", "4"], "error: --heads must divide --dim (30), got 4"),
        (["--seq-len", "5000", "--data-mb", "0.01"], "error: the validation text has 1000 characters, fewer than"),
    ],
)
def test_demo_rejects_bad_arguments(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: flatopt demo" in err
    assert message in err


def test_cpu_threads_set_and_restored():
    before = torch.get_num_threads()
    threads = demo.CpuThreads(interval_s=0.0)
    try:
        assert 1 <= threads.threads <= (os.cpu_count() or 1) and torch.get_num_threads() == threads.threads
        threads.update(5)
        assert threads.changes[0] == [0, threads.changes[0][1]] and all(n >= 1 for _, n in threads.changes)
    finally:
        threads.close()
    assert torch.get_num_threads() == before
    fixed = demo.CpuThreads(fixed=1)
    try:
        fixed.update(3, force=True)
        assert torch.get_num_threads() == 1 and fixed.changes == [[0, 1]]
    finally:
        fixed.close()
    assert torch.get_num_threads() == before


def test_cli_needs_a_command(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([])
    assert exc.value.code == 2
    assert "required: COMMAND" in capsys.readouterr().err
