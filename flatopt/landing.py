"""Gradients born in the flat gradient buffer: covered layers write their parameters' gradients into it.

Without this module each gradient is a tensor of its own and a post-accumulate-grad hook copies it
into the parameter's view of the flat gradient buffer (:mod:`flatopt.grads`): a read and a write of
every gradient byte. Here covered layers (instances whose type is exactly ``nn.Linear`` or
``nn.Embedding``; ``nn.LayerNorm`` and ``nn.RMSNorm`` on request) run through autograd Functions
whose backward writes each parameter's gradient straight into the parameter's slot, makes
``.grad`` a view of the slot and returns None for the parameter::

    backward of a covered Linear                     flat gradient buffer (one per device and dtype)
    ┌─────────────────────────────────────┐          ┌───── W ──────┬pad┬─ b ─┬pad┬── ... ──┐
    │ grad_x = grad_y @ W       → returned│          │              │ 0 │     │ 0 │         │
    │ W: .grad None → mm(out=W's slot) ───┼────────► │ written here │   │     │   │         │
    │ b: .grad None → sum(out=b's slot) ──┼──────────┼──────────────┼───┼──►  │   │         │
    │ .grad = views of the slots          │          └──────────────┴───┴─────┴───┴─────────┘
    │ returns (grad_x, None, None)        │          AccumulateGrad still runs: hooks fire,
    └─────────────────────────────────────┘          uncovered uses are added into the slot

Where a parameter's next gradient goes (:meth:`LandingSlots.land`):

* ``.grad`` None: written into the slot, and ``.grad`` becomes a view of it at once, so a second use in
  the same backward (a tied weight) finds it defined;
* ``.grad`` a view of its slot, written afresh in this same backward pass (autograd graph task id):
  the gradient is added into it with ``add_``, in the order the uses come, as torch's input buffer sums
  the uses of one pass;
* ``.grad`` a view of its slot from before this pass (micro-batches, ``zero_grad(set_to_none=False)``):
  the gradient is returned; autograd sums this pass's uses and AccumulateGrad adds the sum into the slot
  in place, torch's own ops in torch's order. With ``fuse_accumulation=True`` the producing op
  accumulates into the slot instead (``addmm_`` with beta=1, ``index_add_``): no temporary, one pass
  and one rounding less, not bit-identical to torch;
* anything else (a ``.grad`` of the caller's, tensor hooks on the parameter, ``create_graph=True``,
  ``torch.autograd.grad()``, compiled autograd, a parameter without a slot): the gradient as torch computes it, returned
  to autograd; the optimizer copies it in (:meth:`LandingSlots.adopt`). ``backward(inputs=...)``
  without the parameter leaves it alone.

Numerics: without autocast the gradients are torch's to the bit: the ops torch's backward uses, in its
order (``mm_mat2_backward``'s ``grad_y^T @ x`` for the weight, ``sum_to`` over the leading dims for the
bias, on the CPU ``embedding_dense_backward``'s row adds as ``index_add_`` into the zeroed slot, torch's
own layer-norm backward), only writing into the slot. One exception: in a pass that writes a slot
afresh, uses of the parameter by uncovered layers are added after the covered ones (the same sum in
another rounding order). Under bf16/fp16 autocast with fp32 parameters torch makes a low-precision weight
gradient and casts it: on the CPU so does this module, the cast writing into the slot (bit-identical);
on CUDA the GEMM writes fp32 into the slot (``torch.mm(..., out_dtype=torch.float32)``, aten's
``mm.dtype_out``, which the CPU lacks), so the gradient is the fp32 accumulator rather than its bf16
rounding: more accurate, within bf16 rounding of torch's. (A weight used by two Linear layers under
autocast: torch casts it once and sums the two bf16 gradients in bf16; here each use casts it and the
sum is float32.)

Not elided: LayerNorm's weight and bias gradients come from ``native_layer_norm_backward``, which has no
variant writing into given memory (its ``.out`` overload is generated: compute, then copy), so they are
copied into the slots inside backward. On CUDA the embedding gradient is torch's kernel's, copied in
(``index_add_`` there sums with atomics: order-dependent and not deterministic), unless
``fuse_accumulation=True``. RMSNorm is covered for float32 on the CPU only (torch's composition there
is split so the weight's gradient is summed into its slot; CUDA runs a fused kernel). Convolutions,
BatchNorm and GroupNorm are not covered. Under ``torch.compile`` the modules' own forward is traced (no
custom Function, no graph break) and gradients reach the buffer by the optimizer's hook: the copy is not
elided there. Each covered call runs a Python autograd.Function, which costs more host time than
torch's native layer: worth it where the device time saved (a write and a read of the gradient)
exceeds it.

Memory: :meth:`LandingSlots.zero_grad` sets every ``.grad`` to None and releases the storage of the
flat gradient buffers (``untyped_storage().resize_(0)``), as torch's ``zero_grad(set_to_none=True)``
frees its gradients; the first gradient of the next backward brings it back (:meth:`acquire`), at an
address that may differ (:meth:`data_ptr`), and zeroes the alignment padding. Reading a released buffer
crashes the process, so every reader of ``buf.grad`` calls :meth:`acquire` first. The storage is kept
when anything beyond the buffers' own views references it (a ``.grad`` the caller kept, as torch lets
one keep), always under :meth:`hold` (CUDA graphs, whose recorded addresses must not move), and on the
CPU (:attr:`LandingSlots.release_on_cpu`: re-faulting a large buffer's pages at every backward costs more
than the step there).
"""

