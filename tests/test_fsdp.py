"""flatopt in step mode over FSDP2 (``fully_shard``) models: CPU ranks on the gloo backend (tests/ranks.py).

* On two ranks (and HSDP on four): flatopt.AdamW (with decay / no-decay param groups), SGD (momentum) and
  Lion on a model with several fully_shard groups, uneven shards (7 and 3 rows over 2 and 4 ranks) and a
  frozen parameter, each with ``opt.clip_grad_norm_`` before every step, match torch.optim (Lion: the paper's
  reference) on the same FSDP2 model with ``torch.nn.utils.clip_grad_norm_``, parameters and every state at
  every step, and match single-process flatopt on the whole batch; also under a MixedPrecisionPolicy
  (bfloat16 compute). FSDP2 keeps the local shards in flatopt's flat buffer, and each step is one launch per
  buffer.
* What flatopt cannot step is refused at construction, before anything changes: tensor-parallel DTensors,
  in-backward mode and ``flat=False`` over FSDP2, parameters given without the model; shards that FSDP2
  replaced after construction, at the next step.
* torch.distributed.checkpoint: ``get_optimizer_state_dict`` exports DTensor states (sharded) and full
  tensors (full); a full state dict loads into torch.optim on the same model, a sharded one into a new
  flatopt optimizer, both continuing as the original does. A DCP checkpoint saved on two ranks loads on four
  and continues as on two; one saved on four loads on two.

Three runs of processes: two ranks (everything above but the loads on other world sizes), four ranks (load
the two-rank checkpoint; save one), two ranks (load the four-rank checkpoint).
"""

import io
import math
import os
import warnings
from contextlib import nullcontext

import pytest
import ranks
import torch
import torch.distributed as dist
from conftest import LionReference
from torch import nn

import flatopt

STEPS = 6
RUN_TIMEOUT_S = 240
# flatopt's CPU backend against torch.optim's for-loop implementation, float32: differences of a few ulps (below
# 1e-7 observed over the steps); a skipped or doubled step, or a wrong shard, is off by 1e-3 or more.
TOL = dict(rtol=1e-6, atol=1e-6)
CKPT_ENV = "FLATOPT_TEST_FSDP_DIR"  # where the ranks of the three runs share their checkpoints

pytestmark = pytest.mark.skipif(
    not ranks.gloo_available(), reason="needs torch.distributed with the gloo backend, which this torch build lacks"
)

OPTIMIZERS = {
    "AdamW": (flatopt.AdamW, torch.optim.AdamW, dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.1)),
    "SGD": (flatopt.SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.1)),
    "Lion": (flatopt.Lion, LionReference, dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)),
}
MAX_NORM = 0.5


# ------------------------------------------------------------------------------------------------ models and data


class Net(nn.Sequential):
    """7 and 3 output rows: uneven shards over 2 and 4 ranks (an empty one on the fourth); ``skip`` is frozen."""

    def __init__(self):
        super().__init__(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
        self.skip = nn.Linear(5, 3)
        self.skip.weight.requires_grad_(False)

    def forward(self, x):
        return self[2](self[1](self[0](x))) + self.skip(x)


def net():
    torch.manual_seed(0)
    return Net()


def sharded(world, mp_policy=None, hsdp=None):
    """net() with fully_shard on its two Linear layers and on the root (three groups); ``hsdp``: the (replicate,
    shard) shape of a 2-D mesh for HSDP."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = net()
    if hsdp is None:
        mesh = init_device_mesh("cpu", (world,))
    else:
        mesh = init_device_mesh("cpu", hsdp, mesh_dim_names=("replicate", "shard"))
    kw = {} if mp_policy is None else {"mp_policy": MixedPrecisionPolicy(**mp_policy)}
    fully_shard(model[0], mesh=mesh, **kw)
    fully_shard(model[2], mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def batch(step):
    """The global batch of a step (8 rows); each rank takes its chunk."""
    gen = torch.Generator().manual_seed(step)
    return torch.randn(8, 5, generator=gen), torch.randn(8, 3, generator=gen)


def train_step(model, opt, rank, world, step, torch_clip=False):
    x, y = (t.chunk(world)[rank] for t in batch(step))
    # the loss in float32: under a bf16 param_dtype the model's output is bf16, and torch 2.11's mse_loss backward
    # refuses a bf16 input with a float32 target (torch 2.13 promotes)
    nn.functional.mse_loss(model(x).float(), y).backward()
    if torch_clip:
        norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], MAX_NORM)
    else:
        norm = opt.clip_grad_norm_(MAX_NORM)
    opt.step()
    opt.zero_grad()
    return float(full(norm))


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def snapshot(model, opt):
    """Full parameters and the optimizer's full states (a collective: every rank calls it)."""
    state = {
        i: {k: float(v) if k == "step" else full(v).detach().clone() for k, v in entry.items()}
        for i, entry in opt.state_dict()["state"].items()
    }
    return {"params": [full(p).detach().clone() for p in model.parameters()], "state": state}


def groups_of(model, hp):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0}]


def error_of(e):
    return {"type": type(e).__name__, "message": str(e)}


# ------------------------------------------------------------------------------------------ scenarios (in the ranks)


def run_match(rank, opt_name, mp_policy, backend=None, hsdp=None):
    """flatopt and torch.optim, each on its own FSDP2 model, over STEPS steps; and single-process flatopt on
    rank 0. ``backend="triton"``: the Triton kernels (under the interpreter), which read FSDP2's gradient shards
    through their addresses."""
    world = dist.get_world_size()
    flat_cls, ref_cls, hp = OPTIMIZERS[opt_name]
    model, ref = sharded(world, mp_policy, hsdp), sharded(world, mp_policy, hsdp)
    kw = {} if backend is None else {"backend": backend}
    if opt_name == "AdamW":
        opt = flat_cls(groups_of(model, hp), model=model, **hp, **kw)
        ref_opt = ref_cls(groups_of(ref, hp), **hp)
    else:
        opt, ref_opt = flat_cls(model, **hp, **kw), ref_cls(ref.parameters(), **hp)
    buffers = flatopt.inspect(opt).buffers
    out = {"history": [], "norms": [], "ref_norms": []}
    engine = flatopt.inspect(opt).engine
    counted, launch = [], engine.launch

    def counting(*args, **kwargs):
        counted.append(1)
        return launch(*args, **kwargs)

    engine.launch = counting
    from flatopt.engines import fsdp as fsdp_engine

    allocations, acquire = [], fsdp_engine.acquire_grad
    fsdp_engine.acquire_grad = lambda buf: (allocations.append(1), acquire(buf))[1]
    for step in range(STEPS):
        out["norms"].append(train_step(model, opt, rank, world, step))
        out["ref_norms"].append(train_step(ref, ref_opt, rank, world, step, torch_clip=True))
        out["history"].append({"flat": snapshot(model, opt), "ref": snapshot(ref, ref_opt)})
    fsdp_engine.acquire_grad = acquire
    out["launches"] = len(counted)
    out["grad_buffer_allocations"] = len(allocations)
    out["buffers"] = len(buffers)
    # FSDP2 keeps every local shard in flatopt's flat buffer
    storages = {b.data.untyped_storage().data_ptr() for b in buffers}
    out["in_buffer"] = all(
        p.to_local().numel() == 0 or p.to_local().untyped_storage().data_ptr() in storages
        for p in model.parameters()
        if p.requires_grad
    )
    if rank == 0 and mp_policy is None and hsdp is None and backend is None:  # one process, the whole batch
        single = net()
        sopt = flat_cls(groups_of(single, hp), model=single, **hp) if opt_name == "AdamW" else flat_cls(single, **hp)
        out["single"] = []
        for step in range(STEPS):
            train_step(single, sopt, 0, 1, step)
            out["single"].append([p.detach().clone() for p in single.parameters()])
    return out


