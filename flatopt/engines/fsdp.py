"""The FSDP2 step engine: ``opt.step()`` over the local shards of a ``fully_shard``-ed model, one launch per
flat buffer (per (device, dtype)) on each rank.

* Parameters: each rank's flat data buffer is the storage of its local shards (FSDP2 keeps them there and
  all-gathers from there: :mod:`flatopt.distributed.fsdp`), so the kernel updates them in place.
* Gradients stay where FSDP2's reduce-scatter put them (``p.grad``, a DTensor): the kernel reads each local
  gradient shard through a table of their addresses (the gathering launch, ``sources=``: see
  :class:`flatopt.layout.GradSources`). The Triton kernels store none of them: the flat gradient buffer keeps no
  storage, a shard the kernel cannot read in place (not 16-byte aligned) is read from an aligned copy, and
  ``p.grad`` is left as FSDP2 made it (unscaled under GradScaler's ``grad_scale``, as torch's fused kernels leave
  it). The CPU backend and the torch reference gather the shards into the flat gradient buffer, which has storage
  only during their launch (allocated and zeroed before it, freed after it), and under ``grad_scale`` copy the
  unscaled gradients back into ``p.grad``, as the kernels leave them.
* States: flat buffers like the parameters'; ``opt.state[p]`` holds views of the local shards, and
  ``state_dict()`` exports them as DTensors with the parameter's sharding, as torch.optim on the same model
  holds them, so ``torch.distributed.checkpoint`` saves, reshards and loads them.
* ``state_dict()`` carries every trainable parameter's state, also before its first step (zeros, step 0), so that
  the state dict ``get_optimizer_state_dict`` makes of a new optimizer is one that ``dcp.load`` fills.
* ``clip_grad_norm_``: the norm of the local gradient shards, one scalar all-reduce over the shards' process
  group, and every local gradient scaled in place.
"""

import torch
import torch.distributed as dist

from flatopt.bindings import taken_message
from flatopt.distributed import fsdp
from flatopt.engines.base import FlatEngine, clip_coefficient
from flatopt.layout import FlatBuffer, GradSources
from flatopt.torch_compat import own_storage


def acquire_grad(buf):
    """The flat gradient buffer's storage, zeroed (its padding must read zero), for the launch about to read it."""
    storage = buf.grad.untyped_storage()
    if storage.nbytes() == 0:
        storage.resize_(buf.grad.numel() * buf.grad.element_size())
        buf.grad.zero_()


def release_grad(buf):
    """Free the flat gradient buffer's storage between launches: the gradients live in FSDP2's ``.grad``, and the
    buffer is only where a launch stores what it read (its views stay valid objects, with no memory)."""
    buf.grad.untyped_storage().resize_(0)


