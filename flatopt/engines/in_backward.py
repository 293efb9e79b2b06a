"""In-backward mode: step parameters from post-accumulate-grad hooks, in buckets, during backward.

Parameters and optimizer states stay in their flat buffers; there is no flat gradient buffer.
Each buffer is cut into buckets of consecutive parameters. In-backward mode lays out the large
parameters (at least ``bucket_size // 8`` elements, each a bucket of its own) first, then the
small ones, each class in param-group order (for a module, registration order, so a backward pass
produces a bucket's gradients one after another)::

    flat buffer   ┌─ p0 ─┬─ p1 ─┬──── p2 ────┬─ p3 ─┬─ p4 ─┬─ p5 ─┐
    buckets       └──── bucket 0 ────┴─ bucket 1 ─┴──── bucket 2 ────┘
                   (at most bucket_size elements, or one larger parameter)

When a parameter's gradient is accumulated, its hook copies it into the bucket's staging
gradient (allocated zeroed when the bucket's first gradient arrives) and sets ``p.grad = None``.
When every parameter of a bucket has arrived, one kernel launch steps the bucket and the staging
gradient is freed. A bucket holding a single parameter whose gradient already has the
parameter's layout is stepped straight from ``p.grad``, with no copy. A callback queued on the
autograd engine runs when the backward pass ends and steps the buckets that are still open,
treating missing gradients as zero (or, with ``skip_unused=True``, stepping only the parameters
that received one), so every backward pass equals one ``step()`` of step mode.
``opt.step()`` steps the gradients it finds in ``p.grad`` (accumulated under ``no_step()`` or by
a short accumulation window, or set by hand), as torch.optim does.

With ``accumulation_steps=k`` the backward passes since the last ``step()`` or ``zero_grad()`` form
a window: the first ``k - 1`` leave their gradients in ``p.grad`` (as under ``no_step()``), the
``k``-th steps with the sum. With ``max_grad_norm`` each bucket's launch divides its gradient by a
clip divisor computed on the device from the running norm (:mod:`flatopt.engines.backward_clip`),
and ``torch.nn.utils.clip_grad_norm_`` over the parameters asks :meth:`InBackwardEngine.clip_call`
(:mod:`flatopt.clip_patch`).

A parameter with post-accumulate-grad hooks registered after the optimizer's (per-parameter
clipping, logging) keeps its gradient until those hooks have run: torch runs a parameter's hooks
one after another, in registration order, so its gradient is taken at the next gradient hook on
the same thread, or at the end of the pass.

A backward pass that cannot be stepped as one ``step()`` is refused at its first gradient, and
the refused pass leaves no gradient in ``.grad``: a pass after the window's stepping pass (with
``k = 1``, a second pass) with neither ``opt.step()`` nor ``opt.zero_grad()`` in between, a pass
begun after one that raised (stepping or accumulating) with neither ``opt.zero_grad()`` nor
``opt.step()`` in between, and a pass that runs others inside it (reentrant activation
checkpointing), found at its first gradient by one walk of its autograd graph
(:mod:`flatopt.engines.nesting`), before anything is stepped. In an accumulation window such a pass
is refused too, leaving the window's gradients in ``.grad``. The first gradient is seen before
autograd adds it to ``.grad``, by a tensor hook on the parameter whose gradient came first in the
previous pass (on every parameter while every pass is refused), so a pass refused or raising there
leaves ``.grad`` as it was; the refusal of a retry leaves the failed pass's gradients (in ``.grad``
and its open buckets) for ``step()``.

Kernel launches per backward: about ``numel / bucket_size`` plus one per parameter larger than a
bucket. Gradient memory held by flatopt: the open buckets' staging gradients (one bucket at a
time when gradients arrive in layout order) plus the gradient autograd is producing.
"""

import dataclasses
import operator
import threading
import warnings
import weakref
from contextlib import contextmanager

import torch

from flatopt import clip_patch
from flatopt.bindings import FULL_CHECK_EVERY
from flatopt.distributed import check_single_process
from flatopt.engines.backward_clip import BackwardClip, ClipCalls
from flatopt.engines.base import FlatEngine
from flatopt.engines.nesting import nesting_backward, reentrant_segment
from flatopt.layout import ALIGN, StepMeta
from flatopt.step_graph import StepGraph
from flatopt.torch_compat import bump_versions, has_step_pre_hooks, outside_compile, outside_stacklevel

is_compiling = torch.compiler.is_compiling


def _graph_task_id():
    get = getattr(torch._C, "_current_graph_task_id", None)
    return get() if get is not None else -1


def _accumulates():
    """From a parameter's tensor hook: whether autograd will add the gradient to ``.grad`` (and run the
    post-accumulate-grad hooks). Not in ``torch.autograd.grad``, which returns the gradient instead, and where torch
    refuses to say for a leaf's node."""
    will_run = getattr(torch._C, "_will_engine_execute_node", None)
    node = torch._C._current_autograd_node() if will_run is not None else None
    if node is None:
        return False
    try:
        return bool(will_run(node))
    except RuntimeError:  # "A leaf node was passed to _will_engine_execute_node but ... running autograd.grad()"
        return False


