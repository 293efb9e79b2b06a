"""How gradients reach the flat gradient buffers.

Each parameter has a slot in its buffer (:mod:`flatopt.landing`). On a GPU the covered layers of the model
(``nn.Linear``, ``nn.Embedding``) write their gradients into the slots during backward, with the op
that computes them; every other gradient is born as a tensor of its own and a post-accumulate-grad
hook copies it into its slot (a read and a write of its bytes), which frees the tensor at once. On the CPU
(:attr:`GradLanding.copy_on_cpu` and :attr:`GradLanding.direct_on_cpu` off) no layer is covered unless
``direct_grads=True`` and no hook copies: ``step()`` reads or gathers autograd's gradients.

* :meth:`GradLanding.release` (``opt.zero_grad()``) sets every ``.grad`` to None, as torch does,
  and releases the gradient storage until the next gradient arrives;
* a second backward pass before the next ``zero_grad()`` (gradient accumulation) adds into the
  slots, as autograd adds into any existing ``.grad``;
* :meth:`GradLanding.settle`, run before anything reads the buffers (``step()``,
  ``clip_grad_norm_()``, ``check_bindings()``), zeroes the slot of every parameter whose ``.grad``
  is still None (it received no gradient) and copies in any ``.grad`` that is a tensor of its own
  (set by ``p.grad = ...``, or by DistributedDataParallel: a parameter only other ranks used, or
  ``gradient_as_bucket_view=True``), so the buffers hold what zeroing plus accumulation would have
  left.

Between ``zero_grad()`` and ``step()`` a ``.grad`` is therefore None (no gradient yet) or a view of
its slot holding its gradient (a tensor object of its own: never the buffer's own view, so that one
the caller keeps holds the storage), as torch.optim users expect. Inside ``capture()``
(``deferred``) the hooks leave the new gradients in the graph's memory pool; after backward the
optimizer's kernel reads them there and stores them into the slots as it steps
(:meth:`GradLanding.settle_gathering`), and those it cannot read in place, or all of them when
something reads the views before the step (max_grad_norm, a train_step that steps itself, a step
pre-hook), are copied in by settle(), one batched copy per (dtype, device).
"""

import weakref
from contextlib import contextmanager

import torch

from flatopt.landing import LandingSlots
from flatopt.options import GATHER


def _remove(handles):
    for h in handles:
        h.remove()


