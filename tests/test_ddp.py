"""flatopt in step mode (flat=True, in_backward=False) under DistributedDataParallel: two CPU ranks
on the gloo backend, started once for the whole module (tests/ranks.py).

* Each rank feeds different data and DDP averages the gradients in place into flatopt's ``.grad``
  views: flatopt.AdamW, SGD (momentum) and Lion match torch.optim.AdamW, SGD and the paper's Lion
  (conftest.LionReference) run under DDP the same way, parameters and every state, at every step;
  both ranks hold bit-identical parameters and states; every ``p.data`` and ``p.grad`` is still a
  view into the flat buffers. The optimizer is created after wrapping (on ``ddp.module``'s
  parameters, or on the DDP wrapper itself) and before wrapping (DDP's constructor broadcasts rank
  0's parameters in place, into the flat buffers). Also with ``static_graph=True``, with gradient
  accumulation under ``ddp.no_sync()`` and with a communication hook (fp16_compress_hook).
* ``gradient_as_bucket_view=True`` makes DDP rebind every ``.grad`` to a view of its own buckets
  (at construction when ``.grad`` exists, else at the first backward): ``step()`` copies the averaged
  gradients into the flat buffer (see flatopt.grads) and must match torch.optim under the same DDP.
* ``find_unused_parameters=True`` with a parameter that only one rank uses: DDP hands the averaged
  gradient to the rank that did not use it, which must step it as the other rank does, also with
  ``skip_unused=True`` (which decides from ``.grad`` at the step, as torch.optim does).

Every rank runs every scenario in one pair of processes; an exception in a rank fails the scenario's
tests with that rank's traceback.
"""

import os
import warnings
from contextlib import nullcontext

import pytest
import ranks
import torch
from conftest import LionReference
from torch import nn

import flatopt

WORLD = 2
STEPS = 12
RUN_TIMEOUT_S = 240  # the whole run takes a few seconds; a hung collective is cut off by gloo's timeout first

# flatopt's torch backend against torch.optim's for-loop implementation (and the Lion reference), float32 on
# the CPU, values of order 0.1 to 1. The largest differences observed over the 12 steps (parameters and states):
# SGD 9e-8, AdamW 4.5e-8, Lion 1.4e-9, a few ulps of rounding; a rank that skips or adds a step is off by 1e-3
# or more.
TOL = dict(rtol=1e-6, atol=5e-7)
SAME = dict(rtol=0.0, atol=0.0)  # the two ranks, which run the same arithmetic on the same values


pytestmark = pytest.mark.skipif(
    not ranks.gloo_available(),
    reason="needs torch.distributed with the gloo backend, which this torch build lacks",
)

OPTIMIZERS = {
    "AdamW": (flatopt.AdamW, torch.optim.AdamW, dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.1)),
    "SGD": (flatopt.SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.1)),
    "Lion": (flatopt.Lion, LionReference, dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)),
}

# Where the optimizer is created, relative to DistributedDataParallel(model):
ORDERS = {
    "after_wrap": "flatopt.X(ddp.module.parameters()) after ddp = DDP(model) (the usual order)",
    "after_wrap_on_ddp": "flatopt.X(ddp) after ddp = DDP(model): the wrapper passed as the module",
    "before_wrap": "flatopt.X(model), then ddp = DDP(model): DDP broadcasts into the flat views",
}


def _ddp():
    from torch.nn.parallel import DistributedDataParallel  # only where torch.distributed is available

    return DistributedDataParallel


# ------------------------------------------------------------------------------------------------ models and data


