"""flatopt inside Hugging Face's ``transformers.Trainer`` and Lightning, in step mode: the examples under
``examples/`` run here, each against the same run with torch.optim.AdamW.

Tolerances. flatopt computes AdamW as torch.optim's ``fused=True`` kernel does (float32, one
expression per element); torch.optim.AdamW on the CPU defaults to its for-loop implementation, which
rounds differently, so the two agree to float32 noise, not bit for bit:

* float32, 16 steps: losses within 1e-5, parameters within 2e-5. Seen: losses within 2.4e-7, parameters
  within 4.0e-6 (GPT-2's attention key bias, whose true gradient is zero: Adam scales its rounding noise up
  to steps of lr), 1.2e-7 elsewhere. Against what a mistake would cost, in the same runs with
  torch.optim: no clipping moves the parameters by 6.3e-3, weight decay 0 by 2.4e-4, a learning rate 1 %
  off by 1.3e-3, one step fewer by 1.4e-3.
* bfloat16 autocast: losses and parameters within 1e-3. Seen: 2.4e-4 and 2.3e-4; torch.optim's own fused
  and for-loop AdamW differ by as much there (2.8e-4 in the loss), since each rounding difference of a
  parameter can flip a bfloat16 rounding of the activations.
* Resuming from a checkpoint is bit-identical to the uninterrupted run: the checkpoint holds the states,
  step counts, schedule, RNG states and data position exactly, and the step computes the same thing from
  the same inputs.

The tests skip (saying so) where transformers, accelerate or lightning are not installed; ``make env``
installs them (the ``integrations`` extra).
"""

import importlib.util
import os
import warnings

import pytest
import torch
from torch import nn

import flatopt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FP32 = dict(loss=1e-5, param=2e-5)
BF16 = dict(loss=1e-3, param=1e-3)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: a second intra-op thread buys nothing, and on a machine whose cores are busy
    (other test runs) every parallel region waits for a descheduled thread, which made these tests 15x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def missing(*packages):
    return [p for p in packages if importlib.util.find_spec(p) is None]


