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

Kernel launches per backward: about ``numel / bucket_size`` plus one per parameter larger than a
bucket. Gradient memory held by flatopt: the open buckets' staging gradients (one bucket at a
time when gradients arrive in layout order) plus the gradient autograd is producing.
"""

import threading
import weakref
from contextlib import contextmanager

import torch

from flatopt.bindings import FULL_CHECK_EVERY
from flatopt.distributed import check_single_process
from flatopt.engines.base import FlatEngine
from flatopt.layout import ALIGN, StepMeta
from flatopt.step_graph import StepGraph


def _graph_task_id():
    get = getattr(torch._C, "_current_graph_task_id", None)
    return get() if get is not None else -1


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


class InBackwardEngine(FlatEngine):
    """The hooks, buckets and end-of-backward flush of one optimizer with ``in_backward=True``."""

    has_grad_buffer = False

    def __init__(self, opt):
        super().__init__(opt)
        check_single_process(self.cls, opt.options.allow_several_ranks)
        self.bucket_size = opt.options.bucket_size
        self.buckets = []
        self.bucket_of = {}  # param -> (bucket, element offset in the bucket)
        self.index_of = {}  # param -> index in its buffer
        self.lock = threading.Lock()
        self.task = None  # graph task id of the backward pass in progress
        self.paused = 0  # > 0 inside opt.no_step()
        self.backwards_since_step = 0
        self.step_called = False
        self.dirty = True  # recompute each bucket's UNIFORM flag at the next backward
        self.pending = False  # gradients accumulated under no_step() that no pass has taken yet
        self.backwards = 0  # backward passes begun (every FULL_CHECK_EVERY-th checks every parameter)
        self.launches = 0  # kernel launches so far (tests and benchmarks read it through flatopt.inspect)
        self.held = 0  # staging-gradient elements allocated now
        self.peak_held = 0  # the most staging-gradient elements allocated at once
        self.handles = []

    # ------------------------------------------------------------------ layout
    def order(self, params, groups):
        """Large parameters first: each is a bucket, the small ones share a few."""
        order = sorted(range(len(params)), key=lambda i: not is_large(params[i], self.bucket_size))
        return [params[i] for i in order], [groups[i] for i in order]

    def attach(self, without_grad, with_grad):
        self.buckets = [b for buf in self.buffers for b in make_buckets(buf, self.bucket_size)]
        self.bucket_of, self.index_of = {}, {}
        for b in self.buckets:
            for i in range(b.first, b.stop):
                p = b.buf.params[i]
                self.bucket_of[p] = (b, b.buf.starts[i] - b.start)
                self.index_of[p] = i
        method = weakref.WeakMethod(self.hook)  # the hooks live on the parameters: no reference back to the engine

        def hook(p):
            engine_hook = method()
            if engine_hook is not None:
                engine_hook(p)

        self.handles = [p.register_post_accumulate_grad_hook(hook) for p in self.bucket_of]
        self._finalizer = weakref.finalize(self, _remove, self.handles)  # gone with the engine (and optimizer)

    def detach(self):
        self.remove()

    def refresh_uniform(self, buf):
        super().refresh_uniform(buf)
        self.dirty = True

    def check_bindings(self, full):
        if full or not self.ends_bound():
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
        loss = None
        self.abandon()
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.pending:  # every micro-batch ran under no_step(): step their accumulated gradients now
            self.step_pending()
        self.step_called = True
        self.backwards_since_step = 0
        return loss

    def zero_grad(self, set_to_none):
        self.abandon()
        self.pending = False  # the accumulated gradients are dropped, as torch.optim does
        torch.optim.Optimizer.zero_grad(self.opt, set_to_none=set_to_none)

    def clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite):
        raise RuntimeError(
            f"{self.cls}(in_backward=True) cannot clip by the global gradient norm: each bucket "
            "of parameters is updated during backward, before the gradients of the others exist. Use "
            "in_backward=False to clip, or clip each gradient separately"
        )

    def remove(self):
        if getattr(self, "_finalizer", None) is not None:
            self._finalizer.detach()
        for h in self.handles:
            h.remove()
        self.handles = []

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
            self.pending = True  # accumulated in p.grad, for the next stepping pass or opt.step()
            return
        with self.lock, torch.no_grad():
            try:
                self._arrive(p)
            except BaseException:
                self.reset()
                raise

    def reset(self):
        for b in self.buckets:
            self._release(b)
            b.reset()
        self.task = None

    def _release(self, bucket):
        if bucket.grad is not None:
            self.held -= bucket.grad.numel()
        bucket.close()

    def abandon(self):
        """Called outside backward (zero_grad, step): a pass that began but never ended (its backward
        raised, out of memory say) is dropped, so the next backward starts afresh. Buckets it had
        stepped stay stepped; the others are not."""
        if self.task is not None:
            with self.lock:
                self.reset()

    def _arrive(self, p):
        opt = self.opt
        task = _graph_task_id()
        if self.task is None:
            self._begin(task)
        elif task != self.task:
            raise RuntimeError(
                f"{self.cls}(in_backward=True): the gradient of {opt.names(p)} arrived in a nested "
                "backward pass. Reentrant activation checkpointing (torch.utils.checkpoint with use_reentrant=True) "
                "runs one; use use_reentrant=False, or in_backward=False. (If instead the previous backward pass "
                "raised and was retried without opt.zero_grad() in between, run this backward pass again)"
            )
        if p in self.bucket_of[p][0].arrived:
            raise RuntimeError(
                f"{self.cls}(in_backward=True): the gradient hook of {opt.names(p)} fired twice in one "
                "backward pass (reentrant activation checkpointing does that); use "
                "torch.utils.checkpoint(..., use_reentrant=False), or in_backward=False"
            )
        self._take(p)

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
        check_single_process(self.cls, opt.options.allow_several_ranks)  # the group may have started since
        if backward:
            self.backwards_since_step += 1
            if self.step_called and self.backwards_since_step > 1:
                self.backwards_since_step = 1
                raise RuntimeError(
                    f"{self.cls}(in_backward=True): a second backward pass started without opt.step() "
                    "in between. Each backward pass updates the parameters, so gradients are not accumulated over "
                    "micro-batches: run all but the last micro-batch's backward inside `with opt.no_step():`"
                )
        self.check_bindings(full=self.dirty or self.backwards % FULL_CHECK_EVERY == 0)
        self.backwards += 1
        self.refresh_hparams()
        if self.dirty:
            for b in self.buckets:
                steps = b.meta.steps[b.first : b.stop]
                b.meta.uniform = not opt.skip_unused and b.single_groups and bool((steps == steps[0]).all())
            self.dirty = False
        self.task = task
        self.pending = False  # gradients accumulated under no_step() are taken by this pass
        if backward:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def step_pending(self):
        """``opt.step()`` after every micro-batch ran under ``no_step()``: step the accumulated
        ``p.grad`` as torch.optim would, then free them."""
        with self.lock, torch.no_grad():
            try:
                self._begin(task=None, backward=False)
                self._end_pass()
            finally:
                self.reset()

    def _finish(self):
        """End of the backward pass (queued on the autograd engine by its first gradient)."""
        with self.lock, torch.no_grad():
            try:
                self._end_pass()
            finally:
                self.reset()

    def _end_pass(self):
        """Step the buckets still open: first take the gradients left in ``p.grad`` by micro-batches
        run under no_step() that this pass did not reach; then treat missing gradients as zero (or,
        with skip_unused, step only the parameters that received one), as step mode does."""
        opt = self.opt
        for b in self.buckets:
            if not b.done:
                for p in [p for p in b.params if p not in b.arrived and p.grad is not None]:
                    self._take(p)
        if not self.unused_reported:
            missing = [p for b in self.buckets if not b.done for p in b.params if p not in b.arrived]
            if missing:
                self.warn_unused(missing)
            self.unused_reported = True
        for b in self.buckets:
            if not b.done and (b.arrived or not opt.skip_unused):
                self._step(b, partial=True)
        self.keep_padding_zero()  # every bucket of the pass is stepped by now

    def _step(self, bucket, partial=False):
        opt, buf = self.opt, bucket.buf
        grad = bucket.direct if bucket.direct is not None else bucket.staging(self)
        meta = bucket.meta
        if partial and opt.skip_unused:
            active = torch.zeros(len(buf.params), dtype=torch.uint8)
            active[[self.index_of[p] for p in bucket.arrived]] = 1
            meta = StepMeta(**{**vars(meta), "active": active.to(buf.device), "uniform": False})
        s, e = bucket.start, bucket.end
        states = [buf.states.get(n) for n in opt.rule.state_names]
        hparams = opt.hparams.on(buf.device)

        def launch():
            self.launch(buf, grad, hparams=hparams, meta=meta, span=(s, e))

        if meta.active is None and self.graph_usable():
            key = (grad.data_ptr(), meta.uniform, hparams.data_ptr(), meta.steps.data_ptr())
            bucket.graph.run_keyed(key + tuple(None if t is None else t.data_ptr() for t in states), launch)
        else:
            launch()
        self.launches += 1
        bucket.done = True
        self._release(bucket)

    def graph_usable(self):
        opt = self.opt
        return StepGraph.usable(opt.use_step_graph, opt.backend, opt.skip_unused, self.devices)
