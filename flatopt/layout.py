"""The flat layout: one buffer per (device, dtype) holding parameters, gradients and states.

::

    params of one (device, dtype), in param-group order
    ┌───────────── p0 ─────────────┬pad┬──────── p1 ────────┬pad┬── p2 ──┬pad┐
    │ elements [0, n0)             │   │ [s1, s1 + n1)      │   │ ...    │   │  data   (p.data: own storages)
    ├──────────────────────────────┼───┼────────────────────┼───┼────────┼───┤
    │                              │   │                    │   │        │   │  grad   (p.grad: see flatopt.grads)
    ├──────────────────────────────┼───┼────────────────────┼───┼────────┼───┤
    │                              │   │                    │   │        │   │  one buffer per state
    └──────────────────────────────┴───┴────────────────────┴───┴────────┴───┘
    s_i = align_up(s_{i-1} + n_{i-1}, ALIGN); the length is align_up(end, ALIGN)

Every parameter starts on a multiple of ``ALIGN`` elements (64: 512 bytes for float64, 256 for float32,
128 for bfloat16 and float16), so each aligned granule of 64 elements belongs to exactly one parameter
and the kernels find a parameter's group and step count with one table lookup. Padding elements
are zero in every buffer; the optimizers map zeros to zeros, so stepping them changes nothing.

A parameter sharded by FSDP2 takes its local shard's shape and the room of FSDP2's padded shard
(``like`` and ``room``; see :mod:`flatopt.distributed.fsdp`), whose tail is padding like the rest.

Each ``p.data`` shares the data buffer's memory over a storage of exactly its own bytes (a slice of the
buffer's storage: ``flatopt.torch_compat.own_storage``), so that ``torch.save``, ``copy.deepcopy`` and
safetensors take one parameter's bytes, not the whole buffer. Gradient views share the gradient buffer's
storage itself, which ``zero_grad()`` may release (see :mod:`flatopt.landing`); a FSDP2 buffer stays one
storage, whose memory FSDP2 manages.

A parameter view keeps the parameter's own strides (a channels_last weight stays channels_last);
parameters must be dense (no gaps or overlaps between elements).
"""

import functools
import weakref
from dataclasses import dataclass, field

import torch

from flatopt.torch_compat import own_storage

ALIGN = 64  # elements; also the kernels' GRANULE (flatopt.kernels.common imports it from here)

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def compute_dtype(dtype):
    """The dtype the update math runs in for buffers of ``dtype``: float64 for float64, float32 for the others
    (bfloat16 and float16 are upcast). The hyper-parameter table a launch reads has this dtype too."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def align_up(n, align=ALIGN):
    return (n + align - 1) // align * align


HUGE_PAGE = 2 << 20  # bytes: the transparent huge page of x86-64 and arm64 Linux


def flat_zeros(numel, dtype, device):
    """A zeroed flat tensor of ``numel`` elements for a buffer that is never resized (parameters, states, master).

    On the CPU under Linux, one of at least HUGE_PAGE bytes lies in anonymous memory of its own (``mmap``),
    aligned to HUGE_PAGE and marked ``MADV_HUGEPAGE``, so that the kernel backs it with transparent huge pages
    where it can (``/sys/kernel/mm/transparent_hugepage/enabled`` set to ``madvise`` or ``always``): a step
    streams every byte of the buffers, and 2 MiB pages spare it most TLB misses. Memory from torch's allocator
    also depends on what the process freed before: glibc serves large requests from its heap once a large block
    was freed (its mmap threshold grows), and a step over such memory was measurably slower (docs/optimizers.md,
    "The CPU backend", quotes benchmark runs before and after). Elsewhere, or where ``mmap`` or ``madvise`` is
    refused, ``torch.zeros``. The tensor holds the mapping alive (``torch.frombuffer``); its storage cannot be
    resized, which these buffers never are."""
    nbytes = numel * dtype.itemsize
    if torch.device(device).type == "cpu" and nbytes >= HUGE_PAGE and _MMAP is not None:
        mm = _MMAP
        try:
            area = mm.mmap(-1, nbytes + HUGE_PAGE, flags=mm.MAP_PRIVATE | mm.MAP_ANONYMOUS)
            raw = torch.frombuffer(area, dtype=torch.uint8)  # anonymous memory: zeroed
            start = (-raw.data_ptr()) % HUGE_PAGE
            area.madvise(mm.MADV_HUGEPAGE, start, nbytes - nbytes % mm.PAGESIZE)
            # over a storage of the buffer's bytes alone (holding the mapping alive), so that torch.save of a view of
            # it writes the buffer, not the alignment's slack
            return own_storage(raw[start : start + nbytes].view(dtype))
        except (OSError, ValueError, RuntimeError, TypeError):  # no such mapping or advice here: torch's allocator
            pass
    return torch.zeros(numel, dtype=dtype, device=device)


def _torch_zeros(numel, dtype, device):
    return torch.zeros(numel, dtype=dtype, device=device)


def _mmap_module():
    """Python's mmap module where it offers what flat_zeros needs (Linux), else None."""
    import mmap
    import sys

    if sys.platform != "linux" or not all(hasattr(mmap, n) for n in ("MAP_ANONYMOUS", "MAP_PRIVATE", "MADV_HUGEPAGE")):
        return None
    return mmap


