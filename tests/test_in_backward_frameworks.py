"""In-backward mode in the loops frameworks drive: gradient accumulation the user cannot wrap in no_step()
(``accumulation_steps``), clipping by the global norm in backward (``max_grad_norm``), and the calls of
``torch.nn.utils.clip_grad_norm_`` frameworks make after backward, which must clip for real, return the
norm the optimizer clipped by, or raise before anything changes; never find no gradient and clip nothing.

The loops are written as transformers' Trainer drives them (backward per micro-batch, clip, ``step()``,
``model.zero_grad()``) and as Lightning does (``zero_grad()`` at a window's start, the last micro-batch's
forward and backward inside ``opt.step(closure)``, clipping inside the closure), with torch.optim as the
reference."""

import copy
import gc
import io
import math
import warnings

import pytest
import torch
from conftest import device_for
from test_in_backward_semantics import PAIRS, TORCH_TOL  # the same optimizers and tolerance
from torch import nn
from torch.utils.checkpoint import checkpoint

import flatopt
from flatopt import clip_patch


class MLP(nn.Module):
    """Weights of 63, 99 and 33 elements (none a multiple of 64: copied into staging gradients, each a bucket
    of its own at bucket_size=200) and biases that share a bucket there; sizes that are not multiples of any
    block size."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(7, 9), nn.Linear(9, 11), nn.Linear(11, 3)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def batches(n, device="cpu", scales=None):
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(5, 7, generator=gen), torch.randn(5, 3, generator=gen)) for _ in range(n)]
    scales = scales or [1.0] * n
    return [(x.to(device), y.to(device), s) for (x, y), s in zip(data, scales)]


def loss_of(model, batch, k=1):
    x, y, scale = batch
    return scale * nn.functional.mse_loss(model(x), y) / k  # frameworks divide the loss by k themselves


def windows(n, k):
    """The windows of an epoch of ``n`` micro-batches, ``k`` per optimizer step (the last one may be short)."""
    return [list(range(i, min(i + k, n))) for i in range(0, n, k)]


def assert_matches(ours, theirs, opt_ours, opt_theirs, what):
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, **TORCH_TOL, msg=lambda m: f"{what}, {name}: {m}")
        for key, value in opt_theirs.state.get(q, {}).items():
            torch.testing.assert_close(
                opt_ours.state[p][key].float(), value.float(), **TORCH_TOL, msg=lambda m: f"{what}, {name}.{key}: {m}"
            )


def run_epoch(model, opt, data, k, style, clip=None):
    """One epoch in windows of ``k`` micro-batches, as transformers' Trainer (``"hf"``) or Lightning drives it.
    ``clip``: the max_norm the framework clips by before the step (None: no clipping). Returns the norms the
    clipping calls returned."""
    norms = []
    for window in windows(len(data), k):
        if style == "hf":
            for i in window:
                loss_of(model, data[i], k).backward()
            if clip is not None:
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
            opt.step()
            model.zero_grad()
        else:
            opt.zero_grad()
            for i in window[:-1]:
                loss_of(model, data[i], k).backward()

            def closure(i=window[-1]):
                loss = loss_of(model, data[i], k)
                loss.backward()
                if clip is not None:  # Lightning clips inside the closure it hands to step()
                    params = (p for g in opt.param_groups for p in g["params"])
                    norms.append(torch.nn.utils.clip_grad_norm_(params, clip))
                return loss

            opt.step(closure)
    return norms


# ---------------------------------------------------------------------- accumulation_steps


@pytest.mark.parametrize("style", ["hf", "lightning"])
@pytest.mark.parametrize("opt", list(PAIRS))
def test_accumulation_steps_match_torch_optim_accumulating_the_same_way(backend, opt, style):
    """k=4 over epochs of 10 micro-batches (windows of 4, 4 and a short 2, which step() steps), 3 epochs."""
    torch.manual_seed(0)
    device = device_for(backend)
    model = MLP().to(device)
    twin = copy.deepcopy(model)
    make_ours, make_theirs = PAIRS[opt]
    theirs = make_theirs(model.parameters())
    ours = make_ours(twin, in_backward=True, accumulation_steps=4, bucket_size=100, backend=backend)
    data = batches(10, device)
    for epoch in range(1, 4):
        run_epoch(model, theirs, data, 4, style)
        run_epoch(twin, ours, data, 4, style)
        assert_matches(twin, model, ours, theirs, f"epoch {epoch}")
    assert {float(ours.state[p]["step"]) for p in twin.parameters() if "step" in ours.state[p]} <= {9.0}


def test_the_first_passes_of_a_window_accumulate_and_the_last_steps_with_the_sum():
    torch.manual_seed(0)
    model = MLP()
    twin = copy.deepcopy(model)
    ours = flatopt.AdamW(twin, lr=1e-2, in_backward=True, accumulation_steps=3, bucket_size=100)
    data = batches(3)
    before = [p.detach().clone() for p in twin.parameters()]
    for i in range(2):
        loss_of(twin, data[i], 3).backward()
        assert all(torch.equal(p.detach(), b) for p, b in zip(twin.parameters(), before)), f"pass {i + 1} stepped"
        loss_of(model, data[i], 3).backward()
        for (name, p), q in zip(twin.named_parameters(), model.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=0, rtol=0, msg=lambda m: f"pass {i + 1}, {name}: {m}")
    loss_of(twin, data[2], 3).backward()
    assert all(p.grad is None for p in twin.parameters()), "the window's last pass frees the gradients"
    assert all(not torch.equal(p.detach(), b) for p, b in zip(twin.parameters(), before))
    assert {float(ours.state[p]["step"]) for p in twin.parameters()} == {1.0}
    after = [p.detach().clone() for p in twin.parameters()]
    ours.step()  # a full window: nothing left to step
    assert all(torch.equal(p.detach(), a) for p, a in zip(twin.parameters(), after))


def test_a_pass_beyond_the_window_is_refused_before_it_updates_anything():
    """accumulation_steps=2 while the loop accumulates 3: the third pass, the first of the loop's window to
    come after the optimizer stepped, is refused at its first gradient."""
    torch.manual_seed(0)
    model = MLP()
    opt = flatopt.SGD(model, lr=0.1, momentum=0.9, in_backward=True, accumulation_steps=2, bucket_size=100)
    data = batches(3)
    loss_of(model, data[0]).backward()
    loss_of(model, data[1]).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(
        RuntimeError, match=r"accumulation_steps=2\): backward pass 3 of a window.*pass accumulation_steps=k"
    ):
        loss_of(model, data[2]).backward()
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters()), "the refused pass left a gradient"
    opt.zero_grad()  # a new window
    loss_of(model, data[2]).backward()
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before)), "the first pass stepped"


def test_zero_grad_starts_a_new_window_and_drops_what_was_accumulated():
    torch.manual_seed(0)
    model = MLP()
    twin = copy.deepcopy(model)
    theirs = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ours = flatopt.AdamW(twin, lr=1e-2, in_backward=True, accumulation_steps=2)
    data = batches(3)
    for m, o in ((model, theirs), (twin, ours)):
        loss_of(m, data[0], 2).backward()
        o.zero_grad()
        loss_of(m, data[1], 2).backward()
        loss_of(m, data[2], 2).backward()
        o.step()
    assert_matches(twin, model, ours, theirs, "after the window")
    assert {float(ours.state[p]["step"]) for p in twin.parameters()} == {1.0}


def test_passes_under_no_step_are_not_counted():
    torch.manual_seed(0)
    model = MLP()
    twin = copy.deepcopy(model)
    theirs = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ours = flatopt.SGD(twin, lr=0.05, momentum=0.9, in_backward=True, accumulation_steps=2)
    data = batches(4)
    for m, o in ((model, theirs), (twin, ours)):
        with ours.no_step():
            loss_of(m, data[0]).backward()
            loss_of(m, data[1]).backward()
        loss_of(m, data[2]).backward()
        loss_of(m, data[3]).backward()
        o.step()
    assert_matches(twin, model, ours, theirs, "after the window")


@pytest.mark.parametrize("segment", ["middle", "head"])
def test_reentrant_checkpointing_in_an_accumulation_window_is_refused_before_any_update(segment):
    """The nested pass's gradients come after the outer pass's first ones (a checkpointed middle layer), or
    first (a checkpointed head): refused at once, nothing updated, the window's gradients left in .grad."""
    torch.manual_seed(0)
    model = MLP()
    opt = flatopt.AdamW(model, lr=1e-2, in_backward=True, accumulation_steps=2)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(4, 7)

    def forward(reentrant):
        h = torch.tanh(model.a(x))
        if segment == "middle":
            return model.c(checkpoint(lambda h: torch.tanh(model.b(h)), h, use_reentrant=reentrant))
        return checkpoint(lambda h: model.c(torch.tanh(model.b(h))), h, use_reentrant=reentrant)

    with pytest.raises(RuntimeError, match=r"accumulation_steps=2\): .*use_reentrant=False.*No parameter was updated"):
        forward(True).sum().backward()
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    for _ in range(2):
        forward(False).sum().backward()
    assert all(not torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))