class Bucket:
    """Consecutive parameters ``[first, stop)`` of one flat buffer, elements ``[start, end)``."""

    def __init__(self, buf, first, stop):
        self.buf = buf
        self.first, self.stop = first, stop
        self.start = buf.starts[first]
        self.end = buf.starts[stop] if stop < len(buf.params) else buf.numel
        self.params = buf.params[first:stop]
        self.meta = StepMeta(
            param_of_granule=buf.meta.param_of_granule[self.start // ALIGN : self.end // ALIGN],
            param_group=buf.meta.param_group,
            steps=buf.meta.steps,
            counter=buf.meta.counter,
            first=first,
            stop=stop,
        )
        self.single_groups = len(set(buf.group_ids[first:stop])) == 1
        self.arrived = set()
        self.done = False  # stepped in the backward pass in progress
        self.grad = None  # staging gradient while the bucket is open
        self.direct = None  # the parameter's own gradient, flattened, for a one-parameter bucket
        self.divisor = None  # [1] on the buffer's device: the clip divisor of the bucket's launch (max_grad_norm)
        self.graph = StepGraph()  # the bucket's launch, replayed (keyed on the gradient's address too)

    def staging(self, stats=None):
        if self.grad is None:
            self.grad = torch.zeros(self.end - self.start, dtype=self.buf.dtype, device=self.buf.device)
            if stats is not None:
                stats.held += self.grad.numel()
                stats.peak_held = max(stats.peak_held, stats.held)
        return self.grad

    def close(self):
        """Free the staging gradient; the bucket stays done until the backward pass ends."""
        self.grad = None
        self.direct = None

    def reset(self):
        self.close()
        self.arrived.clear()
        self.done = False


def is_large(p, bucket_size):
    """A parameter that gets a bucket of its own (and, in-backward, a place before the small ones)."""
    return p.numel() >= max(bucket_size // 8, 1)


def make_buckets(buf, bucket_size):
    """Cut ``buf`` into buckets of consecutive parameters spanning at most ``bucket_size`` elements
    (padding included). A large parameter (at least ``bucket_size // 8`` elements) is a bucket of
    its own, so it is stepped straight from its gradient, with no staging copy."""
    n = len(buf.params)

    def end_of(i):  # where parameter i's slot (with its padding) ends
        return buf.starts[i + 1] if i + 1 < n else buf.numel

    large = [is_large(p, bucket_size) for p in buf.params]
    buckets, first = [], 0
    for i in range(1, n):
        if large[i] or large[i - 1] or end_of(i) - buf.starts[first] > bucket_size:
            buckets.append(Bucket(buf, first, i))
            first = i
    buckets.append(Bucket(buf, first, n))
    return buckets


def _remove(handles):
    for h in handles:
        h.remove()


def warn_late_pre_hooks(engine):
    """At ``step()`` of an in-backward engine (``engine.applied``: a pass stepped since the last step() or
    zero_grad()), warn once per optimizer that its step pre-hooks ran after the pass had stepped the parameters."""
    if engine.applied and not engine.warned_pre_hooks and has_step_pre_hooks(engine.opt):
        engine.warned_pre_hooks = True
        warnings.warn(
            f"{engine.cls}(in_backward=True): a step pre-hook (opt.register_step_pre_hook, or torch's global "
            "register_optimizer_step_pre_hook) ran at step(), after the backward pass had stepped the parameters "
            "and freed their gradients: it found no gradient to read or change, and its param_groups edits take "
            "effect from the next pass, where torch.optim applies both to this step. Transform gradients in a "
            "post-accumulate-grad hook registered after the optimizer (docs/in-backward.md, Gradient hooks), or "
            "use in_backward=False. (Warned once.)",
            stacklevel=outside_stacklevel(),
        )


class InBackwardEngine(ClipCalls, FlatEngine):
    """The hooks, buckets and end-of-backward flush of one optimizer with ``in_backward=True``."""

    has_grad_buffer = False

    def __init__(self, opt):
        super().__init__(opt)
        self.check_ranks()
        self.bucket_size = opt.options.bucket_size
        self.buckets = []
        self.bucket_of = {}  # param -> (bucket, element offset in the bucket)
        self.index_of = {}  # param -> index in its buffer
        self.lock = threading.Lock()
        self.task = None  # graph task id of the backward pass in progress (or of one that raised, until dropped)
        self.paused = 0  # > 0 inside opt.no_step()
        options = opt.options
        self.accumulation_steps = options.accumulation_steps
        self.window = 0  # backward passes (outside no_step()) begun since the last step() or zero_grad()
        self.accumulating = None  # graph task id of the accumulating pass in progress (window < accumulation_steps)
        self.applied = False  # a pass since the last step() or zero_grad() stepped its gradients and freed them
        self.window_stepped = set()  # the parameters stepped since the last step() or zero_grad()
        # the parameters that received a gradient since the last zero_grad(set_to_none=True), and whether a
        # zero_grad(set_to_none=False) came since: torch.optim's loop would then hold a zero .grad for each of them
        # and step it at every step, gradient or not (this mode freed their gradients as it applied them)
        self.had_grad, self.zeros_kept = set(), False
        self.kept_zero = {}  # parameter -> the zero .grad tensor zero_grad(set_to_none=False) left it (see zero_grad)
        self.groups_stepped = None  # each group's params (the list, and its entries) as the last stepped pass ended
        self.warned_pre_hooks = False  # step() warned that a step pre-hook ran after the pass had stepped
        self.micro = None  # graph task id of the accumulating pass in progress, until its end (still set: it raised)
        self.failed = False  # a pass raised leaving its first gradient added to an earlier one in .grad
        self.loaded = False  # .grad may hold gradients of earlier passes (no_step(), a window, a pass that raised)
        self.first = None  # the parameter whose gradient came first in the last pass: its tensor hook sees the next
        self.first_hook = None  # the handle of that tensor hook
        self.seen_first = None  # the parameter whose gradient came first in the pass in progress
        self.guards = []  # tensor hooks on every parameter while passes are refused until zero_grad() or step()
        self.clip = None if options.max_grad_norm is None else BackwardClip(options.max_grad_norm, options.norm_type)
        self.deferred = []  # (thread id, parameter): gradients to take once the parameter's later hooks ran
        self.stepped = 0  # parameters stepped so far in the backward pass in progress
        self.dirty = True  # recompute each bucket's UNIFORM flag at the next backward
        self.pending = False  # gradients accumulated under no_step() that no pass has taken yet
        self.backwards = 0  # backward passes begun (every FULL_CHECK_EVERY-th checks every parameter)
        self.launches = 0  # kernel launches so far (tests and benchmarks read it through flatopt.inspect)
        self.held = 0  # staging-gradient elements allocated now
        self.peak_held = 0  # the most staging-gradient elements allocated at once
        self.handles = []
        self.hook_id = {}  # param -> the id of the optimizer's hook in p._post_accumulate_grad_hooks
        self.outside = set()  # laid-out parameters removed from param_groups since: not stepped until laid out anew
        clip_patch.register(self)  # torch.nn.utils.clip_grad_norm_ over its parameters asks it (see clip_patch)

    def launched_buckets(self):
        """The buckets whose launches read ``meta.uniform``, recomputed at a pass after a step count changed."""
        return self.buckets

    def check_ranks(self):
        """Refuse several ranks (see :func:`flatopt.distributed.check_single_process`): the hooks step each rank's
        own gradient. The DDP engine (:mod:`flatopt.engines.ddp_backward`) steps averaged gradients instead."""
        check_single_process(self.cls, self.opt.options.allow_several_ranks)

    # ------------------------------------------------------------------ layout
    def order(self, params, groups):
        """Large parameters first: each is a bucket, the small ones share a few."""
        order = sorted(range(len(params)), key=lambda i: not is_large(params[i], self.bucket_size))
        return [params[i] for i in order], [groups[i] for i in order]

    def make_buckets(self):
        """The buckets of the layout, and where each parameter lies in them (``bucket_of``, ``index_of``)."""
        self.buckets = [b for buf in self.buffers for b in make_buckets(buf, self.bucket_size)]
        self.bucket_of, self.index_of = {}, {}
        for b in self.buckets:
            for i in range(b.first, b.stop):
                p = b.buf.params[i]
                self.bucket_of[p] = (b, b.buf.starts[i] - b.start)
                self.index_of[p] = i

    def attach(self, without_grad, with_grad):
        self.make_buckets()
        method = weakref.WeakMethod(self.hook)  # the hooks live on the parameters: no reference back to the engine

        def hook(p):
            if is_compiling():  # torch.compile of a function that runs backward traces the hooks: not this one
                return uncompiled(p)  # (see outside_compile; the check inline: one call per parameter per pass)
            engine_hook = method()
            if engine_hook is not None:
                engine_hook(p)

        uncompiled = torch._disable_dynamo(hook)
        hooked = [p for p in self.bucket_of if p.requires_grad]  # frozen: laid out again when unfrozen
        self.handles = [p.register_post_accumulate_grad_hook(hook) for p in hooked]
        self.hook_id = {p: h.id for p, h in zip(hooked, self.handles)}
        self.outside = set()
        self._finalizer = weakref.finalize(self, _remove, self.handles)  # gone with the engine (and optimizer)
        # a backward pass delivers the last registered parameter's gradient first (its layer is the last one)
        order = [p for g in self.opt.param_groups for p in g["params"] if p in self.hook_id]
        self.first_hook = None  # removed with the other hooks (detach)
        self._arm(self.first if self.first in self.hook_id else order[-1] if order else None)

    def _arm(self, p):
        """Move the tensor hook that sees a pass's first gradient before autograd adds it to ``.grad`` to ``p``."""
        if p is self.first and self.first_hook is not None:
            return
        if self.first_hook is not None:
            self.first_hook.remove()
            self.handles.remove(self.first_hook)
        self.first, self.first_hook = p, None
        if p is not None:
            self.first_hook = self._tensor_hook(p)

    def _tensor_hook(self, p):
        """A hook that autograd runs before it adds a gradient to ``p.grad``: :meth:`before`."""
        # a weak reference to the engine (no cycle through the parameter's hooks), none to the parameter:
        # torch.utils.swap_tensors refuses a tensor with a weak reference
        method = weakref.WeakMethod(self.before)

        def before(grad):
            engine_before = method()
            if engine_before is not None:
                engine_before(p)

        handle = p.register_hook(outside_compile(before))
        self.handles.append(handle)  # removed with the optimizer
        return handle

    def _guard(self):
        """Every backward pass is refused until zero_grad() or step(): refuse each before its first gradient lands,
        wherever it comes from, with a tensor hook on every parameter (until then only)."""
        if not self.guards:  # (a parameter frozen since the layout gets no gradient, and takes no tensor hook)
            self.guards = [self._tensor_hook(p) for p in self.hook_id if p.requires_grad]

    def _unguard(self):
        if self.guards:
            guards = set(self.guards)
            for h in guards:
                h.remove()
            self.handles[:] = [h for h in self.handles if h not in guards]
            self.guards = []

    def detach(self):
        self.remove()

    def refresh_uniform(self, buf):
        super().refresh_uniform(buf)
        self.dirty = True

    def check_bindings(self, full):
        if full or not self.ends_bound() or self.frozen_since():
            self.check_data_bindings(full)

    # ------------------------------------------------------------------ the optimizer's calls
    def step(self, closure, grad_scale, found_inf):
        """The parameters were stepped during backward; check what step() is told."""
        if grad_scale is not None or found_inf is not None:
            raise RuntimeError(
                f"{self.cls}(in_backward=True) cannot be used with torch.amp.GradScaler: the parameters "
                "were already updated during backward, with gradients still multiplied by the loss scale and before "
                "infs could be checked. Train in bfloat16 without a GradScaler, or use in_backward=False (the "
                "parameters of this step have been updated with scaled gradients: restart from a checkpoint)"
            )
        if self.applied and self._groups_edited_since_the_pass():
            warnings.warn(
                f"{self.cls}(in_backward=True): opt.param_groups' parameters were edited after a backward pass that "
                "had already stepped them as the groups stood then; the edit takes effect from the next pass, where "
                "torch.optim's step() would apply it to this step. Edit param_groups before the backward pass (after "
                "zero_grad()), or use in_backward=False",
                stacklevel=outside_stacklevel(),
            )
        warn_late_pre_hooks(self)
        self.abandon(give_back=True)
        self.follow_members()  # parameters unfrozen or added since: laid out, and their .grad stepped below
        loss = self.run_closure(closure)
        # Gradients in p.grad: accumulated under no_step() or by the first passes of an accumulation window (a
        # short last window: step() before its last pass), or set by hand (p.grad = g after torch.autograd.grad):
        # step them as torch.optim does. A stepped pass leaves none.
        if self.pending or any(p.grad is not None for p in self.bucket_of):
            self.step_pending()
        elif not self.applied:  # no pass stepped anything: the parameters may have been replaced in the module
            self.check_bindings(full=True)  # (assign=True loads), whose gradients no hook of this one sees
        self.new_window()
        return loss

    def _groups_edited_since_the_pass(self):
        """Whether a group's params changed since the last stepped pass ended (see groups_stepped)."""
        then, groups = self.groups_stepped, self.opt.param_groups
        if then is None or len(then) != len(groups):
            return then is not None
        return any(
            g["params"] is not lst or len(lst) != len(kept) or not all(map(operator.is_, lst, kept))
            for g, (lst, kept) in zip(groups, then)
        )

    def zero_grad(self, set_to_none):
        self.abandon()
        self.follow_members()  # torch.optim zeroes what the groups hold now
        self.pending = False  # the accumulated gradients are dropped, as torch.optim does
        torch.optim.Optimizer.zero_grad(self.opt, set_to_none=set_to_none)
        self.zeros_kept = not set_to_none
        if set_to_none:
            self.had_grad = set()
        # the zeroed .grad tensors, until a pass adds to them: a refused pass's gradient can be taken out of them
        self.kept_zero = {} if set_to_none else {p: p.grad for p in self.bucket_of if p.grad is not None}
        self.new_window()

    def new_window(self):
        """step() or zero_grad(): the next backward pass is the first of a new accumulation window."""
        self.window = 0
        self.accumulating = self.micro = None
        self.applied = self.failed = self.loaded = False
        self.window_stepped = set()
        self._unguard()

    def holds(self, p):
        """Whether ``p`` is laid out in this optimizer's buffers now (not moved since by another optimizer)."""
        entry = self.bucket_of.get(p)
        return entry is not None and p.data_ptr() == entry[0].buf.expected[self.index_of[p]][0]

    def clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite):
        """``opt.clip_grad_norm_()``: as ``torch.nn.utils.clip_grad_norm_`` over this optimizer's parameters."""
        params = list(self.bucket_of)
        clip = clip_patch.original("clip_grad_norm_")
        return clip_patch.clip_request(
            self, max_norm, norm_type, error_if_nonfinite, lambda: clip(params, max_norm, norm_type, error_if_nonfinite)
        )

    def pending_norm(self):
        """The total norm of the gradients in ``.grad`` (not stepped yet), measured apart: the running norm of
        in-backward clipping is left as it is."""
        measure = BackwardClip(self.clip.max_norm, self.clip.norm_type)
        measure.begin(self.devices, [b.dtype for b in self.buffers])
        return measure.norm_of([p.grad for p in self.bucket_of if p.grad is not None])

    def remove(self):
        if getattr(self, "_finalizer", None) is not None:
            self._finalizer.detach()
        for h in self.handles:
            h.remove()
        self.handles = []
        self.first_hook, self.guards = None, []

    @contextmanager
    def no_step(self):
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    # ------------------------------------------------------------------ hooks
    def hook(self, p):
        if self.paused:
            if self.applied:  # (before() refuses it earlier where this gradient is the pass's first)
                raise RuntimeError(self._paused_after_a_stepped_pass(p, landed=True))
            self.pending = self.loaded = True  # accumulated in p.grad, for the next stepping pass or opt.step()
            return
        with self.lock, torch.no_grad():
            refusal = self._arrive(p)  # a pass that raised here stays begun: refused retries, give-back at step()
        if refusal is not None:
            raise RuntimeError(refusal)

    def before(self, p):
        """The tensor hook of the parameter whose gradient came first in the last pass: the first gradient of a pass
        is seen here before autograd adds it to ``p.grad``, so a pass refused (or raising) there leaves nothing in
        ``.grad``. Elsewhere in a pass: one comparison."""
        if self.paused:
            if self.applied and _accumulates():
                raise RuntimeError(self._paused_after_a_stepped_pass(p, landed=False))
            return
        task = _graph_task_id()
        if task == self.task or task == self.accumulating or not _accumulates():
            return
        with self.lock, torch.no_grad():
            refusal = None if task in (self.task, self.accumulating) else self._open(p, task, landed=False)
        if refusal is not None:
            raise RuntimeError(refusal)

    def _paused_after_a_stepped_pass(self, p, landed):
        """Why a backward pass under no_step() after a pass that stepped the window's gradients is refused: torch.optim
        would step the gradients of both together at the next step(), and the first pass's are applied and freed."""
        left = (
            f" but the gradient of {self.opt.names(p)}, which autograd had already added to its .grad "
            "(opt.zero_grad() drops it)"
            if landed
            else ""
        )
        return (
            f"{self.cls}(in_backward=True): a backward pass under opt.no_step() started after a pass that already "
            "stepped the parameters (each backward pass outside no_step() updates them and frees its gradients), "
            "with neither opt.step() nor opt.zero_grad() in between: torch.optim would step the gradients of both "
            "passes together at the next step(), which this mode cannot. Run the micro-batches under no_step() "
            "before the pass that steps, and call opt.step() (or opt.zero_grad()) after it. Nothing was updated or "
            f"kept by this backward pass{left}"
        )

    def reset(self):
        for b in self.buckets:
            self._release(b)
            b.reset()
        self.task = None
        self.deferred = []
        self.stepped = 0
        if self.clip is not None:
            self.clip.drop()

    def _release(self, bucket):
        if bucket.grad is not None:
            self.held -= bucket.grad.numel()
        bucket.close()

    def abandon(self, give_back=False):
        """Called outside backward (zero_grad, step): a pass that began but never ended (its backward
        raised, out of memory say) is dropped, so the next backward starts afresh. Buckets it had
        stepped stay stepped (an update cannot be undone). ``give_back`` (step()): the gradients it had
        moved into the buckets it had not stepped go back to ``p.grad``, beside those it had not taken,
        so that step() steps every gradient the failed pass left, as torch.optim's step() would;
        ``zero_grad()`` drops them all."""
        if self.task is None:
            return
        with self.lock:
            if give_back:
                self._give_back()
            self.reset()

    def _give_back(self):
        """The gradients taken into the open buckets, back in ``p.grad`` as views of the staging gradient (or the
        parameter's own gradient, for a one-parameter bucket), with the parameter's shape and strides."""
        for b in self.buckets:
            if b.done or not b.arrived:
                continue
            for p in b.arrived:
                if b.direct is not None:  # p's own gradient, flattened by _take
                    p.grad = b.direct.as_strided(p.shape, p.stride(), b.direct.storage_offset())
                else:
                    p.grad = b.grad.as_strided(p.shape, p.stride(), self.bucket_of[p][1])

    def _arrive(self, p):
        """The gradient of ``p`` in a stepping backward pass: begin the pass at its first gradient, or
        refuse the pass (returns the message, once the refused gradients are dropped); then take
        ``p.grad`` now, or, when hooks were registered on ``p`` after the optimizer's, once they have run."""
        task = _graph_task_id()
        if task == self.accumulating:
            return None  # a micro-batch of the window: accumulated in p.grad, as under no_step()
        if task != self.task:
            refusal = self._open(p, task, landed=True)  # p's tensor hook did not see the pass begin
            if refusal is not None or task == self.accumulating:
                return refusal
        if p in self.outside:
            return None  # removed from param_groups: its gradient stays in .grad, as torch.optim leaves it
        elif p in self.bucket_of[p][0].arrived or any(q is p for _, q in self.deferred):
            return self._refuse(
                p,
                f"{self.cls}(in_backward=True): the gradient hook of {self.opt.names(p)} fired twice in one "
                "backward pass, which cannot be stepped as one step(); use in_backward=False (step mode)",
            )
        thread = threading.get_ident()
        if self.deferred:
            self._flush(thread)  # the previous gradient's later hooks on this thread have run by now
        if self._hooked_after(p):
            self.deferred.append((thread, p))
            self.loaded = True  # p.grad is held until its later hooks ran: a pass raising before keeps it there
        else:
            self._take(p)

    def _open(self, p, task, landed):
        """The first gradient of a backward pass, ``p``'s: refuse the pass (returns the message), count it as a
        micro-batch of the window, or begin it. ``landed``: autograd has added this pass's gradient to ``p.grad``
        already (seen by the post-accumulate-grad hook; the tensor hook sees it before). A pass refused or raising
        here leaves ``.grad`` as it was where it can, and the state of a pass that raised before it (its gradients,
        which step() steps) is kept."""
        accumulate = self.window + 1 < self.accumulation_steps
        refusal = self._refusal(p, accumulate)
        if refusal is not None:
            return self._unland(p, landed, refusal)
        accumulating = self.accumulating
        try:
            if accumulate:
                self.accumulating = self.micro = task
                self.pending = self.loaded = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_micro_batch)
            else:
                self.accumulating = None
                self._begin(task)
        except BaseException as e:  # an opt.state edit or hyper-parameter found invalid: the pass is not counted
            self.task, self.accumulating, self.micro = None, accumulating, None
            note = self._unland(p, landed, None)
            if note is not None and hasattr(e, "add_note"):
                e.add_note(note)
            raise
        self.window += 1
        self.seen_first = p
        self.kept_zero = {}  # the pass adds to them from here on
        return None

    def _unland(self, p, landed, message):
        """Take the refused pass's gradient out of ``p.grad``, where autograd added it (``landed``): back to None
        when ``p`` held none before; otherwise it cannot be taken out, and the pass is remembered as one that
        raised. Returns ``message`` with what was left, or, for ``message=None``, that alone (None if nothing)."""
        if not landed:
            return message
        self._arm(p)  # the next pass's first gradient is likely p's again: seen before it lands
        if p.grad is None:
            return message
        if self.kept_zero.get(p) is p.grad:  # a zero kept by zero_grad(set_to_none=False): zero again
            p.grad.zero_()
            return message
        bucket = self.bucket_of[p][0]
        # a gradient autograd set (not added to one) is a tensor not modified in place since; one that had arrived
        # in a pass that raised was taken from .grad; without loaded, no earlier pass left one in .grad
        fresh = p.grad._version == 0 and (not self.loaded or (p in bucket.arrived and self.task is not None))
        if fresh:
            p.grad = None
            return message
        self.failed = True
        self._guard()
        left = (
            f"The gradient of {self.opt.names(p)} in .grad now holds this pass's gradient added to the one it held "
            "(autograd adds it before the optimizer's hook runs): call opt.zero_grad() to drop every gradient left "
            "in .grad; backward passes are refused until opt.zero_grad() or opt.step()"
        )
        return left if message is None else f"{message}. {left}"

    def _end_micro_batch(self):
        """End of an accumulating pass (queued by its first gradient): it did not raise."""
        with self.lock:
            self.micro = None
            self._arm(self.seen_first)

    def _refusal(self, p, accumulate):
        """Why the backward pass that delivers ``p``'s gradient, the first of a pass, cannot be stepped, or
        accumulated when ``accumulate`` (None when it can): a pass nested in another one or that would run
        one (reentrant checkpointing), a pass begun while one that raised was not dropped, or a pass after
        the one that stepped the window's gradients, with neither opt.step() nor opt.zero_grad() in between.
        Checked before anything is taken or stepped."""
        cls, k = self.cls, self.accumulation_steps
        nested = nesting_backward()
        if nested is not None:
            return self._refuse_nested(p, nested, None, accumulate)
        if self.task is not None or self.micro is not None or self.failed:  # a stepping or accumulating pass raised
            self._guard()
            return (
                f"{cls}(in_backward=True): a backward pass started after the previous one raised, without "
                "opt.zero_grad() or opt.step() in between. Call opt.zero_grad() before running backward again (as "
                "with torch.optim, a retry would otherwise add its gradients to those the failed pass left), or "
                "opt.step() to step what the failed pass left. Nothing was updated by this backward pass, and the "
                "gradients the failed pass left are kept"
            )
        ahead = reentrant_segment()  # once per pass: one walk of its autograd graph
        if ahead is not None:
            return self._refuse_nested(p, None, ahead, accumulate)
        if self.window >= k:
            if k == 1:
                what = (
                    f"{cls}(in_backward=True): a second backward pass started with neither opt.step() nor "
                    "opt.zero_grad() since the previous one, which in-backward mode already stepped (each backward "
                    "pass updates the parameters and frees its gradients). "
                )
            else:
                what = (
                    f"{cls}(in_backward=True, accumulation_steps={k}): backward pass {k + 1} of a window started with "
                    f"neither opt.step() nor opt.zero_grad() since its first; pass {k} already stepped the parameters "
                    "with the accumulated gradients. "
                )
            return (
                what + "If the loop accumulates gradients over k backward passes per optimizer step (transformers' "
                "Trainer with gradient_accumulation_steps=k, Lightning's accumulate_grad_batches=k), pass "
                f"accumulation_steps=k to {cls}; in a hand-written loop, run the micro-batches' backward inside "
                "`with opt.no_step():`, or call opt.step() (or opt.zero_grad()) after each optimizer step's last "
                "backward. If the loop steps another optimizer now, this one is still alive (held by its LR "
                "scheduler, a trainer or a variable) and steps the parameters in backward as long as it lives: "
                "delete it and what holds it. Nothing was updated by this backward pass"
            )
        return None

    def _refuse_nested(self, p, nested, ahead, accumulate):
        """Refuse a backward pass run inside another one: the nested pass at its first gradient, when
        ``nested`` (what runs it) was seen in the hook's frames, or the outer pass at its first gradient,
        before anything is stepped, when its graph holds ``ahead``, a reentrant checkpointing Function."""
        cls, name, k = self.cls, self.opt.names(p), self.accumulation_steps
        source = (
            f"the gradient of {name} comes from a backward pass run inside another backward pass (by {nested}'s "
            if nested is not None
            else f"the backward pass that delivers the gradient of {name} would run others inside it (by {ahead}'s "
        ) + (
            "backward), as reentrant activation checkpointing (torch.utils.checkpoint with use_reentrant=True) runs "
            "one per checkpointed segment"
        )
        fix = "Use torch.utils.checkpoint(..., use_reentrant=False), or in_backward=False (step mode)"
        if accumulate or self.accumulating is not None:
            return (  # nothing begun, nothing stepped: p.grad keeps the sum of the window's micro-batches
                f"{cls}(in_backward=True, accumulation_steps={k}): {source}; such a pass can neither be counted as "
                "a micro-batch of the window nor step the window's gradients. "
                f"{fix}. No parameter was updated; the gradients accumulated so far stay in .grad, and "
                "opt.zero_grad() drops them"
            )
        if self.task is None:  # refused at the pass's first gradient: nothing begun, nothing stepped
            return (
                f"{cls}(in_backward=True): {source}, each of which would step its parameters before the outer pass "
                f"ends. {fix}. No parameter was updated"
            )
        stepped = (  # only for a nested pass the walk could not foresee (roots not read, a Function of another name)
            f"{self.stepped} parameter(s) stepped earlier in this pass, whose gradients came before the nested pass, "
            "stay stepped: restart from a checkpoint if that matters"
            if self.stepped
            else "No parameter was updated"
        )
        return self._refuse(
            p,
            f"{cls}(in_backward=True): {source}, each of which would step its parameters before the outer pass "
            f"ends. {fix}. {stepped}",
        )

    def _refuse(self, p, message):
        """Refuse a stepping pass part way (its hook fired twice, a nested pass in it): drop its gradients
        (``p``'s, and those waiting for later hooks), so that no later pass or step() applies them, and end
        it. It is not counted in the window: the next pass steps."""
        p.grad = None
        for _, q in self.deferred:
            q.grad = None
        if self.task is not None:
            self.window -= 1
        self.reset()
        return message

    def _hooked_after(self, p):
        """Whether hooks were registered on ``p`` after the optimizer's (torch runs them after it)."""
        hooks = getattr(p, "_post_accumulate_grad_hooks", None)
        return bool(hooks) and next(reversed(hooks)) != self.hook_id.get(p)

    def _flush(self, thread=None):
        """Take the gradients deferred on ``thread`` (on every thread at the end of the pass): their
        parameters' later hooks have run. One whose hook set ``p.grad = None`` has no gradient in this pass."""
        keep = []
        for t, q in self.deferred:
            if thread is not None and t != thread:
                keep.append((t, q))
            elif q.grad is not None:
                self._take(q)
        self.deferred = keep

    def _take(self, p):
        """Move ``p.grad`` into its bucket (or keep it, for a one-parameter bucket), free it, and step
        the bucket once all its gradients are in."""
        bucket, offset = self.bucket_of[p]
        g = p.grad
        if g.layout != torch.strided:
            raise RuntimeError(f"{self.cls} does not support sparse gradients ({self.opt.names(p)})")
        n = bucket.end - bucket.start
        if len(bucket.params) == 1 and g.numel() == n and g.stride() == p.stride():
            # p is dense, so a gradient with p's strides is too, in the buffer's element order
            bucket.direct = g.as_strided((n,), (1,), g.storage_offset())
        else:
            bucket.staging(self).as_strided(p.shape, p.stride(), offset).copy_(g)
        p.grad = None
        bucket.arrived.add(p)
        if len(bucket.arrived) == len(bucket.params):
            self._step(bucket)

    def _begin(self, task, backward=True):
        """First gradient of a backward pass (or ``opt.step()`` applying accumulated gradients):
        checks, hyper-parameters, and, in a backward pass, the end-of-pass callback."""
        opt = self.opt
        self.sync_state()  # the caller's edits of opt.state (a reset, an assigned tensor), as torch.optim reads them
        self.check_ranks()  # the group may have started since
        self.check_bindings(full=self.dirty or self.backwards % FULL_CHECK_EVERY == 0)
        # param_groups edited since the layout: the buffers are laid out anew at the next step() or zero_grad()
        # (not during backward, whose saved tensors hold the parameters); until then, a parameter removed from
        # the groups, or moved to another group, is not stepped (the moved one keeps its gradient in .grad, as one
        # unfrozen or added does: step() lays it out in its new group and steps it there).
        self.outside = set()
        if self.members_changed():
            self.check_members()  # what step() would refuse when it lays them out: before this pass steps anything
            laid = {p: gi for gi, (_, kept) in enumerate(self.members) for p in kept}
            now = {q: gi for gi, g in enumerate(opt.param_groups) for q in g["params"]}
            self.outside = {p for p in self.bucket_of if now.get(p) != laid.get(p)}
        self.backwards += 1
        self.refresh_hparams()
        if self.dirty:
            for b in self.launched_buckets():
                steps = b.meta.steps[b.first : b.stop]
                b.meta.uniform = b.single_groups and bool((steps == steps[0]).all())
            self.dirty = False
        self.task = task
        self.pending = False  # gradients accumulated under no_step() are taken by this pass
        if self.clip is not None:
            self.clip.begin(self.devices, [b.dtype for b in self.buffers])
        if backward:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def step_pending(self):
        """``opt.step()`` after every micro-batch ran under ``no_step()`` (or a short accumulation window):
        step the accumulated ``p.grad`` as torch.optim would, then free them. With ``max_grad_norm`` every
        gradient is known before the first bucket: they are clipped by their total norm, as torch clips."""
        with self.lock, torch.no_grad():
            try:
                self._begin(task=None, backward=False)
                if self.clip is not None:
                    self.clip.know_all(
                        [
                            p.grad
                            for p in self.bucket_of
                            if p.grad is not None and p.grad.layout == torch.strided and p not in self.outside
                        ]
                    )
                self._end_pass()
                if self.clip is not None:
                    self.clip.end()
            finally:
                self.reset()

    def _finish(self):
        """End of the backward pass (queued on the autograd engine by its first gradient)."""
        with self.lock, torch.no_grad():
            try:
                self._flush()
                self._end_pass()
                if self.clip is not None:
                    self.clip.end()
                self.applied = True  # the pass's gradients are applied and freed
                self.groups_stepped = [(g["params"], tuple(g["params"])) for g in self.opt.param_groups]
                self.loaded = False
                self._arm(self.seen_first)
            finally:
                self.reset()

    def _end_pass(self):
        """Step the buckets still open: first take the gradients left in ``p.grad`` by micro-batches
        run under no_step() that this pass did not reach; then treat missing gradients as zero (or,
        with skip_unused, step only the parameters that received one), as step mode does."""
        opt = self.opt
        for b in self.buckets:
            if not b.done:
                for p in [p for p in b.params if p not in b.arrived and p.grad is not None and p not in self.outside]:
                    self._take(p)
        if not self.unused_reported:
            missing = [p for b in self.buckets if not b.done for p in b.params if p not in b.arrived | self.outside]
            if missing:
                self.warn_unused(missing)
            self.unused_reported = True
        zeros = self.had_grad if self.zeros_kept else ()
        for b in self.buckets:
            if not b.done and (b.arrived or not opt.skip_unused or any(p in zeros for p in b.params)):
                self._step(b, partial=True)
        self.keep_padding_zero()  # every bucket of the pass is stepped by now

    def _step(self, bucket, partial=False):
        opt, buf = self.opt, bucket.buf
        grad = bucket.direct if bucket.direct is not None else bucket.staging(self)
        meta = bucket.meta
        stepped = bucket.params
        if partial:
            # with skip_unused, the parameters that received a gradient; without, also the others, as if their
            # gradient were zero, but not one removed from its group since the layout (step mode and torch.optim
            # step the groups' parameters only) nor one stepped already since the last step() or zero_grad() (by a
            # pass whose step() now steps a gradient it left in .grad: torch.optim's step() steps each once)
            skip, away, done = opt.skip_unused, self.outside, self.window_stepped
            zeros = self.had_grad if self.zeros_kept else ()  # a zero .grad in torch.optim's loop: stepped there
            stepped = [
                p
                for p in bucket.params
                if p in bucket.arrived or (p not in away and p not in done and (not skip or p in zeros))
            ]
            if not stepped:
                bucket.done = True
                self._release(bucket)
                return
            if len(stepped) == len(bucket.params):
                stepped = bucket.params
        if stepped is not bucket.params:
            active = torch.zeros(len(buf.params), dtype=torch.uint8, device="cpu")
            active[[self.index_of[p] for p in stepped]] = 1
            meta = dataclasses.replace(meta, active=active.to(buf.device), uniform=False)
            bucket.meta.uniform = False  # the step counts of its parameters differ from now on
        s, e = bucket.start, bucket.end
        states = [buf.states.get(n) for n in opt.rule.state_names]
        hparams = opt.hparams.on(buf.device)
        divisor = None
        if self.clip is not None:  # max_grad_norm: the gradient is divided by it in the launch, as by a grad scale
            if bucket.divisor is None:
                dtype = torch.float64 if buf.dtype == torch.float64 else torch.float32
                bucket.divisor = torch.ones(1, dtype=dtype, device=buf.device)
            divisor = self.clip.divisor(grad, bucket.divisor)

        # an in-place update of each parameter it steps, as in step mode: a node of this pass or a later one that
        # saved one of them before (a graph kept with retain_graph=True, a detached use) then raises torch's
        # "modified by an inplace operation" error instead of reading the new values
        bump_versions(stepped)

        def launch():
            self.launch(buf, grad, hparams=hparams, meta=meta, span=(s, e), grad_scale=divisor)

        if meta.active is None and self.graph_usable():
            key = (grad.data_ptr(), meta.uniform, hparams.data_ptr(), meta.steps.data_ptr())
            key += (None if divisor is None else divisor.data_ptr(), opt.rounding_seed)
            bucket.graph.run_keyed(key + tuple(None if t is None else t.data_ptr() for t in states), launch)
        else:
            launch()
        self.window_stepped.update(stepped)
        self.had_grad.update(bucket.arrived if partial else bucket.params)
        self.launches += 1
        self.stepped += len(stepped)
        bucket.done = True
        self._release(bucket)

    def graph_usable(self):
        opt = self.opt
        return StepGraph.usable(opt.use_step_graph, opt.backend, self.devices)
