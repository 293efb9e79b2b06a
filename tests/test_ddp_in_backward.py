"""flatopt in in-backward mode under DistributedDataParallel (``flatopt.X(ddp, in_backward=True)``): two CPU ranks
on the gloo backend, started once for the whole module (tests/ranks.py).

* Each rank feeds different data; every DDP bucket is stepped from flatopt's communication hook once averaged.
  flatopt.AdamW, SGD (momentum) and Lion match torch.optim.AdamW, SGD and the paper's Lion run under DDP (step
  mode), and single-process flatopt in step mode on the concatenated batch, parameters and every state, at every
  step; both ranks hold bit-identical parameters and states; the parameters change during backward (before
  ``opt.step()``) and ``.grad`` is None after it. Also with ``gradient_as_bucket_view=True``, ``static_graph=True``,
  small buckets (several per pass, rebuilt by DDP after the first iteration), two param groups, accumulation under
  ``ddp.no_sync()`` and under ``opt.no_step()``, and ``find_unused_parameters=True`` with ``skip_unused=False``.
* Sizes that are multiples of the 64-element alignment: once DDP has rebuilt its buckets, each run is stepped
  straight from DDP's bucket, with no copy.
* Refusals, each before anything is updated: a second backward pass without step()/zero_grad() (raised at the end of
  the pass, DDP left able to go on), ``clip_grad_norm_`` after a stepped pass, and at construction max_grad_norm,
  accumulation_steps, find_unused_parameters with skip_unused=True, a DDP that has a communication hook already,
  parameters DDP does not average, and ``ddp.module`` (or a model wrapped after the optimizer was created) instead of
  the wrapper.
* A backward pass that raised part way: the bucket averaged before it raised is stepped, on both ranks, by the time
  opt.zero_grad() returns (also when its all-reduce was still under way); DDP refuses its next forward pass until
  ``ddp.reducer._reset_state()``; opt.step() and a second backward pass are refused; after the reset and
  opt.zero_grad() training goes on as torch.optim's through the same failed pass (taking the same partial step).
"""

import time
from contextlib import nullcontext

import pytest
import ranks
import torch
from test_ddp import OPTIMIZERS, snapshot, values
from torch import nn

import flatopt

WORLD = 2
STEPS = 6
RUN_TIMEOUT_S = 240  # the whole run takes a few seconds; a hung collective is cut off by gloo's timeout first

# float32 on the CPU, values of order 0.1 to 1: flatopt's torch backend against torch.optim's for-loop code, and DDP's
# average of two half-batches against the gradient of the whole batch, differ by a few ulps; a skipped or repeated
# step is off by 1e-3 or more.
TOL = dict(rtol=1e-6, atol=1e-6)
SAME = dict(rtol=0.0, atol=0.0)

pytestmark = pytest.mark.skipif(
    not ranks.gloo_available(),
    reason="needs torch.distributed with the gloo backend, which this torch build lacks",
)


def train_step(models, opts, x, y):
    """A step of each model on the same batch (its backward, then each optimizer's step and zero_grad())."""
    for d in models:
        nn.functional.mse_loss(d(x), y).backward()
    for o in opts:
        o.step()
    for o in opts:
        o.zero_grad()


def _ddp():
    from torch.nn.parallel import DistributedDataParallel  # only where torch.distributed is available

    return DistributedDataParallel


# ------------------------------------------------------------------------------------------------ models and data


def mlp(seed, width=8, features=5, out=3):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(features, width), nn.Tanh(), nn.Linear(width, out))


