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
import math
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


def tiny_lm():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 16))
    model[1].register_parameter("anchor", nn.Parameter(torch.empty(0)))  # (a common way to track a module's device)
    return model


def train_once(model, opt):
    x = torch.randint(0, 16, (6,), generator=torch.Generator().manual_seed(1))
    model(x).logsumexp(-1).sum().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("mode", [{}, dict(in_backward=True)], ids=["step", "in_backward"])
def test_safetensors_save_model_takes_every_parameter_and_loads_back(mode, tmp_path):
    """safetensors' save_model refuses tensors that do not cover their storage (or drops them as "shared"): each
    parameter's data is a storage of its own bytes over the flat buffer's memory, so every weight is written."""
    absent = missing("safetensors")
    if absent:
        pytest.skip("safetensors not installed: pip install -e '.[integrations]' (make env installs it)")
    from safetensors.torch import load_file, load_model, save_model

    model = tiny_lm()
    opt = flatopt.AdamW(model, lr=0.1, **mode)
    train_once(model, opt)
    path = str(tmp_path / "model.safetensors")
    save_model(model, path)
    assert sorted(load_file(path)) == sorted(model.state_dict())
    fresh = tiny_lm()
    load_model(fresh, path)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p, q), name
    train_once(model, opt)  # the optimizer still steps the parameters where they are
    assert not torch.equal(next(model.parameters()), next(fresh.parameters()))


def test_accelerate_save_state_with_its_default_safetensors_resumes(tmp_path):
    absent = missing("accelerate", "safetensors")
    if absent:
        pytest.skip(f"{', '.join(absent)} not installed: pip install -e '.[integrations]' (make env installs it)")
    from accelerate import Accelerator

    model = tiny_lm()
    accelerator = Accelerator(cpu=True)
    model, opt = accelerator.prepare(model, flatopt.AdamW(model, lr=0.1))
    train_once(model, opt)
    accelerator.save_state(str(tmp_path / "ckpt"))  # safe_serialization=True by default
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    train_once(model, opt)
    accelerator.load_state(str(tmp_path / "ckpt"))
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[k]), k
    for p, m in zip(model.parameters(), moments):
        assert torch.equal(opt.state[p]["exp_avg"], m)


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


# ---------------------------------------------------------------------------------------- clip_grad_norm_(params, inf)
def test_a_max_norm_inf_call_only_asks_for_the_norm_and_is_never_refused():
    """transformers' Trainer with max_grad_norm=0 calls torch.nn.utils.clip_grad_norm_(params, inf) at every step to
    log the norm. Over an in-backward optimizer's parameters that call clips nothing and never raises: the pass's
    norm when the optimizer measured it (max_grad_norm, the same norm_type: any max_norm of its own), NaN with a
    warning when it did not, torch's own call on gradients still in .grad."""
    torch.manual_seed(0)
    x, y = torch.randn(6, 5), torch.randn(6, 3)

    def backward(model):
        nn.functional.mse_loss(model(x), y).backward()

    def model():
        return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))

    plain, clipped, other_type, windowed = model(), model(), model(), model()
    opts = [
        flatopt.AdamW(plain, in_backward=True),
        flatopt.AdamW(clipped, in_backward=True, max_grad_norm=0.5),
        flatopt.AdamW(other_type, in_backward=True, max_grad_norm=0.5, norm_type=math.inf),
        flatopt.AdamW(windowed, in_backward=True, accumulation_steps=2),
    ]
    for m in (plain, clipped, other_type, windowed):
        backward(m)
    before = [p.detach().clone() for p in plain.parameters()]
    with pytest.raises(RuntimeError, match=r"clip_grad_norm_\(max_norm=1.0, norm_type=2.0\) cannot clip") as info:
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)  # a real clip is refused, as before
    assert "Pass max_grad_norm=1.0 to AdamW" in str(info.value), "the default norm_type is not asked for"
    with pytest.raises(RuntimeError, match=r"Pass max_grad_norm=1.0 and norm_type=inf to AdamW"):
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0, norm_type=math.inf)
    with pytest.warns(UserWarning, match=r"built without max_grad_norm, measured no gradient norm.*returns NaN"):
        norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), math.inf)
    assert norm.dim() == 0 and math.isnan(norm)
    with pytest.warns(UserWarning, match=r"built without max_grad_norm, measured no gradient norm.*returns NaN"):
        assert math.isnan(opts[0].clip_grad_norm_(math.inf)), "the optimizer's own method answers as torch's does"
    with pytest.raises(RuntimeError, match=r"max_norm=inf, error_if_nonfinite=True\).*cannot be checked"):
        torch.nn.utils.clip_grad_norm_(plain.parameters(), float("inf"), error_if_nonfinite=True)
    assert all(torch.equal(p, b) for p, b in zip(plain.parameters(), before))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        norm = torch.nn.utils.clip_grad_norm_(clipped.parameters(), float("inf"), norm_type=2)
    assert norm is not opts[1].last_grad_norm and torch.equal(norm, opts[1].last_grad_norm) and norm > 0.5
    with pytest.warns(UserWarning, match=r"built with norm_type=inf, measured no gradient norm of order 2.0"):
        assert math.isnan(torch.nn.utils.clip_grad_norm_(other_type.parameters(), math.inf))
    torch.testing.assert_close(
        torch.nn.utils.clip_grad_norm_(other_type.parameters(), math.inf, norm_type=math.inf), opts[2].last_grad_norm
    )

    grads = [p.grad.clone() for p in windowed.parameters()]  # the window's first pass: gradients in .grad
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    torch.testing.assert_close(torch.nn.utils.clip_grad_norm_(windowed.parameters(), math.inf), expected)
    assert all(torch.equal(p.grad, g) for p, g in zip(windowed.parameters(), grads)), "changed the gradients"


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