# ---------------------------------------------------------------------- max_grad_norm: the stated method


def combine(a, b, norm_type):
    return torch.linalg.vector_norm(torch.stack([a, b]), norm_type)


def bucket_order(arrivals, buckets):
    """The order the buckets are stepped in: each as soon as its last gradient arrived, the rest at the end."""
    arrived, order = set(), []
    for p in arrivals:
        arrived.add(p)
        for b in buckets:
            if b not in order and any(p is q for q in b.params) and all(q in arrived for q in b.params):
                order.append(b)
    return order + [b for b in buckets if b not in order]


def clip_as_documented(grads, order, c, norm_type, prev):
    """docs/in-backward.md, "Clipping": each bucket's gradients multiplied, in the order the buckets are stepped,
    by min(1, c / (n + 1e-6)) with n = max(previous pass's total norm, norm of the buckets so far, this one
    included); returns the pass's total norm and the coefficients."""
    running, coefs = None, []
    for names in order:
        norm = torch.linalg.vector_norm(torch.cat([grads[n].flatten() for n in names]), norm_type)
        running = norm if running is None else combine(running, norm, norm_type)
        n = running if prev is None else torch.maximum(prev, running)
        coef = torch.clamp(c / (n + 1e-6), max=1.0)
        coefs.append(float(coef))
        for name in names:
            grads[name].mul_(coef)
    return running, coefs