def run_grad_scale(rank, backend=None):
    """GradScaler's arguments, as its step() hands them to a fused optimizer (``opt.grad_scale``, ``opt.found_inf``):
    with a loss scaled by a power of two, the same parameters as unscaled training, and ``.grad`` left unscaled, as
    torch's fused kernels leave it; a step that found_inf skips changes nothing and leaves ``.grad`` scaled."""
    world, scale = dist.get_world_size(), 1024.0
    kw = {} if backend is None else {"backend": backend}
    runs = {name: sharded(world) for name in ("scaled", "plain")}
    opts = {name: flatopt.AdamW(m, lr=1e-2, **kw) for name, m in runs.items()}
    out = {"after": [], "want": [], "skipped_params": None}
    for step in range(3):
        x, y = (t.chunk(world)[rank] for t in batch(step))
        for name, m in runs.items():
            (nn.functional.mse_loss(m(x), y) * (scale if name == "scaled" else 1.0)).backward()
        scaled, opt = runs["scaled"], opts["scaled"]
        trained = [p for p in scaled.parameters() if p.requires_grad]
        before = [p.grad.to_local().clone() for p in trained]
        opt.grad_scale, opt.found_inf = torch.tensor(scale), torch.tensor(1.0 if step == 1 else 0.0)
        params = [p.to_local().clone() for p in trained]
        opt.step()
        del opt.grad_scale, opt.found_inf
        if step == 1:  # skipped: nothing changes
            out["skipped_params"] = [torch.equal(a, p.to_local()) for a, p in zip(params, trained)]
            out["after"].append([p.grad.to_local().clone() for p in trained])
            out["want"].append(before)
        else:
            opts["plain"].step()
            out["after"].append([p.grad.to_local().clone() for p in trained])
            out["want"].append([p.grad.to_local().clone() for p in runs["plain"].parameters() if p.requires_grad])
        for o in opts.values():
            o.zero_grad()
    out["params"] = [p.to_local().clone() for p in runs["scaled"].parameters()]
    out["plain_params"] = [p.to_local().clone() for p in runs["plain"].parameters()]
    return out