def mlp(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


class Branchy(nn.Module):
    """``b`` is used only when the forward pass is told to: on some ranks, at some steps."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 3)
        self.b = nn.Linear(5, 3)

    def forward(self, x, use_b):
        return self.a(x) + self.b(x) if use_b else self.a(x)


def batch(rank, step, micro=0):
    """Different data on each rank, at each step and micro-batch."""
    gen = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    return torch.randn(4, 5, generator=gen), torch.randn(4, 3, generator=gen)


def values(model):
    return [p.detach().clone() for p in model.parameters()]


def snapshot(model, opt):
    """Parameters and the optimizer's state_dict state (torch.optim's format; ``step`` as a float)."""
    state = {
        i: {k: float(v) if k == "step" else v.detach().clone() for k, v in entry.items()}
        for i, entry in opt.state_dict()["state"].items()
    }
    return {"params": values(model), "state": state}


def flat_views(opt):
    """For every parameter in flatopt's buffers: (name, p.data is its view, p.grad is its view: None when
    .grad is None, as a parameter with no gradient yet keeps it, as in torch)."""
    rows = []
    for buf in flatopt.inspect(opt).buffers:
        grad_storage = buf.grad.untyped_storage().data_ptr()
        # the gradient storage is released by zero_grad() and may come back elsewhere: compare with where it is now
        for p, (data_ptr, _), view in zip(buf.params, buf.expected, buf.grad_views):
            # the data lies over a storage of its own bytes, in the buffer's memory
            data_ok = p.data_ptr() == data_ptr and p.untyped_storage().data_ptr() == data_ptr
            g = p.grad
            grad_ok = (
                None
                if g is None
                else (
                    grad_storage != 0
                    and g.data_ptr() == view.data_ptr()
                    and g.untyped_storage().data_ptr() == grad_storage
                )
            )
            rows.append((opt.names(p), data_ok, grad_ok))
    return rows


def binding_error(opt):
    """What ``opt.check_bindings()`` (every parameter) raises, or None."""
    try:
        opt.check_bindings(full=True)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def error_of(e):
    return {"type": f"{type(e).__module__}.{type(e).__qualname__}", "message": str(e)}


# ------------------------------------------------------------------------------------------ scenarios (in the ranks)


def run_match(rank, opt_name, order, variant):
    """flatopt and its reference, each on its own DDP-wrapped copy of the model, over STEPS steps.

    ``variant``: ``static_graph`` (passed to DDP), ``accumulate`` (micro-batches per step, all but the
    last under ``ddp.no_sync()``), ``comm_hook`` (a name in torch's ``default_hooks``, registered on both
    DDP instances)."""
    DDP = _ddp()
    ddp_kwargs = {k: v for k, v in variant.items() if k == "static_graph"}
    accumulate = variant.get("accumulate", 1)
    flat_cls, ref_cls, hp = OPTIMIZERS[opt_name]
    # a different initialisation on each rank: DDP's constructor must broadcast rank 0's
    model, ref = mlp(seed=rank), mlp(seed=rank)
    init = values(model)
    if order == "before_wrap":
        opt = flat_cls(model, backend="torch", **hp)
        ddp = DDP(model, **ddp_kwargs)
    else:
        ddp = DDP(model, **ddp_kwargs)
        opt = flat_cls(ddp if order == "after_wrap_on_ddp" else ddp.module.parameters(), backend="torch", **hp)
    ref_ddp = DDP(ref, **ddp_kwargs)
    ref_opt = ref_cls(ref_ddp.module.parameters(), **hp)
    if "comm_hook" in variant:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        for d in (ddp, ref_ddp):
            d.register_comm_hook(None, getattr(default_hooks, variant["comm_hook"]))
    out = {
        "init": init,
        "start": values(model),
        "buffer_at_start": [v.detach().clone() for v in flatopt.inspect(opt).buffers[0].data_views],
        "views_at_start": flat_views(opt),
        "history": [],
    }
    for step in range(STEPS):
        for micro in range(accumulate):
            x, y = batch(rank, step, micro)
            for d in (ddp, ref_ddp):
                with d.no_sync() if micro < accumulate - 1 else nullcontext():
                    nn.functional.mse_loss(d(x), y).backward()
        opt.step()
        ref_opt.step()
        out["views_at_end"] = flat_views(opt)  # after the last step; zero_grad() sets every .grad to None
        opt.zero_grad()
        ref_opt.zero_grad()
        out["history"].append({"flat": snapshot(model, opt), "ref": snapshot(ref, ref_opt)})
    out["binding_error"] = binding_error(opt)
    return out


def run_bucket_view(rank, order):
    """DDP(gradient_as_bucket_view=True), flatopt.AdamW against torch.optim.AdamW under the same DDP, over
    STEPS steps."""
    DDP = _ddp()
    flat_cls, ref_cls, hp = OPTIMIZERS["AdamW"]
    model, ref = mlp(seed=0), mlp(seed=0)
    if order == "before_wrap":
        opt = flat_cls(model, backend="torch", **hp)
        ddp = DDP(model, gradient_as_bucket_view=True)
    else:
        ddp = DDP(model, gradient_as_bucket_view=True)
        opt = flat_cls(ddp.module.parameters(), backend="torch", **hp)
    ref_ddp = DDP(ref, gradient_as_bucket_view=True)
    ref_opt = ref_cls(ref_ddp.module.parameters(), **hp)
    out = {"history": [], "views_after_backward": []}
    for step in range(STEPS):
        x, y = batch(rank, step)
        for d in (ddp, ref_ddp):
            nn.functional.mse_loss(d(x), y).backward()
        out["views_after_backward"].append(flat_views(opt))
        opt.step()
        ref_opt.step()
        out["views_at_end"] = flat_views(opt)
        opt.zero_grad()
        ref_opt.zero_grad()
        out["history"].append({"flat": snapshot(model, opt), "ref": snapshot(ref, ref_opt)})
    out["binding_error"] = binding_error(opt)
    return out


def run_gather(rank, bucket_view):
    """flatopt.AdamW(direct_grads="gather") under DDP, against torch.optim.AdamW under the same DDP: the step
    reads the averaged gradients where DDP left them (its buckets' views with ``gradient_as_bucket_view``), with
    the Triton kernels under the interpreter (make test), with the torch reference otherwise."""
    DDP = _ddp()
    flat_cls, ref_cls, hp = OPTIMIZERS["AdamW"]
    model, ref = mlp(seed=rank), mlp(seed=rank)
    ddp = DDP(model, gradient_as_bucket_view=bucket_view)
    backend = "triton" if os.environ.get("TRITON_INTERPRET") == "1" else "torch"
    opt = flat_cls(ddp.module.parameters(), backend=backend, direct_grads="gather", **hp)
    ref_ddp = DDP(ref, gradient_as_bucket_view=bucket_view)
    ref_opt = ref_cls(ref_ddp.module.parameters(), **hp)
    out = {"history": [], "grads_are_ddps": []}
    for step in range(STEPS):
        x, y = batch(rank, step)
        for d in (ddp, ref_ddp):
            nn.functional.mse_loss(d(x), y).backward()
        grads = [p.grad for p in model.parameters()]
        opt.step()
        ref_opt.step()
        out["grads_are_ddps"].append(all(p.grad is g for p, g in zip(model.parameters(), grads)))
        opt.zero_grad()
        ref_opt.zero_grad()
        out["history"].append({"flat": snapshot(model, opt), "ref": snapshot(ref, ref_opt)})
    return out


def run_unused(rank):
    """find_unused_parameters=True; ``b`` is used by rank 1 alone at even steps, by no rank at odd
    steps, with skip_unused=False (every parameter stepped at every step). torch.optim's counterpart:
    zero_grad(set_to_none=False), with zero gradients to start from."""
    DDP = _ddp()
    hp = OPTIMIZERS["AdamW"][2]
    model, ref = Branchy(), Branchy()
    ref.load_state_dict(model.state_dict())
    ddp = DDP(model, find_unused_parameters=True)
    ref_ddp = DDP(ref, find_unused_parameters=True)
    opt = flatopt.AdamW(ddp.module, backend="torch", skip_unused=False, **hp)
    ref_opt = torch.optim.AdamW(ref.parameters(), **hp)
    for q in ref.parameters():  # torch.optim then steps every parameter at every step, as flatopt does
        q.grad = torch.zeros_like(q)
    out = {"history": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            use_b = rank == 1 and step % 2 == 0
            x, y = batch(rank, step)
            for d in (ddp, ref_ddp):
                nn.functional.mse_loss(d(x, use_b), y).backward()
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad(set_to_none=False)
            out["history"].append({"flat": snapshot(model, opt), "ref": snapshot(ref, ref_opt)})
    out["warnings"] = [str(w.message) for w in caught if str(w.message).startswith("AdamW")]
    out["views_at_end"] = flat_views(opt)
    out["binding_error"] = binding_error(opt)
    return out


def run_skip_unused(rank):
    """skip_unused=True under DDP(find_unused_parameters=True), against torch.optim with its default
    zero_grad(set_to_none=True): ``b`` is used by rank 1 alone at even steps (rank 0 gets DDP's averaged
    gradient, from no hook of its own) and by no rank at odd steps (no rank steps it)."""
    DDP = _ddp()
    hp = OPTIMIZERS["AdamW"][2]
    model, ref = Branchy(), Branchy()
    ref.load_state_dict(model.state_dict())
    ddp = DDP(model, find_unused_parameters=True)
    ref_ddp = DDP(ref, find_unused_parameters=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the first step's warning about b
        opt = flatopt.AdamW(ddp.module, backend="torch", **hp)  # skip_unused=True, the default
    ref_opt = torch.optim.AdamW(ref.parameters(), **hp)
    out = {"history": []}
    for step in range(STEPS):
        x, y = batch(rank, step)
        for d in (ddp, ref_ddp):
            nn.functional.mse_loss(d(x, rank == 1 and step % 2 == 0), y).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        out["history"].append({"flat": snapshot(model, opt), "ref": snapshot(ref, ref_opt)})
    return out


def run_in_backward(rank):
    """in_backward=True with two ranks: refused when the optimizer is created."""
    DDP = _ddp()
    ddp = DDP(mlp(seed=0))
    ptrs = [p.data_ptr() for p in ddp.module.parameters()]
    try:
        flatopt.AdamW(ddp.module, in_backward=True, backend="torch")
        error = None
    except Exception as e:
        error = error_of(e)
    return {"construct_error": error, "rebound": [p.data_ptr() for p in ddp.module.parameters()] != ptrs}


MATCH = [(o, order, {}) for o in OPTIMIZERS for order in ORDERS] + [
    ("AdamW", "after_wrap", {"static_graph": True}),
    ("AdamW", "before_wrap", {"static_graph": True}),
    ("AdamW", "after_wrap", {"accumulate": 3}),  # two micro-batches under ddp.no_sync(), then one that syncs
    ("AdamW", "after_wrap", {"comm_hook": "fp16_compress_hook"}),  # the reducer's comm-hook path
]


def match_id(opt_name, order, variant):
    return "-".join([opt_name, order, *(f"{k}={v}" for k, v in variant.items())])


SCENARIOS = {
    **{f"match:{match_id(*m)}": (run_match, m) for m in MATCH},
    **{f"bucket_view:{order}": (run_bucket_view, (order,)) for order in ("after_wrap", "before_wrap")},
    **{f"gather:{v}": (run_gather, (v,)) for v in (False, True)},
    "unused": (run_unused, ()),
    "skip_unused": (run_skip_unused, ()),
    "in_backward": (run_in_backward, ()),
}


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    return ranks.run("test_ddp", WORLD, str(tmp_path_factory.mktemp("ddp")), RUN_TIMEOUT_S)


def assert_history(ours, theirs, what, **tol):
    __tracebackhide__ = True
    assert len(ours) == STEPS
    ranks.assert_history(ours, theirs, what, **tol)


# ------------------------------------------------------------------------------------------------ tests

MATCH_IDS = [match_id(*m) for m in MATCH]


@pytest.mark.parametrize("scenario", MATCH_IDS)
def test_matches_torch_optim_under_ddp(ddp_results, scenario):
    """Parameters and every state equal torch.optim's (Lion: the paper's reference) at every step, on each rank."""
    for rank, result in enumerate(ddp_results(f"match:{scenario}")):
        hist = result["history"]
        assert_history([h["flat"] for h in hist], [h["ref"] for h in hist], f"rank {rank}, flatopt vs torch", **TOL)


@pytest.mark.parametrize("scenario", MATCH_IDS)
def test_ranks_stay_identical(ddp_results, scenario):
    """DDP's constructor gave rank 1 rank 0's parameters (into the flat buffers, whichever order), and
    the ranks hold bit-identical parameters and states after every step."""
    r0, r1 = ddp_results(f"match:{scenario}")
    assert any(not torch.equal(a, b) for a, b in zip(r0["init"], r1["init"])), "the ranks must start apart"
    for i, (a, b, in_buffer) in enumerate(zip(r0["start"], r1["start"], r1["buffer_at_start"])):
        torch.testing.assert_close(b, a, **SAME, msg=lambda m: f"parameter {i} after DDP's broadcast: {m}")
        torch.testing.assert_close(in_buffer, a, **SAME, msg=lambda m: f"parameter {i} in the flat buffer: {m}")
    assert_history([h["flat"] for h in r0["history"]], [h["flat"] for h in r1["history"]], "rank 0 vs 1", **SAME)


@pytest.mark.parametrize("scenario", MATCH_IDS)
def test_params_and_grads_stay_flat_views(ddp_results, scenario):
    """Every p.data and p.grad is still a view into flatopt's buffers, after DDP's construction and
    after all the steps; opt.check_bindings() agrees."""
    for rank, result in enumerate(ddp_results(f"match:{scenario}")):
        for when in ("views_at_start", "views_at_end"):
            allowed = (True, None) if when == "views_at_start" else (True,)  # no gradient before the first backward
            moved = [(name, d, g) for name, d, g in result[when] if not (d and g in allowed)]
            assert not moved, f"rank {rank}, {when}: (name, data is a view, grad is a view): {moved}"
        assert result["binding_error"] is None, f"rank {rank}: {result['binding_error']}"


@pytest.mark.parametrize("order", ["after_wrap", "before_wrap"])
def test_gradient_as_bucket_view_matches_torch(ddp_results, order):
    """DDP(gradient_as_bucket_view=True) rebinds every .grad to its own buckets at every backward: step()
    copies them into the flat buffer and puts the views back, and the steps match torch.optim's under the
    same DDP, parameters and states, on both ranks."""
    results = ddp_results(f"bucket_view:{order}")
    for rank, result in enumerate(results):
        for step, views in enumerate(result["views_after_backward"]):
            assert all(not grad_ok for _, _, grad_ok in views), (
                f"rank {rank}, step {step}: DDP was expected to hand over its bucket views as .grad"
            )
        moved = [(name, data_ok, grad_ok) for name, data_ok, grad_ok in result["views_at_end"] if not grad_ok]
        assert not moved, f"rank {rank}: .grad not back in the flat buffer after step(): {moved}"
        assert result["binding_error"] is None, f"rank {rank}: {result['binding_error']}"
        assert_history(
            [h["flat"] for h in result["history"]],
            [h["ref"] for h in result["history"]],
            f"rank {rank}, flatopt vs torch",
            **TOL,
        )
    assert_history(
        [h["flat"] for h in results[0]["history"]], [h["flat"] for h in results[1]["history"]], "ranks", **SAME
    )


@pytest.mark.parametrize("bucket_view", [False, True], ids=["grads", "bucket_view"])
def test_gathering_the_averaged_gradients_matches_torch(ddp_results, bucket_view):
    """direct_grads="gather" in step mode under DDP: the step reads the averaged gradients where DDP left them
    (.grad stays DDP's tensor), as torch.optim does, and the ranks stay bit-identical."""
    r0, r1 = ddp_results(f"gather:{bucket_view}")
    for rank, result in enumerate((r0, r1)):
        hist = result["history"]
        assert_history([h["flat"] for h in hist], [h["ref"] for h in hist], f"rank {rank}, flatopt vs torch", **TOL)
        assert all(result["grads_are_ddps"]), f"rank {rank}: a .grad was replaced by step()"
    assert_history([h["flat"] for h in r0["history"]], [h["flat"] for h in r1["history"]], "rank 0 vs 1", **SAME)


def test_parameter_used_on_one_rank_only(ddp_results):
    """find_unused_parameters=True, skip_unused=False: a parameter that rank 1 alone uses gets the averaged
    gradient on rank 0 too (from DDP, not from rank 0's autograd), and both ranks must step it as torch.optim
    does after zero_grad(set_to_none=False)."""
    r0, r1 = ddp_results("unused")
    assert_history([h["flat"] for h in r0["history"]], [h["flat"] for h in r1["history"]], "rank 0 vs 1", **SAME)
    # rank 0's backward gave b no gradient at the first step (rank 1's did): its warning says whose backward it
    # means and that DDP hands such a parameter the other ranks' gradient
    (warning,) = r0["warnings"]
    assert "'b.weight'" in warning and "from this rank's backward pass (one of 2 ranks)" in warning, warning
    assert "another rank used gets the averaged gradient from DDP" in warning, warning
    assert not r1["warnings"], r1["warnings"]
    for rank, result in enumerate((r0, r1)):
        hist = result["history"]
        assert_history([h["flat"] for h in hist], [h["ref"] for h in hist], f"rank {rank}, flatopt vs torch", **TOL)
        assert result["binding_error"] is None, f"rank {rank}: {result['binding_error']}"


def test_skip_unused_with_several_ranks_matches_torch(ddp_results):
    """skip_unused=True steps a parameter whose .grad is not None at step(), as torch.optim does: rank 0 steps
    ``b`` with the gradient DDP hands it when rank 1 alone used it, and no rank steps it when none did. Both
    ranks stay bit-identical and match torch.optim (states and step counts included)."""
    r0, r1 = ddp_results("skip_unused")
    for rank, result in enumerate((r0, r1)):
        hist = result["history"]
        assert_history([h["flat"] for h in hist], [h["ref"] for h in hist], f"rank {rank}, flatopt vs torch", **TOL)
    assert_history([h["flat"] for h in r0["history"]], [h["flat"] for h in r1["history"]], "rank 0 vs 1", **SAME)


def test_in_backward_with_several_ranks_is_refused(ddp_results):
    """In-backward mode given ``ddp.module`` rather than the DDP wrapper would step each rank's own gradient
    before DDP averages them: refused when the optimizer is created, before the parameters are moved into its
    buffers (the wrapper itself is stepped bucket by bucket: tests/test_ddp_in_backward.py)."""
    for rank, result in enumerate(ddp_results("in_backward")):
        err = result["construct_error"]
        assert err is not None, f"rank {rank}: in_backward=True under DDP was not refused"
        assert err["type"] == "builtins.RuntimeError", err
        assert "several distributed ranks (2 here)" in err["message"] and "in_backward=False" in err["message"], err
        assert not result["rebound"], f"rank {rank}: the refused constructor rebound the parameters"