_MMAP = _mmap_module()


def is_dense(t):
    """True when the elements of ``t`` fill one contiguous range of memory exactly once."""
    if t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last):
        return True
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


@dataclass
class StepMeta:
    """What the kernels need besides the buffers: see ``flatopt.kernels.common``."""

    param_of_granule: torch.Tensor  # int32 [numel // ALIGN]
    param_group: torch.Tensor  # int32 [params]
    steps: torch.Tensor  # float32 [params], completed steps
    counter: torch.Tensor  # int32 [1], zero between launches
    active: torch.Tensor | None = None  # uint8 [params]; None means all active
    uniform: bool = False  # one group, equal steps, no active mask (over [first, stop))
    first: int = 0  # a launch steps parameters [first, stop) of the buffer
    stop: int | None = None  # None: every parameter
    # the CPU backend's slices of the launch's buffers, the same at every step: see flatopt.cpu._slices
    cuts: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    cut_slices: int = field(default=0, init=False, repr=False, compare=False)  # how many slices ``cuts`` holds
    hosts: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # see host()
    checked: tuple | None = field(default=None, init=False, repr=False, compare=False)  # see flatopt.cpu._check
    # ``steps._version`` when ``uniform`` was last found from the counts (or the engine's own writes since): another
    # value means the caller wrote a count in place (opt.state[p]["step"].fill_(7)), which ``uniform`` must follow
    steps_version: int = field(default=-1, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.stop is None:
            self.stop = self.param_group.numel()

    def host(self, name):
        """The CPU tensor ``name`` of this meta (``steps``, ``param_group``) as a numpy array over its memory, kept
        while that attribute is the same tensor: the CPU step reads the step counts and group of a launch and adds
        one to the counts without a torch operation each (several microseconds of host time each, several times
        that right after a kernel that streamed the buffers through the caches). The array is taken again where the
        tensor's memory moved (``share_memory_()`` moves a storage in place, as a state's ``step`` shared for
        Hogwild-style training does). The numpy writes do not count in the tensor's version counter."""
        t = getattr(self, name)
        hit = self.hosts.get(name)
        if hit is not None and hit[0] is t and hit[2] == t.data_ptr():
            return hit[1]
        arr = t.numpy()
        self.hosts[name] = (t, arr, t.data_ptr())
        return arr


_HOLDERS = {}  # id(parameter) -> weak reference to the live FlatBuffer that adopted it last (no weak reference to it)


def _forget(ids, ref):
    """A FlatBuffer is gone: the parameters it adopted (``ids``) are held by none, unless another adopted them since."""
    for key in ids:
        if _HOLDERS.get(key) is ref:
            del _HOLDERS[key]


def holder(p):
    """The live FlatBuffer whose data ``p`` was last bound to by adoption (``FlatBuffer.adopt``), or None."""
    ref = _HOLDERS.get(id(p))
    buf = ref() if ref is not None else None
    return buf if buf is not None and p in buf.index else None


class FlatBuffer:
    """Parameters of one (device, dtype), their gradients and optimizer states in flat buffers.

    Args:
        params (list[Tensor]): parameters, each once, all of ``device`` and ``dtype``.
        groups (list[int]): the param-group index of each parameter.
        state_names (tuple[str]): one zeroed flat buffer is allocated per name now; more with
            :meth:`add_state`.
        grad (bool or "kept"): allocate the flat gradient buffer and make every ``p.grad`` a view into it
            (``False`` in in-backward mode, where gradients are stepped and freed as they arrive); ``"kept"``: one
            whose storage is never released, allocated as the parameters' (:func:`flat_zeros`).
        like (list[Tensor], optional): the tensor whose shape, strides, dtype and device each parameter's views
            take, when it is not the parameter itself (FSDP2's local shard of a DTensor parameter).
        room (list[int], optional): the elements reserved for each parameter, at least its own (FSDP2's padded
            shard); the elements past its own are padding. Default: its own.
        precision (flatopt.precision.BufferPrecision, optional): the states' dtype (None: the parameters')
            and the master buffer (``master``: float32 master copy, or int16 remainders; None without one).
    """

    def __init__(self, params, groups, state_names=(), grad=True, like=None, room=None, precision=None):
        if not params:
            raise ValueError("a FlatBuffer needs at least one parameter")
        self.params = list(params)
        self.like = list(params) if like is None else list(like)
        room = [t.numel() for t in self.like] if room is None else list(room)
        if len(self.like) != len(self.params) or len(room) != len(self.params):
            raise ValueError(f"like and room need one entry per parameter ({len(self.params)})")
        self.device = self.like[0].device
        self.dtype = self.like[0].dtype
        self.index = {}  # param -> (start, end)
        self.starts = []
        self.sizes = tuple(t.numel() for t in self.like)  # each parameter's number of elements
        self.room = room
        start = 0
        for p, t, n in zip(self.params, self.like, room):
            if n < t.numel():
                raise ValueError(f"room for {n} elements cannot hold a tensor of {t.numel()}")
            self.index[p] = (start, start + t.numel())
            self.starts.append(start)
            start = align_up(start + n)
        self.numel = max(start, ALIGN)
        self.group_ids = list(groups)
        self.group_set = frozenset(self.group_ids)
        self.ordinal = 0  # the buffer's place among its optimizer's (stochastic rounding mixes it into the seed)
        self.taken = set()  # ids of its parameters adopted since by another buffer (another flatopt optimizer's)
        self.state_dtype = self.dtype if precision is None else precision.state_dtype
        self.stochastic = precision is not None and precision.stochastic
        self.unsigned = () if precision is None else precision.unsigned
        master = None if precision is None else precision.master_dtype

        # FSDP2 keeps its local shards in a data buffer given ``like`` (and manages the memory it gathers into): that
        # one stays torch's; the others are laid out by flat_zeros
        self.data = (flat_zeros if like is None else _torch_zeros)(self.numel, self.dtype, self.device)
        # a gradient buffer whose storage zero_grad() releases (LandingSlots) stays torch's, which can be resized;
        # one that is kept ("kept": on the CPU) is laid out as the others
        if grad == "kept":
            self.grad = flat_zeros(self.numel, self.dtype, self.device)
        else:
            self.grad = torch.zeros(self.numel, dtype=self.dtype, device=self.device) if grad else None
        self.states = {}
        self.state_views = {}
        owner = torch.zeros(self.numel // ALIGN, dtype=torch.int32, device="cpu")
        for i, (p, n) in enumerate(zip(self.params, room)):
            s = self.index[p][0]
            owner[s // ALIGN : align_up(s + n) // ALIGN] = i
        self.meta = StepMeta(
            param_of_granule=owner.to(self.device),
            param_group=torch.tensor(self.group_ids, dtype=torch.int32, device=self.device),
            steps=torch.zeros(len(self.params), dtype=torch.float32, device=self.device),
            counter=torch.zeros(1, dtype=torch.int32, device=self.device),
            uniform=len(set(self.group_ids)) == 1,
        )
        self.data_views = [self.view(self.data, i) for i in range(len(self.params))]
        self.own_storages = False  # adopt() binds each p.data over a storage of its own (bindings.watch_every_address)
        self.grad_views = [self.view(self.grad, i) for i in range(len(self.params))] if grad else None
        # the master copy (float32) or the low bits the parameters drop (int16), set from the parameters at adopt()
        self.master = None if master is None else flat_zeros(self.numel, master, self.device)
        self.master_views = None if master is None else [self.view(self.master, i) for i in range(len(self.params))]
        for name in state_names:
            self.add_state(name)

    @property
    def quantized(self):
        """Whether the states are stored block-wise in 8 bits (see :mod:`flatopt.quantize`)."""
        return self.state_dtype == "int8"

    def add_state(self, name):
        """Allocate a zeroed flat state buffer and its per-parameter views. 8-bit states (``state_dtype="int8"``)
        have codes (int8, or uint8 for the ``unsigned`` ones) under ``name`` and one float32 scale per block
        under ``name + ABSMAX``, whose views are each parameter's blocks."""
        from flatopt.quantize import ABSMAX, QBLOCK, code_dtype  # quantize reads ALIGN from here

        dtype = self.state_dtype
        if self.quantized:
            dtype = code_dtype(name not in self.unsigned)
            scales = torch.zeros(self.numel // QBLOCK, dtype=torch.float32, device=self.device)
            self.states[name + ABSMAX] = scales
            self.state_views[name + ABSMAX] = [
                scales[s // QBLOCK : align_up(s + p.numel(), QBLOCK) // QBLOCK]
                for s, p in zip(self.starts, self.params)
            ]
        self.states[name] = flat_zeros(self.numel, dtype, self.device)
        self.state_views[name] = [self.view(self.states[name], i) for i in range(len(self.params))]

    def padding(self, flat):
        """Views of ``flat`` (one of this buffer's flat tensors) between parameters and after the last one:
        the alignment padding, which must stay zero."""
        pads, end = [], 0
        for start, t in sorted(zip(self.starts, self.like), key=lambda t: t[0]):
            if start > end:
                pads.append(flat[end:start])
            end = start + t.numel()
        if flat.numel() > end:
            pads.append(flat[end:])
        return pads

    def index_tables(self):
        """Each parameter's offset and number of elements as int64 tensors on the buffer's device, the tables of
        :class:`GradSources` that never change: built once."""
        tables = getattr(self, "_index_tables", None)
        if tables is None:
            tables = self._index_tables = (_table(self.starts, self.device), _table(self.sizes, self.device))
        return tables

    def load_width(self):
        """(width, starts): the widest load, in elements, that every parameter's size allows (16 bytes of elements,
        or 1), and the parameters' offsets as a tuple; found once (the layout does not change)."""
        found = self.__dict__.get("_load_width")
        if found is None:
            vec = 16 // self.dtype.itemsize
            if any(n % vec for n in self.sizes):
                vec = 1
            found = self._load_width = (vec, tuple(self.starts))
        return found

    def view(self, flat, i):
        """The view of parameter ``i`` in ``flat``, with the parameter's shape and strides."""
        p = self.like[i]
        return flat.as_strided(p.shape, p.stride(), flat.storage_offset() + self.starts[i])

    def claim(self):
        """Record that this buffer holds its parameters now (when it binds them): another flatopt optimizer's buffer
        that held one loses it, and its next binding check looks at every parameter and names the cause."""
        ref = weakref.ref(self, functools.partial(_forget, [id(p) for p in self.params]))
        for p in self.params:
            other = holder(p)
            if other is not None and other is not self:
                other.taken.add(id(p))
            _HOLDERS[id(p)] = ref

    def adopt(self):
        """Copy each parameter (and its existing gradient) into the buffers and rebind
        ``p.data`` (and ``p.grad``, when there is a gradient buffer) to the views."""
        grad_views = self.grad_views or [None] * len(self.params)
        self.claim()
        with torch.no_grad():
            for i, (p, dv) in enumerate(zip(self.params, self.data_views)):
                dv.copy_(p.data)
                # over a storage of its own bytes (sharing the buffer's memory), so that what goes by storages
                # (torch.save, safetensors, copy.deepcopy) takes the parameter, not the whole buffer
                self.data_views[i] = p.data = own_storage(dv)
            self.own_storages = True
            if self.master is not None and self.master.dtype == torch.float32:
                self.master.copy_(self.data)  # the remainders stay zero: the parameters are their master's top half
            for p, gv in zip(self.params, grad_views):
                if gv is not None:
                    if p.grad is not None:
                        gv.copy_(p.grad)
                    p.grad = gv
        # where each parameter's data and gradient were at adoption: the data stays there while the parameter is
        # bound; the gradient storage may be released and come back elsewhere (see flatopt.landing)
        self.expected = [
            (dv.data_ptr(), None if gv is None else gv.data_ptr()) for dv, gv in zip(self.data_views, grad_views)
        ]


def _table(values, device):
    """``values`` as an int64 tensor on ``device``. To a GPU from pinned memory, without waiting: torch's blocking
    copy synchronises the stream after it, so the host would wait for the work queued before it and stop running
    ahead of the device at every step that builds a table."""
    t = torch.tensor(values, dtype=torch.int64, device="cpu")
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass
class GradSources:
    """Where each parameter's gradient of one flat buffer lies, for a kernel that reads the gradients
    from there and stores them into the flat gradient buffer as it steps (``sources=`` of the
    kernels; see ``flatopt.kernels.common.gather_grad``) instead of a copy into the buffer first and
    a read back: a read of every gradient's bytes less.

    ``src``, ``start``, ``numel``: int64 ``[params]`` on the buffer's device (the address of each
    gradient, each parameter's offset in the buffer, its number of elements), the tables the kernels
    read; ``tensors``: the gradients the addresses point at, kept alive here (None where the source is
    the parameter's own view, whose value the kernel then keeps); ``starts`` and ``sizes``: the offsets
    and numels on the host, which the CPU backend and the reference read. ``store=False``: the caller
    will not read these gradients' slots in the flat buffer after the launch (their ``.grad`` stays
    where the gradient lies), so a launch need not store them there: the CPU backend and the Triton
    kernels (GATHER_STORE off) then step from the gradients in place and write nothing into the buffer
    (under ``grad_scale`` they leave the unscaled gradients where they lie, as torch's fused kernels leave
    them in ``.grad``); the torch reference stores them all the same. Such
    sources of a CPU buffer build their device tables only if a kernel asks for them (:meth:`tables`):
    the CPU backend reads the host values, and building them costs host time at every step.
    """

    src: torch.Tensor | None
    start: torch.Tensor | None
    numel: torch.Tensor | None
    tensors: list
    vec: int  # every numel is a multiple of it (16 bytes of elements, or 1): the kernel's load width
    sizes: tuple  # the numels, on the host
    widest: int  # the widest load width the sizes allow (what vec is set to by of())
    length: int  # the flat buffer's length and dtype: sources are for that buffer only
    dtype: torch.dtype
    store: bool = True  # False: the slots of these gradients need not be written (see above)
    starts: tuple = ()  # each parameter's offset in the buffer, on the host
    views: list = field(default_factory=list)  # the buffer's gradient views (for the addresses of None sources)
    device: torch.device | None = None  # where the tables go

    def check(self, meta, grad):
        """Raise unless a launch over ``grad`` (a flat gradient buffer) with ``meta`` can gather from
        these sources: built for this buffer (length, dtype, one entry per parameter), a launch over
        the whole buffer, and a load width the sizes allow. Called before anything is changed."""
        n = meta.param_group.numel()
        if grad.numel() != self.length or grad.dtype != self.dtype or len(self.sizes) != n:
            raise ValueError(
                f"these GradSources were built for a flat buffer of {self.length} {self.dtype} elements and "
                f"{len(self.sizes)} parameters, not {grad.numel()} {grad.dtype} and {n}: build them with "
                "GradSources.of(buffer, grads) for the buffer launched"
            )
        for name in ("src", "start", "numel"):
            t = getattr(self, name)
            if t is None:
                continue  # not built yet: tables() builds it from the host values, checked here
            if t.dtype != torch.int64 or t.shape != (n,) or t.device != grad.device:
                raise ValueError(
                    f"GradSources.{name} must be int64 of shape ({n},) on {grad.device}, got {t.dtype} "
                    f"{tuple(t.shape)} on {t.device}"
                )
        if meta.first != 0 or meta.stop != n:
            raise ValueError(
                f"a launch that gathers its gradients steps a whole flat buffer, not parameters [{meta.first}, "
                f"{meta.stop}) of {n}: launch without sources= over a slice"
            )
        if meta.param_of_granule.numel() * ALIGN != grad.numel():
            raise ValueError(
                f"a launch that gathers its gradients needs a flat buffer laid out by FlatBuffer (a length that is a "
                f"multiple of {ALIGN}, one param_of_granule entry per {ALIGN} elements); got {grad.numel()} elements "
                f"and {meta.param_of_granule.numel()} entries"
            )
        if self.vec not in (1, self.widest):  # O(1): no walk over the parameters at every launch
            raise ValueError(
                f"GradSources.vec={self.vec} is not a load width these sizes allow: 1, or "
                f"{16 // grad.element_size()} when every parameter's size is a multiple of it"
            )

    def tables(self):
        """``(src, start, numel)`` on the device, built now if they were not (not inside a CUDA graph capture)."""
        if self.src is None:
            src = [(v if g is None else g).data_ptr() for v, g in zip(self.views, self.tensors)]
            self.src = _table(src, self.device)
        if self.start is None:
            self.start = _table(self.starts, self.device)
        if self.numel is None:
            self.numel = _table(self.sizes, self.device)
        return self.src, self.start, self.numel

    def pieces(self):
        """``(start, numel, gradient)`` of each gradient that is not the parameter's own view, on the host."""
        return [(s, n, g) for s, n, g in zip(self.starts, self.sizes, self.tensors) if g is not None]

    @staticmethod
    def fits(view, g):
        """Whether the kernel can read ``g`` in place of ``view``: same shape, strides, dtype and device
        (so element k of its memory is element k of the view's), and 16-byte aligned."""
        return (
            g.shape == view.shape
            and g.stride() == view.stride()
            and g.dtype == view.dtype
            and g.device == view.device
            and g.layout == torch.strided
            and g.data_ptr() % 16 == 0
        )

    @classmethod
    def addresses(cls, buf, grads):
        """The address of each parameter's gradient of ``buf`` in ``grads`` (one tensor or None per
        parameter: None is the parameter's own view). Raises ValueError for a gradient that does not fit."""
        cls._check_fit(buf, grads)
        return [(view if g is None else g).data_ptr() for view, g in zip(buf.grad_views, grads)]

    @classmethod
    def _check_fit(cls, buf, grads):
        if buf.grad is None:
            raise ValueError("GradSources need a flat gradient buffer to store into; this FlatBuffer has none")
        if len(grads) != len(buf.params):
            raise ValueError(f"expected {len(buf.params)} gradients, got {len(grads)}")
        for i, (view, g) in enumerate(zip(buf.grad_views, grads)):
            if g is not None and not cls.fits(view, g):
                raise ValueError(
                    f"the gradient of parameter {i} cannot be read in place: shape {tuple(g.shape)}, strides "
                    f"{g.stride()}, {g.dtype} on {g.device} at {g.data_ptr():#x}; the kernel needs shape "
                    f"{tuple(view.shape)}, strides {view.stride()}, {view.dtype} on {view.device}, 16-byte aligned"
                )

    @classmethod
    def of(cls, buf, grads, *, store=True, checked=False):
        """The sources of ``buf`` from ``grads`` (one tensor or None per parameter of ``buf``: None
        reads the parameter's own view). Raises ValueError for a gradient that does not fit (unless
        ``checked``: the caller tested each with :meth:`fits`). Copies its tables to the device (not
        inside a CUDA graph capture: see :meth:`point_at`), except for ``store=False`` sources of a CPU
        buffer, whose tables are built if a kernel asks for them (:meth:`tables`)."""
        if not checked:
            cls._check_fit(buf, grads)
        vec, starts = buf.load_width()
        out = cls(None, None, None, list(grads), vec, buf.sizes, vec, buf.numel, buf.dtype, store, starts,
                  buf.grad_views, buf.device)  # fmt: skip
        if store or buf.device.type != "cpu":
            out.start, out.numel = buf.index_tables()
            out.tables()
        return out

    def point_at(self, addresses):
        """Make ``src`` hold ``addresses`` (one per parameter, from :meth:`addresses`): for a CUDA graph
        that recorded a launch with these sources while the gradients lay there (its memory pool puts
        them there again at every replay). ``tensors`` is left as it is (the gradients are the graph's
        to keep), so such sources are for the Triton kernels, which read ``src``; the torch reference
        reads ``tensors``. A blocking copy: call it outside capture."""
        if len(addresses) != len(self.sizes):
            raise ValueError(f"expected {len(self.sizes)} addresses, got {len(addresses)}")
        self.tables()
        self.src.copy_(torch.tensor(addresses, dtype=torch.int64, device="cpu"))