def run_errors(rank):
    """Refusals at construction, each leaving the parameters where they were."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    world = dist.get_world_size()
    out = {}
    model = sharded(world)
    before = [p.to_local().data_ptr() for p in model.parameters()]
    attempts = {
        "accumulation_steps": lambda: flatopt.AdamW(model, in_backward=True, accumulation_steps=2),
        "flat_false": lambda: flatopt.AdamW(model, flat=False),
        "no_model": lambda: flatopt.AdamW(model.parameters()),
        "precision": lambda: flatopt.AdamW(model, state_dtype=torch.bfloat16),
    }
    tp = nn.Linear(4, 6)  # tensor parallelism's kind of DTensor, which fully_shard does not manage
    mesh = init_device_mesh("cpu", (world,))
    tp.weight = nn.Parameter(distribute_tensor(tp.weight.detach(), mesh, [Shard(0)]))
    tp.bias = nn.Parameter(distribute_tensor(tp.bias.detach(), mesh, [Shard(0)]))
    attempts["tensor_parallel"] = lambda: flatopt.AdamW(tp)
    for name, make in attempts.items():
        try:
            make()
            out[name] = None
        except Exception as e:
            out[name] = error_of(e)
    out["unchanged"] = [p.to_local().data_ptr() for p in model.parameters()] == before
    opt = flatopt.AdamW(model)
    try:
        opt.capture(lambda: None)
        out["capture"] = None
    except Exception as e:
        out["capture"] = error_of(e)
    x, y = (t.chunk(world)[rank] for t in batch(0))
    nn.functional.mse_loss(model(x), y).backward()
    grads = [p.grad.to_local().clone() for p in model.parameters() if p.grad is not None]
    for name, order in (("clip_order_0", 0.0), ("clip_order_-inf", -math.inf)):
        try:
            opt.clip_grad_norm_(1.0, norm_type=order)
            out[name] = None
        except Exception as e:
            out[name] = error_of(e)
    out["clip_unchanged"] = all(
        torch.equal(a, p.grad.to_local()) for a, p in zip(grads, [p for p in model.parameters() if p.grad is not None])
    )
    opt.zero_grad()
    model.double()  # FSDP2 gives every parameter a new local shard, off the flat buffer
    try:
        opt.step()
        out["moved"] = None
    except Exception as e:
        out["moved"] = error_of(e)
    from torch.distributed.fsdp import fully_shard

    late = net()
    late_opt = flatopt.AdamW(late)  # the usual mistake: the optimizer before fully_shard
    fully_shard(late, mesh=mesh)
    late_before = [p.to_local().clone() for p in late.parameters()]
    try:
        x, y = (t.chunk(world)[rank] for t in batch(0))
        nn.functional.mse_loss(late(x), y).backward()
        late_opt.step()
        out["sharded_after"] = None
    except Exception as e:
        out["sharded_after"] = error_of(e)
    out["late_unchanged"] = all(torch.equal(a, p.to_local()) for a, p in zip(late_before, late.parameters()))
    # a second flatopt optimizer over some of the parameters (the model's middle layer, a throwaway): the first one's
    # next step looks at every shard (not only each buffer's ends) and names the cause
    twice = sharded(world)
    first = flatopt.AdamW(twice)
    inner = [m for m in twice.modules() if isinstance(m, nn.Linear)][1]
    flatopt.AdamW(list(inner.parameters()), model=twice)
    x, y = (t.chunk(world)[rank] for t in batch(0))
    nn.functional.mse_loss(twice(x), y).backward()
    try:
        first.step()
        out["taken"] = None
    except Exception as e:
        out["taken"] = error_of(e)
    return out


def run_in_backward(rank, accumulate):
    """in_backward=True against step mode on the same FSDP2 model and data, over STEPS steps of two micro-batches
    when ``accumulate`` says how the first is kept from stepping ("no_step": opt.no_step(); "fsdp": FSDP2's
    set_requires_gradient_sync(False)), of one otherwise."""
    world = dist.get_world_size()
    flat_cls, _, hp = OPTIMIZERS["AdamW"]
    model, ref = sharded(world), sharded(world)
    opt, ref_opt = flat_cls(model, in_backward=True, **hp), flat_cls(ref, **hp)
    engine = flatopt.inspect(opt).engine
    out = {"history": [], "freed": [], "clip_error": None, "grad_buffer_bytes": []}
    launch = engine.launch

    def recording(buf, *args, **kwargs):  # what the flat gradient buffer holds while a group is stepped
        out["grad_buffer_bytes"].append(buf.grad.untyped_storage().nbytes())
        return launch(buf, *args, **kwargs)

    engine.launch = recording
    micros = 1 if accumulate is None else 2
    for step in range(STEPS):
        for micro in range(micros):
            x, y = (t.chunk(world)[rank] for t in batch(10 * step + micro))
            last = micro == micros - 1
            for m, o in ((model, opt), (ref, ref_opt)):
                if accumulate == "fsdp":
                    m.set_requires_gradient_sync(last)
                    ctx = nullcontext()
                else:
                    ctx = nullcontext() if last else o.no_step()
                with ctx:
                    nn.functional.mse_loss(m(x), y).backward()
            if not last and accumulate == "no_step":  # the gradients kept in .grad are clipped as torch clips them
                out.setdefault("pending_norms", []).append(
                    (float(opt.clip_grad_norm_(1e9)), float(ref_opt.clip_grad_norm_(1e9)))
                )
        out["freed"].append(all(p.grad is None for p in model.parameters()))
        if step == 0:
            try:
                opt.clip_grad_norm_(1.0)
            except RuntimeError as e:
                out["clip_error"] = str(e)
        hook = opt.register_step_pre_hook(lambda *args: None) if step == 0 else None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        if hook is not None:
            hook.remove()
            out["late_pre_hook"] = [str(w.message) for w in caught if "step pre-hook" in str(w.message)]
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        out["history"].append({"flat": snapshot(model, opt), "ref": snapshot(ref, ref_opt)})
    out["launches"] = engine.launches
    return out


def run_in_backward_second_pass(rank, paused=False):
    """Two backward passes with neither step() nor zero_grad() between them, as a torch.optim loop accumulates:
    in-backward mode stepped the first, so the second is refused at its first gradient, before anything changes
    (``paused``: the second under opt.no_step(), whose gradients would wait for step(), a second update)."""
    world = dist.get_world_size()
    flat_cls, _, hp = OPTIMIZERS["AdamW"]
    model = sharded(world)
    opt = flat_cls(model, in_backward=True, **hp)
    x, y = (t.chunk(world)[rank] for t in batch(0))
    nn.functional.mse_loss(model(x), y).backward()
    before = snapshot(model, opt)
    out = {"refusal": None}  # (not "error": a scenario's result under that key is the traceback it raised)
    try:
        with opt.no_step() if paused else nullcontext():
            nn.functional.mse_loss(model(x), y).backward()
    except RuntimeError as e:
        out["refusal"] = str(e)
    after = snapshot(model, opt)
    out["params_same"] = all(torch.equal(a, b) for a, b in zip(before["params"], after["params"]))
    out["steps"] = sorted(entry["step"] for entry in after["state"].values())
    if fsdp_resets():  # the recovery the message gives: FSDP2's reset (where torch has it) and zero_grad(), then on
        reset_fsdp(model)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        out["recovered_steps"] = sorted(entry["step"] for entry in snapshot(model, opt)["state"].values())
    return out


def run_in_backward_unfreeze(rank):
    """in_backward=True over FSDP2 with model[2] frozen at construction and unfrozen after the first step, against
    torch.optim on the same FSDP2 model: the first pass after unfreezing has no hook for it, FSDP2 leaves its
    gradient in .grad, and step() lays it out and steps it, as torch.optim steps it."""
    world = dist.get_world_size()
    flat_cls, ref_cls, hp = OPTIMIZERS["AdamW"]
    model, ref = sharded(world), sharded(world)
    for m in (model, ref):
        m[2].requires_grad_(False)
    opt, ref_opt = flat_cls(model, in_backward=True, **hp), ref_cls(ref.parameters(), **hp)

    def unfreeze(step):
        if step == 1:
            for m in (model, ref):
                m[2].requires_grad_(True)

    return side_by_side(rank, (model, opt), (ref, ref_opt), 4, before=unfreeze)


def side_by_side(rank, ours, theirs, steps, before=None):
    """``steps`` plain steps (backward, step(), zero_grad()) of two (model, optimizer) pairs on the same data;
    ``before(step)`` runs first at each. Returns {"history": their snapshots after each step}."""
    world = dist.get_world_size()
    out = {"history": []}
    for step in range(steps):
        if before is not None:
            before(step)
        x, y = (t.chunk(world)[rank] for t in batch(step))
        for m, o in (ours, theirs):
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
        out["history"].append({"flat": snapshot(*ours), "ref": snapshot(*theirs)})
    return out


def run_in_backward_groups(rank):
    """in_backward=True over FSDP2 with param groups (decay / no decay) and model=model, against torch.optim on the
    same FSDP2 model and groups."""
    world = dist.get_world_size()
    flat_cls, ref_cls, hp = OPTIMIZERS["AdamW"]
    model, ref = sharded(world), sharded(world)
    opt = flat_cls(groups_of(model, hp), model=model, in_backward=True, **hp)
    ref_opt = ref_cls(groups_of(ref, hp), **hp)
    return side_by_side(rank, (model, opt), (ref, ref_opt), 3)


# In-backward clipping: what each of the STEPS steps runs. "pass": one backward pass, stepped in backward; "accumulate":
# a micro-batch under opt.no_step(), then one stepped in backward (on the sum); "exact": every micro-batch under
# opt.no_step(), then step() clips by the exact global norm.
CLIP_PLAN = ["pass", "pass", "pass", "accumulate", "exact", "pass"]
CLIP_NORM = 0.05  # below every pass's norm here: each step clips (the test checks it)


def clip_groups(model, arrivals):
    """The trainable parameters of each fully_shard group of ``model`` (the two Linear layers, the root's
    skip.bias) in the order FSDP2 reduce-scattered them in the last backward pass: the order of ``arrivals``, the
    parameters whose post-accumulate-grad hooks ran, in the order they ran (FSDP2 runs them group by group)."""
    groups = [[model[2].weight, model[2].bias], [model[0].weight, model[0].bias], [model.skip.bias]]
    first = {}
    for i, p in enumerate(arrivals):
        first.setdefault(p, i)
    assert all(p in first for g in groups for p in g), "a trainable parameter got no gradient"
    return sorted(groups, key=lambda g: first[g[0]])


def global_norm_of(params, norm_type):
    """The norm of the full gradients of ``params`` (a collective), in float64."""
    flat = torch.cat([p.grad.full_tensor().flatten().double() for p in params])
    return torch.linalg.vector_norm(flat, norm_type)


def combine_norms(a, b, norm_type):
    return torch.maximum(a, b) if norm_type == float("inf") else (a**norm_type + b**norm_type) ** (1 / norm_type)


def reference_clip(model, arrivals, norm_type, prev, exact):
    """Clip ``model``'s gradients (torch.optim's FSDP2 model, after backward; ``arrivals``: see :func:`clip_groups`)
    as the definition says, independently of flatopt: each fully_shard group, in backward order, by
    ``min(1, c / (n + 1e-6))``, ``n`` the larger of ``prev`` (the previous stepped pass's total norm; None on the
    first pass) and the global norm of the groups so far, this one included; with ``exact``, every gradient by
    their global total norm. Returns the pass's total norm, the coefficients, and the coefficients a rank-local
    definition (its own shards' norms) would have used."""
    groups = clip_groups(model, arrivals)
    norms = [global_norm_of(g, norm_type) for g in groups]
    local = []
    for g in groups:
        flat = torch.cat([p.grad.to_local().flatten().double() for p in g])
        local.append(torch.linalg.vector_norm(flat, norm_type) if flat.numel() else torch.zeros((), dtype=flat.dtype))
    total = global_norm_of([p for g in groups for p in g], norm_type)
    coefs, local_coefs, running, running_local = [], [], None, None
    for norm, mine in zip(norms, local):
        running = norm if running is None else combine_norms(running, norm, norm_type)
        running_local = mine if running_local is None else combine_norms(running_local, mine, norm_type)
        n, n_local = (total, total) if exact else (running, running_local)
        if prev is not None and not exact:
            n, n_local = torch.maximum(prev, n), torch.maximum(prev, n_local)
        coefs.append(float(torch.clamp(CLIP_NORM / (n + 1e-6), max=1.0)))
        local_coefs.append(float(torch.clamp(CLIP_NORM / (n_local + 1e-6), max=1.0)))
    with torch.no_grad():
        for g, coef in zip(groups, coefs):
            for p in g:
                p.grad.mul_(coef)
    return total, coefs, local_coefs


def run_in_backward_clip(rank, opt_name, norm_type):
    """flatopt (in_backward=True, max_grad_norm=CLIP_NORM) on an FSDP2 model against torch.optim on another, whose
    gradients :func:`reference_clip` clips before each step, over the steps of CLIP_PLAN; with the norms flatopt
    reports (opt.last_grad_norm, torch.nn.utils.clip_grad_norm_ after a stepped pass and opt.clip_grad_norm_ on
    gradients still in .grad) and the refusal of a clipping call with another max_norm."""
    world = dist.get_world_size()
    flat_cls, ref_cls, hp = OPTIMIZERS[opt_name]
    model, ref = sharded(world), sharded(world)
    opt = flat_cls(model, in_backward=True, max_grad_norm=CLIP_NORM, norm_type=norm_type, **hp)
    ref_opt = ref_cls(ref.parameters(), **hp)
    params = list(model.parameters())
    arrivals = []  # the reference model's parameters, as FSDP2 runs their post-accumulate-grad hooks
    for p in ref.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(arrivals.append)
    out = {"history": [], "last": [], "torch_clip": [], "pending": [], "ref_total": [], "coefs": [], "local_coefs": []}
    out["last_before"] = opt.last_grad_norm
    prev = None
    for step, how in enumerate(CLIP_PLAN):
        micros = 1 if how == "pass" else 2
        for micro in range(micros):
            x, y = (t.chunk(world)[rank] for t in batch(100 + 10 * step + micro))
            hold = how == "exact" or micro < micros - 1
            with opt.no_step() if hold else nullcontext():
                nn.functional.mse_loss(model(x), y).backward()
            arrivals.clear()
            nn.functional.mse_loss(ref(x), y).backward()
        if how == "exact":  # the gradients wait in .grad: their global norm, left for step() to clip
            out["pending"].append(float(opt.clip_grad_norm_(CLIP_NORM, norm_type=norm_type)))
        else:  # a stepped pass: torch's call returns the norm it was clipped by, and clips nothing more
            out["torch_clip"].append(float(torch.nn.utils.clip_grad_norm_(params, CLIP_NORM, norm_type=norm_type)))
            if step == 0:
                try:
                    torch.nn.utils.clip_grad_norm_(params, 2 * CLIP_NORM, norm_type=norm_type)
                    out["other_max_norm"] = None
                except RuntimeError as e:
                    out["other_max_norm"] = str(e)
        opt.step()
        opt.zero_grad()
        out["last"].append(float(opt.last_grad_norm))
        total, coefs, local_coefs = reference_clip(ref, arrivals, norm_type, prev, exact=how == "exact")
        prev = total
        ref_opt.step()
        ref_opt.zero_grad()
        out["ref_total"].append(float(total))
        out["coefs"].append(coefs)
        out["local_coefs"].append(local_coefs)
        out["history"].append({"flat": snapshot(model, opt), "ref": snapshot(ref, ref_opt)})
    out["launches"] = flatopt.inspect(opt).engine.launches
    return out


class Raised(Exception):
    """What the backward passes that fail in :func:`run_in_backward_recover` raise."""


def raising(p):
    raise Raised("a post-accumulate-grad hook raised during backward")


def fsdp_resets():
    """Whether this torch's FSDP2 can reset its state after a backward pass that raised
    (``FSDPModule.reset_iter_state()``, in torch 2.13, not in 2.11): without it the FSDP2 model runs no
    post-accumulate-grad hooks in later passes."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return hasattr(FSDPModule, "reset_iter_state")


def reset_fsdp(model):
    """FSDP2's own recovery after a backward pass that raised (see :func:`fsdp_resets`)."""
    model.reset_iter_state()


RECOVER_STEPS = 6  # steps of run_in_backward_recover: passes stepped in backward but for the failed ones
RECOVERIES = {1: "zero_grad", 3: "step"}  # the steps whose pass raises, and the call that recovers from it


def run_in_backward_recover(rank, skip_unused):
    """flatopt.SGD (in_backward=True, max_grad_norm=CLIP_NORM, skip_unused) on an FSDP2 model through backward
    passes that raise part way, against torch.optim on another model through the same failed passes. The passes of
    the steps of RECOVERIES raise in a post-accumulate-grad hook of model[0].weight that runs after flatopt's (so
    that flatopt has taken the gradient, its group left part arrived), when the model[2] and root groups have been
    stepped; then reset_fsdp() (FSDP2's reset_iter_state()) and the recovery: opt.zero_grad() (step 1), or
    opt.step() alone (step 3), which steps the gradients the failed pass left in .grad (the next pass follows it
    with no opt.zero_grad() in between). The reference steps, for a failed pass, the groups flatopt stepped, each
    clipped by the running norm of the pass so far, and, for opt.step(), the gradients left in .grad, clipped by
    their own global norm (an exact step of what .grad holds), and, with skip_unused=False, the other parameters of
    the group the failed pass did not step, with a zero gradient; the next pass's N_prev is the last completed
    pass's norm after zero_grad(), that global norm after step(). The other steps are passes stepped in backward,
    clipped by the definition. Apart, on a third model: a backward pass after one that raised, with neither
    opt.zero_grad() nor opt.step() in between, is refused before anything is updated, and the pass after
    opt.zero_grad() is stepped."""
    world = dist.get_world_size()
    flat_cls, ref_cls, hp = OPTIMIZERS["SGD"]
    model, ref = sharded(world), sharded(world)
    opt = flat_cls(model, in_backward=True, max_grad_norm=CLIP_NORM, skip_unused=skip_unused, **hp)
    ref_opt = ref_cls(ref.parameters(), **hp)
    engine = flatopt.inspect(opt).engine
    arrivals = []  # the reference model's parameters, as FSDP2 runs their post-accumulate-grad hooks
    for p in ref.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(arrivals.append)

    def data(step):
        return (t.chunk(world)[rank] for t in batch(200 + step))

    out = {"history": [], "last": [], "ref_total": [], "freed": [], "launches": [], "raised": 0, "failed": {}}
    prev = None
    for step in range(RECOVER_STEPS):
        x, y = data(step)
        launches = engine.launches
        how = RECOVERIES.get(step)
        if how is None:
            nn.functional.mse_loss(model(x), y).backward()
            # the pass ended as one: every gradient stepped and freed, its total norm recorded (end of pass)
            out["freed"].append(all(p.grad is None for p in model.parameters()))
            out["launches"].append(engine.launches - launches)
            arrivals.clear()
            nn.functional.mse_loss(ref(x), y).backward()
            prev, _, _ = reference_clip(ref, arrivals, 2.0, prev, exact=False)
        else:
            handles = [m[0].weight.register_post_accumulate_grad_hook(raising) for m in (model, ref)]
            for m in (model, ref):
                arrivals.clear()
                try:
                    nn.functional.mse_loss(m(x), y).backward()
                except Raised:
                    out["raised"] += 1
                reset_fsdp(m)
            for h in handles:
                h.remove()
            failed = out["failed"][how] = {
                "launches": engine.launches - launches,
                "last": float(opt.last_grad_norm),  # the failed pass records no total norm
                "left_in_grad": sum(p.grad is not None for p in model.parameters()),
            }
            if how == "zero_grad":
                opt.zero_grad()  # the recovery: drops the failed pass, and the gradients it left in .grad
                failed["zeroed"] = all(p.grad is None for p in model.parameters())
            # the reference: the groups complete when the hook raised were stepped, by the running norm so far
            groups = [[ref[2].weight, ref[2].bias], [ref[0].weight, ref[0].bias], [ref.skip.bias]]
            order = {p: i for i, p in enumerate(arrivals)}
            complete = [g for g in groups if all(p in order for p in g)]
            complete.sort(key=lambda g: order[g[0]])
            failed["arrived"], failed["complete"] = len(order), len(complete)
            unstepped = [p for g in groups if not any(g is c for c in complete) for p in g]
            left = [p for p in unstepped if p.grad is not None]
            failed["ref_left_in_grad"] = len(left)
            failed["unstepped"] = [any(q is p for p in unstepped) for q in ref.parameters()]
            running = None
            with torch.no_grad():
                for g in complete:
                    norm = global_norm_of(g, 2.0)
                    running = norm if running is None else combine_norms(running, norm, 2.0)
                    coef = torch.clamp(CLIP_NORM / (torch.maximum(prev, running) + 1e-6), max=1.0)
                    for p in g:
                        p.grad.mul_(coef)
                if how == "step":  # opt.step(): what .grad holds, clipped by its own global norm, which is N_prev next
                    prev = global_norm_of(left, 2.0)
                    for p in left:
                        p.grad.mul_(torch.clamp(CLIP_NORM / (prev + 1e-6), max=1.0))
                    if not skip_unused:  # the others of the groups the failed pass did not step: a zero gradient
                        for p in unstepped:
                            if p.grad is None:
                                p.grad = torch.zeros_like(p)
                else:
                    for p in left:
                        p.grad = None  # dropped by zero_grad(): torch.optim skips a parameter without a gradient
        before = [full(p).detach().clone() for p in model.parameters()]
        had_grad = [p.grad is not None for p in model.parameters()]
        opt.step()
        if how == "step":  # which parameters opt.step() moved, and whether it freed every gradient
            out["failed"][how]["had_grad"] = had_grad
            out["failed"][how]["moved"] = [not torch.equal(a, full(p)) for a, p in zip(before, model.parameters())]
            out["failed"][how]["freed"] = all(p.grad is None for p in model.parameters())
        else:  # after the recovery by opt.step(), the next backward pass comes with no opt.zero_grad() before it
            opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        out["last"].append(float(opt.last_grad_norm))
        out["ref_total"].append(float(prev))
        out["history"].append({"flat": snapshot(model, opt), "ref": snapshot(ref, ref_opt)})

    # refused: a backward pass after one that raised, with neither opt.zero_grad() nor opt.step() in between
    other = sharded(world)
    other_opt = flat_cls(other, in_backward=True, **hp)
    x, y = data(0)
    handle = other[2].weight.register_post_accumulate_grad_hook(raising)
    try:
        nn.functional.mse_loss(other(x), y).backward()
    except Raised:
        out["raised"] += 1
    handle.remove()
    reset_fsdp(other)
    before = [full(p).detach().clone() for p in other.parameters()]
    try:
        nn.functional.mse_loss(other(x), y).backward()
        out["refused"] = None
    except RuntimeError as e:
        out["refused"] = str(e)
    reset_fsdp(other)
    out["unchanged_by_refused"] = all(torch.equal(a, full(p)) for a, p in zip(before, other.parameters()))
    other_opt.zero_grad()
    launches = flatopt.inspect(other_opt).engine.launches
    nn.functional.mse_loss(other(x), y).backward()
    out["after_refused_launches"] = flatopt.inspect(other_opt).engine.launches - launches
    out["after_refused_freed"] = all(p.grad is None for p in other.parameters())
    out["after_refused_moved"] = not all(torch.equal(a, full(p)) for a, p in zip(before, other.parameters()))
    return out


def dcp_api():
    """torch.distributed.checkpoint and its state_dict helpers (imported where torch.distributed is available)."""
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.state_dict as sd

    return dcp, sd


def checkpoint_dir(name):
    return os.path.join(os.environ[CKPT_ENV], name)


def dcp_options(full_state):
    return dcp_api()[1].StateDictOptions(full_state_dict=full_state)


def trained(rank, world):
    """A sharded model and its flatopt.AdamW after 3 steps."""
    flat_cls, _, hp = OPTIMIZERS["AdamW"]
    model = sharded(world)
    opt = flat_cls(model, **hp)
    for step in range(3):
        train_step(model, opt, rank, world, step)
    return model, opt


def run_checkpoints(rank):
    """Train 3 steps, save (DCP, sharded) and export (full), then continue 3 steps; a new flatopt optimizer
    loading the sharded state dict and torch.optim loading the full one, on models loaded from the checkpoint,
    continue the same 3 steps."""
    dcp, sd = dcp_api()

    world = dist.get_world_size()
    flat_cls, ref_cls, hp = OPTIMIZERS["AdamW"]
    model, opt = trained(rank, world)
    sharded_osd = sd.get_optimizer_state_dict(model, opt)
    out = {
        "state_types": sorted({type(v).__name__ for e in sharded_osd["state"].values() for v in e.values()}),
        "keys": sorted(sharded_osd["state"]),
    }
    dcp.save({"model": sd.get_model_state_dict(model), "optim": sharded_osd}, checkpoint_id=checkpoint_dir("two"))
    full_osd = sd.get_optimizer_state_dict(model, opt, options=dcp_options(True))
    out["full_types"] = sorted({type(v).__name__ for e in full_osd["state"].values() for v in e.values()})
    full_msd = sd.get_model_state_dict(model, options=dcp_options(True))

    def resumed(make_opt, osd, options):
        m = sharded(world)
        sd.set_model_state_dict(m, full_msd, options=dcp_options(True))
        o = make_opt(m)
        sd.set_optimizer_state_dict(m, o, osd, options=options)
        return m, o

    def full_in_torch_format(m):  # torch.optim's own format, of full tensors: each rank keeps its shard of them
        o = flat_cls(m, **hp)
        sd = opt.state_dict()
        sd["state"] = {k: {n: full(v) for n, v in e.items()} for k, e in sd["state"].items()}
        o.load_state_dict(sd)
        return o

    plain = sharded(world)
    sd.set_model_state_dict(plain, full_msd, options=dcp_options(True))
    runs = {
        "original": (model, opt),
        "flatopt_full_load_state_dict": (plain, full_in_torch_format(plain)),
        "flatopt_sharded": resumed(lambda m: flat_cls(m, **hp), sharded_osd, dcp_options(False)),
        "torch_full": resumed(lambda m: ref_cls(m.parameters(), **hp), full_osd, dcp_options(True)),
    }
    for name, (m, o) in runs.items():
        out[name] = []
        for step in range(3, 6):
            train_step(m, o, rank, world, step, torch_clip=name == "torch_full")
            out[name].append(snapshot(m, o))
    return out


def resume_from(name, rank):
    """A model and flatopt optimizer on this world size, loaded from DCP checkpoint ``name``, trained 3 steps."""
    dcp, sd = dcp_api()

    world = dist.get_world_size()
    flat_cls, _, hp = OPTIMIZERS["AdamW"]
    model = sharded(world)
    opt = flat_cls(model, **hp)
    state = {"model": sd.get_model_state_dict(model), "optim": sd.get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=checkpoint_dir(name))
    sd.set_model_state_dict(model, state["model"])
    sd.set_optimizer_state_dict(model, opt, state["optim"])
    history = []
    for step in range(3, 6):
        train_step(model, opt, rank, world, step)
        history.append(snapshot(model, opt))
    return history


def run_four(rank):
    """On four ranks: resume from the two-rank checkpoint; and train 3 steps from scratch, save, continue."""
    dcp, sd = dcp_api()

    out = {"from_two": resume_from("two", rank)}
    world = dist.get_world_size()
    model, opt = trained(rank, world)
    state = {"model": sd.get_model_state_dict(model), "optim": sd.get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=checkpoint_dir("four"))
    out["original"] = []
    for step in range(3, 6):
        train_step(model, opt, rank, world, step)
        out["original"].append(snapshot(model, opt))
    return out


def run_from_four(rank):
    return {"from_four": resume_from("four", rank)}


RESUME_SCALES = [1.0, 30.0, 0.03, 1.0]  # pass 2's norm is below pass 1's: N_prev decides pass 2's clip


def run_in_backward_clip_resume(rank):
    """SGD (in_backward=True, max_grad_norm) over FSDP2, two passes, then resumed three ways, each going on two
    passes beside the original: from opt.state_dict() through torch.save, torch.load and opt.load_state_dict()
    (its "flatopt" entry holds N_prev), and through torch.distributed.checkpoint's get_optimizer_state_dict /
    set_optimizer_state_dict, sharded and full, which carry "state" and "param_groups" only (the load warns)."""
    dcp, sd = dcp_api()
    world = dist.get_world_size()
    flat_cls, _, hp = OPTIMIZERS["SGD"]

    def make(m):
        return flat_cls(m, in_backward=True, max_grad_norm=CLIP_NORM, **hp)

    def run_pass(m, o, step):
        x, y = (t.chunk(world)[rank] for t in batch(200 + step))
        (RESUME_SCALES[step] * nn.functional.mse_loss(m(x), y)).backward()
        o.step()
        o.zero_grad()
        return float(o.last_grad_norm)

    model = sharded(world)
    opt = make(model)
    out = {"norms": [run_pass(model, opt, step) for step in range(2)]}
    saved = opt.state_dict()
    out["saved_clip"] = {k: v if k == "norm_type" else v.clone() for k, v in saved["flatopt"]["clip"].items()}
    file = io.BytesIO()  # as each rank saves it: torch.save (DTensor states over views of the flat buffers)
    torch.save(saved, file)
    full_msd = sd.get_model_state_dict(model, options=dcp_options(True))
    exported = {
        "dcp_sharded": sd.get_optimizer_state_dict(model, opt),
        "dcp_full": sd.get_optimizer_state_dict(model, opt, options=dcp_options(True)),
    }
    out["dcp_keys"] = {name: sorted(osd) for name, osd in exported.items()}
    runs = {"original": (model, opt)}
    for name in ("load_state_dict", *exported):
        m = sharded(world)
        sd.set_model_state_dict(m, full_msd, options=dcp_options(True))
        o = make(m)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if name == "load_state_dict":
                file.seek(0)
                o.load_state_dict(torch.load(file))
            else:
                sd.set_optimizer_state_dict(m, o, exported[name], options=dcp_options(name == "dcp_full"))
        out[f"{name}_warnings"] = [str(w.message) for w in caught if "N_prev" in str(w.message)]
        out[f"{name}_last"] = None if o.last_grad_norm is None else float(o.last_grad_norm)
        runs[name] = (m, o)
    for name, (m, o) in runs.items():
        out[name] = [run_pass(m, o, step) for step in range(2, 4)]
        out[f"{name}_params"] = [full(p).detach().clone() for p in m.parameters()]
    return out


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # the Triton kernels run on the CPU (make test sets it)
MATCH = [
    ("AdamW", None, None),
    ("SGD", None, None),
    ("Lion", None, None),
    ("AdamW", {"param_dtype": torch.bfloat16}, None),
    ("AdamW", None, "triton"),
]


# SGD's update is linear in the gradient, so a wrong clip coefficient shows in full; AdamW's normalises it away in part
IN_BACKWARD_CLIP = [("SGD", 2.0), ("SGD", float("inf")), ("AdamW", 2.0)]


def match_id(opt_name, mp_policy, backend):
    return opt_name + ("-bf16" if mp_policy else "") + (f"-{backend}" if backend else "")


SCENARIOS = {
    **{f"match:{match_id(*m)}": (run_match, m) for m in MATCH if m[2] != "triton" or INTERPRETED},
    **{f"grad_scale:{b}": (run_grad_scale, (b,)) for b in (None, "torch", "triton") if b != "triton" or INTERPRETED},
    **{f"in_backward:{a}": (run_in_backward, (a,)) for a in (None, "no_step", "fsdp")},
    **{f"in_backward_clip:{o}-{n}": (run_in_backward_clip, (o, n)) for o, n in IN_BACKWARD_CLIP},
    **{f"in_backward_recover:{s}": (run_in_backward_recover, (s,)) for s in (True, False) if fsdp_resets()},
    "in_backward_clip_resume": (run_in_backward_clip_resume, ()),
    "in_backward_second_pass": (run_in_backward_second_pass, ()),
    "in_backward_second_pass_paused": (run_in_backward_second_pass, (True,)),
    "in_backward_unfreeze": (run_in_backward_unfreeze, ()),
    "in_backward_groups": (run_in_backward_groups, ()),
    "errors": (run_errors, ()),
    "checkpoints": (run_checkpoints, ()),
}
HSDP = ("AdamW", None, None, (2, 2))  # two replicas of two shards
FOUR = {"four": (run_four, ()), "match:hsdp": (run_match, HSDP)}
BACK_TO_TWO = {"from_four": (run_from_four, ())}


# ------------------------------------------------------------------------------------------- the runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The three runs, in order (each later one loads a checkpoint of the one before)."""
    tmp = tmp_path_factory.mktemp("fsdp")
    for name in ("two_ranks", "four_ranks", "back"):
        (tmp / name).mkdir()
    os.environ[CKPT_ENV] = str(tmp)  # inherited by the spawned ranks
    try:
        two = ranks.run("test_fsdp", 2, str(tmp / "two_ranks"), RUN_TIMEOUT_S)
        four = ranks.run("test_fsdp", 4, str(tmp / "four_ranks"), RUN_TIMEOUT_S, table="FOUR")
        back = ranks.run("test_fsdp", 2, str(tmp / "back"), RUN_TIMEOUT_S, table="BACK_TO_TWO")
    finally:
        del os.environ[CKPT_ENV]
    return {"two": two, "four": four, "back": back}


# ------------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("scenario", [match_id(*m) for m in MATCH])
def test_matches_torch_optim_on_the_same_fsdp2_model(runs, scenario):
    """Parameters and every state equal torch.optim's on the same FSDP2 model at every step, on each rank; the
    clipping norms are the global ones torch computes; one launch per flat buffer per step; FSDP2's local
    shards live in flatopt's buffer; the flat gradient buffer is allocated only where the launch reads it. With the
    CPU backend, and with the Triton kernels (under the interpreter)."""
    if scenario.endswith("-triton") and not INTERPRETED:
        pytest.skip("the Triton kernels run on the CPU only under the interpreter: set TRITON_INTERPRET=1")
    for rank, result in enumerate(runs["two"](f"match:{scenario}")):
        hist = result["history"]
        ranks.assert_history([h["flat"] for h in hist], [h["ref"] for h in hist], f"rank {rank}", **TOL)
        torch.testing.assert_close(result["norms"], result["ref_norms"], **TOL)
        assert result["buffers"] == 1 and result["launches"] == STEPS, result
        assert result["in_buffer"], f"rank {rank}: FSDP2's local shards are not views of the flat buffer"
        # the Triton kernels read every shard in place and store none: no flat gradient buffer is allocated; the
        # CPU backend reads its alignment padding, so it allocates one at every step
        want = 0 if scenario.endswith("-triton") else STEPS
        assert result["grad_buffer_allocations"] == want, (rank, result["grad_buffer_allocations"])


@pytest.mark.parametrize("backend", [None, "torch", "triton"])
def test_grad_scale_leaves_unscaled_gradients_as_torch_fused(runs, backend):
    """Under GradScaler's grad_scale the steps are those of unscaled training and each rank's ``.grad`` shards hold
    the unscaled gradients after the step (as torch's fused kernels leave them), with the CPU backend (None: the
    default), the torch reference and the Triton kernels; a step skipped by found_inf changes no parameter and
    leaves the scaled gradients."""
    if backend == "triton" and not INTERPRETED:
        pytest.skip("the Triton kernels run on the CPU only under the interpreter: set TRITON_INTERPRET=1")
    for rank, result in enumerate(runs["two"](f"grad_scale:{backend}")):
        assert all(result["skipped_params"]), (rank, result["skipped_params"])
        for step, (after, want) in enumerate(zip(result["after"], result["want"])):
            for i, (a, w) in enumerate(zip(after, want)):
                where = f"rank {rank}, step {step}, grad {i}"
                torch.testing.assert_close(a, w, rtol=0, atol=0, msg=lambda m, where=where: f"{where}: {m}")
        for i, (a, w) in enumerate(zip(result["params"], result["plain_params"])):
            torch.testing.assert_close(a, w, rtol=0, atol=0, msg=lambda m: f"rank {rank}, param {i}: {m}")


def test_hsdp_matches_torch_optim(runs):
    """HSDP on four ranks (a 2-D mesh: two replicas of two shards): as torch.optim on the same model; the
    gradient norm is taken over the shards once (not once per replica)."""
    for rank, result in enumerate(runs["four"]("match:hsdp")):
        hist = result["history"]
        ranks.assert_history([h["flat"] for h in hist], [h["ref"] for h in hist], f"rank {rank}", **TOL)
        torch.testing.assert_close(result["norms"], result["ref_norms"], **TOL)
        assert result["in_buffer"], f"rank {rank}: FSDP2's local shards are not views of the flat buffer"


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_matches_single_process_flatopt(runs, opt_name):
    """Two ranks of FSDP2 take the same steps as one process on the whole batch."""
    result = runs["two"](f"match:{opt_name}")[0]
    for step, (ours, single) in enumerate(zip(result["history"], result["single"]), start=1):
        for i, (p, q) in enumerate(zip(ours["flat"]["params"], single)):
            torch.testing.assert_close(p, q, **TOL, msg=lambda m: f"step {step}, parameter {i}: {m}")


@pytest.mark.parametrize("accumulate", [None, "no_step", "fsdp"])
def test_in_backward_matches_step_mode(runs, accumulate):
    """in_backward=True steps each fully_shard group once FSDP2 has reduce-scattered its gradients (one launch
    per group and step: three groups here) and frees them; the result is bit-identical to step mode, also when
    micro-batches accumulate under opt.no_step() or FSDP2's set_requires_gradient_sync(False); the flat gradient
    buffer (the rank's whole size) is not allocated to step a group. After a stepped
    pass, clip_grad_norm_ is refused (built without max_grad_norm); gradients accumulated under no_step() are
    clipped as in step mode."""
    for rank, result in enumerate(runs["two"](f"in_backward:{accumulate}")):
        hist = result["history"]
        ranks.assert_history([h["flat"] for h in hist], [h["ref"] for h in hist], f"rank {rank}", rtol=0, atol=0)
        assert all(result["freed"]), f"rank {rank}: sharded gradients left after a stepped pass: {result['freed']}"
        assert result["launches"] == 3 * STEPS, result["launches"]
        # each group's gradients are staged in a tensor of the group's size: the flat gradient buffer, the size of
        # every group of the rank, is never allocated
        assert result["grad_buffer_bytes"] == [0] * (3 * STEPS), result["grad_buffer_bytes"]
        assert "cannot clip the gradients: the backward pass applied them" in (result["clip_error"] or ""), result[
            "clip_error"
        ]
        late = result["late_pre_hook"]
        assert len(late) == 1, late  # the hook ran after the step's last pass had stepped the parameters
        for ours, step_mode in result.get("pending_norms", []):  # summed in another order: the layout is grouped
            assert ours == pytest.approx(step_mode, rel=1e-6), (ours, step_mode)
        assert (accumulate == "no_step") == bool(result.get("pending_norms"))


@pytest.mark.parametrize("opt_name, norm_type", IN_BACKWARD_CLIP)
def test_in_backward_clips_by_the_global_norm(runs, opt_name, norm_type):
    """in_backward=True with max_grad_norm over FSDP2 clips each fully_shard group, in backward, by
    min(1, c / (n + 1e-6)), n the larger of the previous stepped pass's global total norm and the global norm of
    the groups stepped so far in the pass: parameters and states equal torch.optim's on gradients clipped so (by
    tests' own code, from the full gradients) at every step, also for a pass after micro-batches accumulated under
    no_step(), and for a step() whose gradients all waited under no_step(), which clips by their exact global norm.
    Every step clips; opt.last_grad_norm and torch.nn.utils.clip_grad_norm_ return the global total norm, the
    same on every rank; a clipping call with another max_norm is refused."""
    results = runs["two"](f"in_backward_clip:{opt_name}-{norm_type}")
    for rank, result in enumerate(results):
        what = f"rank {rank}, {opt_name}, norm_type {norm_type}"
        hist = result["history"]
        ranks.assert_history([h["flat"] for h in hist], [h["ref"] for h in hist], what, **TOL)
        coefs = result["coefs"]
        assert all(c < 1 for step in coefs for c in step), f"{what}: a step did not clip: {coefs}"
        # the data tells the definition apart from a rank-local one and from one by the previous pass's norm alone
        assert any(abs(a - b) > 1e-3 for g, m in zip(coefs, result["local_coefs"]) for a, b in zip(g, m)), what
        by_prev = [  # each pass after the first by the previous pass's norm alone
            (c, CLIP_NORM / (prev + 1e-6))
            for c, prev, how in zip(coefs[1:], result["ref_total"], CLIP_PLAN[1:])
            if how != "exact"
        ]
        assert any(abs(a - b) > 1e-3 for c, b in by_prev for a in c), f"{what}: the running norm never mattered"
        torch.testing.assert_close(result["last"], result["ref_total"], **TOL)
        stepped = [n for n, how in zip(result["last"], CLIP_PLAN) if how != "exact"]
        assert result["torch_clip"] == stepped, (result["torch_clip"], stepped)
        exact = [n for n, how in zip(result["ref_total"], CLIP_PLAN) if how == "exact"]
        torch.testing.assert_close(result["pending"], exact, **TOL)
        assert result["last_before"] is None
        assert "asks for another clipping" in (result["other_max_norm"] or ""), result["other_max_norm"]
        assert result["launches"] == 3 * len(stepped), result["launches"]  # one launch per group and stepped pass
    assert results[0]["last"] == results[1]["last"], "the ranks clipped by different norms"


def test_in_backward_refuses_a_second_backward_pass_before_anything_changes(runs):
    """A second backward pass with neither step() nor zero_grad() since the first, which in-backward mode stepped:
    torch.optim would step once with the summed gradients; flatopt refuses it on every rank, at its first gradient,
    with nothing updated (single-process in-backward mode refuses it alike)."""
    for rank, result in [*enumerate(runs["two"]("in_backward_second_pass")), *enumerate(
        runs["two"]("in_backward_second_pass_paused"))]:  # fmt: skip
        assert "started with neither opt.step() nor opt.zero_grad()" in (result["refusal"] or ""), result
        assert "model.reset_iter_state()" in result["refusal"]
        assert result["params_same"] and set(result["steps"]) == {1.0}, (rank, result)
        if fsdp_resets():
            assert set(result["recovered_steps"]) == {2.0}, (rank, result)


def test_in_backward_steps_a_parameter_unfrozen_after_construction_as_torch_optim(runs):
    for rank, result in enumerate(runs["two"]("in_backward_unfreeze")):
        hist = result["history"]
        ranks.assert_history([h["flat"] for h in hist], [h["ref"] for h in hist], f"rank {rank}", **TOL)


def test_in_backward_takes_param_groups_beside_the_model(runs):
    """flatopt.AdamW(groups, model=model, in_backward=True) over FSDP2 (decay / no decay, the usual setup), as in step
    mode and under DDP: it matches torch.optim with the same groups."""
    for rank, result in enumerate(runs["two"]("in_backward_groups")):
        hist = result["history"]
        ranks.assert_history([h["flat"] for h in hist], [h["ref"] for h in hist], f"rank {rank}", **TOL)


def test_in_backward_clipping_resumes_with_the_previous_norm(runs):
    """in_backward=True with max_grad_norm over FSDP2: opt.state_dict() holds N_prev (the global total norm of
    the last stepped pass, the same on every rank) and opt.load_state_dict() restores it, so the resumed run goes
    on bit-identical to the original, whose first pass after the checkpoint is clipped by N_prev (checked: its
    norm is smaller). torch.distributed.checkpoint's get_optimizer_state_dict keeps only "state" and
    "param_groups", sharded and full: set_optimizer_state_dict leaves N_prev unknown and warns, saying how to
    resume bit for bit; the run then takes another first pass."""
    results = runs["two"]("in_backward_clip_resume")
    for rank, result in enumerate(results):
        what = f"rank {rank}"
        norms, original = result["norms"], result["original"]
        assert result["saved_clip"]["norm_type"] == 2.0
        assert float(result["saved_clip"]["prev_norm"]) == norms[-1], what
        assert original[0] < norms[-1], f"{what}: the data no longer lets N_prev decide the pass after resuming"
        assert result["load_state_dict_last"] == norms[-1] and result["load_state_dict_warnings"] == [], what
        assert result["load_state_dict"] == original, what
        for p, q in zip(result["load_state_dict_params"], result["original_params"]):
            assert torch.equal(p, q), f"{what}: the run resumed from opt.state_dict() differs by {(p - q).abs().max()}"
        for name in ("dcp_sharded", "dcp_full"):
            assert result["dcp_keys"][name] == ["param_groups", "state"], (what, name, result["dcp_keys"][name])
            assert result[f"{name}_last"] is None, (what, name)
            warned = result[f"{name}_warnings"]
            assert len(warned) == 1 and "torch.distributed.checkpoint" in warned[0], warned
            assert not all(torch.equal(p, q) for p, q in zip(result[f"{name}_params"], result["original_params"]))
    assert results[0]["norms"] == results[1]["norms"] and results[0]["original"] == results[1]["original"]


@pytest.mark.skipif(
    not fsdp_resets(),
    reason="this torch's FSDP2 has no reset_iter_state() (torch 2.11 has none): after a backward pass that raised it "
    "runs no post-accumulate-grad hooks, which in-backward mode steps from, and offers no way to reset that",
)
@pytest.mark.parametrize("skip_unused", [True, False])
def test_in_backward_recovers_from_a_backward_pass_that_raised(runs, skip_unused):
    """A backward pass that raised part way (after flatopt had stepped two fully_shard groups and taken one
    gradient of the third) leaves the groups it stepped stepped and nothing else, with the gradients of the third
    in .grad; after FSDP2's reset_iter_state() and either recovery, each backward pass is one pass again, ended as
    one: every gradient stepped and freed by its end, one launch per group, its global total norm recorded.
    opt.zero_grad() drops the failed pass's running norm and gradients; opt.step() steps those gradients (clipped
    by their own global norm, which becomes N_prev), with skip_unused=False also the other parameters of the group
    the failed pass did not step (a zero gradient), and never again a group the failed pass stepped; it frees them,
    and the next pass, with no opt.zero_grad() before it, is stepped. Parameters and states equal torch.optim's
    through the same failed passes (stepping what flatopt stepped, clipped by the definition) at every step. A
    backward pass after one that raised, with neither opt.zero_grad() nor opt.step() in between, is refused and
    updates nothing; after opt.zero_grad() the next is stepped."""
    for rank, result in enumerate(runs["two"](f"in_backward_recover:{skip_unused}")):
        what = f"rank {rank}"
        hist = result["history"]
        assert len(hist) == RECOVER_STEPS, what
        ranks.assert_history([h["flat"] for h in hist], [h["ref"] for h in hist], what, **TOL)
        assert result["raised"] == 5, f"{what}: the failing passes did not all raise: {result['raised']}"
        assert result["failed"].keys() == {"zero_grad", "step"}, result["failed"]
        for how, failed in result["failed"].items():
            # model[2]'s and the root's groups stepped, model[0]'s with one gradient of two taken
            assert (failed["arrived"], failed["complete"], failed["launches"]) == (4, 2, 2), f"{what}, {how}: {failed}"
            assert failed["left_in_grad"] == failed["ref_left_in_grad"] > 0, f"{what}, {how}: {failed}"
        assert result["failed"]["zero_grad"]["zeroed"], f"{what}: gradients left after opt.zero_grad()"
        by_step = result["failed"]["step"]
        # opt.step() moved exactly the parameters whose gradients the failed pass left in .grad (with
        # skip_unused=False, every parameter of the groups it did not step, and not those it stepped), and freed them
        moves = [had or (not skip_unused and u) for had, u in zip(by_step["had_grad"], by_step["unstepped"])]
        assert by_step["moved"] == moves and by_step["freed"], f"{what}: opt.step() after it: {by_step}"
        assert moves != by_step["had_grad"] or skip_unused, f"{what}: no parameter without a gradient to step"
        # every other pass ended as one
        assert all(result["freed"]), f"{what}: gradients left in .grad after a pass: {result['freed']}"
        passes = RECOVER_STEPS - len(RECOVERIES)
        assert result["launches"] == [3] * passes, f"{what}: launches per pass: {result['launches']}"
        for how, step in ((h, s) for s, h in RECOVERIES.items()):  # a failed pass records no total norm
            assert result["failed"][how]["last"] == result["last"][step - 1], f"{what}: {how}'s failed pass set it"
        # last_grad_norm after each step: the pass's total, unchanged by zero_grad(), what opt.step() stepped
        torch.testing.assert_close(result["last"], result["ref_total"], rtol=1e-6, atol=1e-6, msg=what)
        # refused without opt.zero_grad(), updating nothing; stepped after it
        assert "a backward pass started after the previous one raised, without opt.zero_grad()" in (
            result["refused"] or ""
        ), f"{what}: {result['refused']}"
        assert result["unchanged_by_refused"], f"{what}: the refused pass updated parameters"
        assert result["after_refused_launches"] == 3 and result["after_refused_freed"], result
        assert result["after_refused_moved"], f"{what}: the pass after opt.zero_grad() updated nothing"


def test_what_cannot_work_is_refused_at_construction(runs):
    """In-backward mode with accumulation_steps, flat=False, FSDP2 parameters given without their model, the storage
    options (master_weights, stochastic_rounding, state_dtype) and tensor-parallel DTensors are refused by the
    constructor, saying why, before the shards move; a model
    whose shards FSDP2 replaced (model.double()) by the next step(), as is an optimizer created before fully_shard
    (saying so); capture() by capture(); opt.clip_grad_norm_ of an order its all-reduce cannot combine (0) by the
    call, leaving the gradients as they were."""
    expected = {
        "accumulation_steps": r"in_backward=True\) over FSDP2 does not take accumulation_steps: accumulate under",
        "flat_false": r"flat=False\) cannot step '0.weight', a DTensor",
        "no_model": r"pass the model itself",
        "precision": r"state_dtype are not supported on FSDP2 \(DTensor\) parameters yet",
        "tensor_parallel": r"'weight' is a DTensor that fully_shard \(FSDP2\) does not manage",
        "moved": r"the local shard of parameter '0.weight' no longer lives in the optimizer's flat buffer",
        "capture": r"AdamW.capture\(\) cannot record the step of an FSDP2 model",
        "sharded_after": r"are DTensors now: FSDP2's fully_shard was applied after the optimizer was created",
        "clip_order_0": r"clip_grad_norm_\(norm_type=0.0\) under FSDP2 takes a norm order above 0",
        "clip_order_-inf": r"clip_grad_norm_\(norm_type=-inf\) under FSDP2 takes a norm order above 0",
        "taken": r"parameter '.*' was laid out by another flatopt optimizer, created over it after this one",
    }
    import re

    for rank, result in enumerate(runs["two"]("errors")):
        for name, pattern in expected.items():
            err = result[name]
            assert err is not None, f"rank {rank}: {name} was accepted"
            kind = "RuntimeError" if name in ("moved", "capture", "sharded_after", "taken") else "ValueError"
            assert err["type"] == kind and re.search(pattern, err["message"]), (name, err)
        assert result["unchanged"], f"rank {rank}: a refused constructor moved the shards"
        assert result["late_unchanged"], f"rank {rank}: the refused step moved the parameters"
        assert result["clip_unchanged"], f"rank {rank}: the refused clip_grad_norm_ changed the gradients"


def test_state_dicts_and_resuming(runs):
    """Sharded state dicts hold DTensors, full ones plain tensors; flatopt resumed from the sharded one,
    torch.optim from the full one, and flatopt from opt.load_state_dict() of full tensors in torch.optim's
    format continue as the original optimizer does."""
    for rank, result in enumerate(runs["two"]("checkpoints")):
        assert result["state_types"] == ["DTensor", "Tensor"], result["state_types"]  # states, and "step"
        assert result["full_types"] == ["Tensor"], result["full_types"]
        assert result["keys"] == ["0.bias", "0.weight", "2.bias", "2.weight", "skip.bias"], result["keys"]
        for name in ("flatopt_sharded", "torch_full", "flatopt_full_load_state_dict"):
            ranks.assert_history(result[name], result["original"], f"rank {rank}, {name}", **TOL)


def test_checkpoint_saved_on_two_ranks_loads_on_four(runs):
    original = runs["two"]("checkpoints")[0]["original"]
    for rank, result in enumerate(runs["four"]("four")):
        ranks.assert_history(result["from_two"], original, f"rank {rank} of 4", **TOL)


def test_checkpoint_saved_on_four_ranks_loads_on_two(runs):
    original = runs["four"]("four")[0]["original"]
    for rank, result in enumerate(runs["back"]("from_four")):
        ranks.assert_history(result["from_four"], original, f"rank {rank} of 2", **TOL)
