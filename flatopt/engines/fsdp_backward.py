"""The FSDP2 in-backward engine (``in_backward=True`` over a ``fully_shard``-ed model): each fully_shard group's
parameters are stepped as soon as FSDP2 has reduce-scattered their gradients, one launch per group (per
(device, dtype)), and the sharded gradients are freed.

FSDP2 runs a sharded parameter's post-accumulate-grad hooks right after it sets (or accumulates into) its
sharded ``.grad``, group by group. The layout puts each group's parameters next to each other in the flat
buffers (:meth:`order`), so a group is one run of consecutive parameters: when the last of its parameters
with a gradient has one, the group's gradients are copied into a staging tensor of the run's length (the flat
gradient buffer, the whole rank's size, is never allocated) and one launch steps the run; then every ``p.grad`` of
the group is set to None, which frees FSDP2's reduce-scatter output.

* Accumulation: under ``opt.no_step()`` the hooks do nothing and FSDP2 adds each micro-batch's gradient into
  ``.grad``; the next pass outside it steps with the sum. FSDP2's own ``set_requires_gradient_sync(False)``
  works too: FSDP2 reduce-scatters nothing (so no hook runs) until the pass that syncs. A pass begun after one
  that stepped, with neither ``step()`` nor ``zero_grad()`` since, is refused at its first gradient
  (:meth:`refuse_second`).
* Gradients that no hook stepped (accumulated under ``no_step()`` and not followed by a stepping pass, or a
  group whose parameters did not all receive a gradient in the pass) are stepped at the end of the backward
  pass, or by ``step()``, as the step engine steps them.
* Clipping, ``max_grad_norm=c``: single-process in-backward mode's definition (:mod:`flatopt.engines.backward_clip`)
  with a fully_shard group in a bucket's part and every norm global. When a group is stepped, the norm of its
  local gradient shards is all-reduced (one scalar, over the shards' process group), so the running norm of the
  pass, the previous pass's total norm and the group's divisor ``max(1, (n + 1e-6) / c)`` are the same on every
  rank; the launch divides the gradients by it. The total norm of a pass is the running norm at its end (no
  further all-reduce). ``step()`` stepping gradients left in ``.grad`` (every micro-batch under ``no_step()``)
  clips them by their exact global norm (one all-reduce), as torch does: the exact two-pass way, which keeps
  every gradient until the step.
* A backward pass that raised (an exception in a hook, out of memory, an interrupt) never reaches its end: the
  groups it stepped stay stepped, the others are not, and their gradients stay in ``.grad``. ``zero_grad()``
  drops it (and its running norm), so the next pass is a pass of its own, with its own end; ``step()`` does too,
  and steps what is in ``.grad``. Neither that ``step()`` nor the end of a pass steps again a group the pass
  stepped, also with ``skip_unused=False`` (:meth:`untouched`), under which the step engine would step every
  parameter without a gradient. A pass begun with neither in between is refused at its first gradient, which
  is dropped, before anything is stepped (:class:`PassEnd` tells the failed pass from a running one).
* ``clip_grad_norm_`` (``opt``'s, or torch's, which :mod:`flatopt.clip_patch` routes here) after a stepped pass
  returns the norm that pass was clipped by (with ``max_grad_norm``, the same value and ``norm_type``) or raises;
  on gradients still in ``.grad`` it clips them exactly (one all-reduce), or, with ``max_grad_norm``, returns
  their global norm and leaves them for the step to clip.
"""

import weakref

import torch

from flatopt import clip_patch
from flatopt.engines.backward_clip import BackwardClip, ClipCalls
from flatopt.engines.fsdp import FSDPStepEngine
from flatopt.engines.in_backward import Bucket, is_compiling, warn_late_pre_hooks


class PassEnd:
    """The end-of-pass callback of one backward pass, queued on the autograd engine by its first gradient. The
    engine holds it until the pass ends and runs it then; when the pass raises instead, the engine drops it
    unrun, so a weak reference to it tells a pass that raised from one still running. (A graph task id cannot:
    the backward pass that reentrant activation checkpointing runs inside a pass has an id of its own.)"""

    __slots__ = ("engine", "__weakref__")

    def __init__(self, engine):
        self.engine = engine

    def __call__(self):
        self.engine.end_pass()