class FSDPStepEngine(FlatEngine):
    # torch.distributed.checkpoint fills the state dict it is given: a new optimizer's must carry every state (its
    # zeros, step 0), as torch.optim's does once DCP has stepped it with lr=0 (which it skips when opt.state is set)
    exports_unstepped = True

    def __init__(self, opt):
        super().__init__(opt)
        self.shards = {}  # parameter -> fsdp.Shard
        self.expected = {}  # parameter -> (address of its padded shard, of its local shard) at the layout

    # ------------------------------------------------------------------ layout
    def build(self):
        opt = self.opt
        placed = {p for buf in self.buffers for p in buf.params}
        params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad or p.grad is not None]
        module = opt.model() if opt.model is not None else None
        new = [p for p in params if p not in self.shards]
        self.shards.update(fsdp.shards_of(self.cls, opt.names, new, module))
        super().build()
        for p in placed - {p for buf in self.buffers for p in buf.params}:
            self.shards.pop(p, None)

    def new_buffer(self, params, groups, state_names, precision=None):
        shards = [self.shards[p] for p in params]
        return FlatBuffer(
            params, groups, state_names, grad=True, like=[s.local for s in shards], room=[s.room for s in shards],
            precision=precision,
        )  # fmt: skip

    def adopt(self, buf):
        buf.claim()
        with torch.no_grad():
            for i, p in enumerate(buf.params):
                shard = self.shards[p]
                start = buf.starts[i]
                padded = buf.data[start : start + shard.room]
                local = buf.data_views[i]
                padded.copy_(shard.fsdp_param._sharded_param_data)  # the shard and FSDP2's padding (zeros)
                fsdp.bind(shard, padded, local)
                self.expected[p] = (padded.data_ptr(), local.data_ptr())
        buf.expected = [(dv.data_ptr(), None) for dv in buf.data_views]
        release_grad(buf)

    def release(self, p):
        fsdp.unbind(self.shards[p])
        self.expected.pop(p, None)

    def export_state(self, p, t):
        """A state tensor of ``p`` as ``state_dict()`` exports it: a DTensor with the parameter's sharding, whose
        local tensor shares the flat buffer's memory (over a slice of its storage, so that torch.save and
        copy.deepcopy take it: see torch_compat.own_storage)."""
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or p not in self.shards:
            return t
        from torch.distributed.tensor import DTensor

        local = own_storage(t)
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())

    def load(self, parsed):
        local = {}
        for p, (step, tensors) in parsed.items():
            local[p] = (step, {name: self.local_state(p, t) for name, t in tensors.items()})
        return super().load(local)

    def local_state(self, p, t):
        """This rank's shard of a loaded state of ``p``: a DTensor's (resharded like ``p`` if it is sharded
        otherwise), or the shard of a full tensor."""
        from torch.distributed.tensor import distribute_tensor

        if p not in self.shards:
            return t
        if fsdp.is_dtensor(t):
            if t.device_mesh != p.device_mesh or tuple(t.placements) != tuple(p.placements):
                t = t.redistribute(p.device_mesh, p.placements)
            return t.to_local()
        return distribute_tensor(t.to(p.device), p.device_mesh, p.placements, src_data_rank=None).to_local()

    # ------------------------------------------------------------------ checks
    def ends_bound(self):
        for buf in self.buffers:
            if buf.taken:  # another flatopt optimizer laid out one of its parameters since: look at them all
                return False
            for i in (0, len(buf.params) - 1):
                p = buf.params[i]
                if not fsdp.bound(self.shards[p], *self.expected[p]) or not p.requires_grad:
                    return False
        return True

    def check_data_bindings(self, full):
        opt = self.opt
        for buf in self.buffers:
            idx = range(len(buf.params)) if full or buf.taken else sorted({0, len(buf.params) - 1})
            for i in idx:
                p = buf.params[i]
                if not fsdp.bound(self.shards[p], *self.expected[p]):
                    if id(p) in buf.taken:
                        raise RuntimeError(taken_message(self.cls, opt.names(p)))
                    raise RuntimeError(
                        f"{self.cls}: the local shard of parameter {opt.names(p)} no longer lives in the optimizer's "
                        "flat buffer: FSDP2 was given another one (model.to(), load_state_dict(assign=True), a new "
                        "fully_shard). Create the optimizer after moving or casting the model; to keep the "
                        "optimizer state, save opt.state_dict() first and load it into the new optimizer"
                    )

    def check_bindings(self, full):
        if self.follow_members():
            full = True
        if full or not self.ends_bound():
            self.check_data_bindings(full)

    # ------------------------------------------------------------------ step
    def step(self, closure, grad_scale, found_inf):
        opt = self.opt
        loss = self.run_closure(closure)
        self.sync_state()
        self.check_bindings(self.full_check_due())
        self.refresh_hparams()
        self.checked_steps += 1
        without = [(p, None) for buf in self.buffers for p in buf.params if p.grad is None]
        if not self.unused_reported:
            self.unused_reported = True
            unused = [p for p, _ in without if p.requires_grad]
            if unused:
                self.warn_unused(unused)
        idle = self._set_masks(self.untouched(without))
        with torch.no_grad():
            for b, buf in enumerate(self.buffers):
                if b in idle:
                    continue
                sources, copies = self.sources(buf, unscaled=grad_scale is not None)
                self.launch(
                    buf, buf.grad, hparams=opt.hparams.on(buf.device), meta=buf.meta, grad_scale=grad_scale,
                    found_inf=found_inf, sources=sources,
                )  # fmt: skip
                self.put_back(copies, grad_scale)
                release_grad(buf)
        self.keep_padding_zero()
        return loss

    def untouched(self, without):
        """The (parameter, None) pairs this step leaves untouched: those of ``without`` (the parameters whose
        ``.grad`` is None) under ``skip_unused``, torch.optim's rule; none otherwise (stepped with a zero gradient)."""
        return without if self.opt.skip_unused else []

    def sources(self, buf, unscaled=False):
        """The sources of ``buf``'s local gradient shards for its gathering launch, and the (shard, copy) pairs whose
        copy the launch reads instead (see :meth:`put_back`). With the Triton kernels the launch stores none of them
        (``store=False``) and the flat gradient buffer keeps no storage: a shard that cannot be read in place (not
        16-byte aligned, as a small one often is in FSDP2's reduce-scatter output) is read from an aligned copy of
        its own, a parameter without a gradient from zeros (one tensor for all of them). Otherwise (the CPU
        backend, whose pieces of a launch would round differently from in-backward mode's whole runs, and the torch
        reference) the buffer is brought back, zeroed, and those go into their views there, the others gathered
        into it; with ``unscaled`` (a launch under ``grad_scale``) every view is then paired with its shard."""
        grads = [None if p.grad is None else fsdp.local_of(p.grad) for p in buf.params]
        if self.opt.backend != "triton":
            shards = list(grads)
            acquire_grad(buf)
            for i, (view, g) in enumerate(zip(buf.grad_views, grads)):
                if g is None:
                    view.zero_()  # stepped with a zero gradient (skip_unused=False), or left out by the mask
                elif not GradSources.fits(view, g):
                    view.copy_(g)
                    grads[i] = None
            if not unscaled:
                return GradSources.of(buf, grads), []
            # the launch leaves each unscaled gradient in its view, which put_back takes to the shard (the same values
            # after a launch that found_inf skipped: the gradients are gathered before it)
            return GradSources.of(buf, grads), [(g, view) for g, view in zip(shards, buf.grad_views) if g is not None]
        copies, zeros = [], None
        for i, (view, g) in enumerate(zip(buf.grad_views, grads)):
            if g is None:  # one tensor of zeros for all of them: nothing writes into it (0 unscaled is 0)
                if zeros is None:
                    zeros = torch.zeros(max(buf.sizes), dtype=buf.dtype, device=buf.device)
                grads[i] = zeros.as_strided(view.shape, view.stride())
            elif not GradSources.fits(view, g):
                own = torch.empty_strided(view.shape, view.stride(), dtype=view.dtype, device=view.device)
                grads[i] = own.copy_(g)
                copies.append((g, own))
        return GradSources.of(buf, grads, store=False), copies

    @staticmethod
    def put_back(copies, grad_scale):
        """Under GradScaler's ``grad_scale`` the launch leaves the unscaled gradient where it read it: for a shard
        read from a copy (or, on the CPU backend and the reference, from its view of the flat buffer), there, which
        goes back into the shard (``.grad``, as torch's fused kernels leave it)."""
        if grad_scale is not None:
            for g, own in copies:
                g.copy_(own)

    # ------------------------------------------------------------------ gradients
    def local_grads(self):
        return [fsdp.local_of(p.grad) for buf in self.buffers for p in buf.params if p.grad is not None]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite):
        if not norm_type > 0:  # global_norm combines the ranks' p-th powers (or maxima)
            raise ValueError(
                f"{self.cls}.clip_grad_norm_(norm_type={norm_type!r}) under FSDP2 takes a norm order above 0 (or inf): "
                "its one all-reduce combines the ranks' p-norms. Call "
                f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type={norm_type!r}) for this order"
            )
        self.check_bindings(full=False)
        grads = self.local_grads()
        if not self.buffers:
            return torch.tensor(0.0)
        device = self.buffers[0].device
        wide = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
        if grads:
            norms = torch._foreach_norm(grads, norm_type, dtype=wide) if norm_type != float("inf") else [
                g.abs().max().to(wide) if g.numel() else torch.zeros((), dtype=wide, device=g.device) for g in grads
            ]  # fmt: skip
            local = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)
        else:
            local = torch.zeros((), dtype=wide, device=device)
        total = self.global_norm(local, norm_type)
        coef = clip_coefficient(total, max_norm, norm_type, error_if_nonfinite)
        by_kind = {}
        for g in grads:
            by_kind.setdefault((g.device, g.dtype), []).append(g)
        for (dev, dtype), same in by_kind.items():
            torch._foreach_mul_(same, coef.to(dev, dtype))
        return total

    def global_norm(self, local, norm_type):
        """The ``norm_type`` norm of the gradients of every rank from this rank's ``local`` norm of its shards (a
        device tensor, left as it is): one scalar all-reduce (of the p-th powers, or the maximum for inf) over the
        shards' process group, the shard dimension of an HSDP mesh, whose replicas hold the same gradients. A
        collective: every rank calls it, and gets the same value."""
        group = next(iter(self.shards.values())).process_group
        if norm_type == float("inf"):
            local = local.clone()
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
            return local
        local = local**norm_type
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
        return local ** (1.0 / norm_type)

    def zero_grad(self, set_to_none):
        self.follow_members()
        torch.optim.Optimizer.zero_grad(self.opt, set_to_none=set_to_none)