def clipped_pair(opt, backend="torch", **kwargs):
    """torch.optim over a model, flatopt in in-backward mode over a copy, and a list that the copy's gradients
    are recorded into in the order they arrive (hooks registered before the optimizer's run before them)."""
    torch.manual_seed(0)
    device = device_for(backend)
    model = MLP().to(device)
    twin = copy.deepcopy(model)
    arrivals = []
    for p in twin.parameters():
        p.register_post_accumulate_grad_hook(arrivals.append)
    make_ours, make_theirs = PAIRS[opt]
    ours = make_ours(twin, in_backward=True, bucket_size=200, backend=backend, **kwargs)
    return model, make_theirs(model.parameters()), twin, ours, arrivals


def names_of(model):
    return {p: n for n, p in model.named_parameters()}


@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0])
@pytest.mark.parametrize("opt", list(PAIRS))
def test_max_grad_norm_clips_each_bucket_as_documented(backend, opt, norm_type):
    """Several buckets (each weight its own, the biases shared), 8 passes; the loss is 30 times larger at pass
    3, so at pass 4 the previous pass's norm dominates the running norm: checked to change the coefficients,
    so that a clip that ignores it fails here."""
    c = {2.0: 0.05, math.inf: 0.01, 1.0: 0.2}[norm_type]
    model, theirs, twin, ours, arrivals = clipped_pair(opt, backend, max_grad_norm=c, norm_type=norm_type)
    buckets = flatopt.inspect(ours).engine.buckets
    assert len(buckets) >= 4 and any(len(b.params) > 1 for b in buckets)
    name, ref_params = names_of(twin), dict(model.named_parameters())
    data = batches(8, device_for(backend), scales=[1, 1, 30, 1, 1, 0.2, 1, 1])
    prev, prev_mattered, clipped = None, False, False
    for step, batch in enumerate(data, 1):
        arrivals.clear()
        loss_of(twin, batch).backward()
        ours.step()
        loss_of(model, batch).backward()
        grads = {n: q.grad for n, q in ref_params.items()}
        order = [[name[p] for p in b.params] for b in bucket_order(arrivals, buckets)]
        if prev is not None:
            alone = {n: g.clone() for n, g in grads.items()}
            _, without_prev = clip_as_documented(alone, order, c, norm_type, None)
        total, coefs = clip_as_documented(grads, order, c, norm_type, prev)
        if prev is not None and max(abs(a - b) for a, b in zip(coefs, without_prev)) > 1e-3:
            prev_mattered = True
        clipped |= min(coefs) < 0.99
        theirs.step()
        theirs.zero_grad()
        torch.testing.assert_close(ours.last_grad_norm, total, **TORCH_TOL, msg=lambda m: f"step {step} norm: {m}")
        assert_matches(twin, model, ours, theirs, f"step {step}")
        prev = total
    assert clipped and prev_mattered, "the data did not exercise the method"


def test_max_grad_norm_with_accumulation_clips_the_window_sum_and_step_clips_a_short_window_exactly():
    """k=3 over 8 micro-batches: two full windows clipped in backward on the accumulated sum (the second by the
    first's total norm too), then a short window of 2 that step() steps, clipped by the total norm as
    torch.nn.utils.clip_grad_norm_ clips."""
    c, k = 0.05, 3
    model, theirs, twin, ours, arrivals = clipped_pair("adamw", max_grad_norm=c, accumulation_steps=k)
    buckets = flatopt.inspect(ours).engine.buckets
    name, ref_params = names_of(twin), dict(model.named_parameters())
    data = batches(8, scales=[1, 1, 1, 5, 5, 5, 1, 1])
    prev = None
    for number, window in enumerate(windows(len(data), k), 1):
        for i in window:
            arrivals.clear()
            loss_of(twin, data[i], k).backward()
            loss_of(model, data[i], k).backward()
        if len(window) == k:
            grads = {n: q.grad for n, q in ref_params.items()}
            order = [[name[p] for p in b.params] for b in bucket_order(arrivals, buckets)]
            prev, _ = clip_as_documented(grads, order, c, 2.0, prev)
        else:
            prev = torch.nn.utils.clip_grad.clip_grad_norm_.__wrapped__(model.parameters(), c)
        ours.step()
        theirs.step()
        theirs.zero_grad()
        torch.testing.assert_close(ours.last_grad_norm, prev, **TORCH_TOL, msg=lambda m: f"window {number}: {m}")
        assert_matches(twin, model, ours, theirs, f"window {number}")


# ---------------------------------------------------------------------- max_grad_norm: N_prev in checkpoints
# The loss is 30 times smaller from pass 4 on: pass 4's norm is below pass 3's, so N_prev decides its clip.
RESUME_SCALES = [1, 1, 30, 0.03, 0.03, 1]


def clipped(dtype=torch.float32, backend="torch", **kwargs):
    """A model and its in-backward SGD with max_grad_norm (SGD's update is linear in the clip coefficient)."""
    torch.manual_seed(0)
    model = MLP().to(device_for(backend), dtype)
    options = dict(in_backward=True, bucket_size=200, backend=backend, max_grad_norm=0.05)
    return model, PAIRS["sgd"][0](model, **{**options, **kwargs})


def run_passes(model, opt, data):
    """One stepped pass per batch; the total norm of each (opt.last_grad_norm)."""
    dtype, norms = next(model.parameters()).dtype, []
    for x, y, scale in data:
        loss_of(model, (x.to(dtype), y.to(dtype), scale)).backward()
        opt.step()
        opt.zero_grad()
        norms.append(opt.last_grad_norm)
    return norms


