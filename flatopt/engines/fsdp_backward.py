"""The FSDP2 in-backward engine (``in_backward=True`` over a ``fully_shard``-ed model): each fully_shard group's
parameters are stepped as soon as FSDP2 has reduce-scattered their gradients, one launch per group (per
(device, dtype)), and the sharded gradients are freed.

FSDP2 runs a sharded parameter's post-accumulate-grad hooks right after it sets (or accumulates into) its
sharded ``.grad``, group by group. The layout puts each group's parameters next to each other in the flat
buffers (:meth:`order`), so a group is one run of consecutive parameters: when the last of its parameters
with a gradient has one, the group's gradients are copied into the flat gradient buffer and one launch steps
the run; then every ``p.grad`` of the group is set to None, which frees FSDP2's reduce-scatter output.

* Accumulation: under ``opt.no_step()`` the hooks do nothing and FSDP2 adds each micro-batch's gradient into
  ``.grad``; the next pass outside it steps with the sum. FSDP2's own ``set_requires_gradient_sync(False)``
  works too: FSDP2 reduce-scatters nothing (so no hook runs) until the pass that syncs.
* Gradients that no hook stepped (accumulated under ``no_step()`` and not followed by a stepping pass, or a
  group whose parameters did not all receive a gradient in the pass) are stepped at the end of the backward
  pass, or by ``step()``, as the step engine steps them.
* Clipping by the global norm needs every gradient before the first group is stepped: ``clip_grad_norm_`` clips
  gradients still in ``.grad`` exactly (one all-reduce), and is refused after a pass that stepped them;
  ``max_grad_norm`` is refused at construction. Use step mode to clip.
"""

import weakref

import torch

from flatopt.engines.fsdp import FSDPStepEngine, acquire_grad, release_grad
from flatopt.engines.in_backward import Bucket


class FSDPInBackwardEngine(FSDPStepEngine):
    def __init__(self, opt):
        o = opt.options
        if o.max_grad_norm is not None or o.accumulation_steps != 1:
            raise ValueError(
                f"{type(opt).__name__}(in_backward=True) over FSDP2 takes neither max_grad_norm nor "
                "accumulation_steps: accumulate under opt.no_step() (or FSDP2's set_requires_gradient_sync(False)), "
                "and clip in step mode (in_backward=False), where clip_grad_norm_ sees every gradient"
            )
        super().__init__(opt)
        self.hooks = []
        self.held = 0  # no_step() depth
        self.runs = {}  # fully_shard group -> [Bucket]: its parameters' runs, one per flat buffer
        self.group_members = {}  # fully_shard group -> its trainable parameters
        self.arrived = {}  # fully_shard group -> parameters whose gradient arrived in this pass
        self.end_queued = False
        self.applied = False  # a pass stepped (and freed) gradients since the last step() or zero_grad()
        self.launches = 0
        self.unused_reported = True  # what a group lacks is stepped at the end of the pass; no first-step warning

    def order(self, params, groups):
        keyed = sorted(range(len(params)), key=lambda i: self.shards[params[i]].group)  # stable: param order within
        return [params[i] for i in keyed], [groups[i] for i in keyed]

    def detach(self):
        for h in self.hooks:
            h.remove()
        self.hooks = []

    def attach(self, without_grad, with_grad):
        self.runs, self.group_members, self.arrived = {}, {}, {}
        for buf in self.buffers:
            first = 0
            for i in range(1, len(buf.params) + 1):
                group = self.shards[buf.params[first]].group
                if i == len(buf.params) or self.shards[buf.params[i]].group != group:
                    self.runs.setdefault(group, []).append(Bucket(buf, first, i))
                    first = i
        ref = weakref.ref(self)  # the hooks live on in the parameters: no reference back to the engine
        for buf in self.buffers:
            for p in buf.params:
                if p.requires_grad:
                    self.group_members.setdefault(self.shards[p].group, set()).add(p)

                    def hook(param, ref=ref):
                        engine = ref()
                        if engine is not None:
                            engine.on_grad(param)

                    self.hooks.append(p.register_post_accumulate_grad_hook(hook))

    # ------------------------------------------------------------------ backward
    def no_step(self):
        from contextlib import contextmanager

        @contextmanager
        def held():
            self.held += 1
            try:
                yield
            finally:
                self.held -= 1

        return held()

    def on_grad(self, p):
        """FSDP2 has set (or accumulated into) ``p.grad``: step ``p``'s group once all of it has arrived."""
        if self.held:
            return
        if not self.end_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.end_pass)
            self.end_queued = True
        group = self.shards[p].group
        arrived = self.arrived.setdefault(group, set())
        arrived.add(p)
        if arrived >= self.group_members[group]:
            self.step_group(group)

    @torch.no_grad()
    def step_group(self, group):
        opt = self.opt
        self.sync_state()
        self.refresh_hparams()
        for bucket in self.runs[group]:
            buf = bucket.buf
            acquire_grad(buf)
            for i in range(bucket.first, bucket.stop):
                p, view = buf.params[i], buf.grad_views[i]
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad._local_tensor)
            self.launch(
                buf, buf.grad[bucket.start : bucket.end], hparams=opt.hparams.on(buf.device), meta=bucket.meta,
                span=(bucket.start, bucket.end),
            )  # fmt: skip
            self.launches += 1
            release_grad(buf)
            for p in bucket.params:
                p.grad = None  # FSDP2's sharded gradient is freed
        self.arrived.pop(group, None)
        self.applied = True
        self.keep_padding_zero()

    def end_pass(self):
        """At the end of the backward pass: step what the groups left (gradients of groups not complete)."""
        self.end_queued = False
        self.arrived = {}
        if any(p.grad is not None for ps in self.group_members.values() for p in ps):
            self.step_pending()

    def step_pending(self):
        """Step every parameter whose ``.grad`` is not None, as the step engine does, and free the gradients."""
        super().step(None, None, None)
        for ps in self.group_members.values():
            for p in ps:
                p.grad = None
        self.applied = True

    # ------------------------------------------------------------------ torch.optim's interface
    def step(self, closure, grad_scale, found_inf):
        if grad_scale is not None or found_inf is not None:
            raise RuntimeError(
                f"{self.cls}(in_backward=True) cannot be used with torch.amp.GradScaler: the parameters were updated "
                "during backward; train in bfloat16 without a GradScaler, or use in_backward=False"
            )
        loss = self.run_closure(closure)
        if any(p.grad is not None for ps in self.group_members.values() for p in ps):
            self.step_pending()
        self.applied = False
        return loss

    def zero_grad(self, set_to_none):
        super().zero_grad(set_to_none)
        self.applied = False

    def clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite):
        if self.applied:
            raise RuntimeError(
                f"{self.cls}(in_backward=True) stepped and freed this pass's gradients during backward, group by "
                "group, before their global norm was known, so they cannot be clipped now. Under FSDP2, clip in "
                "step mode (in_backward=False), or accumulate under opt.no_step() and clip before step()"
            )
        return super().clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)
