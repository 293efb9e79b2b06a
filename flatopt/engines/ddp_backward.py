"""The DDP in-backward engine (``in_backward=True`` given a ``DistributedDataParallel`` model): each DDP bucket is
stepped right after its all-reduce, from a DDP communication hook, so every rank steps the same averaged gradients
and the step overlaps the communication and backward computation still to come.

flatopt registers one communication hook on the DDP instance (``ddp.register_comm_hook``). For each bucket DDP
hands it, the hook averages the bucket over DDP's process group, as DDP's own all-reduce does (torch's
``default_hooks.allreduce_hook``: divide by the group's size, then all-reduce), and, in the future's ``then``
callback, steps the bucket's parameters from the averaged bucket: the parameters of one DDP bucket lie in runs of
consecutive parameters of a flat buffer, and each run is one kernel launch. torch's precedent is
``torch.distributed.algorithms.ddp_comm_hooks.optimizer_overlap_hooks._hook_then_optimizer`` (which
``DistributedDataParallel._register_fused_optim`` uses), one functional step per parameter; here it is one launch
per run::

    DDP bucket        [ p3.grad | p2.grad | p1.grad ]           (averaged in place by the all-reduce)
    flat buffer    ┌─ p3 ─┬─ p2 ─┬─ p1 ─┬─ p0 ─┐                  (reverse registration order, DDP's order)
    launch          └─── one run ──────┘

* Gradients: a run whose gradients lie in the DDP bucket exactly as its parameters lie in the flat buffer (same
  order, no padding: every size a multiple of the 64-element alignment) is stepped straight from the bucket, with
  no copy; any other run's gradients are copied into a staging gradient first (a read and a write of each element).
  The layout puts the parameters in reverse registration order, the order in which DDP's buckets hold them once
  DDP has rebuilt its buckets in gradient-ready order (after the first iteration; a model whose backward produces
  gradients in reverse registration order).
* After the step the autograd gradient is freed (``p.grad = None``, as in single-process in-backward mode), and DDP
  is told not to copy the averaged bucket back into ``.grad`` (``reducer._set_optimizer_in_backward()``, what DDP
  itself does for ``torch.distributed.optim._apply_optimizer_in_backward``).
* The engine's per-parameter post-accumulate-grad hooks are not registered: they would step each rank's own
  gradient before DDP averages it.
* Accumulation: ``ddp.no_sync()`` (no communication, so no step; gradients add up in ``.grad``) or ``opt.no_step()``
  (DDP averages each micro-batch and the hook puts the average in ``.grad``, as DDP does); the next synchronised
  pass outside them steps with the sum, or ``step()`` does. ``accumulation_steps`` and ``max_grad_norm`` are refused
  at construction.
* An optimizer created on a DDP model that has flatopt's hook already (from an optimizer created before) takes the
  hook over; while no optimizer is alive, the hook puts DDP's averages in ``.grad``, as DDP would.
* A pass that cannot be stepped (a second one without ``step()`` or ``zero_grad()``, one after a pass that raised)
  still lets DDP finish its all-reduces, steps nothing, drops its gradients, and raises when DDP's end-of-backward
  work is done, so that the reducer is left ready for the next iteration.
* A pass that raised (a hook's exception, out of memory) never reaches DDP's end-of-backward work: the buckets whose
  all-reduce it had launched (on every rank alike) are stepped in their futures' callbacks, possibly after the
  exception reached the caller; ``zero_grad()`` waits for them, then drops the pass. ``step()`` after it is refused:
  the gradients the pass left in ``.grad`` were never averaged. DDP itself refuses its next forward pass until its
  reducer is reset (``ddp.reducer._reset_state()``, the caller's to call).
"""

import weakref

import torch

from flatopt.engines.in_backward import Bucket, InBackwardEngine, _graph_task_id


def ddp_managed(ddp):
    """The parameters whose gradients ``ddp`` averages: those of its module that require grad, less the ignored."""
    ignored = getattr(ddp, "parameters_to_ignore", set())
    return {p for name, p in ddp.module.named_parameters() if p.requires_grad and name not in ignored}