def saved_and_loaded(state_dict):
    """``state_dict`` through torch.save and torch.load, as a checkpoint file holds it."""
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf)


def resumed_from(model, opt_state, backend="torch", **kwargs):
    twin, opt = clipped(next(model.parameters()).dtype, backend, **kwargs)
    twin.load_state_dict(model.state_dict())
    opt.load_state_dict(opt_state)
    return twin, opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_a_resumed_run_is_clipped_by_the_saved_previous_norm_bit_for_bit(backend, norm_type, dtype):
    """state_dict() after pass 3 holds N_prev (pass 3's total norm, a CPU tensor of the norms' dtype) in its
    "flatopt" entry; the run resumed from it (through torch.save) ends bit-identical to the uninterrupted one,
    whose pass 4 is clipped by N_prev (checked: its own norm is smaller)."""
    data = batches(6, device_for(backend), scales=RESUME_SCALES)
    model, opt = clipped(dtype, backend, norm_type=norm_type)
    norms = run_passes(model, opt, data[:3])
    saved = opt.state_dict()
    prev = saved["flatopt"]["clip"]["prev_norm"]
    assert saved["flatopt"]["clip"]["norm_type"] == norm_type and set(saved["flatopt"]) == {"clip"}
    assert prev.device.type == "cpu" and prev.dtype == dtype and torch.equal(prev, norms[-1].cpu())
    twin, resumed = resumed_from(model, saved_and_loaded(saved), backend, norm_type=norm_type)
    assert torch.equal(resumed.last_grad_norm, norms[-1]) and resumed.last_grad_norm.device == norms[-1].device
    whole = run_passes(model, opt, data[3:])
    assert float(whole[0]) < float(norms[-1]), "the data no longer lets N_prev decide the first pass after resuming"
    again = run_passes(twin, resumed, data[3:])
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), f"{name} differs by {(p - q).abs().max()} after resuming"
    assert [float(n) for n in again] == [float(n) for n in whole]


def test_state_dict_holds_no_previous_norm_before_the_first_stepped_pass_nor_without_max_grad_norm():
    """Default storage options: no "flatopt" entry, as torch.optim's state dict, until a pass was clipped."""
    model, opt = clipped()
    assert "flatopt" not in opt.state_dict()
    run_passes(model, opt, batches(1))
    assert "clip" in opt.state_dict()["flatopt"]
    model, opt = clipped(max_grad_norm=None)
    run_passes(model, opt, batches(1))
    assert "flatopt" not in opt.state_dict()


def bad_clip_entries():
    good = torch.tensor(0.5)
    return {
        "not_a_dict": (0.5, r"'flatopt' 'clip' float"),
        "missing_norm": ({"norm_type": 2.0}, r"'flatopt' 'clip' \['norm_type'\]"),
        "norm_type": ({"norm_type": 3.0, "prev_norm": good}, r"'norm_type' 3.0; it is one of"),
        "float": ({"norm_type": 2.0, "prev_norm": 0.5}, r"'prev_norm' as a float; it is a one-element floating"),
        "integer": ({"norm_type": 2.0, "prev_norm": torch.tensor(1)}, r"'prev_norm' as a torch.strided torch.int64"),
        "two_elements": ({"norm_type": 2.0, "prev_norm": torch.ones(2)}, r"'prev_norm' as .* of shape \(2,\)"),
        "meta": ({"norm_type": 2.0, "prev_norm": torch.empty((), device="meta")}, r"'prev_norm' as .* on meta"),
        "negative": ({"norm_type": 2.0, "prev_norm": torch.tensor(-1.0)}, r"'prev_norm' -1.0; a norm is >= 0"),
        "nan": ({"norm_type": 2.0, "prev_norm": torch.tensor(float("nan"))}, r"'prev_norm' nan; a norm is >= 0"),
    }


@pytest.mark.parametrize("case", list(bad_clip_entries()))
def test_load_of_a_bad_previous_norm_is_refused_and_changes_nothing(case):
    """The entry is checked with everything else, before anything changes: the optimizer keeps its states, hyper-
    parameters and N_prev, and its next pass is the one it would have taken."""
    entry, match = bad_clip_entries()[case]
    data = batches(5, scales=RESUME_SCALES[1:])
    model, opt = clipped()
    run_passes(model, opt, data[:2])
    saved = opt.state_dict()
    bad = copy.deepcopy(saved)
    bad["flatopt"]["clip"] = entry
    bad["param_groups"][0]["lr"] = 0.5
    for entry_state in bad["state"].values():
        entry_state["momentum_buffer"] = entry_state["momentum_buffer"] + 1
    twin, same = resumed_from(model, saved)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(bad)
    assert opt.param_groups[0]["lr"] == same.param_groups[0]["lr"]
    assert torch.equal(opt.last_grad_norm, same.last_grad_norm)
    run_passes(model, opt, data[2:])
    run_passes(twin, same, data[2:])
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), f"{name}: the refused load changed something"