import sys
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module

from flatopt.layout import FlatBuffer

__all__ = ["LandingSlots", "COVERED", "DEFAULT_CLASSES"]

_FALLBACK, _SKIP, _FRESH, _ACCUM = range(4)
_LOW = (torch.bfloat16, torch.float16)
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)  # None: never release (safe)


class _Slot:
    """One parameter's place: its buffer (index ``b`` in the LandingSlots), its view there (the
    FlatBuffer's own object), the tensor this module last put into ``.grad`` and the epoch in which
    the slot last received a gradient. It keeps no autograd node of the parameter's: torch.utils.swap_tensors
    poisons a live AccumulateGrad node, which a swap back would give the parameter again."""

    __slots__ = ("param", "b", "index", "start", "view", "grad", "epoch", "task", "home", "kept")

    def __init__(self, param, b, index, start, view):
        self.param, self.b, self.index, self.start, self.view = param, b, index, start, view
        self.grad = None
        self.epoch = -1
        self.task = -1  # the backward pass (autograd graph task) that wrote the slot afresh
        self.home = None  # where the parameter's data lives in the buffer (it is elsewhere once laid out anew)
        self.kept = None  # put()'s tensor object, reused where the storage is never released (the CPU's default)


_compiled_autograd = None  # torch's compiled-autograd module, once something imported it


def _in_compiled_autograd():
    """Whether compiled autograd runs the backward now: a Function's backward that dynamo could not trace (past its
    recompile limit) runs eagerly inside the compiled graph, where ``torch.compiler.is_compiling()`` is False and a
    ``.grad`` set here is not kept either. Read from torch's module once compiled autograd was imported (looked up
    until then, kept after: this runs per covered parameter per backward)."""
    global _compiled_autograd
    module = _compiled_autograd
    if module is None:
        module = _compiled_autograd = sys.modules.get("torch._dynamo.compiled_autograd")
        if module is None:
            return False
    return getattr(module, "in_compiled_autograd_region", False) is True


