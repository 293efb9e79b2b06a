"""``flatopt demo`` end to end at a tiny size: outputs, printed results, and flatopt.AdamW giving
torch.optim.AdamW's loss curve from the same initialisation; argument errors."""

import contextlib
import io
import json
import math
import os
import sys

import pytest
import torch

from flatopt import cli, demo

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


def test_demo_writes_a_png_and_results(demo_run):
    status, _, _, results, out = demo_run
    assert status == 0
    png = out / "loss_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "loss_curves.png is not a PNG file"
    assert png.stat().st_size > 5000, "the plot is suspiciously small"
    assert results["plot"] == "loss_curves.png"
    assert results["device"] == "cpu"
    assert results["versions"]["torch"] and results["versions"]["flatopt"]
    assert results["runs"]["flatopt.AdamW"]["backend"] == "cpu"  # the default on the CPU
    assert results["config"]["steps"] == 6


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