@pytest.mark.parametrize("source", ["older_flatopt", "torch_optim"])
def test_a_state_dict_without_the_previous_norm_leaves_it_unknown(source):
    """An older flatopt state dict (no "clip" in its "flatopt" entry) or torch.optim's, loaded into an optimizer
    that has clipped passes of its own: N_prev is unknown, as at a run's start (opt.last_grad_norm is None), so
    the next pass is clipped by its own norm, as in a new optimizer that loads the same state dict."""
    data = batches(6, scales=RESUME_SCALES)
    model, opt = clipped()
    before = run_passes(model, opt, data[:3])
    if source == "torch_optim":
        ref = PAIRS["sgd"][1](model.parameters())
        ref.load_state_dict(opt.state_dict())
        saved = ref.state_dict()
    else:
        saved = opt.state_dict()
        del saved["flatopt"]["clip"]
    assert "clip" not in saved.get("flatopt", {})
    fresh_model, fresh = resumed_from(model, saved)
    opt.load_state_dict(saved)
    assert opt.last_grad_norm is None and fresh.last_grad_norm is None
    first = run_passes(model, opt, data[3:])
    run_passes(fresh_model, fresh, data[3:])
    for (name, p), q in zip(model.named_parameters(), fresh_model.parameters()):
        assert torch.equal(p, q), f"{name}: the optimizer kept its own N_prev"
    assert float(first[0]) < float(before[-1]), "the data no longer lets N_prev decide the pass after loading"


def loaded_into(target, params):
    """An SGD like :func:`clipped`'s, but in step mode, without max_grad_norm, or with another norm or threshold."""
    if target == "step_mode":
        return PAIRS["sgd"][0](params, backend="torch")
    options = dict(in_backward=True, bucket_size=200, backend="torch", max_grad_norm=0.05)
    options.update(
        {
            "in_backward_without_max_grad_norm": dict(max_grad_norm=None),
            "another_norm_type": dict(norm_type=math.inf),
            "another_max_grad_norm": dict(max_grad_norm=0.5),
        }[target]
    )
    return PAIRS["sgd"][0](params, **options)


@pytest.mark.parametrize(
    "target", ["step_mode", "in_backward_without_max_grad_norm", "another_norm_type", "another_max_grad_norm"]
)
def test_a_saved_previous_norm_is_taken_only_by_in_backward_clipping_of_the_same_norm_type(target):
    """N_prev is a norm of one order: an optimizer that clips in backward by a norm of another order starts with
    it unknown; one that does not clip in backward (step mode, or no max_grad_norm) has no use for it and loads
    the rest, as torch.optim ignores the entry; one with another max_grad_norm takes it (a norm does not depend
    on the threshold)."""
    model, opt = clipped()
    run_passes(model, opt, batches(3, scales=RESUME_SCALES))
    saved = opt.state_dict()
    assert "clip" in saved["flatopt"]
    torch.manual_seed(0)
    twin = MLP()
    loaded = loaded_into(target, twin)
    loaded.load_state_dict(saved)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(opt.state[p]["momentum_buffer"], loaded.state[q]["momentum_buffer"])
    if target == "another_max_grad_norm":
        assert torch.equal(loaded.last_grad_norm, opt.last_grad_norm)
        assert torch.equal(loaded.state_dict()["flatopt"]["clip"]["prev_norm"], saved["flatopt"]["clip"]["prev_norm"])
    else:
        assert loaded.last_grad_norm is None
        assert "flatopt" not in loaded.state_dict()


# ---------------------------------------------------------------------- torch.nn.utils.clip_grad_norm_ in frameworks


@pytest.mark.parametrize("style", ["hf", "lightning"])
def test_a_framework_clipping_by_the_optimizers_max_grad_norm_gets_the_norm_it_was_clipped_by(style):
    c, k = 0.05, 2
    model, theirs, twin, ours, arrivals = clipped_pair("adamw", max_grad_norm=c, accumulation_steps=k)
    data = batches(6)
    norms = run_epoch(twin, ours, data, k, style, clip=c)
    assert len(norms) == 3
    torch.testing.assert_close(norms[-1], ours.last_grad_norm, atol=0, rtol=0)
    assert norms[-1] is not ours.last_grad_norm, "a copy: the caller may change it"
    assert all(n.dim() == 0 and n.dtype == torch.float32 and float(n) > c for n in norms)


@pytest.mark.parametrize("style", ["hf", "lightning"])
def test_a_framework_clipping_an_unclipped_optimizer_raises_at_the_first_step(style):
    """Trainer's default max_grad_norm=1.0 with an optimizer built without max_grad_norm: the first clipping
    call raises before anything else changes (after the one in-backward update nothing could prevent)."""
    model, theirs, twin, ours, arrivals = clipped_pair("adamw")
    batch = batches(1)[0]
    seen = {}

    def backward_then_clip():
        loss_of(twin, batch).backward()
        seen["state"] = {n: {k: v.clone() for k, v in ours.state[p].items()} for n, p in twin.named_parameters()}
        seen["params"] = [p.detach().clone() for p in twin.parameters()]
        torch.nn.utils.clip_grad_norm_(twin.parameters() if style == "hf" else ours.param_groups[0]["params"], 1.0)

    with pytest.raises(
        RuntimeError,
        match=r"clip_grad_norm_\(max_norm=1.0, norm_type=2.0\) cannot clip the gradients: the backward pass applied "
        r"them.*Pass max_grad_norm=1.0.*max_grad_norm=0 in transformers' TrainingArguments.*gradient_clip_val=None",
    ):
        if style == "hf":
            backward_then_clip()
        else:
            ours.step(backward_then_clip)
    assert all(torch.equal(p.detach(), b) for p, b in zip(twin.parameters(), seen["params"]))
    for n, p in twin.named_parameters():
        assert all(torch.equal(ours.state[p][key], v) for key, v in seen["state"][n].items()), n