class LandingSlots:
    """The slots of every parameter of some flat buffers, and where each next gradient goes.

    Args:
        buffers (list[FlatBuffer]): flat buffers with a gradient buffer (``grad=True``), each
            parameter in one of them only.
        fuse_accumulation (bool): accumulate over micro-batches inside the producing op (``addmm_``
            with beta=1, ``index_add_``) rather than computing the gradient and adding it as
            AccumulateGrad does: a temporary and a pass less, one rounding instead of two, not
            bit-identical to torch. Default: False.
        on_fallback (Callable, optional): called with a covered parameter whose gradient goes
            torch's way (a tensor hook on it, ``create_graph=True``, compiled autograd).

    What the optimizer (:class:`flatopt.grads.GradLanding`) calls: :meth:`install` once (the model;
    :attr:`covered` then holds the parameters of covered modules); :meth:`zero_grad` for its
    ``zero_grad()``; :meth:`adopt` in a post-accumulate-grad hook on the other parameters (their
    gradients are tensors of their own); :meth:`put` whenever it puts a slot into ``.grad``;
    :meth:`acquire` before anything reads ``buf.grad``; :meth:`owns_grad` to tell a ``.grad`` that is
    its slot; :attr:`reset_seen` (a landed ``.grad`` set to None behind ``zero_grad()``: look at every
    ``.grad``, then :meth:`settled`); :meth:`hold` around CUDA graphs; ``on_fallback`` (an argument),
    called with a covered parameter whose gradient goes torch's way. The optimizer settles by one
    scan of every ``.grad`` at every step; ``reset_seen``, the O(1) counters (:meth:`all_landed`,
    :meth:`unlanded`, :meth:`stale`) and ``fuse_accumulation`` are not used by it today.
    """

    #: Whether zero_grad() releases a CPU gradient storage too. Off: on the CPU a buffer of more than
    #: malloc's mmap threshold (32 MiB at most) comes back as fresh pages that fault on first touch at
    #: every backward, while torch's per-parameter gradients are reused from the heap; kept, the
    #: resident memory is what torch's loop holds too (a freed heap block stays resident).
    release_on_cpu = False

    def __init__(self, buffers, *, fuse_accumulation=False, on_fallback=None):
        buffers = list(buffers)  # none when no parameter is trainable yet: the slots come with the next layout
        self.buffers = buffers
        self.fuse = bool(fuse_accumulation)
        self.epoch = 0
        self.keep_allocated = False
        self.reset_seen = False  # a landed .grad was found None again (set to None behind zero_grad())
        self._slots = {}  # id(parameter) -> _Slot (keyed by id: a tensor's own __hash__ is Python code)
        self._by_buffer = []
        self._count = []  # per buffer: parameters that received a gradient this epoch
        self._last = []  # per buffer: the slot that last received one (release_if_reset() looks at its .grad)
        self._storages, self._nbytes, self._pads, self._released, self._baseline = [], [], [], [], []
        self._on_cpu = []
        self._scanned = -1  # the epoch of release_if_reset()'s last scan (one per epoch at most)
        for b, buf in enumerate(buffers):
            if not isinstance(buf, FlatBuffer):
                raise TypeError(f"LandingSlots takes FlatBuffer objects, got {type(buf).__name__} at index {b}")
            if buf.grad is None:
                raise ValueError(f"buffer {b} has no flat gradient buffer: build it with FlatBuffer(..., grad=True)")
            slots = []
            for i, p in enumerate(buf.params):
                if id(p) in self._slots:
                    raise ValueError(f"a parameter of shape {tuple(p.shape)} is in two buffers; give each one slot")
                self._slots[id(p)] = s = _Slot(p, b, i, buf.starts[i], buf.grad_views[i])
                s.home = buf.data_views[i].data_ptr()
                slots.append(s)
            self._by_buffer.append(slots)
            self._count.append(0)
            self._last.append(None)
            self._pads.append(buf.padding(buf.grad))
            st = buf.grad.untyped_storage()
            self._storages.append(st)
            self._nbytes.append(st.nbytes())
            self._released.append(False)
            self._on_cpu.append(buf.grad.device.type == "cpu")
        # references to each storage when no gradient tensor of ours is alive: more means someone kept one
        self._baseline = [_storage_use_count(st._cdata) if _storage_use_count else None for st in self._storages]
        self._patches = []  # (weak module, the installed call)
        self.covered = set()  # parameters of covered modules (the others land by adopt() only)
        self.on_fallback = on_fallback  # called with a covered parameter whose gradient goes torch's way
        self._finalizer = weakref.finalize(self, _remove_patches, self._patches)

    def _get(self, p):
        """``p``'s slot, or None."""
        s = self._slots.get(id(p))
        return s if s is not None and s.param is p else None

    # ---- what the optimizer asks -------------------------------------------------------------------

    def slot(self, p):
        """(FlatBuffer, index, start) of parameter ``p``, or None when it has no slot here."""
        s = self._get(p)
        return None if s is None else (self.buffers[s.b], s.index, s.start)

    def slot_of(self, p):
        """``p``'s slot object (its ``grad`` is the tensor this module last put into ``.grad``), or None."""
        return self._get(p)

    def owns_grad(self, p):
        """Whether ``p.grad`` is a view of its slot put there by this module (or the buffer's own view)."""
        s = self._get(p)
        g = p.grad
        return s is not None and g is not None and (g is s.grad or g is s.view)

    def landed_count(self, b):
        """Parameters of buffer ``b`` whose slot received a gradient since the last zero_grad(): O(1)."""
        return self._count[b]

    def all_landed(self, b=None):
        """Whether every parameter (of buffer ``b``, or of all buffers) received a gradient: O(1) per buffer."""
        bs = range(len(self.buffers)) if b is None else (b,)
        return all(self._count[i] == len(self._by_buffer[i]) for i in bs)

    def landed(self, p):
        """Whether ``p``'s slot received a gradient since the last zero_grad()."""
        s = self._get(p)
        return s is not None and s.epoch == self.epoch

    def unlanded(self, b):
        """Indices (in buffer ``b``) of the parameters whose slot received no gradient since zero_grad()."""
        return [s.index for s in self._by_buffer[b] if s.epoch != self.epoch]

    def stale(self, b):
        """Indices (in buffer ``b``) of parameters counted as landed whose ``.grad`` is no longer the slot's
        tensor (replaced after landing: ``p.grad = ...``, DistributedDataParallel with
        ``gradient_as_bucket_view=True``): O(parameters). The counts say what the covered layers wrote, not
        what happened to ``.grad`` afterwards."""
        return [s.index for s in self._by_buffer[b] if s.epoch == self.epoch and not self.owns_grad(s.param)]

    def released(self, b):
        """Whether buffer ``b``'s gradient storage is released (0 bytes) now."""
        return self._released[b]

    def data_ptr(self, b):
        """The address of buffer ``b``'s gradient storage now (0 while released); it may change at acquire()."""
        return self._storages[b].data_ptr()

    def release_blocked(self, b):
        """Whether buffer ``b``'s storage is referenced beyond its own views now, so zero_grad() would keep it."""
        base = self._baseline[b]
        return base is None or _storage_use_count(self._storages[b]._cdata) > base

    # ---- zeroing, releasing, acquiring ------------------------------------------------------------

    def zero_grad(self, set_to_none=True):
        """Start a new accumulation. ``set_to_none=True``: every ``.grad`` of a parameter with a slot to
        None and the gradient storage released (unless held or referenced from outside); the next
        gradients are written into the slots. ``set_to_none=False``: the buffers zeroed (one memset
        each) and every ``.grad`` a view of its slot; the next gradients accumulate there. A ``.grad``
        the caller kept is a view of its slot: the next backward writes over it (torch would leave it
        as it was), as it did when flatopt copied gradients into the views."""
        self.epoch += 1
        self.reset_seen = False
        for b, slots in enumerate(self._by_buffer):
            if set_to_none:
                for s in slots:
                    s.param.grad = None
                    s.grad = None
                    s.task = -1
                self._count[b] = 0
                if not self.keep_allocated:
                    self._release(b)
            else:
                self.acquire(b)
                self.buffers[b].grad.zero_()
                for s in slots:
                    s.grad = s.view.detach()
                    s.param.grad = s.grad
                    s.epoch = self.epoch
                    s.task = -1
                self._count[b] = len(slots)

    def release_if_reset(self):
        """zero_grad()'s release when every ``.grad`` was set to None behind its back (``model.zero_grad()``, which
        Hugging Face's Trainer calls instead of the optimizer's): run by each covered layer's forward, so the
        storage is not held through the forward pass. O(buffers) while the slot that last received a gradient
        still has it (accumulation) or the storage is released (zero_grad() was called); otherwise one scan of
        every ``.grad``, once per epoch at most."""
        if self._scanned == self.epoch or self.keep_allocated:
            return
        for b, s in enumerate(self._last):
            if s is not None and s.epoch == self.epoch and s.param.grad is None and self._releasable(b):
                break
        else:
            return
        self._scanned = self.epoch
        if all(s.param.grad is None for slots in self._by_buffer for s in slots):
            self.zero_grad(set_to_none=True)

    @classmethod
    def keeps(cls, device):
        """Whether a gradient buffer on ``device`` keeps its storage through ``zero_grad()`` (the CPU's policy:
        see the module docstring), so that FlatBuffer may lay it out as a storage that cannot be resized."""
        return torch.device(device).type == "cpu" and not cls.release_on_cpu

    def _releasable(self, b):
        # (a storage laid out as one that is never released, FlatBuffer's "kept", cannot be resized: never released,
        # also if release_on_cpu is changed after the buffer was made)
        return (
            not self._released[b]
            and not (self._on_cpu[b] and not self.release_on_cpu)
            and self._storages[b].resizable()
        )

    def _release(self, b):
        if not self._releasable(b) or self.release_blocked(b):
            return
        self._storages[b].resize_(0)
        self._released[b] = True

    def release(self, b):
        """Release buffer ``b``'s storage now, as zero_grad() would (not while held for a CUDA graph, nor while
        referenced from outside): for a step that reads none of its views. The slots forget the views they put
        into ``.grad`` that are no longer there (``model.zero_grad()`` set them to None behind the optimizer's
        back), as zero_grad() does. Returns whether it is released."""
        if self.keep_allocated or self._released[b]:  # O(1) at every step where it stays released
            return self._released[b]
        for s in self._by_buffer[b]:
            if s.grad is not None and s.param.grad is not s.grad:
                s.grad = None
        self._release(b)
        return self._released[b]

    def acquire(self, b=None):
        """Bring back the gradient storage of buffer ``b`` (every buffer when None) if it is released,
        zeroing its alignment padding (one batched op); the parameters' views hold undefined values
        until written. Returns whether memory was allocated (the address may differ from before)."""
        if b is None:
            return any([self.acquire(i) for i in range(len(self.buffers))])
        if not self._released[b]:
            return False
        self._storages[b].resize_(self._nbytes[b])
        self._released[b] = False
        if self._pads[b]:
            torch._foreach_zero_(self._pads[b])
        return True

    def hold(self, keep=True):
        """Keep the gradient storage allocated through zero_grad() (``keep=True``; brought back now if
        released), for CUDA graphs whose recorded addresses must stay valid; ``keep=False`` lets the
        next zero_grad() release it again."""
        self.keep_allocated = bool(keep)
        if keep:
            self.acquire()

    # ---- where a gradient goes --------------------------------------------------------------------

    def _stamp(self, s):
        self._last[s.b] = s
        if s.epoch != self.epoch:
            s.epoch = self.epoch
            self._count[s.b] += 1

    def _unstamp(self, s):
        if s.epoch == self.epoch:
            s.epoch = -1
            self._count[s.b] -= 1

    def _route(self, p, grad_mode, edge):
        """(_FRESH | _ACCUM | _SKIP | _FALLBACK, slot) for a gradient of ``p`` computed in a backward; ``edge``:
        (the backward's ctx, the index of ``p`` among its Function's inputs)."""
        s = self._get(p)
        if s is None or p.dtype != s.view.dtype or p.device != s.view.device:
            return _FALLBACK, None  # no slot, or the parameter was cast or moved since (model.to())
        if p.data_ptr() != s.home:
            return _FALLBACK, None  # laid out elsewhere since (another optimizer's buffers): not this slot's
        g = p.grad
        if grad_mode or p._backward_hooks or torch.compiler.is_compiling() or _in_compiled_autograd():
            # create_graph=True (AccumulateGrad then replaces .grad out of place), tensor hooks, which must
            # see the gradient, or compiled autograd, whose graph does not replay a .grad set here: torch's
            # way. The slot keeps its gradient only if .grad is the slot and is added into in place
            if grad_mode or not (g is s.grad or g is s.view):
                self._unstamp(s)
            return _FALLBACK, s
        try:
            # the AccumulateGrad node this graph reaches the parameter by (the one of its forward: p.set_(),
            # torch.utils.swap_tensors and a parametrization give a parameter a new one); not run:
            # backward(inputs=...) without this parameter, whose .grad stays as it is
            if not torch._C._will_engine_execute_node(edge[0].next_functions[edge[1]][0]):
                return _SKIP, s
        except RuntimeError:
            return _FALLBACK, s  # autograd.grad(): the gradient goes back to the caller, .grad untouched
        if g is None:
            if s.epoch == self.epoch:
                self.reset_seen = True  # landed, then set to None behind zero_grad(): written afresh
            if self._released[s.b]:
                self.acquire(s.b)
            return _FRESH, s
        if g is s.grad or g is s.view:
            if self._released[s.b]:
                raise RuntimeError(
                    "a .grad is a view of a released flat gradient buffer: call LandingSlots.acquire() (or "
                    "zero_grad(set_to_none=False)) before putting the views back into .grad"
                )
            return _ACCUM, s
        self._unstamp(s)  # a tensor of its own: AccumulateGrad adds into it; the optimizer copies it in
        return _FALLBACK, s

    def land(self, p, edge, grad_mode, compute, write=None, add=None):
        """Send a gradient of ``p`` where it goes; returns what the backward returns for ``p``.

        ``edge`` is (``ctx``, ``i``): the backward's ctx and ``p``'s index among its Function's inputs.

        ``compute()`` makes the gradient as a new tensor (as torch does); ``write(out)`` writes it into
        ``out`` (the slot; None: ``out.copy_(compute())``); ``add(grad)`` accumulates it into
        ``grad`` inside the producing op (with ``fuse_accumulation=True``).

        Into a slot that already holds a gradient, in torch's order (without ``fuse_accumulation``):
        torch sums the contributions of one backward pass in arrival order, ``((a + b) + c)``, then
        adds the sum into ``.grad``. So a slot written afresh in this backward pass (the graph task
        id tells) takes the next uses' gradients with ``add_`` as they come, and a slot that held a
        gradient before this pass gets the gradient back to autograd, which sums this pass's
        contributions and adds them into ``.grad`` in place (the slot). Either way the result is
        torch's to the bit."""
        kind, s = self._route(p, grad_mode, edge)
        if kind == _FALLBACK:
            if s is not None and self.on_fallback is not None:
                self.on_fallback(p)  # its gradient arrives as a tensor of its own: the optimizer copies it in
            return compute()
        if kind == _SKIP:
            return None
        self._stamp(s)
        if kind == _ACCUM:
            if self.fuse and add is not None:
                add(p.grad)
            elif s.task == torch._C._current_graph_task_id():
                p.grad.add_(compute())
            else:
                return compute()
            return None
        out = s.view.detach()  # a tensor object of its own: references the caller keeps are seen at release
        if write is None:
            out.copy_(compute())
        else:
            write(out)
        p.grad = out
        s.grad = out
        s.task = torch._C._current_graph_task_id()
        return None

    def settled(self):
        """The optimizer has looked at every ``.grad`` since a landed one was found None again."""
        self.reset_seen = False

    def put(self, p):
        """Make ``p.grad`` a view of its slot: a tensor object of its own (never the buffer's own view), so
        that a reference the caller keeps to it holds the storage through zero_grad(). Returns it."""
        s = self._get(p)
        if self._releasable(s.b) or self._released[s.b]:
            out = s.view.detach()
        else:  # a storage kept for good: one object per slot will do (a detach per parameter per step costs more)
            out = s.kept
            if out is None:
                out = s.kept = s.view.detach()
        p.grad = out
        s.grad = out
        return out

    def adopt(self, p):
        """Copy ``p.grad`` into the slot and make ``.grad`` a view of it, if it is a dense tensor of its own
        (a gradient of an uncovered use). Returns whether it copied."""
        s = self._get(p)
        g = p.grad
        if s is None or g is None or g is s.grad or g is s.view:
            return False
        if g.requires_grad or g.layout is not torch.strided or g.dtype != s.view.dtype or g.device != s.view.device:
            return False  # the optimizer's checks name the problem
        self.take(s, g)
        return True

    def take(self, s, g):
        """:meth:`adopt` without its checks, for the optimizer's post-accumulate-grad hook, which made them: ``g``
        (``.grad`` of slot ``s``'s parameter, without history, dense, of the slot's dtype and device) copied into
        the slot, which becomes ``.grad``."""
        if self._released[s.b]:
            self.acquire(s.b)
        out = s.view.detach()
        if g.data_ptr() != out.data_ptr() or g.stride() != out.stride():
            out.copy_(g)  # neither side requires grad: nothing is recorded, whatever the grad mode
        s.param.grad = out
        s.grad = out
        self._stamp(s)

    # ---- covered layers ---------------------------------------------------------------------------

    def install(self, model, classes=None, cpu=True):
        """Cover every module of ``model`` whose type is exactly one of ``classes`` (default:
        :data:`DEFAULT_CLASSES`; any of :data:`COVERED`) and whose weight (LayerNorm: weight or bias)
        trains and has a slot here (with ``cpu=False``: a slot on another device than the CPU); returns
        the names of the covered modules. The module's class,
        ``forward`` and state are left as they are: the patch is the instance's ``_compiled_call_impl``,
        which torch.save() and copy.deepcopy() drop (the copies are plain modules). A module with another
        call in place (``module.compile()``) is left alone."""
        classes = DEFAULT_CLASSES if classes is None else tuple(classes)
        unknown = [c for c in classes if c not in COVERED]
        if unknown:
            raise ValueError(
                f"cannot cover {', '.join(getattr(c, '__name__', repr(c)) for c in unknown)}: the covered classes are "
                f"{', '.join(c.__name__ for c in COVERED)}"
            )
        names = []
        for name, m in model.named_modules(remove_duplicate=True):
            if type(m) not in classes:
                continue
            # the Function runs for a trainable weight with a slot (LayerNorm: weight or bias); a Linear whose
            # weight is frozen is left to torch (its bias, if it trains, lands by adopt())
            keys = (m.weight, m.bias) if type(m) is nn.LayerNorm else (m.weight,)
            slots = [self._get(p) for p in keys if p is not None and p.requires_grad]
            if not any(s is not None and (cpu or not self._on_cpu[s.b]) for s in slots):
                continue
            own = [p for p in m.parameters(recurse=False) if self._get(p) is not None]
            current = m.__dict__.get("_compiled_call_impl")
            if current is not None and not isinstance(current, _Call):
                continue
            if _patched(m):  # a forward of the caller's (accelerate's hooks, a monkeypatch): torch runs it
                continue
            call = _Call(m, self, COVERED[type(m)])
            m._compiled_call_impl = call
            self._patches.append((weakref.ref(m), call))
            self.covered.update(own)
            names.append(name)
        return names

    def uninstall(self):
        """Restore every covered module (those whose patch is still this one's)."""
        _remove_patches(self._patches)
        self.covered.clear()


