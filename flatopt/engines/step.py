"""The flat step engine: ``opt.step()`` launches one kernel per flat buffer.

Gradients reach the flat gradient buffers as :mod:`flatopt.grads` describes; the launches of a
step are replayed from a CUDA graph once recorded (:mod:`flatopt.step_graph`); the first step
names the parameters that received no gradient.
"""

import functools
import weakref
from contextlib import contextmanager

import torch

from flatopt.engines.base import FlatEngine, clip_coefficient
from flatopt.engines.cpu_lane import CpuLane
from flatopt.grads import GradLanding
from flatopt.layout import GradSources
from flatopt.step_graph import StepGraph
from flatopt.torch_compat import bump_versions, has_step_pre_hooks, remove_hooks

# On the CPU, a gradient of its own (an uncovered use) of at least this many elements is read where autograd left it
# by step(), rather than copied into the flat buffer first; smaller ones are copied in with one batched copy, so that
# the step's call per piece does not take a tensor per parameter. In cache a copy of 64K float32 elements takes about
# 6 us and of 256K about 14 us; each extra tensor in a fused kernel's lists 13 to 16 us on a 2-core AMD EPYC, 2 (SGD)
# to 4 (AdamW) on a 2-core Intel Xeon. In a training loop the copies run out of cache, at about three times those
# times (the batched copy of a GPT-2-style model's 64K-element gradients and small ones, timed inside its steps).
IN_PLACE_MIN = 1 << 16
PATTERNS_CHECKED = 16  # new patterns of parameters without a gradient that step() makes a full binding check for