def test_a_different_max_norm_or_norm_type_is_refused():
    model, theirs, twin, ours, arrivals = clipped_pair("adamw", max_grad_norm=0.5)
    loss_of(twin, batches(1)[0]).backward()
    for args in [(1.0,), (0.5, math.inf)]:
        with pytest.raises(RuntimeError, match=r"max_grad_norm=0.5, norm_type=2.0\) clips its gradients in backward"):
            torch.nn.utils.clip_grad_norm_(twin.parameters(), *args)
        with pytest.raises(RuntimeError, match=r"max_grad_norm=0.5, norm_type=2.0\) clips its gradients in backward"):
            ours.clip_grad_norm_(*args)
    torch.testing.assert_close(ours.clip_grad_norm_(0.5), ours.last_grad_norm, atol=0, rtol=0)
    torch.testing.assert_close(torch.nn.utils.clip_grad.clip_grad_norm_(twin.b.weight, 0.5), ours.last_grad_norm)


def test_error_if_nonfinite_after_a_pass_with_a_nonfinite_norm():
    model, theirs, twin, ours, arrivals = clipped_pair("sgd", max_grad_norm=1.0)
    x, y, _ = batches(1)[0]
    nn.functional.mse_loss(twin(x), y).mul(float("inf")).backward()
    assert not torch.isfinite(ours.last_grad_norm)
    assert not torch.isfinite(torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0))
    with pytest.raises(RuntimeError, match="is non-finite, so it cannot be clipped.*already updated the parameters"):
        torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0, error_if_nonfinite=True)


def test_a_call_in_the_middle_of_a_window_clips_the_gradients_in_grad():
    """Not made by frameworks, whose windows match accumulation_steps; by a loop with a longer one here. The
    gradients are in .grad: torch's call clips them for real (no max_grad_norm), or the optimizer clips them
    when step() steps them (max_grad_norm, the same value: the call returns their norm and changes nothing)."""
    data = batches(2)
    for kwargs in ({}, {"max_grad_norm": 0.05}):
        model, theirs, twin, ours, arrivals = clipped_pair("adamw", accumulation_steps=4, **kwargs)
        for m in (model, twin):
            for batch in data:
                loss_of(m, batch, 2).backward()
        grads = [p.grad.clone() for p in twin.parameters()]
        expected = torch.nn.utils.clip_grad.clip_grad_norm_.__wrapped__(model.parameters(), 0.05)
        norm = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.05)
        torch.testing.assert_close(norm, expected, **TORCH_TOL)
        if kwargs:
            assert all(torch.equal(p.grad, g) for p, g in zip(twin.parameters(), grads)), "changed the gradients"
        theirs.step()
        ours.step()
        assert_matches(twin, model, ours, theirs, f"after step(), {kwargs}")


def with_grads(model):
    twin = copy.deepcopy(model)
    for p, q in zip(twin.parameters(), model.parameters()):
        p.grad = q.grad.clone()
    return twin


def test_unpatched_results_for_parameters_of_no_in_backward_optimizer():
    """Ordinary models go to torch's function unchanged, while an in-backward optimizer lives: same norm, same
    clipped gradients, a generator or a single tensor as torch takes them, the same error for a non-finite norm."""
    torch.manual_seed(0)
    keep = flatopt.SGD(MLP(), lr=0.1, in_backward=True)  # noqa: F841 (live: the wrapper looks at every call)
    original = clip_patch.original("clip_grad_norm_")
    wrapper = torch.nn.utils.clip_grad_norm_
    assert wrapper is not original and wrapper.__wrapped__ is original
    assert torch.nn.utils.clip_grad.clip_grad_norm_ is wrapper
    assert wrapper.__name__ == "clip_grad_norm_" and wrapper.__doc__ == original.__doc__
    model = MLP()
    loss_of(model, batches(1)[0]).backward()
    for make_args, kwargs in [
        (lambda m: (m.parameters(), 0.05), {}),
        (lambda m: (list(m.parameters()), 0.3, 1.0), {"foreach": False}),
        (lambda m: (m.a.weight, 0.01), {"norm_type": math.inf}),
    ]:
        ours, theirs = with_grads(model), with_grads(model)
        got = wrapper(*make_args(ours), **kwargs)
        expected = original(*make_args(theirs), **kwargs)
        assert torch.equal(got, expected)
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(ours.parameters(), theirs.parameters()))
    model.a.weight.grad[0, 0] = float("nan")
    messages = []
    for fn in (wrapper, original):
        with pytest.raises(RuntimeError, match="non-finite") as info:
            fn(with_grads(model).parameters(), 1.0, error_if_nonfinite=True)
        messages.append(str(info.value))
    assert messages[0] == messages[1]
    with pytest.raises(TypeError):
        wrapper(model.parameters())  # max_norm missing: torch's own error