def _remove_patches(patches):
    for ref, call in patches:
        m = ref()
        if m is not None and m.__dict__.get("_compiled_call_impl") is call:
            del m.__dict__["_compiled_call_impl"]
    patches.clear()


# ---- the patch: how a covered module's call reaches a Function --------------------------------------

_HOOKS = (
    _module._global_backward_pre_hooks,
    _module._global_backward_hooks,
    _module._global_forward_hooks,
    _module._global_forward_pre_hooks,
)


class _Call:
    """A covered module's ``_compiled_call_impl``: the landing forward when nothing calls for torch's,
    else the module's own ``_call_impl`` (hooks, no grad, tracing, compiling, an unusual call)."""

    __slots__ = ("module", "slots", "forward", "cls", "__weakref__")

    def __init__(self, module, slots, kind):
        self.module = weakref.ref(module)
        self.slots = weakref.ref(slots)
        self.cls, self.forward = type(module), kind

    def __call__(self, *args, **kwargs):
        m = self.module()
        slots = self.slots()
        if (
            slots is not None
            and len(args) == 1
            and not kwargs
            and type(m) is self.cls
            and not _patched(m)
            and torch.is_grad_enabled()
            and not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)
            and not any(_HOOKS)
            and not torch.compiler.is_compiling()
            and torch._C._get_tracing_state() is None
            and torch._C._functorch.peek_interpreter_stack() is None
            and type(args[0]) is torch.Tensor
        ):
            slots.release_if_reset()
            out = self.forward(m, slots, args[0])
            if out is not None:
                return out
        return m._call_impl(*args, **kwargs)