class FSDPInBackwardEngine(ClipCalls, FSDPStepEngine):
    clip_doc = "docs/distributed.md, 'FSDP2, in-backward mode'"

    def __init__(self, opt):
        o = opt.options
        if o.accumulation_steps != 1:
            raise ValueError(
                f"{type(opt).__name__}(in_backward=True) over FSDP2 does not take accumulation_steps: accumulate "
                "under opt.no_step() (or FSDP2's set_requires_gradient_sync(False)) on all but the last micro-batch"
            )
        super().__init__(opt)
        self.clip = None if o.max_grad_norm is None else BackwardClip(o.max_grad_norm, o.norm_type)
        self.hooked = set()  # the parameters whose gradient hook is the optimizer's
        self.hooks = []
        self.held = 0  # no_step() depth
        self.runs = {}  # fully_shard group -> [Bucket]: its parameters' runs, one per flat buffer
        self.group_members = {}  # fully_shard group -> its trainable parameters
        self.arrived = {}  # fully_shard group -> parameters whose gradient arrived in this pass
        self.stepped_groups = set()  # fully_shard groups stepped in this pass (or in one that raised, until dropped)
        self.open = None  # weak reference to the PassEnd of the pass in progress (dead once that pass raised)
        self.applied = False  # a pass stepped (and freed) gradients since the last step() or zero_grad()
        self.warned_pre_hooks = False  # step() warned that a step pre-hook ran after the pass had stepped
        self.launches = 0
        self.unused_reported = True  # what a group lacks is stepped at the end of the pass; no first-step warning
        clip_patch.register(self)  # torch.nn.utils.clip_grad_norm_ over its parameters asks it (see clip_patch)

    def order(self, params, groups):
        keyed = sorted(range(len(params)), key=lambda i: self.shards[params[i]].group)  # stable: param order within
        return [params[i] for i in keyed], [groups[i] for i in keyed]

    def detach(self):
        for h in self.hooks:
            h.remove()
        self.hooks = []

    def attach(self, without_grad, with_grad):
        self.runs, self.group_members, self.arrived, self.hooked = {}, {}, {}, set()
        for buf in self.buffers:
            first = 0
            for i in range(1, len(buf.params) + 1):
                group = self.shards[buf.params[first]].group
                if i == len(buf.params) or self.shards[buf.params[i]].group != group:
                    self.runs.setdefault(group, []).append(Bucket(buf, first, i))
                    first = i
        ref = weakref.ref(self)  # the hooks live on in the parameters: no reference back to the engine

        def hook(param):
            if is_compiling():  # torch.compile of a function that runs backward: outside its graph
                return uncompiled(param)
            engine = ref()
            if engine is not None:
                engine.on_grad(param)

        uncompiled = torch._disable_dynamo(hook)
        for buf in self.buffers:
            for p in buf.params:
                if p.requires_grad:
                    self.group_members.setdefault(self.shards[p].group, set()).add(p)
                    self.hooked.add(p)
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
            if self.applied:  # torch.optim would step both passes' gradients together at the next step()
                self.refuse_second(p, paused=True)
            return
        if self.open is not None and self.open() is None:
            self.refuse(p)  # the pass begun by an earlier gradient raised, and nothing dropped it since
        if self.open is None and self.applied:
            self.refuse_second(p)  # an earlier pass stepped, and neither step() nor zero_grad() came since
        if self.open is None:
            self.stepped_groups = set()
            end = PassEnd(self)
            torch.autograd.Variable._execution_engine.queue_callback(end)
            self.open = weakref.ref(end)
            if self.clip is not None:
                self.clip.begin(self.devices, [b.dtype for b in self.buffers])
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
        divisor = None
        if self.clip is not None:  # the group's global norm: one scalar all-reduce, the same on every rank
            grads = [p.grad._local_tensor for bucket in self.runs[group] for p in bucket.params if p.grad is not None]
            divisor = self.clip.fold(self.global_norm(self.clip.norm_of(grads), self.clip.norm_type))
        for bucket in self.runs[group]:
            buf = bucket.buf
            # the run's gradients in a staging tensor of the run's length (zeros where a parameter has none, and in
            # the alignment padding), not in the flat gradient buffer, whose storage would be the whole rank's
            staging = torch.zeros(bucket.end - bucket.start, dtype=buf.dtype, device=buf.device)
            for i in range(bucket.first, bucket.stop):
                p, like = buf.params[i], buf.like[i]
                if p.grad is not None:
                    at = buf.starts[i] - bucket.start
                    staging.as_strided(like.shape, like.stride(), at).copy_(p.grad._local_tensor)
            self.launch(
                buf, staging, hparams=opt.hparams.on(buf.device), meta=bucket.meta, span=(bucket.start, bucket.end),
                grad_scale=divisor,
            )  # fmt: skip
            self.launches += 1
            del staging
            for p in bucket.params:
                p.grad = None  # FSDP2's sharded gradient is freed
        self.arrived.pop(group, None)
        self.stepped_groups.add(group)
        self.applied = True
        self.keep_padding_zero()

    def refuse(self, p):
        """The first gradient of a backward pass begun after one that raised (whose end never came), with neither
        ``zero_grad()`` nor ``step()`` since: FSDP2 adds it to what the failed pass left in ``.grad``. Drop it and
        raise, before anything of this pass is stepped; later passes are refused too until one of them is called."""
        p.grad = None
        raise RuntimeError(
            f"{self.cls}(in_backward=True) over FSDP2: a backward pass started after the previous one raised, "
            "without opt.zero_grad() or opt.step() in between. Call opt.zero_grad() (and FSDP2's "
            "model.reset_iter_state() on the root module, where torch has it) before running backward again: as "
            "with torch.optim, a retry would otherwise add its gradients to those the failed pass left. Nothing was "
            "updated by this backward pass"
        )

    def refuse_second(self, p, paused=False):
        """The first gradient of a backward pass begun after one that stepped, with neither ``step()`` nor
        ``zero_grad()`` since (``paused``: under ``no_step()``): torch.optim would step once, with the passes' summed
        gradients, and this pass cannot be added to the gradients the previous one applied. Drop it and raise,
        before anything is stepped (as single-process in-backward mode refuses it)."""
        p.grad = None
        under = " under opt.no_step()" if paused else ""
        raise RuntimeError(
            f"{self.cls}(in_backward=True) over FSDP2: a second backward pass{under} started with neither "
            "opt.step() nor opt.zero_grad() since the previous one, which in-backward mode already stepped (each "
            "backward pass updates the parameters and frees its gradients). To accumulate gradients over several "
            "backward passes per optimizer step, run all but the last inside `with opt.no_step():` (or FSDP2's "
            "set_requires_gradient_sync(False)); otherwise call opt.step() (or opt.zero_grad()) after each "
            "backward. Nothing was updated by this backward pass; FSDP2 stopped inside it, so call FSDP2's "
            "model.reset_iter_state() on the root module (where torch has it) and opt.zero_grad() before the next"
        )

    def abandon(self):
        """Called outside backward (``zero_grad()``, ``step()``): a pass that began but never ended (its backward
        raised) is dropped, so that the next backward pass begins afresh, with its own end-of-pass step. The
        groups it had stepped stay stepped; the gradients it left in ``.grad`` stay there (``zero_grad()`` drops
        them, ``step()`` steps them), and its running norm (``max_grad_norm``) is dropped."""
        if self.open is not None:
            self.open = None
            self.arrived = {}
            if self.clip is not None:
                self.clip.drop()

    def end_pass(self):
        """At the end of the backward pass: step what the groups left (gradients of groups not complete), and
        record the pass's total norm (``max_grad_norm``)."""
        self.open = None
        self.arrived = {}
        if any(p.grad is not None for ps in self.group_members.values() for p in ps):
            self.step_pending(all_known=False)
        self.stepped_groups = set()
        if self.clip is not None:
            self.clip.end()

    def untouched(self, without):
        """The step engine's rule, and also every parameter of the groups this pass (or the pass that raised, for
        ``step()`` after it) stepped already: with ``skip_unused=False`` the step engine would step them again, with a
        zero gradient."""
        left = super().untouched(without)
        seen = {p for p, _ in left}
        return left + [(p, None) for g in self.stepped_groups for p in self.group_members[g] if p not in seen]

    def step_pending(self, all_known):
        """Step every parameter whose ``.grad`` is not None, as the step engine does, and free the gradients.
        With ``max_grad_norm`` they are divided by the divisor of their global norm (one all-reduce) folded into
        the pass's running norm, or, when ``all_known`` (``step()``, outside backward: every gradient of the step
        is here), by that of their global norm, torch's exact clip."""
        divisor = None
        if self.clip is not None:
            norm = self.global_norm(self.clip.norm_of(self.local_grads()), self.clip.norm_type)
            if all_known:
                self.clip.begin(self.devices, [b.dtype for b in self.buffers])
                self.clip.know_total(norm)
            divisor = self.clip.fold(norm)
        super().step(None, divisor, None)
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
        warn_late_pre_hooks(self)
        self.abandon()
        loss = self.run_closure(closure)
        # a parameter that requires grad since the layout (frozen at construction) had no hook in the pass: laid out
        # (and hooked) now, so that its gradient, which FSDP2 left in .grad, is stepped with the others
        self.follow_members()
        if any(p.grad is not None for ps in self.group_members.values() for p in ps):
            self.step_pending(all_known=True)  # not the groups a pass that raised stepped (stepped_groups)
            if self.clip is not None:
                self.clip.end()
        self.stepped_groups = set()
        self.applied = False
        return loss

    def zero_grad(self, set_to_none):
        self.abandon()
        super().zero_grad(set_to_none)
        self.stepped_groups = set()
        self.applied = False

    def holds(self, p):
        """Whether ``p`` is one of this optimizer's trainable parameters (for :mod:`flatopt.clip_patch`)."""
        return p in self.hooked

    def clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite):
        """``opt.clip_grad_norm_()``: the step engine's exact clip of the gradients in ``.grad``, unless a pass
        stepped them or ``max_grad_norm`` clips them (:meth:`clip_call`)."""
        exact = super().clip_grad_norm_
        return clip_patch.clip_request(
            self, max_norm, norm_type, error_if_nonfinite, lambda: exact(max_norm, norm_type, error_if_nonfinite)
        )

    def pending_norm(self):
        """The global norm of the gradients in ``.grad`` (one all-reduce); the running norm is left as it is."""
        measure = BackwardClip(self.clip.max_norm, self.clip.norm_type)
        measure.begin(self.devices, [b.dtype for b in self.buffers])
        return self.global_norm(measure.norm_of(self.local_grads()), measure.norm_type)