def test_clip_grad_value_after_an_in_backward_pass_is_refused():
    model, theirs, twin, ours, arrivals = clipped_pair("adamw", accumulation_steps=2)
    data = batches(2)
    loss_of(twin, data[0]).backward()
    torch.nn.utils.clip_grad_value_(twin.parameters(), 1e-4)  # in .grad, not yet stepped: clipped for real
    assert max(float(p.grad.abs().max()) for p in twin.parameters()) <= 1e-4
    loss_of(twin, data[1]).backward()
    with pytest.raises(RuntimeError, match="clip_grad_value_ cannot clip the gradients.*register_post_accumulate"):
        torch.nn.utils.clip_grad_value_(twin.parameters(), 1e-4)


HALVES = pytest.mark.skipif(
    not hasattr(torch.nn.utils, "clip_grads_with_norm_"),
    reason="torch.nn.utils.get_total_norm and clip_grads_with_norm_ are torch 2.6 and later",
)


@HALVES
def test_the_halves_of_clip_grad_norm_after_an_in_backward_pass_warn_or_refuse():
    """torch's get_total_norm(grads) and clip_grads_with_norm_(params, max_norm, total) after a stepped pass: the
    first, given no gradient, warns that its 0 is not the pass's norm; the second is refused, or does nothing
    where the optimizer clipped in backward by the same max_norm. On gradients still in .grad both are torch's."""
    model, theirs, twin, ours, arrivals = clipped_pair("adamw", accumulation_steps=2)
    data = batches(2)
    loss_of(twin, data[0]).backward()  # in .grad, not yet stepped: torch's functions, for real
    grads = [p.grad for p in twin.parameters()]
    total = torch.nn.utils.get_total_norm(grads)
    torch.testing.assert_close(total, clip_patch.original("clip_grad_norm_")(with_grads(twin).parameters(), 1e9))
    torch.nn.utils.clip_grads_with_norm_(twin.parameters(), 1e-4, total)
    assert max(float(p.grad.norm()) for p in twin.parameters()) <= 1.1e-4
    loss_of(twin, data[1]).backward()  # stepped, and the gradients freed
    with pytest.warns(UserWarning, match=r"get_total_norm\(\) was given no gradient: AdamW\(in_backward=True\)"):
        assert float(torch.nn.utils.get_total_norm([p.grad for p in twin.parameters() if p.grad is not None])) == 0
    values = [p.detach().clone() for p in twin.parameters()]
    with pytest.raises(RuntimeError, match=r"\): clip_grads_with_norm_\(max_norm=1.0\) cannot clip the gradients"):
        torch.nn.utils.clip_grads_with_norm_(twin.parameters(), torch.tensor(1.0), torch.tensor(5.0))
    assert all(torch.equal(p, v) for p, v in zip(twin.parameters(), values))
    assert torch.nn.utils.clip_grads_with_norm_(twin.parameters(), math.inf, torch.tensor(5.0)) is None  # a no-op

    clipped = MLP()
    opt = flatopt.AdamW(clipped, in_backward=True, max_grad_norm=1.0)
    loss_of(clipped, data[0]).backward()
    assert torch.nn.utils.clip_grads_with_norm_(clipped.parameters(), 1.0, opt.last_grad_norm) is None
    with pytest.raises(RuntimeError, match=r"max_grad_norm=1.0, norm_type=2.0\) clips .* clip_grads_with_norm_\(max"):
        torch.nn.utils.clip_grads_with_norm_(clipped.parameters(), 0.5, opt.last_grad_norm)
    opt.zero_grad()
    with opt.no_step():  # gradients in .grad, which the optimizer clips when it steps them: left as they are
        loss_of(clipped, data[1]).backward()
    held = [p.grad.clone() for p in clipped.parameters()]
    assert torch.nn.utils.clip_grads_with_norm_(clipped.parameters(), 1.0, torch.tensor(50.0)) is None
    assert all(torch.equal(p.grad, g) for p, g in zip(clipped.parameters(), held))
    with pytest.raises(RuntimeError, match=r"clip_grads_with_norm_\(max_norm=0.5\) asks for another clipping"):
        torch.nn.utils.clip_grads_with_norm_(clipped.parameters(), 0.5, torch.tensor(50.0))