class GradLanding:
    """The gradient views of one optimizer's flat buffers and the hooks that copy gradients into them.

    On the CPU (:attr:`copy_on_cpu` False, the default) no hook copies gradients in as they arrive: autograd's
    tensor stays in ``.grad`` until ``step()``, which copies the small ones into their slots with one batched copy
    and reads the others where they lie (:mod:`flatopt.engines.step`). A Python hook per parameter per backward
    and a copy of every gradient cost more there than the flat step saves; on a GPU the hook's host time overlaps
    the device's work and releasing each gradient at once lowers the memory peak.

    Args:
        buffers (list[FlatBuffer]): the buffers, each with a gradient buffer.
        keep_none (bool): a ``.grad`` that is None stays None (``skip_unused=True``).
        names (flatopt.naming.Names): how messages name parameters.
        cls (str): the optimizer's class name, for messages.
    """

    copy_on_cpu = False  # the tests set it to run the GPU's copying hooks on the CPU (tests/conftest.py)

    #: Whether ``direct=None`` (the optimizers' default ``direct_grads``) covers the layers of a model on the CPU.
    #: Off: there step() already reads autograd's gradients where they lie or gathers the small ones with one
    #: batched copy, so a covered layer saves next to nothing, while its Python autograd.Function costs host time
    #: at every forward and backward (docs/gradients.md has the measurement). The tests set it to run the GPU's
    #: path on the CPU (tests/conftest.py).
    direct_on_cpu = False

    def __init__(self, buffers, *, keep_none=False, names=None, cls="flatopt", module=None, direct=None):
        self.views = {p: view for buf in buffers for p, view in zip(buf.params, buf.grad_views)}
        # the parameters' slots: where covered layers write their gradients, and the storage released by zero_grad()
        hook = weakref.WeakMethod(self.hook)  # the slots live on in the modules' patches: no reference back

        def on_fallback(p):
            method = hook()
            if method is not None:
                method(p)

        self.slots = LandingSlots(buffers, on_fallback=on_fallback)
        # (parameter, view, slot, and the view's dtype, device, numel, shape and strides) for settling's scan: one
        # attribute read and two identity tests per parameter whose .grad is in its slot
        self.entries = [
            (p, view, self.slots.slot_of(p), view.dtype, view.get_device(), view.numel(), view.shape, view.stride())
            for p, view in self.views.items()
        ]
        self.counts = [len(buf.params) for buf in buffers]
        self.module = module  # the model to cover: its covered layers write into the slots
        # True: cover the model's layers; None: those on a GPU (or everywhere: direct_on_cpu); False: none, "gather":
        # none, and no hook copies a gradient in: step() reads them where they lie (see gathers)
        self.direct = direct
        # where each parameter's data lives in these buffers: a hook does nothing for a parameter that another
        # optimizer (or a re-layout) has moved into buffers of its own since
        self.homes = {p: buf.expected[i][0] for buf in buffers for i, p in enumerate(buf.params)}
        self.firsts = [(buf.params[0], buf.grad_views[0]) for buf in buffers]
        self.firsts_views = [view for _, view in self.firsts]  # one per buffer: their storages, as they are now
        self.on_cpu = all(buf.device.type == "cpu" for buf in buffers)
        self.names = names if names is not None else (lambda p: f"a parameter of shape {tuple(p.shape)}")
        self.cls = cls
        # skip_unused: a .grad that is None stays None (its view is zeroed all the same), as torch leaves it
        self.keep_none = keep_none
        # inside capture(): the hooks leave each new gradient where autograd put it (the graph's pool), and
        # settle() copies them all into the views with one batched copy after backward, recorded as a few
        # kernels instead of one per parameter
        self.deferred = False
        self.pooled = {}  # while deferred: storage address of each gradient left in the pool -> its parameter
        self.handles = []
        self.hooked = set()
        self._land = None
        self._finalizer = None

    def attach(self):
        """Register the hooks (once)."""
        if self.handles:
            return
        if (self.direct is True or self.direct is None) and self.module is not None:
            self.slots.install(self.module, cpu=self.direct is True or self.direct_on_cpu)
        for p, view in self.views.items():  # .grad is never the buffer's own view object (see restore())
            if p.grad is view:
                self.slots.put(p)
        ref = weakref.ref(self)  # the hooks live on the parameters: no reference back to the landing
        views, homes, strided = self.views, self.homes, torch.strided

        def land(p):
            """Copy a gradient of its own into ``p``'s view and put the view back in ``.grad``. Runs once per
            parameter per backward pass, so it is kept short (no no_grad(): autograd runs hooks with grad
            mode off, and a gradient with history is left alone)."""
            g, view = p.grad, views[p]
            if g is view or g is None:  # accumulated into the view: nothing to do
                return
            self_ = ref()
            if self_ is None or p.data_ptr() != homes[p]:
                return  # the optimizer is gone, or p was laid out elsewhere
            s = self_.slots.slot_of(p)
            if s is None or g is s.grad or g is s.view:
                return  # no slot, or its gradient is in its slot already
            if (
                self_.deferred
                and g.layout is strided
                and self_.pooled.setdefault(g.untyped_storage().data_ptr(), p) is p
            ):
                return  # capture(): settle() copies them all at once; but a gradient that shares its storage
                # with another parameter's (autograd hands views of one tensor to both branches of an add) is
                # copied now, or in-place changes before settle() (accumulation, unscale_) would apply twice
            if (
                g.requires_grad  # backward(create_graph=True): settle() refuses it, naming the parameter
                or g.layout is not strided
                or g.dtype is not view.dtype  # the parameter was cast or moved: check_bindings() says so
                or g.get_device() != view.get_device()
            ):
                return
            self_.slots.take(s, g)  # copied into its slot (the storage brought back first if it was released)

        # covered layers write into the slots themselves: no hook (no Python per parameter per backward), until a
        # gradient of theirs goes torch's way (a tensor hook, create_graph, torch.compile): then it gets one
        self._land = land
        # a parameter frozen at the layout has none (autograd refuses one); it is laid out again when unfrozen
        self.hooked = {p for p in self.views if p not in self.slots.covered and p.requires_grad and self.copies(p)}
        self.handles = [p.register_post_accumulate_grad_hook(land) for p in self.hooked]
        # once the landing is gone, its hooks go too: they hold the views, and so the gradient buffer
        self._finalizer = weakref.finalize(self, _remove, self.handles)

    @contextmanager
    def deferring(self):
        """Inside capture(): the hooks leave each new gradient where autograd put it (the graph's pool), for
        settle_gathering() or one batched copy by settle() after backward."""
        self.deferred = True
        try:
            yield
        finally:
            self.deferred = False

    @property
    def gathers(self):
        """``direct_grads="gather"``: no hook copies a gradient in on any device, and step() reads the gradients
        where autograd left them, as it does on the CPU."""
        return self.direct == GATHER

    def copies(self, p):
        """Whether ``p``'s gradients of their own are copied in by a hook as they arrive: not on the CPU, where
        step() lands them (:attr:`copy_on_cpu`), nor anywhere when it gathers them (:attr:`gathers`)."""
        return (self.copy_on_cpu or p.device.type != "cpu") and not self.gathers

    def hook(self, p):
        """Give covered parameter ``p`` the copying hook (once): its gradients arrive as tensors of their own."""
        if p not in self.hooked and self._finalizer is not None and p.requires_grad and self.copies(p):
            self.hooked.add(p)
            handle = p.register_post_accumulate_grad_hook(self._land)
            self.handles.append(handle)  # the finalizer's list: removed with the others

    def detach(self):
        self.slots.uninstall()
        if self._finalizer is not None:
            self._finalizer()  # removes the hooks, once
            self._finalizer = None
        self.handles = []

    @staticmethod
    def _fits(p, g, view):
        """Whether ``p`` (and ``g``) still have the buffer's dtype and device: after ``model.to()``
        they do not, and check_bindings() reports it."""
        return p.dtype is view.dtype and p.get_device() == view.get_device() and (g is None or g.dtype is view.dtype)

    def release(self):
        """``zero_grad()``: every ``.grad`` to None and the storage released; covered layers write the next
        gradients into their slots, the hooks copy the others in."""
        self.slots.zero_grad(set_to_none=True)  # every .grad to None; the storage released unless held
        self.pooled.clear()

    def restore(self):
        """Every view back in ``.grad`` (a None ``.grad`` stays None with ``skip_unused=True``),
        launching nothing (its values are stale until the buffer is zeroed): after a failed capture,
        and before ``zero_grad(set_to_none=False)`` zeroes them. A released storage is brought back first."""
        self.slots.acquire()
        owns = self.slots.owns_grad
        for p, view in self.views.items():
            g = p.grad
            if not (g is not None and owns(p)) and self._fits(p, None, view) and not (g is None and self.keep_none):
                # a view of the slot, as a tensor object of its own: one the caller keeps then holds the storage
                # (the buffer's own view objects are never handed out, so a kept one cannot be missed)
                self.slots.put(p)

    def _in_slot(self, pair):
        """Whether ``p.grad`` is its view, or the slot's tensor a covered layer put there."""
        p, view = pair
        return p.grad is view or self.slots.owns_grad(p)

    def restore_if_released(self):
        """restore() when the first parameter of a buffer has lost its view (zero_grad() between two
        replays of a captured step, which writes the gradients into the views): one test per buffer."""
        if not all(map(self._in_slot, self.firsts)):
            self.restore()

    def settle(self):
        """Zero the views of parameters whose ``.grad`` is None, copy in every ``.grad`` that is a
        tensor of its own, and put the views back in ``.grad`` (a None ``.grad`` stays None with
        ``skip_unused=True``). Raises, changing nothing, for a gradient the buffer cannot hold
        (sparse, or with autograd history)."""
        self.apply(self.plan())

    def settle_gathering(self, fits):
        """settle() inside capture(), except for the gradients left in the graph's pool that ``fits(view,
        grad)`` accepts: those are not copied, and are returned ({parameter: gradient}) for the optimizer's
        kernel to read where they lie and store into the views as it steps (see GradSources). Their
        ``.grad`` is the view all the same, holding its old values until that kernel has run. In the graph's pool:
        those the copying hooks left there (:attr:`pooled`), or, with no hook (:attr:`gathers`), every gradient of
        its own, since capture() set every ``.grad`` to None before the recorded backward."""
        zero, copy, _ = self.plan()
        taken, rest = {}, []
        gathers = self.gathers
        for p, view, g in copy:
            if g is not None and (gathers or self.pooled.get(g.untyped_storage().data_ptr()) is p) and fits(view, g):
                taken[p] = g
            else:
                rest.append((p, view, g))
        self.apply((zero, rest))
        for p in taken:
            self.slots.put(p)
        return taken

    def plan(self, in_place_min=None):
        """What settle() does, checked but not done: ((param, view) to zero, (param, view, tensor or None)
        to copy, taken). Two or three identity tests per parameter when every ``.grad`` is in its slot (step() runs
        it at every step, as torch.optim's step looks at every ``.grad``). ``taken`` is empty unless
        ``in_place_min`` is given (the CPU step's): then the gradients of their own of that many elements or more
        that the step can read where they lie (:meth:`flatopt.layout.GradSources.fits`) are not copied but taken,
        their ``.grad`` staying the tensor autograd made: per buffer index that has some, the list of its
        parameters' gradients taken (None for the others), in the buffer's order."""
        zero, copy, taken = [], [], {}
        strided = torch.strided
        least = in_place_min if in_place_min is not None else -1
        spans = self.spans()
        lo, hi = spans[0] if len(spans) == 1 else (0, 0)
        for p, view, slot, dtype, device, numel, shape, stride in self.entries:
            g = p.grad
            if g is None:
                if p.dtype is dtype and p.get_device() == device:  # else moved or cast: check_bindings() raises
                    zero.append((p, view))
                continue
            if g is slot.grad or g is view:  # in place: a covered layer's, or settled
                continue
            # torch gives a .grad its parameter's shape, dtype and device: a parameter moved or cast since the layout
            # has a .grad of another dtype or device, left alone (check_bindings() raises for the parameter); one of
            # another dtype or device beside a parameter as laid out (its .data replaced) is refused here
            if g.dtype is not dtype or g.get_device() != device:
                if p.dtype is dtype and p.get_device() == device:
                    self._refuse_other_kind(p, g)
                continue
            if g.layout is not strided or g.requires_grad:
                self._check(p, g)  # raises, naming the parameter
            at = g.data_ptr()
            if lo <= at < hi or (len(spans) > 1 and any(a <= at < b for a, b in spans)):
                # a view into a gradient buffer: its own slot as another tensor object (nothing to copy), or another
                # place (p.grad = p.grad.t()), which may overlap a destination: copied from a clone
                copy.append((p, view, None if at == view.data_ptr() and g.stride() == stride else g.clone()))
            elif 0 <= least <= numel and g.stride() == stride and g.shape == shape and at % 16 == 0:
                row = taken.get(slot.b)  # GradSources.fits, with the view's shape and strides read once
                if row is None:
                    row = taken[slot.b] = [None] * self.counts[slot.b]
                row[slot.index] = g
            else:
                copy.append((p, view, g))
        return zero, copy, taken

    def spans(self):
        """Each gradient buffer's storage as ``(start, end)`` addresses, as it is now (empty while released)."""
        out = []
        for view in self.firsts_views:
            st = view.untyped_storage()
            at = st.data_ptr()
            out.append((at, at + st.nbytes()))
        return out

    def apply(self, plan, put=True):
        """Do what :meth:`plan` planned: zero the views of the parameters without a gradient, copy the gradients of
        their own into their views (one batched copy per dtype and device), and put the views in ``.grad``. With
        ``put=False`` a copied gradient stays in ``.grad`` (the CPU step's: the views then hold copies of them,
        read by the launch that follows; :meth:`restore` or the next settling puts the views back)."""
        zero, copy = plan[:2]
        self.slots.settled()
        self.pooled.clear()
        if not zero and not copy:
            return
        # the storage released by zero_grad(), back before anything is written into it: of the buffers written only
        slots = self.slots
        if len(slots.buffers) == 1:
            slots.acquire(0)
        else:
            for b in {slots.slot_of(entry[0]).b for entry in (*zero, *copy)}:
                slots.acquire(b)
        with torch.no_grad():
            if zero:
                torch._foreach_zero_([view for _, view in zero])
            if copy:
                self._copy_in(copy)
        if not self.keep_none:
            for p, _ in zero:
                self.slots.put(p)
        if not put:
            return
        hooking = self.copy_on_cpu or not self.on_cpu
        for p, _, g in copy:
            self.slots.put(p)
            if hooking and g is not None and p not in self.hooked:
                self.hook(p)  # a covered parameter whose gradient came torch's way: copied as it comes from now on

    def _copy_in(self, copy):
        """Copy each gradient of ``copy`` ((parameter, view, tensor or None: the view itself), as :meth:`plan` lists
        them: none of them overlaps a view) into its view: one batched copy (a few kernels) per dtype and device
        rather than one per parameter."""
        if len(self.firsts_views) == 1:  # one buffer (the usual case): one dtype and device
            views = [view for _, view, g in copy if g is not None]
            if views:
                torch._foreach_copy_(views, [g for _, _, g in copy if g is not None])
            return
        groups = {}
        for _, view, g in copy:
            if g is not None:
                dst, src = groups.setdefault((view.dtype, view.get_device()), ([], []))
                dst.append(view)
                src.append(g)
        for views, grads in groups.values():
            torch._foreach_copy_(views, grads)

    def _refuse_other_kind(self, p, g):
        raise RuntimeError(
            f"{self.cls}: the .grad of parameter {self.names(p)} is {g.dtype} on {g.device}, the parameter {p.dtype} "
            f"on {p.device}; a gradient has its parameter's dtype and device (torch's .grad setter refuses others, "
            "but not an assignment to p.grad.data). Assign p.grad = g.to(p) instead"
        )

    def _check(self, p, g):
        if g.layout == torch.strided and not g.requires_grad:
            return  # the names are built only for a message: naming a parameter costs tens of microseconds
        cls, name = self.cls, self.names(p)
        if g.layout != torch.strided:
            raise RuntimeError(
                f"{cls} does not support sparse gradients: parameter {name} has a {g.layout} .grad, which its dense "
                "flat gradient buffer cannot hold; use sparse=False on the embedding (nn.Embedding(..., "
                "sparse=False)) that produces it"
            )
        if g.requires_grad:
            raise RuntimeError(
                f"{cls}: the .grad of parameter {name} requires grad (backward(create_graph=True)); the flat gradient "
                "buffer cannot hold its autograd history. Use backward() without create_graph, or construct the "
                "optimizer with flat=False"
            )