def _usable(p, slots, x):
    """Whether ``p`` trains and still has its slot's dtype and device (not cast or moved since), on ``x``'s device."""
    s = slots._get(p) if p is not None else None
    return (
        s is not None
        and p.requires_grad
        and p.dtype == s.view.dtype
        and p.device == s.view.device
        and p.device == x.device
    )


def _autocast(device_type):
    """The autocast dtype in effect for ``device_type`` (None when off)."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def _cast(t, dtype):
    """What autocast does to an argument of a lower-precision op: floating tensors but float64 to ``dtype``."""
    if t is None or dtype is None or t.dtype in (dtype, torch.float64) or not t.is_floating_point():
        return t
    return t.to(dtype)


def _apply(function, *args):
    """``function.apply(*args)`` without torch's Python wrapper, whose work (unwrapping functorch's dead
    wrappers, binding default arguments) is for cases the covered call excludes: no functorch transform
    is active (``_Call`` checks), and the Functions here take positional arguments only."""
    return function.c_apply(*args)


# ---- nn.Linear ----------------------------------------------------------------------------------------


def _linear_forward(m, slots, x):
    w = m.weight
    if x.dim() < 2 or w.dim() != 2 or not _usable(w, slots, x):
        return None
    cast = _autocast(x.device.type)
    if cast is not None and (x.device.type not in ("cpu", "cuda") or x.dtype == torch.float64):
        return None
    return _apply(_Linear, x, w, m.bias, slots, cast)


# aten's GEMM with an fp32 result from bf16/fp16 operands (torch.mm(..., out_dtype=)): torch 2.8 and later
_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype_out")


def _lowp_to_fp32(src, param):
    """Whether a CUDA kernel can take ``src`` (bf16/fp16) and write ``param``'s fp32 gradient directly."""
    return src.device.type == "cuda" and param.dtype == torch.float32 and src.dtype in _LOW