def check_ddp(opt, ddp):
    """Refuse, before anything is laid out, what the DDP in-backward engine cannot step; say what to do."""
    cls, o = type(opt).__name__, opt.options
    if o.max_grad_norm is not None or o.accumulation_steps != 1:
        raise ValueError(
            f"{cls}(in_backward=True) over DistributedDataParallel takes neither max_grad_norm nor accumulation_steps: "
            "accumulate with ddp.no_sync() or opt.no_step() on all but the last micro-batch, and clip in step mode "
            "(in_backward=False), where clip_grad_norm_ sees every averaged gradient before the step"
        )
    if getattr(ddp, "find_unused_parameters", False) and opt.skip_unused:
        raise ValueError(
            f"{cls}(in_backward=True) over DistributedDataParallel(find_unused_parameters=True) cannot tell, when a "
            "bucket is averaged, which parameters no rank used (DDP hands them a zero gradient), so it cannot leave "
            "them untouched as skip_unused=True asks. Pass skip_unused=False (they are stepped with a zero gradient, "
            "as torch.optim after zero_grad(set_to_none=False)), or use in_backward=False (step mode)"
        )
    if any(hook is not comm_hook for hook, _ in getattr(ddp, "_comm_hooks", ())):  # flatopt's own is taken over
        raise ValueError(
            f"{cls}(in_backward=True) steps each bucket from a DDP communication hook of its own, and this "
            "DistributedDataParallel has one already (DDP takes one): create the optimizer on a DDP model without "
            "register_comm_hook, or use in_backward=False (step mode), which works with any hook"
        )
    if getattr(ddp, "mixed_precision", None) is not None:
        raise ValueError(
            f"{cls}(in_backward=True) does not support DistributedDataParallel(mixed_precision=...): its buckets hold "
            "low-precision gradients of low-precision copies of the parameters. Use in_backward=False (step mode)"
        )
    reducer = getattr(ddp, "reducer", None)
    if reducer is None or not hasattr(reducer, "_set_optimizer_in_backward"):
        raise RuntimeError(
            f"{cls}(in_backward=True) over DistributedDataParallel needs DDP's C++ reducer with "
            "_set_optimizer_in_backward (torch >= 2.0, not the Python reducer of compiled DDP); use in_backward=False"
        )
    managed = ddp_managed(ddp)
    outside = [p for g in opt.param_groups for p in g["params"] if p.requires_grad and p not in managed]
    if outside:
        raise ValueError(
            f"{cls}(in_backward=True) over DistributedDataParallel steps the parameters DDP averages, and "
            f"{opt.names.of(outside)} are not among them (ignored by DDP, or not in ddp.module). Give the optimizer "
            "DDP's parameters only (another optimizer for the others), or use in_backward=False (step mode)"
        )


class HookState:
    """What flatopt's communication hook holds: the engine, weakly (DDP keeps the hook for its lifetime, which must
    not keep the optimizer alive), DDP's process group, and whether DDP's ``.grad`` are views of its buckets."""

    __slots__ = ("engine", "group", "bucket_view")

    def __init__(self, engine, group, bucket_view):
        self.engine, self.group, self.bucket_view = weakref.ref(engine), group, bucket_view


def land(state, pairs):
    """Put averaged bucket gradients in ``.grad``, as DDP's reducer would (it no longer does, once told that an
    optimizer runs in backward): for parameters the optimizer does not step in this pass."""
    if state.bucket_view:
        return  # DDP makes .grad its bucket view itself at the end of backward
    for p, g in pairs:
        if p.grad is None:
            p.grad = g.clone()
        elif p.grad is not g:
            p.grad.copy_(g)


