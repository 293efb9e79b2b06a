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

import os
import threading
from contextlib import contextmanager

import torch

from flatopt.layout import ALIGN, StepMeta
from flatopt.step_graph import StepGraph

DEFAULT_BUCKET_SIZE = 2**25  # elements: 128 MiB of float32 staging gradient
FULL_CHECK_EVERY = 256  # step() (or, in-backward, a backward pass) checks every parameter's bindings this often


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


ALLOW_SEVERAL_RANKS = "FLATOPT_ALLOW_SEVERAL_RANKS"  # =1: the ranks share no parameters


def world_size():
    """The number of ranks in torch.distributed's default process group (1 when none is running)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def refuse_several_ranks(message):
    """Raise RuntimeError(``message``, with ``{ranks}`` filled in) when torch.distributed's default process
    group has several ranks, unless the environment says the ranks share no parameters (pipeline stages,
    independent runs), so that nothing averages gradients between them."""
    ranks = world_size()
    if ranks > 1 and os.environ.get(ALLOW_SEVERAL_RANKS) != "1":
        raise RuntimeError(
            message.format(ranks=ranks) + " If the ranks share no parameters (pipeline stages, independent runs), "
            f"set the environment variable {ALLOW_SEVERAL_RANKS}=1 to allow it"
        )


def check_single_process(cls):
    """In-backward mode steps each bucket from this rank's own gradient, as soon as it exists, before
    DistributedDataParallel averages gradients across ranks (DDP then writes its averages into
    ``.grad`` after the step), so the replicas would diverge without any error."""
    refuse_several_ranks(
        f"{cls}(in_backward=True) cannot train with several distributed ranks ({{ranks}} here): it steps each "
        "parameter from this rank's gradient during backward, before DistributedDataParallel averages the "
        "gradients across ranks, so the replicas would diverge. Use in_backward=False with DDP."
    )


class InBackward:
    """The hooks, buckets and end-of-backward flush of one optimizer with ``in_backward=True``."""

    def __init__(self, opt, bucket_size):
        self.opt = opt
        self.bucket_size = bucket_size
        self.buckets = [b for buf in opt._buffers for b in make_buckets(buf, bucket_size)]
        self.bucket_of = {}  # param -> (bucket, element offset in the bucket)
        self.index_of = {}  # param -> index in its buffer
        for b in self.buckets:
            for i in range(b.first, b.stop):
                p = b.buf.params[i]
                self.bucket_of[p] = (b, b.buf.starts[i] - b.start)
                self.index_of[p] = i
        self.lock = threading.Lock()
        self.task = None  # graph task id of the backward pass in progress
        self.paused = 0  # > 0 inside opt.no_step()
        self.backwards_since_step = 0
        self.step_called = False
        self.dirty = True  # recompute each bucket's UNIFORM flag at the next backward
        self.pending = False  # gradients accumulated under no_step() that no pass has taken yet
        self.backwards = 0  # backward passes begun (every FULL_CHECK_EVERY-th checks every parameter)
        self.launches = 0  # kernel launches so far (tests and benchmarks read it)
        self.held = 0  # staging-gradient elements allocated now
        self.peak_held = 0  # the most staging-gradient elements allocated at once
        self.handles = [p.register_post_accumulate_grad_hook(self.hook) for p in self.bucket_of]

    def remove(self):
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
                f"{type(opt).__name__}(in_backward=True): the gradient of {opt._name(p)} arrived in a nested "
                "backward pass. Reentrant activation checkpointing (torch.utils.checkpoint with use_reentrant=True) "
                "runs one; use use_reentrant=False, or in_backward=False. (If instead the previous backward pass "
                "raised and was retried without opt.zero_grad() in between, run this backward pass again)"
            )
        if p in self.bucket_of[p][0].arrived:
            raise RuntimeError(
                f"{type(opt).__name__}(in_backward=True): the gradient hook of {opt._name(p)} fired twice in one "
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
            raise RuntimeError(f"{type(self.opt).__name__} does not support sparse gradients ({self.opt._name(p)})")
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
        check_single_process(type(opt).__name__)  # the process group may have started after construction
        if backward:
            self.backwards_since_step += 1
            if self.step_called and self.backwards_since_step > 1:
                self.backwards_since_step = 1
                raise RuntimeError(
                    f"{type(opt).__name__}(in_backward=True): a second backward pass started without opt.step() "
                    "in between. Each backward pass updates the parameters, so gradients are not accumulated over "
                    "micro-batches: run all but the last micro-batch's backward inside `with opt.no_step():`"
                )
        opt.check_bindings(full=self.dirty or self.backwards % FULL_CHECK_EVERY == 0)
        self.backwards += 1
        opt._refresh_hparams(opt._devices)
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
        if not opt._unused_reported:
            missing = [p for b in self.buckets if not b.done for p in b.params if p not in b.arrived]
            if missing:
                opt._warn_unused(missing)
            opt._unused_reported = True
        for b in self.buckets:
            if not b.done and (b.arrived or not opt.skip_unused):
                self._step(b, partial=True)

    def _step(self, bucket, partial=False):
        opt, buf = self.opt, bucket.buf
        grad = bucket.direct if bucket.direct is not None else bucket.staging(self)
        meta = bucket.meta
        if partial and opt.skip_unused:
            active = torch.zeros(len(buf.params), dtype=torch.uint8)
            active[[self.index_of[p] for p in bucket.arrived]] = 1
            meta = StepMeta(**{**vars(meta), "active": active.to(buf.device), "uniform": False})
        s, e = bucket.start, bucket.end
        states = [buf.states.get(n) for n in opt._state_names]
        hparams = opt._hp[buf.device]

        def launch():
            opt._functional(
                buf.data[s:e], grad, *(None if t is None else t[s:e] for t in states),
                hparams=hparams, meta=meta, backend=opt.backend,
            )  # fmt: skip

        if meta.active is None and StepGraph.usable(opt):
            key = (grad.data_ptr(), meta.uniform, hparams.data_ptr(), meta.steps.data_ptr())
            bucket.graph.run_keyed(key + tuple(None if t is None else t.data_ptr() for t in states), launch)
        else:
            launch()
        self.launches += 1
        bucket.done = True
        self._release(bucket)