class _Linear(torch.autograd.Function):
    """F.linear, whose backward lands the weight and bias gradients with torch's formulas: addmm's
    ``mm_mat2_backward`` for the weight, ``sum_to`` for the bias, ``mm_mat1_backward`` for the input."""

    @staticmethod
    def forward(ctx, x, weight, bias, slots, cast):
        xc, wc, bc = _cast(x, cast), _cast(weight, cast), _cast(bias, cast)
        ctx.save_for_backward(xc, wc)
        ctx.slots, ctx.weight, ctx.bias = slots, weight, bias
        # torch's linear: addmm on the input flattened to 2-D for a 2-D input, or a contiguous one with a
        # bias; else matmul and an add of the bias, whose gradient is then summed over the leading dims
        ctx.flat = x.dim() == 2 or (bias is not None and xc.is_contiguous())
        return F.linear(xc, wc, bc)

    @staticmethod
    def backward(ctx, gy):
        xc, wc = ctx.saved_tensors
        slots, weight, bias = ctx.slots, ctx.weight, ctx.bias
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_mode = torch.is_grad_enabled()
        x2 = xc if xc.dim() == 2 else xc.reshape(-1, xc.shape[-1])
        g2 = gy if gy.dim() == 2 else gy.reshape(-1, gy.shape[-1])
        gx = gw = gb = None
        if need_x:
            if x2.stride(0) == 1 and x2.stride(1) == x2.shape[0]:  # a column-major input: torch's order
                gx = wc.t().mm(g2.t()).t()
            else:
                gx = g2.mm(wc)
            if xc.dim() != 2:
                gx = gx.reshape(xc.shape)
        if need_w:
            gw = _weight_grad(slots, weight, (ctx, 1), g2, x2, grad_mode)
        if need_b:
            gb = _bias_grad(slots, bias, (ctx, 2), g2 if ctx.flat else gy, grad_mode)
        return gx, gw, gb, None, None