class Branchy(nn.Module):
    """``b`` is used only when the forward pass is told to: on some ranks, at some steps."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.a = nn.Linear(5, 3)
        self.b = nn.Linear(5, 3)

    def forward(self, x, use_b=True):
        return self.a(x) + self.b(x) if use_b else self.a(x)


def batch(rank, step, micro=0, features=5, out=3):
    """Different data on each rank, at each step and micro-batch."""
    gen = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    return torch.randn(4, features, generator=gen), torch.randn(4, out, generator=gen)


def error_of(e):
    return None if e is None else {"type": f"{type(e).__module__}.{type(e).__qualname__}", "message": str(e)}


def groups_of(module, opt_name, hp, two_groups):
    """The module's parameters, in one group or in two (the second with half the learning rate)."""
    if not two_groups:
        return list(module.parameters())
    ps = list(module.parameters())
    return [{"params": ps[:2]}, {"params": ps[2:], "lr": hp["lr"] / 2}]


# ------------------------------------------------------------------------------------------ scenarios (in the ranks)


def run_match(rank, opt_name, variant):
    """flatopt in-backward on a DDP model, torch.optim on another DDP model (step mode), and flatopt step mode on a
    single-process copy fed both ranks' data, over STEPS steps.

    ``variant``: ``ddp`` (keyword arguments of DDP), ``groups`` (two param groups), ``micro`` (micro-batches per
    step) with ``accumulate`` = ``"no_sync"`` (all but the last under ddp.no_sync()) or ``"no_step"`` (under
    opt.no_step()) or ``"step"`` (every micro-batch under opt.no_step(), then opt.step() steps the sum), ``aligned``
    (sizes that are multiples of 64), ``unused`` (Branchy, find_unused_parameters=True, skip_unused=False)."""
    DDP = _ddp()
    flat_cls, ref_cls, hp = OPTIMIZERS[opt_name]
    ddp_kwargs = dict(variant.get("ddp", {}))
    micro, accumulate = variant.get("micro", 1), variant.get("accumulate")
    unused = variant.get("unused", False)
    dims = dict(features=64, out=64) if variant.get("aligned") else {}
    if unused:
        model, ref, single = Branchy(), Branchy(), Branchy()
        ddp_kwargs["find_unused_parameters"] = True
    else:
        width = 64 if dims else 8
        # a different initialisation on each rank: DDP's constructor broadcasts rank 0's
        model, ref = mlp(rank, width, **dims), mlp(rank, width, **dims)
        single = mlp(0, width, **dims)
    ddp = DDP(model, **ddp_kwargs)
    ref_ddp = DDP(ref, **ddp_kwargs)
    extra = dict(skip_unused=False) if unused else {}
    if variant.get("groups"):
        opt = flat_cls(groups_of(ddp, opt_name, hp, True), model=ddp, in_backward=True, backend="torch", **hp)
        ref_opt = ref_cls(groups_of(ref, opt_name, hp, True), **hp)
        single_opt = flat_cls(groups_of(single, opt_name, hp, True), backend="torch", **hp)
    else:
        opt = flat_cls(ddp, in_backward=True, backend="torch", **extra, **hp)
        ref_opt = ref_cls(ref.parameters(), **hp)
        single_opt = flat_cls(single, backend="torch", **extra, **hp)
    if unused:  # torch.optim then steps every parameter at every step, as skip_unused=False does
        for q in ref.parameters():
            q.grad = torch.zeros_like(q)
    out = {"history": [], "passes": [], "launches": []}
    engine = flatopt.inspect(opt).engine
    for step in range(STEPS):
        launches = engine.launches
        use_b = rank == 1 and step % 2 == 0
        for m in range(micro):
            x, y = batch(rank, step, m, **dims)
            last = m == micro - 1
            quiet = not last or accumulate == "step"
            if accumulate == "no_sync" and not last:
                context = ddp.no_sync()
            elif accumulate in ("no_step", "step") and quiet:
                context = opt.no_step()
            else:
                context = nullcontext()
            before = values(model)
            with context:
                loss = nn.functional.mse_loss(ddp(x, use_b) if unused else ddp(x), y)
                loss.backward()
            # (stepping pass, parameters changed by the pass, every .grad None after it)
            changed = any(not torch.equal(a, b) for a, b in zip(before, values(model)))
            out["passes"].append((not quiet, changed, all(p.grad is None for p in model.parameters())))
            with ref_ddp.no_sync() if accumulate == "no_sync" and not last else nullcontext():
                nn.functional.mse_loss(ref_ddp(x, use_b) if unused else ref_ddp(x), y).backward()
            if not unused:  # the whole batch of this micro-batch, both ranks' halves, in one process
                xs, ys = zip(*(batch(r, step, m, **dims) for r in range(WORLD)))
                nn.functional.mse_loss(single(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
        ref_opt.step()
        single_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad(set_to_none=not unused)
        single_opt.zero_grad()
        out["launches"].append(engine.launches - launches)
        out["history"].append(
            {"flat": snapshot(model, opt), "ref": snapshot(ref, ref_opt), "single": snapshot(single, single_opt)}
        )
    out["copied"], out["direct"] = engine.copied, engine.direct
    return out


def small_bucket_pair():
    """Two equal MLPs under DDP with one parameter per bucket: flatopt.AdamW in in-backward mode on the first,
    torch.optim.AdamW on the second. Returns (model, ref, ddp, ref_ddp, opt, ref_opt)."""
    DDP = _ddp()
    flat_cls, ref_cls, hp = OPTIMIZERS["AdamW"]
    model, ref = mlp(0), mlp(0)
    ddp, ref_ddp = DDP(model, bucket_cap_mb=1e-4), DDP(ref, bucket_cap_mb=1e-4)
    return (
        model,
        ref,
        ddp,
        ref_ddp,
        flat_cls(ddp, in_backward=True, backend="torch", **hp),
        ref_cls(ref.parameters(), **hp),
    )


def run_second_pass(rank):
    """A second backward pass with neither step() nor zero_grad(): refused at the end of the pass, nothing updated
    and no gradient left, also under no_step(); after zero_grad() DDP and the optimizer go on and still match
    torch.optim."""
    model, ref, ddp, ref_ddp, opt, ref_opt = small_bucket_pair()
    x, y = batch(rank, 0)
    nn.functional.mse_loss(ddp(x), y).backward()
    nn.functional.mse_loss(ref_ddp(x), y).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    before = values(model)
    error = None
    try:
        nn.functional.mse_loss(ddp(x), y).backward()
    except Exception as e:
        error = e
    out = {
        "refusal": error_of(error),
        "unchanged": all(torch.equal(a, b) for a, b in zip(before, values(model))),
        "grads_none": all(p.grad is None for p in model.parameters()),
    }
    error = None
    try:  # under no_step(): its gradients would wait in .grad for step(), a second update of the window
        with opt.no_step():
            nn.functional.mse_loss(ddp(x), y).backward()
    except Exception as e:
        error = e
    out["paused_refusal"] = error_of(error)
    out["paused_unchanged"] = all(torch.equal(a, b) for a, b in zip(before, values(model)))
    out["paused_grads_none"] = all(p.grad is None for p in model.parameters())
    opt.zero_grad()
    for step in range(1, 3):
        x, y = batch(rank, step)
        train_step((ddp, ref_ddp), (opt, ref_opt), x, y)
    out["after"] = {"flat": snapshot(model, opt), "ref": snapshot(ref, ref_opt)}
    return out


class Raised(Exception):
    """What the backward pass that fails in :func:`run_failed_pass` raises."""


def raise_in_backward(module):
    """Make the next backward pass raise at the gradient of ``module``'s output, once the parameters after ``module``
    have their gradients (autograd runs an AccumulateGrad before the other nodes that are ready); returns the
    handle of the forward hook to remove."""

    def fail(grad):
        raise Raised("a tensor hook raised during backward")

    def hook(mod, inputs, output):
        output.register_hook(fail)  # returns None: the output stays as it is

    return module.register_forward_hook(hook)


def delay_backward(module, seconds):
    """Make the next backward passes wait ``seconds`` at the gradient of ``module``'s output; returns the handle of
    the forward hook to remove."""

    def hook(mod, inputs, output):
        output.register_hook(lambda grad: time.sleep(seconds))  # returns None: the gradient stays as it is

    return module.register_forward_hook(hook)


FAILURES = {1: "at_once", 3: "refusals"}  # the steps of run_failed_pass whose first pass raises, and what follows
FAILED_STEPS = 5
LATE_S = 1.0  # how late rank 1 sends its first bucket in the first failed pass


def run_failed_pass(rank):
    """Backward passes that raise part way under DDP, then the recovery, against torch.optim under DDP through the
    same failed passes. At each step of FAILURES a tensor hook on model[0]'s output raises, after model[2]'s bucket
    was averaged and handed to flatopt's hook (DDP rebuilt its buckets after step 0: model[2]'s parameters, then
    model[0]'s), before model[0]'s gradients exist. DDP itself then refuses a forward pass until its reducer is
    reset (``ddp.reducer._reset_state()``, on both models). The recovery is that reset and opt.zero_grad(), then the
    failed batch again.

    * "at_once": rank 1 sends model[2]'s bucket LATE_S late (its backward waits at the output), so that on rank 0
      the bucket's all-reduce, and its step, are still under way when backward raises; the reset and
      opt.zero_grad() come at once, and opt.zero_grad() must have waited for that step.
    * "refusals": opt.step() is refused, and so is a second backward pass, before either updates anything; then
      the reset and opt.zero_grad().

    The reference takes, for a failed pass, the step flatopt took in it: torch.optim steps model[2]'s parameters
    with the failed batch's gradient averaged by DDP (a pass of its own), model[0]'s left without one."""
    import torch.distributed as dist

    model, ref, ddp, ref_ddp, opt, ref_opt = small_bucket_pair()
    engine = flatopt.inspect(opt).engine
    out = {"history": [], "raised": 0, "ddp_refused": [], "moved": {}, "launches": {}, "recovered": {}}
    for step in range(FAILED_STEPS):
        x, y = batch(rank, step)
        how = FAILURES.get(step)
        if how is not None:
            before, launches = values(model), engine.launches
            for m, d in ((model, ddp), (ref, ref_ddp)):
                handles = [raise_in_backward(m[0])]
                if how == "at_once" and m is model and rank == 1:
                    handles.append(delay_backward(m[2], LATE_S))
                try:
                    nn.functional.mse_loss(d(x), y).backward()
                except Raised:
                    out["raised"] += 1
                for h in handles:
                    h.remove()
                if m is ref:
                    # the failed pass's all-reduces may still be under way: flatopt's zero_grad() waits for them,
                    # torch.optim's does not, and DDP's next pass would then average wrong values (seen on gloo);
                    # gloo's barrier waits for every collective before it
                    dist.barrier()
                if how == "at_once":
                    d.reducer._reset_state()  # what DDP needs before its next forward pass
                    (opt if m is model else ref_opt).zero_grad()
                    if m is model:  # at once, before any other collective could let the bucket's step finish
                        out["moved"][how] = [not torch.equal(a, b) for a, b in zip(before, values(model))]
                    continue
                try:  # DDP's own state after a backward pass that raised
                    d(x)
                    out["ddp_refused"].append(None)
                except RuntimeError as e:
                    out["ddp_refused"].append(str(e))
                d.reducer._reset_state()
            if how == "refusals":
                out["step_refused"] = None
                try:
                    opt.step()
                except RuntimeError as e:
                    out["step_refused"] = error_of(e)
                try:  # a second backward pass, with neither opt.step() nor opt.zero_grad() since the one that raised
                    nn.functional.mse_loss(ddp(x), y).backward()
                    out["second_refused"] = None
                except RuntimeError as e:
                    out["second_refused"] = error_of(e)
                out["grads_none_after_refused"] = all(p.grad is None for p in model.parameters())
                opt.zero_grad()
                out["moved"][how] = [not torch.equal(a, b) for a, b in zip(before, values(model))]
                ref_opt.zero_grad()
            out["launches"][how] = engine.launches - launches
            # the reference takes the step flatopt took in the failed pass: model[2]'s parameters, averaged by DDP
            nn.functional.mse_loss(ref_ddp(x), y).backward()
            for p in ref[0].parameters():
                p.grad = None
            ref_opt.step()
            ref_opt.zero_grad()
            out["recovered"][how] = {"flat": snapshot(model, opt), "ref": snapshot(ref, ref_opt)}
        train_step((ddp, ref_ddp), (opt, ref_opt), x, y)  # the failed batch again, after a failed pass
        out["history"].append({"flat": snapshot(model, opt), "ref": snapshot(ref, ref_opt)})
    return out


def run_recreated(rank):
    """An in-backward optimizer deleted, then torch.optim in step mode on the same DDP model (flatopt's hook, its
    optimizer gone, puts DDP's averages in .grad as DDP would), then a new in-backward optimizer (it takes the
    hook over): three phases of two steps, each with a fresh optimizer, against torch.optim doing the same."""
    DDP = _ddp()
    flat_cls, ref_cls, hp = OPTIMIZERS["AdamW"]
    model, ref = mlp(0), mlp(0)
    ddp, ref_ddp = DDP(model), DDP(ref)
    out = {"phases": []}
    step = 0
    for phase in ("in_backward", "torch", "in_backward"):
        opt = flat_cls(ddp, in_backward=True, backend="torch", **hp) if phase == "in_backward" else None
        opt = opt if opt is not None else ref_cls(model.parameters(), **hp)
        ref_opt = ref_cls(ref.parameters(), **hp)
        for _ in range(2):
            x, y = batch(rank, step)
            step += 1
            train_step((ddp, ref_ddp), (opt, ref_opt), x, y)
        out["phases"].append((phase, values(model), values(ref)))
        del opt  # gone before the next phase: its hooks must no longer step
    return out


def run_clip_after_pass(rank):
    """torch.nn.utils.clip_grad_norm_ (and opt.clip_grad_norm_) after a stepped DDP pass: raises (the gradients are
    gone), rather than clip nothing and return 0; on gradients accumulated under opt.no_step() (averaged by DDP) it
    is torch's."""
    DDP = _ddp()
    model = mlp(0)
    ddp = DDP(model)
    opt = flatopt.AdamW(ddp, in_backward=True, backend="torch", lr=1e-2)
    x, y = batch(rank, 0)
    with opt.no_step():
        nn.functional.mse_loss(ddp(x), y).backward()
    accumulated = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    opt.zero_grad()
    nn.functional.mse_loss(ddp(x), y).backward()
    error = own = None
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    except Exception as e:
        error = e
    try:
        opt.clip_grad_norm_(1.0)
    except Exception as e:
        own = e
    return {
        "refusal": error_of(error),
        "own_refusal": error_of(own),
        "accumulated_norm": float(accumulated),
        "grads": grads,
    }


def run_construction_refusals(rank):
    """Each refused constructor: its error, and whether it moved the parameters."""
    DDP = _ddp()
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def attempt(make, model):
        ptrs = [p.data_ptr() for p in model.parameters()]
        try:
            make()
            error = None
        except Exception as e:
            error = e
        return {"error": error_of(error), "rebound": [p.data_ptr() for p in model.parameters()] != ptrs}

    out = {}
    model = mlp(0)
    ddp = DDP(model)
    out["max_grad_norm"] = attempt(lambda: flatopt.AdamW(ddp, in_backward=True, max_grad_norm=1.0), model)
    out["accumulation_steps"] = attempt(lambda: flatopt.AdamW(ddp, in_backward=True, accumulation_steps=2), model)
    out["ddp_module"] = attempt(lambda: flatopt.AdamW(ddp.module, in_backward=True), model)
    out["ddp_module_params"] = attempt(lambda: flatopt.AdamW(ddp.module.parameters(), in_backward=True), model)
    extra = nn.Parameter(torch.ones(3))
    out["not_ddp_managed"] = attempt(
        lambda: flatopt.AdamW([*model.parameters(), extra], model=ddp, in_backward=True), model
    )
    unused_model = Branchy()
    unused = DDP(unused_model, find_unused_parameters=True)
    out["find_unused_skip_unused"] = attempt(lambda: flatopt.AdamW(unused, in_backward=True), unused_model)
    hooked_model = mlp(0)
    hooked = DDP(hooked_model)
    hooked.register_comm_hook(None, default_hooks.allreduce_hook)
    out["comm_hook"] = attempt(lambda: flatopt.AdamW(hooked, in_backward=True), hooked_model)
    bare = mlp(0)  # wrapped in DDP after the optimizer is created: refused when the optimizer is created
    out["wrapped_later"] = attempt(lambda: flatopt.AdamW(bare, in_backward=True), bare)
    return out


MATCH = [
    ("AdamW", {}),
    ("SGD", {}),
    ("Lion", {}),
    ("AdamW", {"ddp": {"gradient_as_bucket_view": True, "bucket_cap_mb": 1e-4}}),
    ("AdamW", {"ddp": {"static_graph": True, "bucket_cap_mb": 1e-4}, "groups": True}),
    ("AdamW", {"micro": 3, "accumulate": "no_sync"}),
    ("SGD", {"micro": 3, "accumulate": "no_step", "ddp": {"gradient_as_bucket_view": True}}),
    ("AdamW", {"micro": 2, "accumulate": "step"}),
    ("AdamW", {"aligned": True, "ddp": {"bucket_cap_mb": 0.01}}),
    ("AdamW", {"aligned": True, "ddp": {"bucket_cap_mb": 0.01, "gradient_as_bucket_view": True}}),
    ("AdamW", {"unused": True}),
]


def match_id(opt_name, variant):
    return "-".join([opt_name, *(f"{k}={v}" for k, v in variant.items())]).replace(" ", "")


MATCH_IDS = [match_id(*m) for m in MATCH]

SCENARIOS = {
    **{f"match:{i}": (run_match, m) for i, m in zip(MATCH_IDS, MATCH)},
    "second_pass": (run_second_pass, ()),
    "failed_pass": (run_failed_pass, ()),
    "clip": (run_clip_after_pass, ()),
    "recreated": (run_recreated, ()),
    "construction": (run_construction_refusals, ()),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return ranks.run("test_ddp_in_backward", WORLD, str(tmp_path_factory.mktemp("ddp_in_backward")), RUN_TIMEOUT_S)


# ------------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("scenario", MATCH_IDS)
def test_matches_torch_optim_single_process_and_across_ranks(results, scenario):
    """Parameters and every state equal torch.optim's under DDP and single-process flatopt's on the whole batch at
    every step, on each rank, and the two ranks are bit-identical."""
    r0, r1 = results(f"match:{scenario}")
    for rank, result in enumerate((r0, r1)):
        hist = result["history"]
        assert len(hist) == STEPS
        flat = [h["flat"] for h in hist]
        ranks.assert_history(flat, [h["ref"] for h in hist], f"rank {rank}, flatopt vs torch.optim under DDP", **TOL)
        if "unused" not in scenario:
            ranks.assert_history(
                flat, [h["single"] for h in hist], f"rank {rank}, flatopt vs single-process step mode", **TOL
            )
    ranks.assert_history([h["flat"] for h in r0["history"]], [h["flat"] for h in r1["history"]], "rank 0 vs 1", **SAME)


@pytest.mark.parametrize("scenario", MATCH_IDS)
def test_buckets_are_stepped_during_backward(results, scenario):
    """A stepping pass changes the parameters during backward (before opt.step()) and leaves every .grad None; a
    pass under no_sync() or no_step() changes nothing and leaves its gradients in .grad."""
    for rank, result in enumerate(results(f"match:{scenario}")):
        for k, (stepping, changed, grads_none) in enumerate(result["passes"]):
            assert changed == stepping, f"rank {rank}, pass {k}: stepping {stepping}, parameters changed {changed}"
            assert grads_none == stepping, f"rank {rank}, pass {k}: stepping {stepping}, every .grad None {grads_none}"
        if "accumulate=step" in scenario:  # no stepping pass: opt.step() launched
            assert all(n > 0 for n in result["launches"]), result["launches"]


def test_small_buckets_take_one_launch_each(results):
    """bucket_cap_mb=1e-4: after DDP's first iteration (one bucket of the 4 parameters, DDP's first bucket being
    larger) DDP rebuilds its buckets in gradient-ready order, two buckets of two parameters: one launch per DDP
    bucket, each bucket a run of the flat buffer."""
    for rank, result in enumerate(results(f"match:{match_id(*MATCH[3])}")):
        assert result["launches"] == [1] + [2] * (STEPS - 1), f"rank {rank}: {result['launches']}"


@pytest.mark.parametrize("scenario", [match_id(*MATCH[8]), match_id(*MATCH[9])])
def test_aligned_sizes_are_stepped_from_ddp_buckets_without_copies(results, scenario):
    """Every size a multiple of 64, either gradient_as_bucket_view: after DDP's first iteration (buckets in
    registration order, copied) each run is stepped straight from DDP's bucket, whose order is then the flat
    buffer's."""
    for rank, result in enumerate(results(f"match:{scenario}")):
        params = 64 * 64 + 64 + 64 * 64 + 64
        assert result["copied"] == params, f"rank {rank}: {result['copied']} elements copied, expected one iteration"
        assert result["direct"] >= STEPS - 1, f"rank {rank}: {result['direct']} runs stepped from DDP's bucket"


def test_second_backward_pass_is_refused_and_ddp_goes_on(results):
    for rank, result in enumerate(results("second_pass")):
        err = result["refusal"]
        assert err is not None, f"rank {rank}: the second pass was not refused"
        assert "second backward pass" in err["message"] and "ddp.no_sync()" in err["message"], err
        assert result["unchanged"], f"rank {rank}: the refused pass updated parameters"
        assert result["grads_none"], f"rank {rank}: the refused pass left gradients"
        err = result["paused_refusal"]
        assert err is not None and "a backward pass under opt.no_step() started after a pass" in err["message"], err
        assert result["paused_unchanged"] and result["paused_grads_none"], f"rank {rank}: the no_step() pass left some"
        after = result["after"]
        ranks.assert_history([after["flat"]], [after["ref"]], f"rank {rank}, after the refusal", **TOL)


def test_backward_pass_that_raised_then_zero_grad(results):
    """A backward pass that raised part way has stepped the DDP bucket averaged before it raised, the same on both
    ranks, and nothing else, by the time opt.zero_grad() returns (also when the bucket's all-reduce was still under
    way when backward raised); DDP refuses its next forward pass until its reducer is reset, as it does under
    torch.optim; opt.step() and a second backward pass after the failed one are refused, updating nothing; after
    the reset and opt.zero_grad() the retry and the steps after it match torch.optim, which took the same partial
    steps, and the ranks stay bit-identical."""
    r0, r1 = results("failed_pass")
    for rank, result in enumerate((r0, r1)):
        what = f"rank {rank}"
        assert result["raised"] == 2 * len(FAILURES), f"{what}: the failing passes did not all raise"
        assert len(result["ddp_refused"]) == 2, result["ddp_refused"]
        for refused in result["ddp_refused"]:  # torch's behaviour, which docs/distributed.md describes
            assert "Expected to have finished reduction in the prior iteration" in (refused or ""), refused
        err = result["step_refused"]
        assert err is not None and "opt.step() after a backward pass that raised" in err["message"], err
        err = result["second_refused"]
        assert err is not None and "started after the previous one raised" in err["message"], err
        assert result["grads_none_after_refused"], f"{what}: the refused pass left gradients"
        for how in FAILURES.values():
            # model[2]'s bucket (weight and bias) stepped in the failed pass, by one launch; model[0]'s untouched
            assert result["moved"][how] == [False, False, True, True], (what, how, result["moved"][how])
            assert result["launches"][how] == 1, (what, how, result["launches"][how])
            recovered = result["recovered"][how]
            ranks.assert_history([recovered["flat"]], [recovered["ref"]], f"{what}, after the failed pass", **TOL)
        hist = result["history"]
        assert len(hist) == FAILED_STEPS, what
        ranks.assert_history([h["flat"] for h in hist], [h["ref"] for h in hist], f"{what}, flatopt vs torch", **TOL)
    for how in FAILURES.values():
        ranks.assert_history([r0["recovered"][how]["flat"]], [r1["recovered"][how]["flat"]], "rank 0 vs 1", **SAME)
    ranks.assert_history([h["flat"] for h in r0["history"]], [h["flat"] for h in r1["history"]], "rank 0 vs 1", **SAME)


def test_optimizer_recreated_on_the_same_ddp_model(results):
    """A deleted in-backward optimizer steps nothing more, DDP's gradients reach .grad for torch.optim, and a new
    in-backward optimizer on the same DDP model steps its buckets."""
    for rank, result in enumerate(results("recreated")):
        for k, (phase, ours, theirs) in enumerate(result["phases"]):
            for i, (a, b) in enumerate(zip(ours, theirs)):
                torch.testing.assert_close(
                    a, b, **TOL, msg=lambda m: f"rank {rank}, phase {k} ({phase}), param {i}: {m}"
                )


def test_clip_grad_norm_after_a_stepped_pass_raises(results):
    for rank, result in enumerate(results("clip")):
        err = result["refusal"]
        assert err is not None, f"rank {rank}: clip_grad_norm_ after a stepped pass was a silent no-op"
        assert err["type"] == "builtins.RuntimeError" and "DistributedDataParallel" in err["message"], err
        assert result["own_refusal"] == err, f"rank {rank}: opt.clip_grad_norm_ differs: {result['own_refusal']}"
        expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in result["grads"]]))
        assert result["accumulated_norm"] == pytest.approx(float(expected), rel=1e-6)
    r0, r1 = results("clip")
    for a, b in zip(r0["grads"], r1["grads"]):  # under no_step() .grad holds DDP's average: the same on both ranks
        torch.testing.assert_close(a, b, **SAME)


REFUSALS = {
    "max_grad_norm": ("builtins.ValueError", "takes neither max_grad_norm nor accumulation_steps"),
    "accumulation_steps": ("builtins.ValueError", "takes neither max_grad_norm nor accumulation_steps"),
    "ddp_module": ("builtins.RuntimeError", "give the wrapper"),
    "ddp_module_params": ("builtins.RuntimeError", "give the wrapper"),
    "not_ddp_managed": ("builtins.ValueError", "are not among them"),
    "find_unused_skip_unused": ("builtins.ValueError", "Pass skip_unused=False"),
    "comm_hook": ("builtins.ValueError", "has one already"),
    "wrapped_later": ("builtins.RuntimeError", "several distributed ranks (2 here)"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_at_construction_without_moving_parameters(results, case):
    kind, words = REFUSALS[case]
    for rank, result in enumerate(results("construction")):
        got = result[case]
        assert got["error"] is not None, f"rank {rank}: {case} was not refused"
        assert got["error"]["type"] == kind and words in got["error"]["message"], got["error"]
        assert not got["rebound"], f"rank {rank}: the refused constructor moved the parameters"