def comm_hook(state, bucket):
    """flatopt's DDP communication hook: average ``bucket`` over the ranks as DDP does, then hand it to the engine
    (or, the optimizer gone, put the averages in ``.grad`` as DDP would)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    engine = state.engine()
    mode = None if engine is None else engine.on_bucket()
    future = allreduce_hook(state.group, bucket)

    def after(fut):
        tensor = fut.value()
        e = state.engine()
        if e is None or mode is None:
            with torch.no_grad():
                land(state, zip(bucket.parameters(), bucket.gradients()))
        else:
            e.after_reduce(bucket, mode)
        return tensor

    chained = future.then(after)
    if engine is not None:
        engine.track(chained)
    return chained


class DDPInBackwardEngine(InBackwardEngine):
    """In-backward mode over DistributedDataParallel: each DDP bucket stepped once averaged."""

    def __init__(self, opt, ddp):
        check_ddp(opt, ddp)
        self._ddp = weakref.ref(ddp)
        self.hook_state = None
        self.runs = {}  # (buffer index, first, stop) -> Bucket: the runs of parameters DDP's buckets step
        self.pass_task = None  # graph task of the backward pass whose buckets are being reduced
        self.mode = None  # what that pass does with its buckets: "step", "land" (under no_step()) or "drop"
        self.refusal = None  # the exception the pass ends with, when refused
        self.copied = 0  # gradient elements copied from DDP's buckets into staging gradients
        self.direct = 0  # runs stepped straight from DDP's bucket, with no copy
        self.futures = []  # the buckets' futures (the step in their callbacks) of passes whose end has not come
        super().__init__(opt)

    def check_ranks(self):
        """Several ranks are what DDP is for: the hook steps the averaged gradients."""

    @property
    def ddp(self):
        return self._ddp()

    # ------------------------------------------------------------------ layout
    def order(self, params, groups):
        """Reverse registration order: the order of the parameters in DDP's buckets (see the module's docstring)."""
        return params[::-1], groups[::-1]

    def attach(self, without_grad, with_grad):
        # the static buckets step gradients left in .grad (opt.step() after no_step() or no_sync()); no gradient hooks
        self.make_buckets()
        self.handles, self.hook_id, self.outside = [], {}, set()
        self.runs = {}
        ddp = self.ddp
        if ddp is None:
            return
        if self.hook_state is None:
            ours = [state for hook, state in getattr(ddp, "_comm_hooks", ()) if hook is comm_hook]
            if ours:  # registered by an optimizer created on this DDP model before: this one steps the buckets now
                self.hook_state = ours[0]
                self.hook_state.engine = weakref.ref(self)
            else:
                state = HookState(self, ddp.process_group, bool(ddp.gradient_as_bucket_view))
                try:
                    ddp.register_comm_hook(state, comm_hook)
                except RuntimeError as e:  # a built-in hook (ddp._register_builtin_comm_hook) is not listed
                    raise RuntimeError(
                        f"{self.cls}(in_backward=True) steps each bucket from a DDP communication hook of its own, "
                        f"and DDP refused it ({e}): create the optimizer on a DDP model without a communication hook, "
                        "or use in_backward=False (step mode)"
                    ) from e
                self.hook_state = state
                ddp.reducer._set_optimizer_in_backward()  # DDP leaves .grad alone at the end of backward

    def launched_buckets(self):
        return [*self.buckets, *self.runs.values()]

    @staticmethod
    def set_uniform(run):
        steps = run.meta.steps[run.first : run.stop]
        run.meta.uniform = run.single_groups and bool((steps == steps[0]).all())

    def step_pending(self):
        super().step_pending()
        self.dirty = True  # skip_unused may have stepped part of a bucket: the runs' UNIFORM flags are recomputed

    def step(self, closure, grad_scale, found_inf):
        if self.task is not None or self.pass_task is not None:
            raise RuntimeError(
                f"{self.cls}(in_backward=True) over DistributedDataParallel: opt.step() after a backward pass that "
                "raised. The gradients that pass left in .grad are this rank's own (DDP averages a bucket only once "
                "every gradient of it is ready), so stepping them would make the replicas differ. Call "
                "opt.zero_grad() instead (and ddp.reducer._reset_state(), which DDP needs before its next forward "
                "pass), then run the backward pass again. Nothing was updated by this call"
            )
        return super().step(closure, grad_scale, found_inf)

    def track(self, future):
        """From the communication hook: the future whose callback steps (or lands, or drops) a bucket."""
        with self.lock:
            self.futures.append(future)

    def abandon(self, give_back=False):
        """``zero_grad()`` (or ``step()``) after a pass that raised: wait for the callbacks of the buckets whose
        all-reduce the pass launched (launched on every rank, so stepped on every rank), which run on the
        communication thread and may still be running: once it returns they have stepped, in the same order on
        every rank, and none steps during the next pass. Then drop the pass, as in single-process mode."""
        with self.lock:
            futures, self.futures = self.futures, []
        failed = None
        for future in futures:
            try:
                future.wait()
            except Exception as e:  # the bucket's all-reduce or its step raised
                failed = failed or e
        super().abandon(give_back)
        self.pass_task = self.mode = self.refusal = None
        if failed is not None:
            raise RuntimeError(
                f"{self.cls}(in_backward=True) over DistributedDataParallel: a bucket of the backward pass that raised "
                f"could not be averaged or stepped on this rank ({failed}), so the replicas may now differ: restart "
                "from a checkpoint. The pass was dropped"
            ) from failed

    # ------------------------------------------------------------------ a backward pass
    def on_bucket(self):
        """From the communication hook, on the autograd thread: what this pass does with its buckets, decided at
        its first bucket."""
        task = _graph_task_id()
        if task == -1:
            raise RuntimeError(
                f"{self.cls}(in_backward=True): DDP ran a bucket's all-reduce outside a backward pass (DDP's join() "
                "for "
                "uneven inputs does so on a rank that has run out of data), where in-backward mode cannot step the "
                "bucket as the other ranks do. Give every rank the same number of batches, or use in_backward=False "
                "(step mode)"
            )
        if task != self.pass_task:
            with self.lock, torch.no_grad():
                self.open_pass(task)
        return self.mode

    def open_pass(self, task):
        cls = self.cls
        self.pass_task, self.refusal = task, None
        if self.task is not None:
            self.mode = "drop"
            self.refusal = RuntimeError(
                f"{cls}(in_backward=True): a backward pass started after the previous one raised, without "
                "opt.zero_grad() or opt.step() in between. Call opt.zero_grad() before running backward again. "
                "Nothing was updated by this backward pass"
            )
        elif self.paused and self.applied:  # torch.optim would step both passes' gradients together
            self.mode = "drop"
            self.refusal = RuntimeError(self._paused_after_a_stepped_pass(None, landed=False))
        elif self.paused:
            self.mode = "land"  # under no_step(): DDP's averages go to .grad, for the next stepping pass or step()
            self.pending = True
        elif self.applied:
            self.mode = "drop"
            self.refusal = RuntimeError(
                f"{cls}(in_backward=True): a second backward pass started with neither opt.step() nor "
                "opt.zero_grad() since the previous one, which in-backward mode already stepped (each DDP bucket is "
                "stepped once averaged). To accumulate gradients over several backward passes under "
                "DistributedDataParallel, run all but the last inside `with ddp.no_sync():` or `with opt.no_step():`; "
                "otherwise call opt.step() (or opt.zero_grad()) after each backward. Nothing was updated by this "
                "backward pass, and its gradients were dropped"
            )
        else:
            try:
                self._begin(task, backward=False)
                self.mode = "step"
            except Exception as e:  # an opt.state edit it cannot honour, a parameter moved: raised at the end
                self.reset()
                self.mode, self.refusal = "drop", e
        engine = torch.autograd.Variable._execution_engine
        # DDP queues its end-of-backward work after this pass's last bucket; what is queued from a queued callback
        # runs after it, once every bucket's future has completed
        engine.queue_callback(lambda: engine.queue_callback(self.close_pass))

    def after_reduce(self, bucket, mode):
        """The future's callback (on the communication thread): step the averaged bucket's parameters."""
        pairs = list(zip(bucket.parameters(), bucket.gradients()))
        with self.lock, torch.no_grad():
            if mode == "drop":
                return
            if mode == "land":
                land(self.hook_state, pairs)
                return
            runs, others = {}, []
            for p, g in pairs:
                where = self.where.get(p)
                if where is None or p in self.outside:
                    others.append((p, g))
                else:
                    runs.setdefault(where[0], []).append((where[1], p, g))
            land(self.hook_state, others)
            for b, items in runs.items():
                items.sort(key=lambda item: item[0])
                start = 0
                for k in range(1, len(items) + 1):
                    if k == len(items) or items[k][0] != items[k - 1][0] + 1:
                        self.step_run(b, items[start:k])
                        start = k
            for items in runs.values():
                for _, p, _ in items:
                    p.grad = None  # autograd's gradient (or DDP's bucket view): applied

    def step_run(self, b, items):
        """One launch over the run of consecutive parameters ``items`` ([(index, parameter, averaged gradient)])."""
        buf = self.buffers[b]
        first, stop = items[0][0], items[-1][0] + 1
        run = self.runs.get((b, first, stop))
        if run is None:
            run = self.runs[(b, first, stop)] = Bucket(buf, first, stop)
            self.set_uniform(run)
        direct = self.in_place(run, items)
        if direct is not None:
            run.direct = direct
            self.direct += 1
        else:
            staging = run.staging(self)
            for i, p, g in items:
                staging.as_strided(p.shape, p.stride(), buf.starts[i] - run.start).copy_(g)
                self.copied += p.numel()
        run.arrived.update(p for _, p, _ in items)
        self._step(run)
        run.reset()

    @staticmethod
    def in_place(run, items):
        """The run's gradient as one flat view of DDP's bucket, when the bucket holds the run's gradients exactly as
        the flat buffer holds its parameters (same order and strides, no padding); else None."""
        buf, n = run.buf, run.end - run.start
        if sum(p.numel() for _, p, _ in items) != n:
            return None  # alignment padding in the run, which DDP's bucket does not have
        _, _, g0 = items[0]
        storage, base = g0.untyped_storage().data_ptr(), g0.storage_offset()
        for i, p, g in items:
            if g.dtype != buf.dtype or g.stride() != p.stride() or g.untyped_storage().data_ptr() != storage:
                return None
            if g.storage_offset() != base + buf.starts[i] - run.start:
                return None
        return g0.as_strided((n,), (1,), base)

    def close_pass(self):
        """After DDP's end-of-backward work (every bucket's future has completed): free what the pass stepped, or
        raise the pass's refusal, its gradients dropped."""
        with self.lock:
            mode, refusal = self.mode, self.refusal
            self.pass_task = self.mode = self.refusal = None
            self.futures = [f for f in self.futures if not f.done()]  # a pass that raised before may have some left
            if mode == "land":
                return
            for p in self.bucket_of:
                if p not in self.outside:
                    p.grad = None  # DDP's bucket view, put back by DDP at the end of backward, or a refused pass's
            if mode == "step":
                self.keep_padding_zero()
                self.applied = True
                self.reset()
        if refusal is not None:
            raise refusal

    # ------------------------------------------------------------------ clipping
    def clip_call(self, max_norm, norm_type, error_if_nonfinite, run_torch):
        if self.applied:
            raise RuntimeError(
                f"{self.cls}(in_backward=True) over DistributedDataParallel: clip_grad_norm_ cannot clip the gradients "
                "of this backward pass: each DDP bucket was stepped as soon as it was averaged, and its gradients "
                "freed, so this call would find none and clip nothing. Clip in step mode (in_backward=False), or "
                "accumulate under ddp.no_sync() / opt.no_step() and clip before opt.step(). The parameters have "
                "already been updated with the unclipped gradients of that pass"
            )
        return super().clip_call(max_norm, norm_type, error_if_nonfinite, run_torch)