def _weight_grad(slots, weight, edge, g2, x2, grad_mode):
    # mm_mat2_backward with mat2 = weight.t(): grad_y^T @ x for a row-major weight, else (x^T @ grad_y)^T
    row = weight.stride(1) == 1 and weight.stride(0) == weight.shape[1]
    a, b = (g2.t(), x2) if row else (x2.t(), g2)

    def mat(t):
        return t if row else t.t()

    def compute():
        return mat(a.mm(b))

    write = add = None
    if g2.dtype == weight.dtype:

        def write(out):
            torch.mm(a, b, out=mat(out))

        def add(grad):
            mat(grad).addmm_(a, b)

    elif _lowp_to_fp32(g2, weight) and _MM_OUT_DTYPE:

        def write(out):  # a bf16/fp16 GEMM with an fp32 result (aten mm.dtype_out: CUDA only)
            torch.mm(a, b, out_dtype=torch.float32, out=mat(out))

    return slots.land(weight, edge, grad_mode, compute, write, add)


def _bias_grad(slots, bias, edge, src, grad_mode):
    dims = tuple(range(src.dim() - 1))

    def compute():
        return src.sum(dims)

    write = None
    if src.dtype == bias.dtype:

        def write(out):
            torch.sum(src, dims, out=out)

    elif _lowp_to_fp32(src, bias):

        def write(out):
            torch.sum(src, dims, dtype=torch.float32, out=out)

    return slots.land(bias, edge, grad_mode, compute, write)


# ---- nn.Embedding -------------------------------------------------------------------------------------


def _embedding_forward(m, slots, idx):
    w = m.weight
    if (
        m.max_norm is not None  # renormalises the weight in place in forward: left to torch
        or m.sparse  # a sparse gradient has no place in a dense buffer
        or m.scale_grad_by_freq  # scaled row adds that index_add_ does not reproduce bit for bit
        or idx.dtype not in (torch.int64, torch.int32)
        or w.dim() != 2
        or not w.is_contiguous()
        or not _usable(w, slots, idx)
    ):
        return None
    return _apply(_Embedding, idx, w, slots, m.padding_idx)


class _Embedding(torch.autograd.Function):
    """F.embedding (dense gradient), whose backward lands the weight gradient. On the CPU,
    ``embedding_dense_backward`` adds the gradient rows into a zeroed table one index after the other;
    ``index_add_`` into the zeroed slot does the same adds in the same order."""

    @staticmethod
    def forward(ctx, idx, weight, slots, padding_idx):
        ctx.save_for_backward(idx)
        ctx.slots, ctx.weight, ctx.padding_idx = slots, weight, padding_idx
        return F.embedding(idx, weight, padding_idx)

    @staticmethod
    def backward(ctx, gy):
        (idx,) = ctx.saved_tensors
        slots, weight = ctx.slots, ctx.weight
        if not ctx.needs_input_grad[1]:
            return None, None, None, None
        pad = -1 if ctx.padding_idx is None else ctx.padding_idx
        flat_idx = idx.reshape(-1)
        rows = gy.reshape(-1, gy.shape[-1])

        def compute():
            return torch.ops.aten.embedding_dense_backward(gy, idx, weight.shape[0], pad, False)

        def add(grad):
            keep = grad[pad].clone() if pad >= 0 else None
            grad.index_add_(0, flat_idx, rows)
            if keep is not None:
                grad[pad].copy_(keep)

        write = None
        if gy.dtype == weight.dtype and (gy.device.type == "cpu" or slots.fuse):

            def write(out):
                out.zero_()
                out.index_add_(0, flat_idx, rows)
                if pad >= 0:
                    out[pad].zero_()

        if gy.dtype != weight.dtype:
            add = None
        return None, slots.land(weight, (ctx, 1), torch.is_grad_enabled(), compute, write, add), None, None


# ---- nn.LayerNorm -------------------------------------------------------------------------------------

# device types whose autocast runs layer_norm in float32 (aten/src/ATen/autocast_mode.cpp); on the CPU
# autocast leaves layer_norm alone
_LAYER_NORM_FP32 = ("cuda",)