@pytest.mark.parametrize("pass_as, release_grads", [("instance", False), ("cls", True)])
def test_hf_model_zero_grad_frees_flatopts_gradient_buffer_before_the_forward_pass(hf, pass_as, release_grads):
    """Trainer ends each step with model.zero_grad(), not the optimizer's: the .grad become None behind flatopt's
    back. Given the model, flatopt releases its gradient buffer at the next forward pass (by its first covered
    layer); built by Trainer from param groups, it does not know the model, and the example's ReleaseGradients
    callback releases it. Either way no forward after the first holds it, as none holds torch.optim's gradients."""
    seen = []

    class Watch(hf.TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            inner = getattr(optimizer, "optimizer", optimizer)
            buffers = flatopt.inspect(inner).buffers

            def record(module, inputs, output):
                seen.append(sum(b.grad.untyped_storage().nbytes() for b in buffers))

            model.get_output_embeddings().register_forward_hook(record)

    run = hf.train("flatopt", pass_as, model="llama", steps=4, callbacks=[Watch()], release_grads=release_grads)
    assert len(seen) == 4 and all(n == 0 for n in seen[1:]), seen
    assert (run["grad_bytes"] == 0) == release_grads, "the callback releases it at the end of each step"


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


@pytest.mark.parametrize("example", ["hf", "lit"])
def test_examples_remove_the_temporary_directories_they_create_when_the_process_exits(
    example, request, tmp_path, monkeypatch
):
    """Without ``output_dir`` an example trains in a temporary directory of its own; a test suite that calls it
    hundreds of times must not leave them all behind. The exit handlers it registers are run here by hand."""
    import atexit
    import tempfile

    module = request.getfixturevalue(example)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    at_exit = []
    monkeypatch.setattr(atexit, "register", lambda fn, *args, **kwargs: at_exit.append((fn, args, kwargs)))
    if example == "hf":
        module.train("flatopt", steps=2, save_at=1)
    else:
        module.train("flatopt", steps=8, save_at=8)
    assert [p.name.split("_")[0] for p in scratch.iterdir()] == [{"hf": "hf", "lit": "lightning"}[example]]
    for fn, args, kwargs in at_exit:
        fn(*args, **kwargs)
    assert list(scratch.iterdir()) == []


# ---------------------------------------------------------------------------------------- in-backward mode
# flatopt.AdamW(..., in_backward=True) steps the parameters during backward. Told the framework's accumulation
# (accumulation_steps) and clipping (max_grad_norm) by the examples, from the framework's own settings.
#
# Without clipping an in-backward run is bit-identical to the same run in step mode (which matches torch.optim
# above): each backward pass, or each window of accumulated passes, is one step() of step mode.
#
# With clipping it is not torch's exact global clip: each bucket is clipped, as soon as its gradients exist, by
# n = max(previous pass's total norm N_prev, this pass's norm so far) (docs/in-backward.md, "Clipping"). These
# tiny models fit in one bucket, whose norm so far is the pass's total norm N when it is stepped: each pass is
# clipped by max(N_prev, N). The reference runs step mode with the framework's clipping off and that clip done
# by a callback (Trainer) or in configure_gradient_clipping (Lightning), and matches to float32 noise; torch's
# exact clip of the same runs differs by far more (figures in each test).
NAN_NORM = r"ignore:clip_grad_norm_\(max_norm=inf\) asks for the norm only"


def assert_bit_identical(a, b, what):
    assert len(a["losses"]) == len(b["losses"]) > 0, what
    assert a["losses"] == b["losses"], f"{what}: losses differ"
    for name, p in a["params"].items():
        assert torch.equal(p, b["params"][name]), f"{what}: {name} differs by {(p - b['params'][name]).abs().max()}"


def max_diff(a, b):
    return max((a["params"][n] - b["params"][n]).abs().max().item() for n in a["params"])


def one_bucket(opt):
    return len(flatopt.inspect(opt).engine.buckets) == 1


class ClipByMaxOfPreviousAndThisNorm:
    """The documented in-backward clip of a pass whose parameters are one bucket: every gradient divided by
    max(1, (n + 1e-6) / c), n = max(N_prev, N), N the pass's total norm (N_prev unknown on the first pass).
    Records, per step, N and whether N_prev decided n while clipping."""

    def __init__(self, c):
        self.c, self.prev, self.norms, self.prev_decided = c, None, [], []

    def __call__(self, params):
        grads = [p.grad for p in params if p.grad is not None]
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        n = total if self.prev is None else torch.maximum(self.prev, total)
        divisor = torch.clamp_min((n + 1e-6) / self.c, 1.0)
        for g in grads:
            g.div_(divisor)
        self.prev_decided.append(self.prev is not None and bool(self.prev > total) and bool(divisor > 1))
        self.norms.append(float(total))
        self.prev = total
        return total


# ------------------------------------------------------------------ transformers.Trainer, in-backward
@pytest.mark.filterwarnings(NAN_NORM)
@pytest.mark.parametrize(
    "knobs",
    [
        dict(pass_as="cls"),
        dict(pass_as="instance", model="llama"),
        dict(grad_accum=4),
        dict(model="llama", bf16=True),
        dict(pass_as="instance", model="llama", checkpointing="non-reentrant"),
    ],
    ids=["optimizer_cls_and_kwargs", "optimizers=(opt,None)", "accumulation4", "bf16", "checkpointing-non-reentrant"],
)
def test_hf_in_backward_without_clipping_is_step_mode_bit_for_bit(hf, knobs):
    """max_grad_norm=0 (Trainer's clipping off): the in-backward run equals the step-mode run bit for bit. With
    gradient_accumulation_steps=4 the example passes accumulation_steps=4: 3 passes accumulate, the 4th steps."""
    ours = hf.train("flatopt", in_backward=True, max_grad_norm=0, **knobs)
    step = hf.train("flatopt", max_grad_norm=0, **knobs)
    assert ours["in_backward"] and not step["in_backward"]
    assert (ours["accumulation_steps"], ours["max_grad_norm"]) == (knobs.get("grad_accum", 1), None)
    assert len(ours["losses"]) == 16
    if knobs.get("bf16"):
        assert ours["mixed_precision"] == "bf16"
    if knobs.get("checkpointing"):
        assert ours["checkpointing"]
    assert_bit_identical(ours, step, f"in-backward vs step mode under Trainer, {knobs}")
    assert_learns(ours)


@pytest.mark.parametrize("grad_accum", [1, 4], ids=["window1", "window4"])
@pytest.mark.parametrize("pass_as", ["cls", "instance"])
def test_hf_in_backward_clipping_is_the_documented_method_and_trainer_logs_its_norm(hf, pass_as, grad_accum):
    """Trainer's default max_grad_norm=1.0, flatopt's max_grad_norm=1.0 (from TrainingArguments). Trainer's
    clip_grad_norm_ call returns the pass's norm, which Trainer logs as grad_norm: equal to opt.last_grad_norm
    at every step, and to the norm of the reference (step mode, clipped as documented) to float noise; the
    parameters match the reference to float noise. Seen, over the four cases: parameters within 3.4e-6 of the
    reference (GPT-2's attention bias, as in step mode against torch.optim), losses within 4.8e-7, norms within
    1.6e-6 relative; 2.5e-3 to 2.7e-3 from torch's exact clip of the same run (in step mode or with
    torch.optim.AdamW alike); N_prev decided the clip at 6 to 8 of the 16 steps."""
    seen = {"norms": [], "one_bucket": []}

    class RecordNorms(hf.TrainerCallback):
        def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
            inner = optimizer.optimizer
            seen["norms"].append(float(inner.last_grad_norm))
            seen["one_bucket"].append(one_bucket(inner))

    documented = ClipByMaxOfPreviousAndThisNorm(1.0)

    class Reference(hf.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            documented(model.parameters())

    knobs = dict(pass_as=pass_as, grad_accum=grad_accum)
    ours = hf.train("flatopt", in_backward=True, callbacks=[RecordNorms()], **knobs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # step mode answers Trainer's max_norm=inf call with the norm, no warning
        ref = hf.train("flatopt", max_grad_norm=0, callbacks=[Reference()], **knobs)
    exact = hf.train("flatopt", **knobs)  # step mode, clipped by torch.nn.utils.clip_grad_norm_
    assert ours["max_grad_norm"] == 1.0 and ours["accumulation_steps"] == grad_accum
    assert all(seen["one_bucket"]) and len(seen["norms"]) == 16
    assert ours["grad_norms"] == seen["norms"], "Trainer's grad_norm is not the pass's norm"
    assert min(ours["grad_norms"]) > 0 and max(ours["grad_norms"]) > 1.0, "no step was clipped"
    assert any(documented.prev_decided), "N_prev never decided a clip: the reference is torch's exact clip"
    torch.testing.assert_close(torch.tensor(ours["grad_norms"]), torch.tensor(documented.norms), atol=0, rtol=1e-5)
    assert_runs_match(ours, ref, FP32, f"in-backward clipping vs the documented method, {knobs}")
    assert max_diff(ours, exact) > 100 * max_diff(ours, ref), "the method is not distinguished from torch's exact clip"
    assert_learns(ours)


@pytest.mark.filterwarnings(NAN_NORM)
@pytest.mark.parametrize("max_grad_norm", [0, 1.0], ids=["no-clip", "clip"])
def test_hf_in_backward_resume_is_bit_identical(hf, tmp_path, max_grad_norm):
    """Resumed at step 8, the run ends bit-identical to the uninterrupted one. With clipping, step 9's norm is at
    least step 8's (checked), so step 9 is clipped by its own norm in either run (the next test resumes where the
    previous pass's norm N_prev, which the checkpoint holds, decides)."""
    knobs = dict(in_backward=True, max_grad_norm=max_grad_norm, save_at=8)
    whole = hf.train("flatopt", output_dir=str(tmp_path / "whole"), **knobs)
    checkpoint = os.path.join(whole["output_dir"], "checkpoint-8")
    resumed = hf.train("flatopt", resume_from=checkpoint, output_dir=str(tmp_path / "resumed"), **knobs)
    if max_grad_norm:
        assert whole["grad_norms"][8] >= whole["grad_norms"][7] > max_grad_norm
    assert_bit_identical(resumed, whole, f"in-backward run resumed at step 8, max_grad_norm={max_grad_norm}")


def test_hf_in_backward_resume_with_clipping_where_the_previous_norm_decides(hf, tmp_path):
    """Resumed at step 9, where step 10's norm is below step 9's: the uninterrupted run clips step 10 by step 9's
    norm N_prev, and so does the resumed one, whose checkpoint holds N_prev (the optimizer state dict's "flatopt"
    entry). Without it the resumed run clipped step 10 by its own norm; the parameters differed by 5.8e-4 at the
    end."""
    knobs = dict(in_backward=True, save_at=9)
    whole = hf.train("flatopt", output_dir=str(tmp_path / "whole"), **knobs)
    assert whole["grad_norms"][8] > whole["grad_norms"][9] > 1.0, "the data no longer exercises N_prev here"
    checkpoint = os.path.join(whole["output_dir"], "checkpoint-9")
    resumed = hf.train("flatopt", resume_from=checkpoint, output_dir=str(tmp_path / "resumed"), **knobs)
    assert_bit_identical(resumed, whole, "in-backward run with clipping resumed at step 9")


def test_hf_in_backward_without_max_grad_norm_is_refused_at_the_first_clipping_call(hf):
    """Trainer's default max_grad_norm=1.0 with an in-backward optimizer built without max_grad_norm: Trainer's
    first clip_grad_norm_ call raises, saying what to pass; step 1 never completes (its backward pass updated
    the parameters once, unclipped, as documented: nothing earlier tells flatopt that Trainer clips)."""
    trainer = hf.build_trainer("flatopt", in_backward=True, options={"max_grad_norm": None})
    with pytest.raises(
        RuntimeError,
        match=r"AdamW\(in_backward=True\): clip_grad_norm_\(max_norm=1.0, norm_type=2\) cannot clip the gradients.*"
        r"Pass max_grad_norm=1.0 .*max_grad_norm=0 in transformers' TrainingArguments",
    ):
        trainer.train()
    opt = hf.inner_optimizer(trainer)
    assert trainer.state.global_step == 0 and trainer.state.log_history == []
    assert {float(opt.state[p]["step"]) for p in trainer.model.parameters()} == {1.0}


def test_hf_accumulation_without_accumulation_steps_is_refused_at_the_second_backward(hf):
    """gradient_accumulation_steps=4 with an in-backward optimizer built without accumulation_steps: the first
    pass steps (as accumulation_steps=1 says), the second pass of the window is refused at its first gradient,
    before it updates anything."""
    after_first = {}

    class Snapshot(hf.TrainerCallback):
        def on_substep_end(self, args, state, control, model=None, **kwargs):  # after each accumulating pass
            after_first.setdefault("params", [p.detach().clone() for p in model.parameters()])

    trainer = hf.build_trainer(
        "flatopt", in_backward=True, grad_accum=4, max_grad_norm=0, options={"accumulation_steps": 1},
        callbacks=[Snapshot()],
    )  # fmt: skip
    with pytest.raises(
        RuntimeError,
        match=r"a second backward pass started with neither opt.step\(\) nor opt.zero_grad\(\).*Trainer with "
        r"gradient_accumulation_steps=k.*pass accumulation_steps=k to AdamW.*Nothing was updated by this backward pass",
    ):
        trainer.train()
    opt = hf.inner_optimizer(trainer)
    assert trainer.state.global_step == 0
    assert all(torch.equal(p, q) for p, q in zip(trainer.model.parameters(), after_first["params"]))
    assert {float(opt.state[p]["step"]) for p in trainer.model.parameters()} == {1.0}
    assert all(p.grad is None for p in trainer.model.parameters()), "the refused pass left a gradient"


def test_hf_in_backward_with_trainers_clipping_off_logs_the_norm_it_can(hf):
    """max_grad_norm=0: Trainer calls clip_grad_norm_(model.parameters(), inf) at every step to log grad_norm.
    That call clips nothing, and is never refused: an optimizer built without max_grad_norm measured no norm and
    returns NaN, with a warning saying how to have it measured; one built with max_grad_norm=1e9 returns the
    pass's norm and divides every gradient by 1, so its run is bit-identical to the first."""
    with pytest.warns(UserWarning, match=r"asks for the norm only.*returns NaN.*max_grad_norm=1e9"):
        plain = hf.train("flatopt", in_backward=True, max_grad_norm=0)
    assert len(plain["grad_norms"]) == 16 and all(math.isnan(n) for n in plain["grad_norms"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        measured = hf.train("flatopt", in_backward=True, max_grad_norm=0, options={"max_grad_norm": 1e9})
        step = hf.train("flatopt", max_grad_norm=0)
    assert_bit_identical(measured, plain, "max_grad_norm=1e9 against none")
    assert measured["grad_norms"][-1] == measured["last_grad_norm"] > 0
    torch.testing.assert_close(
        torch.tensor(measured["grad_norms"]), torch.tensor(step["grad_norms"]), atol=0, rtol=1e-5
    )


@pytest.mark.filterwarnings(NAN_NORM)
def test_hf_example_main_in_backward(hf, capsys):
    summary = hf.main(
        ["--steps", "4", "--in-backward", "--grad-accum", "2", "--max-grad-norm", "0", "--resume-at", "2"]
    )
    out = capsys.readouterr().out
    assert "flatopt.adamw.AdamW (in_backward=True)" in out and "resumed from" in out
    assert summary["flatopt"]["in_backward"] and summary["flatopt"]["accumulation_steps"] == 2
    assert summary["param_diff"] < FP32["param"] and summary["resume_diff"] == 0.0


# ------------------------------------------------------------------ Lightning, in-backward
@pytest.mark.parametrize(
    "knobs",
    [dict(), dict(scheduler=True), dict(accumulate=4), dict(precision="bf16-mixed", accumulate=4, scheduler=True)],
    ids=["plain", "scheduler", "accumulate4", "bf16-mixed-accumulate4-scheduler"],
)
def test_lightning_in_backward_without_clipping_is_step_mode_bit_for_bit(lit, knobs):
    """gradient_clip_val=None; with accumulate_grad_batches=4 the module passes accumulation_steps=4, and the
    window's last pass runs inside opt.step(closure)."""
    ours, step = lit.train("flatopt", clip=0, in_backward=True, **knobs), lit.train("flatopt", clip=0, **knobs)
    assert len(ours["losses"]) == 16 * knobs.get("accumulate", 1)
    if knobs.get("scheduler"):
        assert ours["lr"] == step["lr"] < 3e-3 / 2, "the LR scheduler did not run"
    assert_bit_identical(ours, step, f"in-backward vs step mode under Lightning, {knobs}")
    assert_learns(ours)


@pytest.mark.parametrize(
    "knobs",
    [dict(), dict(accumulate=4), dict(precision="bf16-mixed")],
    ids=["32-true", "accumulate4", "bf16-mixed"],
)
def test_lightning_in_backward_clipping_is_the_documented_method(lit, knobs):
    """gradient_clip_val=1.0, and flatopt's max_grad_norm=1.0 (from the Trainer). The module's clipping call
    returns the pass's norm (the last one is opt.last_grad_norm), equal to the norm of the reference (step
    mode, clipped as documented in configure_gradient_clipping) to float noise, and the parameters match the
    reference. Seen, over the three cases: parameters within 3.6e-7 of the reference, losses within 4.8e-7, norms
    within 4.9e-7 relative; 1.6e-3 to 5.6e-3 from torch's exact clip of the same run (in step mode or with
    torch.optim.AdamW alike); N_prev decided the clip at 9 of the 16 steps."""
    documented = ClipByMaxOfPreviousAndThisNorm(1.0)

    class Reference(lit.NextToken):
        def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
            self.grad_norms.append(float(documented(self.parameters())))

    ours = lit.train("flatopt", in_backward=True, **knobs)
    ref = lit.train("flatopt", module_cls=Reference, **knobs)
    exact = lit.train("flatopt", **knobs)  # step mode, clipped by torch.nn.utils.clip_grad_norm_
    assert len(ours["grad_norms"]) == 16 and ours["grad_norms"][-1] == ours["last_grad_norm"] > 0
    assert max(ours["grad_norms"]) > 1.0, "no step was clipped"
    assert any(documented.prev_decided), "N_prev never decided a clip: the reference is torch's exact clip"
    torch.testing.assert_close(torch.tensor(ours["grad_norms"]), torch.tensor(ref["grad_norms"]), atol=0, rtol=1e-5)
    tol = BF16 if knobs.get("precision") == "bf16-mixed" else FP32
    assert_runs_match(ours, ref, tol, f"in-backward clipping vs the documented method under Lightning, {knobs}")
    assert max_diff(ours, exact) > 100 * max_diff(ours, ref), "the method is not distinguished from torch's exact clip"
    assert_learns(ours)


def test_lightning_own_clipping_call_gets_the_pass_norm(lit):
    """Lightning's own gradient clipping (the module does not override configure_gradient_clipping; 32-true):
    its torch.nn.utils.clip_grad_norm_ call over the optimizer's parameters returns the pass's norm and clips
    nothing more, so the run is bit-identical to the one whose module makes the call itself."""
    import lightning as L

    class LightningClipping(lit.NextToken):
        configure_gradient_clipping = L.LightningModule.configure_gradient_clipping

    ours = lit.train("flatopt", in_backward=True, module_cls=LightningClipping)
    assert ours["grad_norms"] == [] and ours["last_grad_norm"] > 0
    assert_bit_identical(ours, lit.train("flatopt", in_backward=True), "Lightning's clipping call vs the module's")
    # the call reaches flatopt: another max_norm than the optimizer's is refused
    with pytest.raises(RuntimeError, match=r"max_grad_norm=0.5, norm_type=2.0\) clips its gradients in backward"):
        lit.train("flatopt", in_backward=True, module_cls=LightningClipping, options={"max_grad_norm": 0.5})


@pytest.mark.parametrize(
    "clip",
    [0, 1.0],
    ids=["no-clip", "clip"],
)
def test_lightning_in_backward_resume_is_bit_identical(lit, tmp_path, clip):
    """Resumed at step 8 (an epoch's end), with a per-step LR schedule. With clipping, step 9's norm is below
    step 8's here (checked), so the uninterrupted run clips step 9 by step 8's norm N_prev, and so does the
    resumed one: the checkpoint holds N_prev."""
    knobs = dict(in_backward=True, clip=clip, save_at=8, scheduler=True)
    whole = lit.train("flatopt", output_dir=str(tmp_path / "whole"), **knobs)
    resumed = lit.train("flatopt", resume_from=whole["checkpoint"], output_dir=str(tmp_path / "resumed"), **knobs)
    if clip:
        assert whole["grad_norms"][7] > whole["grad_norms"][8] > clip, "the data no longer exercises N_prev here"
    assert resumed["losses"] == whole["losses"][8:]
    for name, p in whole["params"].items():
        assert torch.equal(p, resumed["params"][name]), f"{name} differs after resuming at step 8"


@pytest.mark.parametrize(
    "knobs, match",
    [
        (
            dict(options={"max_grad_norm": None}),
            r"clip_grad_norm_\(max_norm=1.0, norm_type=2.0\) cannot clip the gradients.*Pass max_grad_norm=1.0 .*"
            r"gradient_clip_val=None in Lightning's Trainer",
        ),
        (
            dict(clip=0, accumulate=4, options={"accumulation_steps": 1}),
            r"a second backward pass started with neither opt.step\(\) nor opt.zero_grad\(\).*Lightning's "
            r"accumulate_grad_batches=k.*Nothing was updated by this backward pass",
        ),
    ],
    ids=["clip-without-max_grad_norm", "accumulate-without-accumulation_steps"],
)
def test_lightning_in_backward_refusals(lit, knobs, match):
    with pytest.raises(RuntimeError, match=match):
        lit.train("flatopt", in_backward=True, **knobs)


def test_lightning_example_main_in_backward(lit, capsys):
    summary = lit.main(["--steps", "8", "--in-backward", "--accumulate", "2", "--clip", "0", "--resume-at", "4"])
    out = capsys.readouterr().out
    assert "flatopt.adamw.AdamW (in_backward=True)" in out and "resumed from" in out
    assert summary["param_diff"] < FP32["param"] and summary["resume_diff"] == 0.0