@HALVES
def test_the_halves_of_clip_grad_norm_are_torchs_for_other_models():
    gc.collect()  # in-backward optimizers of earlier tests, which would count as having stepped a pass
    keep = flatopt.SGD(MLP(), lr=0.1, in_backward=True)  # noqa: F841 (live: the wrappers look at every call)
    model = MLP()
    loss_of(model, batches(1)[0]).backward()
    ours, theirs = with_grads(model), with_grads(model)
    wrapped, original = torch.nn.utils.get_total_norm, clip_patch.original("get_total_norm")
    assert wrapped is not original and wrapped.__wrapped__ is original
    a = wrapped(p.grad for p in ours.parameters())  # a generator, as torch takes it
    b = original([p.grad for p in theirs.parameters()])
    assert torch.equal(a, b)
    torch.nn.utils.clip_grads_with_norm_(ours.parameters(), 0.05, a)
    clip_patch.original("clip_grads_with_norm_")(theirs.parameters(), 0.05, b)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(ours.parameters(), theirs.parameters()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert float(wrapped([])) == 0  # no in-backward optimizer has stepped a pass: no warning


def test_parameters_of_several_optimizers_or_with_others_are_refused():
    torch.manual_seed(0)
    one, two, other = MLP(), MLP(), MLP()
    opt_one = flatopt.AdamW(one, in_backward=True, max_grad_norm=1.0)
    opt_two = flatopt.AdamW(two, in_backward=True, max_grad_norm=1.0)
    batch = batches(1)[0]
    for m in (one, two, other):
        loss_of(m, batch).backward()
    with pytest.raises(RuntimeError, match="belong to 2 in-backward optimizers"):
        torch.nn.utils.clip_grad_norm_([*one.parameters(), *two.parameters()], 1.0)
    grads = [p.grad.clone() for p in other.parameters()]
    with pytest.raises(RuntimeError, match="mix those of AdamW.*with 6 other parameter"):
        torch.nn.utils.clip_grad_norm_([*one.parameters(), *other.parameters()], 1.0)
    assert all(torch.equal(p.grad, g) for p, g in zip(other.parameters(), grads)), "changed the other gradients"
    assert opt_one.last_grad_norm is not None and opt_two.last_grad_norm is not None


def test_an_optimizer_garbage_collected_leaves_the_registry():
    torch.manual_seed(0)
    model = MLP()
    opt = flatopt.AdamW(model, in_backward=True)
    loss_of(model, batches(1)[0]).backward()
    with pytest.raises(RuntimeError, match="cannot clip the gradients"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    del opt
    gc.collect()
    assert clip_patch.owner(list(model.parameters()), "clip_grad_norm_") is None
    loss_of(model, batches(1)[0]).backward()  # no optimizer: autograd accumulates as usual
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    torch.testing.assert_close(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3), expected)
    torch.testing.assert_close(
        torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])),
        torch.tensor(1e-3),
        atol=1e-7,
        rtol=1e-4,
    )  # clipped for real


def test_parameters_laid_out_anew_by_another_optimizer_are_no_longer_the_first_ones():
    torch.manual_seed(0)
    model = MLP()
    first = flatopt.AdamW(model, in_backward=True)  # noqa: F841 (alive: its hooks would raise at a backward pass)
    assert clip_patch.owner(list(model.parameters()), "clip_grad_norm_") is not None
    flatopt.AdamW(model)  # step mode: the parameters move into its buffers
    assert clip_patch.owner(list(model.parameters()), "clip_grad_norm_") is None


# ---------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(accumulation_steps=4), ValueError, r"accumulation_steps applies to in_backward=True only.*step\(\)"),
        (dict(in_backward=True, accumulation_steps=0), ValueError, r"Invalid accumulation_steps: 0; expected an int"),
        (dict(in_backward=True, accumulation_steps=2.0), ValueError, r"Invalid accumulation_steps: 2.0"),
        (dict(in_backward=True, accumulation_steps=True), ValueError, r"Invalid accumulation_steps: True"),
        (dict(max_grad_norm=1.0), ValueError, r"max_grad_norm applies to in_backward=True only.*opt.clip_grad_norm_"),
        (dict(in_backward=True, max_grad_norm=0), ValueError, r"Invalid max_grad_norm: 0; expected a finite number"),
        (dict(in_backward=True, max_grad_norm=-1.0), ValueError, r"Invalid max_grad_norm: -1.0"),
        (dict(in_backward=True, max_grad_norm=math.inf), ValueError, r"Invalid max_grad_norm: inf"),
        (dict(in_backward=True, max_grad_norm="1"), ValueError, r"Invalid max_grad_norm: '1'"),
        (dict(in_backward=True, max_grad_norm=1.0, norm_type=3.0), ValueError, r"Invalid norm_type: 3.0.*2.0"),
        (dict(in_backward=True, max_grad_norm=1.0, norm_type="fro"), ValueError, r"Invalid norm_type: 'fro'"),
        (dict(in_backward=True, norm_type=math.inf), ValueError, r"norm_type applies with max_grad_norm only"),
        (dict(in_backward=True, max_grad_nrom=1.0), TypeError, r"unexpected keyword argument 'max_grad_nrom'"),
    ],
)
def test_bad_arguments_are_refused_and_change_nothing(kwargs, error, match):
    model = MLP()
    before = [p.data_ptr() for p in model.parameters()]
    hooks = [len(p._post_accumulate_grad_hooks or ()) for p in model.parameters()]
    with pytest.raises(error, match=match):
        flatopt.AdamW(model, **kwargs)
    assert [p.data_ptr() for p in model.parameters()] == before
    assert [len(p._post_accumulate_grad_hooks or ()) for p in model.parameters()] == hooks


def test_the_options_are_kept_on_the_optimizer_not_in_its_state_dict():
    """Constructor options as in_backward and bucket_size: torch.optim loads the state dict as it is."""
    torch.manual_seed(0)
    model = MLP()
    opt = flatopt.AdamW(model, in_backward=True, accumulation_steps=3, max_grad_norm=0.5, norm_type="inf")
    assert (opt.accumulation_steps, opt.max_grad_norm, opt.norm_type) == (3, 0.5, math.inf)
    assert opt.last_grad_norm is None
    for _ in range(3):
        loss_of(model, batches(1)[0]).backward()
    sd = opt.state_dict()
    assert not {"accumulation_steps", "max_grad_norm", "norm_type"} & set(sd["param_groups"][0])
    torch.optim.AdamW(copy.deepcopy(model).parameters()).load_state_dict(sd)