def load_example(name, *packages):
    """Import ``examples/<name>.py`` as a module; skip, naming what is missing, without ``packages``."""
    absent = missing(*packages)
    if absent:
        pytest.skip(f"{', '.join(absent)} not installed: pip install -e '.[integrations]' (make env installs it)")
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(ROOT, "examples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def hf():
    return load_example("hf_trainer", "transformers", "accelerate")


@pytest.fixture(scope="module")
def lit():
    with warnings.catch_warnings():  # lightning's import, on torch versions it has not caught up with
        warnings.simplefilter("ignore", DeprecationWarning)
        return load_example("lightning_module", "lightning")


def assert_runs_match(a, b, tol, what):
    assert len(a["losses"]) == len(b["losses"]) > 0, what
    torch.testing.assert_close(
        torch.tensor(a["losses"]), torch.tensor(b["losses"]), atol=tol["loss"], rtol=0,
        msg=lambda m: f"{what}: losses per step differ\n{m}",
    )  # fmt: skip
    assert a["params"].keys() == b["params"].keys()
    for name in a["params"]:
        torch.testing.assert_close(
            a["params"][name], b["params"][name], atol=tol["param"], rtol=0,
            msg=lambda m: f"{what}: parameter {name} differs\n{m}",
        )  # fmt: skip


def assert_learns(run):
    losses = run["losses"]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.1, f"the loss did not decrease: {losses}"


# ---------------------------------------------------------------------------------------- step(closure)
def closure_for(model, x, y, seen):
    def closure():
        seen.append(torch.is_grad_enabled())
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    return closure


@pytest.mark.parametrize(
    "cls, torch_cls, kwargs",
    [
        (flatopt.AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
        (flatopt.SGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9)),
        (flatopt.Lion, None, dict(lr=1e-3)),
    ],
    ids=["AdamW", "SGD", "Lion"],
)
@pytest.mark.parametrize("flat", [True, False], ids=["flat", "per-parameter"])
def test_step_runs_the_closure_as_torch_optim(cls, torch_cls, kwargs, flat):
    """Lightning calls ``optimizer.step(closure=...)`` and uses what it returns: step() runs the closure under
    enable_grad (also when called under no_grad), returns the closure's own return value, steps with the
    gradients it made, and leaves grad mode as it was."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    ref = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    ref.load_state_dict(model.state_dict())
    x, y = torch.randn(4, 5), torch.randn(4, 3)
    opt = cls(model, flat=flat, **kwargs)
    ref_opt = torch_cls(ref.parameters(), **kwargs) if torch_cls else None
    before = [p.detach().clone() for p in model.parameters()]
    for step in range(3):
        seen = []
        closure = closure_for(model, x, y, seen)
        opt.zero_grad()
        with torch.no_grad():
            out = opt.step(closure)
            assert not torch.is_grad_enabled()
        assert seen == [True], f"step {step}: the closure ran {len(seen)} times, grad enabled: {seen}"
        assert isinstance(out, torch.Tensor) and out.grad_fn is not None, "step() must return the closure's loss"
        if ref_opt is not None:
            ref_opt.zero_grad()
            with torch.no_grad():
                ref_out = ref_opt.step(closure_for(ref, x, y, []))
            torch.testing.assert_close(out, ref_out, msg=lambda m: f"step {step}: returned loss\n{m}")
            for p, q in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=lambda m: f"step {step}: parameters\n{m}")
    moved = [not torch.equal(p, b) for p, b in zip(model.parameters(), before)]
    assert all(moved), "the closure's gradients were not used"
    assert opt.step() is None


def test_step_with_a_closure_that_raises_changes_nothing():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = flatopt.AdamW(model, lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]

    def closure():
        raise RuntimeError("from the closure")

    with pytest.raises(RuntimeError, match="from the closure"):
        opt.step(closure)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert opt.state_dict()["state"] == {}


# ---------------------------------------------------------------------------------------- transformers.Trainer
def test_hf_optimizer_cls_and_kwargs_matches_torch(hf):
    """optimizer_cls_and_kwargs: Trainer calls flatopt.AdamW(param_groups, **kwargs) with its decay and no-decay
    groups; with clipping at max_grad_norm=1.0 (its default), the run matches torch.optim.AdamW's."""
    ours, ref = hf.train("flatopt", "cls"), hf.train("torch", "cls")
    assert ours["optimizer"] == "flatopt.adamw.AdamW" and ref["optimizer"] == "torch.optim.adamw.AdamW"
    assert ours["weight_decays"] == ref["weight_decays"] == [0.1, 0.0]
    assert max(ours["grad_norms"]) > 1.0, "no step was clipped: the clipping check checks nothing"
    assert_runs_match(ours, ref, FP32, "flatopt vs torch.optim, optimizer_cls_and_kwargs")
    assert_learns(ours)


def test_hf_optimizer_instance_matches_torch(hf):
    """optimizers=(flatopt.AdamW(model, ...), None): Trainer adds its linear schedule to the optimizer given.
    Llama's nn.Linear layers write their gradients straight into flatopt's buffer here."""
    ours, ref = hf.train("flatopt", "instance", model="llama"), hf.train("torch", "instance", model="llama")
    assert ours["optimizer"] == "flatopt.adamw.AdamW"
    assert ours["lrs"] == ref["lrs"] and ours["lrs"][0] > ours["lrs"][-1] > 0, "Trainer's schedule did not run"
    assert_runs_match(ours, ref, FP32, "flatopt vs torch.optim, optimizers=(opt, None)")
    assert_learns(ours)


def test_hf_resume_from_checkpoint_is_bit_identical(hf, tmp_path):
    whole = hf.train("flatopt", save_at=8, output_dir=str(tmp_path / "whole"))
    checkpoint = os.path.join(whole["output_dir"], "checkpoint-8")
    assert os.path.exists(os.path.join(checkpoint, "optimizer.pt"))
    resumed = hf.train("flatopt", save_at=8, resume_from=checkpoint, output_dir=str(tmp_path / "resumed"))
    assert resumed["losses"] == whole["losses"]
    for name, p in whole["params"].items():
        assert torch.equal(p, resumed["params"][name]), f"{name} differs after resuming at step 8"
    # the checkpoint is torch.optim's format: torch.optim.AdamW resumes from it, to float noise
    by_torch = hf.train("torch", save_at=8, resume_from=checkpoint, output_dir=str(tmp_path / "by_torch"))
    assert_runs_match(whole, by_torch, FP32, "flatopt's checkpoint resumed by torch.optim.AdamW")


def test_hf_bf16_on_cpu_matches_torch(hf):
    ours, ref = hf.train("flatopt", model="llama", bf16=True), hf.train("torch", model="llama", bf16=True)
    assert ours["mixed_precision"] == "bf16"
    fp32 = hf.train("flatopt", model="llama", steps=1)
    assert ours["losses"][0] != fp32["losses"][0], "bf16=True changed nothing: autocast did not run"
    assert_runs_match(ours, ref, BF16, "flatopt vs torch.optim, bf16=True")
    assert_learns(ours)


def test_hf_gradient_accumulation_matches_torch(hf):
    ours, ref = hf.train("flatopt", grad_accum=4), hf.train("torch", grad_accum=4)
    assert len(ours["losses"]) == 16
    assert_runs_match(ours, ref, FP32, "flatopt vs torch.optim, gradient_accumulation_steps=4")
    assert_learns(ours)


@pytest.mark.parametrize("mode", ["default", "non-reentrant", "reentrant"])
def test_hf_gradient_checkpointing_matches_torch(hf, mode):
    ours = hf.train("flatopt", "instance", model="llama", checkpointing=mode)
    ref = hf.train("torch", "instance", model="llama", checkpointing=mode)
    assert ours["checkpointing"] and ref["checkpointing"]
    assert_runs_match(ours, ref, FP32, f"flatopt vs torch.optim, {mode} activation checkpointing")


def test_hf_release_gradients_frees_flatopts_gradient_buffer(hf):
    """Trainer ends each step with model.zero_grad(), which leaves flatopt's gradient buffer allocated; the
    example's ReleaseGradients callback frees it (optimizer.zero_grad()), and changes nothing else."""
    released, kept = hf.train("flatopt", steps=4), hf.train("flatopt", steps=4, release_grads=False)
    assert released["grad_bytes"] == 0 and kept["grad_bytes"] > 0
    assert released["losses"] == kept["losses"]
    assert all(torch.equal(p, kept["params"][n]) for n, p in released["params"].items())


def test_hf_example_main(hf, capsys):
    summary = hf.main(["--steps", "4", "--resume-at", "2", "--grad-accum", "2"])
    out = capsys.readouterr().out
    assert "largest parameter difference, flatopt vs torch" in out and "resumed from" in out
    assert summary["param_diff"] < FP32["param"] and summary["resume_diff"] == 0.0


# ---------------------------------------------------------------------------------------- Lightning
@pytest.mark.parametrize(
    "knobs",
    [
        dict(),
        dict(scheduler=True),
        dict(accumulate=4),
        dict(clip=0),
        dict(precision="bf16-mixed"),
        dict(precision="bf16-mixed", accumulate=4, scheduler=True),
    ],
    ids=["plain", "scheduler", "accumulate4", "no-clip", "bf16-mixed", "bf16-accumulate4-scheduler"],
)
def test_lightning_matches_torch(lit, knobs):
    ours, ref = lit.train("flatopt", **knobs), lit.train("torch", **knobs)
    assert ours["optimizer"] == "flatopt.adamw.AdamW" and ref["optimizer"] == "torch.optim.adamw.AdamW"
    assert len(ours["losses"]) == 16 * knobs.get("accumulate", 1)
    if knobs.get("scheduler"):
        assert ours["lr"] == ref["lr"] < 3e-3 / 2, "the LR scheduler did not run"
    tol = BF16 if knobs.get("precision") == "bf16-mixed" else FP32
    assert_runs_match(ours, ref, tol, f"flatopt vs torch.optim under Lightning, {knobs}")
    assert_learns(ours)


def test_lightning_clipping_is_active(lit):
    clipped, free = lit.train("flatopt"), lit.train("flatopt", clip=0)
    assert max((clipped["params"][n] - free["params"][n]).abs().max().item() for n in free["params"]) > 1e-3


def test_lightning_resume_from_checkpoint_is_bit_identical(lit, tmp_path):
    whole = lit.train("flatopt", save_at=8, scheduler=True, output_dir=str(tmp_path / "whole"))
    assert os.path.exists(whole["checkpoint"])
    resumed = lit.train("flatopt", save_at=8, scheduler=True, resume_from=whole["checkpoint"],
                        output_dir=str(tmp_path / "resumed"))  # fmt: skip
    assert resumed["losses"] == whole["losses"][8:]
    for name, p in whole["params"].items():
        assert torch.equal(p, resumed["params"][name]), f"{name} differs after resuming at step 8"


def test_lightning_own_clipping_refuses_bf16_mixed_for_step_unscaling_optimizers(lit):
    """What the example's configure_gradient_clipping works around: Lightning refuses gradient_clip_val under
    mixed precision for flatopt as for torch.optim.AdamW(fused=True), both of which unscale in their step."""
    import lightning as L

    class LightningClipping(lit.NextToken):
        configure_gradient_clipping = L.LightningModule.configure_gradient_clipping

    loader = torch.utils.data.DataLoader(lit.random_tokens(), batch_size=8)
    for make in (lambda m: flatopt.AdamW(m, lr=1e-3), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)):
        module = LightningClipping()
        module.configure_optimizers = lambda module=module, make=make: make(module)
        with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
            lit.make_trainer(2, precision="bf16-mixed").fit(module, loader)


def test_lightning_example_main(lit, capsys):
    summary = lit.main(["--steps", "8", "--resume-at", "4", "--accumulate", "2", "--scheduler"])
    out = capsys.readouterr().out
    assert "largest parameter difference, flatopt vs torch" in out and "resumed from" in out
    assert summary["param_diff"] < FP32["param"] and summary["resume_diff"] == 0.0