def _layer_norm_forward(m, slots, x):
    w, b = m.weight, m.bias
    if not (_usable(w, slots, x) or _usable(b, slots, x)):
        return None
    fp32 = False
    if torch.is_autocast_enabled(x.device.type):
        if x.device.type not in _LAYER_NORM_FP32 + ("cpu",):
            return None
        fp32 = x.device.type in _LAYER_NORM_FP32
    return _apply(_LayerNorm, x, w, b, slots, tuple(m.normalized_shape), m.eps, fp32)


class _LayerNorm(torch.autograd.Function):
    """native_layer_norm, whose backward puts the weight and bias gradients of torch's own
    ``native_layer_norm_backward`` into the slots (a copy: aten has no variant writing into given memory)."""

    @staticmethod
    def forward(ctx, x, weight, bias, slots, shape, eps, fp32):
        xc = x.float() if fp32 and x.dtype in _LOW else x  # what autocast does to layer_norm's input on CUDA
        y, mean, rstd = torch.native_layer_norm(xc, shape, weight, bias, eps)
        ctx.save_for_backward(xc, mean, rstd)
        ctx.slots, ctx.weight, ctx.bias, ctx.shape = slots, weight, bias, shape
        return y

    @staticmethod
    def backward(ctx, gy):
        xc, mean, rstd = ctx.saved_tensors
        slots, weight, bias = ctx.slots, ctx.weight, ctx.bias
        mask = list(ctx.needs_input_grad[:3])
        gx, dw, db = torch.ops.aten.native_layer_norm_backward(gy, xc, ctx.shape, mean, rstd, weight, bias, mask)
        grad_mode = torch.is_grad_enabled()
        gw = slots.land(weight, (ctx, 1), grad_mode, lambda: dw) if mask[1] else None
        gb = slots.land(bias, (ctx, 2), grad_mode, lambda: db) if mask[2] else None
        return gx, gw, gb, None, None, None, None


# ---- nn.RMSNorm ---------------------------------------------------------------------------------------


def _rms_norm_forward(m, slots, x):
    w = m.weight
    # On the CPU torch's rms_norm is a composition (x * rsqrt(mean(x^2) + eps), then * weight, in float32),
    # which is split here: the weightless norm stays torch's, the product with the weight lands its gradient.
    # On CUDA a fused kernel with a backward of its own runs instead: left to torch, as are other dtypes.
    if (
        x.device.type != "cpu"
        or w is None
        or x.dtype != torch.float32
        or w.dtype != torch.float32
        or torch.is_autocast_enabled("cpu")
        or not _usable(w, slots, x)
    ):
        return None
    normed = F.rms_norm(x, m.normalized_shape, None, m.eps)
    return _apply(_Scale, normed, w, slots)


class _Scale(torch.autograd.Function):
    """``normed * weight`` (torch's MulBackward0 for the input; the weight's gradient ``sum_to(grad *
    normed)`` summed into the slot)."""

    @staticmethod
    def forward(ctx, normed, weight, slots):
        ctx.save_for_backward(normed, weight)
        ctx.slots, ctx.param = slots, weight  # the parameter itself (a saved tensor may come back as another object)
        return normed.mul(weight)

    @staticmethod
    def backward(ctx, gy):
        normed, weight = ctx.saved_tensors
        grad_mode = torch.is_grad_enabled()
        gn = gy.mul(weight) if ctx.needs_input_grad[0] else None
        gw = None
        if ctx.needs_input_grad[1]:
            param = ctx.param
            dims = tuple(range(gy.dim() - weight.dim()))

            def compute():
                return gy.mul(normed).sum(dims)

            def write(out):
                torch.sum(gy.mul(normed), dims, out=out)

            gw = ctx.slots.land(param, (ctx, 1), grad_mode, compute, write)
        return gn, gw, None


# Each covered class's own forward, as torch defines it: a module whose forward is another (set on the
# instance, or on the class after import) runs torch's way, so that the forward it was given is the one run.
_FORWARDS = {cls: cls.__dict__["forward"] for cls in (nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm)}


def _patched(m):
    """Whether ``m``'s forward is not its class's own (replaced on the instance or on the class)."""
    return "forward" in m.__dict__ or type(m).__dict__.get("forward") is not _FORWARDS.get(type(m))


COVERED = {
    nn.Linear: _linear_forward,
    nn.Embedding: _embedding_forward,
    nn.LayerNorm: _layer_norm_forward,
    nn.RMSNorm: _rms_norm_forward,
}
"""The module classes that can be covered (an instance's type must be exactly one of these) and their forwards."""

DEFAULT_CLASSES = (nn.Linear, nn.Embedding)
"""Covered unless told otherwise: where the bytes are. A covered call runs a Python autograd.Function, more host
time than torch's native layer; LayerNorm's gradients are copied in anyway (nothing saved) and RMSNorm's are one
element per feature, so the hook path costs them less."""


# Each Function's C++ apply (torch._C._FunctionBase.apply bound to it), for _apply; where torch's classes
# are laid out otherwise, the public apply.
for _function in (_Linear, _Embedding, _LayerNorm, _Scale):
    _base = getattr(torch.autograd.function, "_SingleLevelFunction", None)
    _c = super(_base, _function).apply if _base is not None and _base in _function.__mro__ else None
    _function.c_apply = _c if getattr(_c, "__self__", None) is _function else _function.apply
del _function, _base, _c