class FlatStepEngine(FlatEngine):
    def __init__(self, opt):
        super().__init__(opt)
        self.landing = None  # GradLanding of the current layout
        self.hooks = []  # until the first step: which parameters received a gradient, and no sparse one
        self.hooked = []  # the parameters that carry them
        self.unhook = None  # the finalizer that removes them
        self.pattern_checks = 0  # full binding checks made for new patterns of parameters without a gradient
        self.checked_fully = False  # whether this step's binding check looked at every parameter
        self.seen = set()
        self.recording = False  # inside capture(): step() leaves the hyper-parameter refresh to the replay
        self.sources = None  # capture(): {FlatBuffer: GradSources} the next step gathers its gradients from
        self.holds = 0  # captured steps alive that recorded the gradient buffers' addresses
        self.lane = CpuLane() if opt.backend == "cpu" else None  # an ordinary CPU step's shorter way

    # ------------------------------------------------------------------ layout
    def detach(self):
        self._remove_first_pass_hooks()
        if self.landing is not None:
            self.landing.detach()
        if self.lane is not None:
            self.lane = CpuLane()  # holds nothing of the old layout

    def attach(self, without_grad, with_grad):
        opt = self.opt
        module = opt.model() if opt.model is not None else None
        self.landing = GradLanding(
            self.buffers, keep_none=opt.skip_unused, names=opt.names, cls=self.cls, module=module,
            direct=opt.options.direct_grads,
        )  # fmt: skip
        self.landing.attach()  # for good: also after model.zero_grad() or zero_grad(set_to_none=False)
        if self.holds > 0:  # laid out anew under a captured step: the new storage is held too
            self.landing.slots.hold(True)
        params = [p for b in self.buffers for p in b.params if p.requires_grad]  # autograd hooks need it
        if not self.unused_reported:
            self.seen.update(with_grad)  # a gradient from before the layout is one received
            # a tensor hook, which also refuses a sparse gradient, except on a covered layer's parameter: a tensor
            # hook would send its gradients the copying way (and a covered layer makes dense gradients). A tensor
            # hook, rather than a post-accumulate-grad hook, because removing it really unregisters it (see
            # remove_hooks): an emptied post-accumulate-grad table still costs a call per parameter per backward
            covered = self.landing.slots.covered
            self.hooks = [
                p.register_post_accumulate_grad_hook(self.seen.add)
                if p in covered
                else p.register_hook(self._first_pass_hook(p))
                for p in params
            ]
            self.hooked = params
            # gone with the engine (and the optimizer) if it never steps: no hooks left on the parameters
            self.unhook = weakref.finalize(self, remove_hooks, self.hooks, self.hooked)
        for p in without_grad:  # skip_unused: a parameter steps only once it has a .grad, as in torch.optim
            p.grad = None

    def _remove_first_pass_hooks(self):
        if self.unhook is not None:
            self.unhook()  # removes them, once
            self.unhook = None
        self.hooks, self.hooked = [], []

    def _first_pass_hook(self, p):
        """A hook on ``p``'s incoming gradient, registered until the first step: it records that ``p``
        received one, and refuses a sparse one (autograd would add it into the dense ``.grad`` view in
        place, a silent dense update) before it lands."""
        # no reference to the optimizer (a cycle through the parameter's hooks), and none weak to the parameter:
        # torch.utils.swap_tensors (load_state_dict or model.to() under torch.__future__'s
        # swap_module_params_on_conversion) refuses a tensor with a weak reference
        cls, names, seen = self.cls, weakref.ref(self.opt.names), self.seen

        def hook(grad):
            names_ = names()
            if names_ is None:
                return  # the optimizer is gone
            if grad.layout == torch.strided:
                seen.add(p)
            else:
                raise RuntimeError(
                    f"{cls} does not support sparse gradients: parameter {names_(p)} received a "
                    f"{grad.layout} gradient, which would be added into its dense flat .grad view; use "
                    "sparse=False on the embedding (nn.Embedding(..., sparse=False)) that produces it"
                )

        return hook

    # ------------------------------------------------------------------ checks
    def check_bindings(self, full):
        self._check_bindings(full)

    def _check_bindings(self, full, settle=True):
        """The parameters laid out again if ``param_groups`` or ``requires_grad`` changed, the data bindings,
        then (``settle``) the gradients settled into the flat buffers."""
        if self.follow_members():
            full = True
        if full or not self.ends_bound() or self.frozen_since():
            self.check_data_bindings(full)
        if settle and self.landing is not None:
            self.landing.settle()

    def _check_bindings_at_step(self):
        """step()'s binding check, amortised: full at the first step and at every FULL_CHECK_EVERY-th step
        after it, the first and last parameter of each buffer otherwise (and every parameter's address on the
        CPU: :func:`flatopt.bindings.watch_every_address`). The count advances only when
        the step's checks pass (step() advances it), so a full check that raised runs again at the next
        step. Returns the gradients' settling plan (checked, not done: step() applies it last, once the
        hyper-parameters are validated too)."""
        full = self.full_check_due()
        self._check_bindings(full, settle=False)
        if not self.reads_in_place():
            plan = self.landing.plan()
        else:
            plan = self.landing.plan(IN_PLACE_MIN if self.opt.backend == "cpu" else 1)  # a kernel gathers any size
        self.checked_fully = full
        return plan

    def _check_new_pattern(self):
        """Parameters without a gradient in a pattern not seen before (see _set_masks): they may have been replaced
        in the module (load_state_dict(..., assign=True), `module.weight = nn.Parameter(...)`), which the full
        check finds, rather than at the FULL_CHECK_EVERY-th step after training them no more. For the first few
        patterns (a model whose unused parameters change at every step pays it a few times only)."""
        if not self.checked_fully and self.pattern_checks < PATTERNS_CHECKED:
            self.pattern_checks += 1
            self.check_data_bindings(True)

    def _report_unused(self, plan):
        """The first step's warning: parameters whose .grad was None at the step, and those whose view
        no backward pass wrote into (zero_grad(set_to_none=False), or no zero_grad() yet)."""
        without = {p for p, _ in plan[0]}
        given = {p for p, _, g in plan[1] if g is not None}  # a tensor of its own: set by hand, or by DDP
        for b, grads in plan[2].items():  # those read in place (on the CPU)
            given.update(p for p, g in zip(self.buffers[b].params, grads) if g is not None)
        params = [p for b in self.buffers for p in b.params if p.requires_grad]
        # a covered layer's slot also says it: the hook recording the pass stays with the tensor object a
        # swap-tensors load (torch.utils.swap_tensors) took the parameter's place from
        landed = self.landing.slots.landed
        unused = [p for p in params if p in without or (p not in self.seen and p not in given and not landed(p))]
        self.unused_reported = True
        self._remove_first_pass_hooks()
        self.seen.clear()
        if unused:
            self.warn_unused(unused)

    # ------------------------------------------------------------------ step
    @contextmanager
    def recorded(self):
        """For capture(): inside, step() leaves the hyper-parameter refresh to each replay."""
        self.recording = True
        try:
            yield
        finally:
            self.recording, self.sources = False, None

    def gather_from(self, sources):
        """For capture(): the next step reads the gradients from ``sources`` ({FlatBuffer: GradSources}, or
        None) and stores them into the gradient buffers as it steps."""
        self.sources = sources

    def step(self, closure, grad_scale, found_inf):
        opt = self.opt
        loss = self.run_closure(closure)
        if self.lane is not None and grad_scale is None and found_inf is None and self.lane.step(self, IN_PLACE_MIN):
            return loss  # an ordinary CPU step, done with less host work (see flatopt.engines.cpu_lane)
        self.sync_state()  # the caller's edits of opt.state (a reset, an assigned tensor), as torch.optim reads them
        plan = self._check_bindings_at_step()
        if not self.recording:  # a captured step refreshes hyper-parameters before each replay
            self.refresh_hparams()
        idle = self._set_masks(plan[0], self._check_new_pattern) if opt.skip_unused else ()  # torch.optim's rule
        self.checked_steps += 1
        if not self.unused_reported:
            self._report_unused(plan)
        gathering, in_place = self.reads_in_place(), plan[2]
        # see flatopt.grads. Where the step reads gradients in place, those copied in (the small ones on the CPU)
        # stay in .grad as well (torch.optim's loop frees them at zero_grad(), and so does this one), unless
        # grad_scale unscales them in their views, which then hold what torch's fused kernels leave in .grad
        self.landing.apply(plan, put=not gathering or grad_scale is not None)
        # a Triton launch that gathers every gradient of a buffer, storing none, needs no storage for it: the buffer
        # stays released, or is released again if something brought it back (opt.clip_grad_norm_(), a gradient
        # copied in) and model.zero_grad() rather than the optimizer's reset the gradients since: as with torch's
        # gradients, autograd's tensors are all there is
        unread = [b for b, grads in in_place.items() if None not in grads] if self.opt.backend == "triton" else []
        for b in unread:
            self.landing.slots.release(b)
        self._acquire_grads(skip=unread)
        sources, self.sources = self.sources or {}, None  # for this step only
        for b, grads in in_place.items():  # the gradients of their own read where they lie
            buf = self.buffers[b]
            sources[buf] = GradSources.of(buf, grads, store=False, checked=True)  # not stored into the buffer

        def launch():
            with torch.no_grad():  # for the torch backend's in-place updates (a replayed graph needs none)
                for b, buf in enumerate(self.buffers):
                    if b in idle:  # no parameter of it has a gradient: nothing to step
                        continue
                    self.launch(
                        buf, buf.grad, hparams=opt.hparams.on(buf.device), meta=buf.meta, grad_scale=grad_scale,
                        found_inf=found_inf, sources=sources.get(buf),
                    )  # fmt: skip

        # the version counters first: after a kernel that streamed the buffers through the caches, the first
        # operations cost several times what they cost before it (a CPU step's, measured)
        self._count_updates(idle, plan[0] if opt.skip_unused else ())
        if self.graph_usable() and not sources:  # the step graph's key does not cover sources
            key = StepGraph.key_of(self.buffers, opt.hparams.on(self.buffers[0].device), grad_scale, found_inf)
            key += (opt.rounding_seed,)  # baked into the launches (a load_state_dict may change it)
            self.step_graph.run_keyed((key, tuple(sorted(idle))) if idle else key, launch)  # idle: not launched
        else:
            launch()
        self.keep_padding_zero()
        return loss

    def _count_updates(self, idle, without):
        """The parameters the step updated (those of the buffers launched, but the ``without`` left out) get their
        version counters bumped, as torch.optim's step does with in-place ops (torch's fused kernels leave them)."""
        left_out = {p for p, _ in without}
        for b, buf in enumerate(self.buffers):
            if b not in idle:
                bump_versions([p for p in buf.params if p not in left_out] if left_out else buf.params)

    def reads_in_place(self):
        """Whether step() reads gradients of their own where they lie: the large ones on the CPU backend, when no
        hook copied them in (see flatopt.grads.GradLanding.copy_on_cpu), every one it can with
        ``direct_grads="gather"``. Not inside capture(), whose recorded step reads the gradients backward left in
        the graph's pool its own way (GradLanding.settle_gathering)."""
        landing = self.landing
        on_cpu = self.opt.backend == "cpu" and not landing.copy_on_cpu
        return (on_cpu or landing.gathers) and not self.recording

    def graph_usable(self):
        opt = self.opt
        return StepGraph.usable(opt.use_step_graph, opt.backend, self.devices)

    def gathers(self):
        """Whether a recorded step may read the gradients where backward left them: not when a step
        pre-hook runs before the kernel (it reads the ``.grad`` views)."""
        return not has_step_pre_hooks(self.opt)

    # ------------------------------------------------------------------ gradients
    def _acquire_grads(self, skip=()):
        """The gradient storage, before a kernel reads it: settling brings it back when it zeroes or copies
        anything; if it is still released here (nothing was settled), it comes back zeroed. ``skip``: the indices of
        buffers no kernel reads."""
        slots = self.landing.slots
        for b, buf in enumerate(self.buffers):
            if b not in skip and slots.acquire(b):
                buf.grad.zero_()

    def hold_grads(self, keep=True):
        """Keep the gradient storage allocated, at a fixed address, through zero_grad() (``keep=True``), for
        a CUDA graph that recorded its address; ``keep=False`` when that graph is released: once no graph
        holds it, zero_grad() releases the storage again."""
        self.holds += 1 if keep else -1  # one per captured step alive
        if self.holds > 0:
            self._acquire_grads()
        self.landing.slots.hold(self.holds > 0)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite):
        self.check_bindings(full=False)
        self._acquire_grads()
        if not self.buffers:
            return torch.tensor(0.0)
        first = self.buffers[0].device
        # one norm per buffer (its padding and the zeroed views of parameters without a gradient add nothing to a
        # p-norm), but per parameter with a gradient for the others, as torch: the 0 "norm" of the per-parameter
        # norms counts the parameters with a nonzero gradient, and -inf (or a negative order) would take the zeros in
        tensors = (
            [b.grad for b in self.buffers]
            if norm_type > 0
            else [p.grad for b in self.buffers for p in b.params if p.grad is not None]
        )
        if not tensors:
            return torch.tensor(0.0)
        norms = [  # float32 accumulation, float64 for float64 gradients
            torch.linalg.vector_norm(t, norm_type, dtype=torch.promote_types(t.dtype, torch.float32)) for t in tensors
        ]
        wide = functools.reduce(torch.promote_types, [n.dtype for n in norms])
        total = torch.linalg.vector_norm(torch.stack([n.to(first, wide) for n in norms]), norm_type)
        coef = clip_coefficient(total, max_norm, norm_type, error_if_nonfinite)
        for b in self.buffers:  # the views, not the padding: a nan norm must not leave nan there for good
            torch._foreach_mul_(b.grad_views, coef.to(b.device, b.grad.dtype))
        return total

    def zero_grad(self, set_to_none):
        self.follow_members()  # torch.optim zeroes what the groups hold now
        if set_to_none:
            self.landing.release()
            return
        self.landing.restore()
        for buf in self.buffers:
            buf.grad.zero_()
