"""``optimizer.capture(train_step, *example_inputs)``: a whole training step as one CUDA graph.

Parameters, gradients and optimizer states live in flat buffers that never move, so zeroing the
gradients, ``train_step`` (forward and backward) and the optimizer step can be recorded once and
replayed. What the graph records:

* ``opt.zero_grad()``, as ``.grad`` set to None (see :mod:`flatopt.grads`);
* ``train_step(*static_inputs)``: its CUDA work, with the inputs read from static tensors;
* ``opt.step()``, unless ``train_step`` steps the optimizer itself (for example through
  ``scaler.step(opt)``). Its kernel reads each new gradient where backward left it in the graph's
  memory pool and stores it into the parameter's ``.grad`` view as it steps (``sources=``, see
  :class:`flatopt.layout.GradSources`): no copy into the flat buffer first, a read and a write of
  every gradient's bytes less. Gradients the kernel cannot read in place (other strides, a
  misaligned view) are copied in first, and so are all of them when ``train_step`` steps itself,
  when a step pre-hook is registered, with ``backend="torch"``, or with ``max_grad_norm``, where
  ``opt.clip_grad_norm_(max_grad_norm)`` runs before the step: one batched copy after backward,
  after which the ``.grad`` views hold them.

Every replay reads the hyper-parameters from a device table that is refreshed from
``param_groups`` before the replay (so LR schedulers work), and the step counters (and so the
bias corrections) advance on the device inside the graph.

Warm-up runs ``train_step`` ``warmup`` times on a side stream (compiling every kernel); the last
warm-up iteration runs with CUDA's sync debug mode set to error, so a host synchronisation
(``.item()``, printing a tensor, ``.cpu()``, a data-dependent shape) is reported before capture.
Warm-up and recording leave parameters, gradient values, optimizer states, step counters, the
GradScaler passed as ``scaler`` and, when the optimizer was built from a module, the module's
buffers exactly as they were (a ``.grad`` that was None is afterwards its zeroed view): the first
replay is the first training step.
"""

import weakref
from contextlib import contextmanager

import torch

from flatopt.layout import GradSources

_SYNC_HINT = (
    "train_step synchronised the host with the GPU ({cause}), which a CUDA graph cannot record. Remove "
    "`.item()`, `.cpu()`, `print(tensor)`, `if tensor:` and operations with data-dependent output shapes "
    "(`nonzero`, boolean masks) from train_step, and read results from the returned tensors after the replay"
)


def check_capturable(opt):
    """Raise if ``opt`` cannot be captured, before anything is run."""
    cls = type(opt).__name__
    if not opt.flat:
        raise RuntimeError(f"{cls}(flat=False) cannot be captured: capture relies on flat buffers that never move")
    if opt.in_backward:
        raise RuntimeError(f"{cls}(in_backward=True) cannot be captured; use in_backward=False with capture()")
    if getattr(opt.engine, "shards", None):
        raise RuntimeError(
            f"{cls}.capture() cannot record the step of an FSDP2 model: FSDP2 all-gathers and reduce-scatters with "
            "its own buffers and streams around it. Step it with opt.step()"
        )
    if not torch.cuda.is_available():
        raise RuntimeError(f"{cls}.capture() records a CUDA graph and needs a CUDA GPU; this machine has none")
    if not opt.engine.buffers or any(b.device.type != "cuda" for b in opt.engine.buffers):
        raise RuntimeError(f"{cls}.capture() needs every trainable parameter on a CUDA device")


def check_inputs(static, inputs):
    """Raise unless ``inputs`` match the captured ``static`` inputs in kind, shape, dtype and device."""
    if len(inputs) != len(static):
        raise TypeError(f"the captured step takes {len(static)} inputs, got {len(inputs)}")
    for i, (s, x) in enumerate(zip(static, inputs)):
        if isinstance(s, torch.Tensor):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"input {i}: the captured step was recorded with a tensor, got {type(x).__name__}")
            if x.shape != s.shape or x.dtype != s.dtype or x.device != s.device:
                raise ValueError(
                    f"input {i}: the captured step was recorded for shape {tuple(s.shape)}, {s.dtype} on {s.device}, "
                    f"got shape {tuple(x.shape)}, {x.dtype} on {x.device}. A CUDA graph replays fixed shapes: pad "
                    "or drop the last batch, or capture one step per shape"
                )
        elif isinstance(x, torch.Tensor):
            raise TypeError(
                f"input {i}: the captured step was recorded with the constant {s!r} ({type(s).__name__}), got a "
                "tensor; capture with a tensor input to pass tensors"
            )
        elif not (x is s or x == s):
            raise ValueError(
                f"input {i}: non-tensor inputs are recorded as constants; the step was captured with {s!r}, got {x!r}"
            )


class Snapshot:
    """Copies, in host memory (so that capture does not need twice the GPU memory), of everything
    warm-up changes, to put back before recording."""

    def __init__(self, opt, scaler=None, module=None):
        self.pairs = []
        for buf in opt.engine.buffers:
            self._keep(buf.data, buf.grad, *buf.states.values(), buf.master, buf.meta.steps, buf.meta.counter)
        if scaler is not None and getattr(scaler, "_scale", None) is not None:
            self._keep(scaler._scale, scaler._growth_tracker)
        if module is not None:
            self._keep(*module.buffers())

    def _keep(self, *tensors):
        self.pairs += [(t, t.detach().to("cpu", copy=True)) for t in tensors if isinstance(t, torch.Tensor)]

    @torch.no_grad()
    def restore(self):
        for live, saved in self.pairs:
            live.copy_(saved)


class CapturedStep:
    """A recorded training step; call it with new inputs to replay. See :mod:`flatopt.capture`."""

    signature = None  # [(shape, dtype, CUDA device index)] of the static inputs, when all are CUDA tensors

    def __init__(self, opt, train_step, example_inputs, *, warmup=3, max_grad_norm=None, scaler=None):
        check_capturable(opt)
        if not isinstance(warmup, int) or warmup < 2:
            raise ValueError(f"Invalid warmup: {warmup!r}; expected an int >= 2 (the last one checks for host syncs)")
        if max_grad_norm is not None and not float(max_grad_norm) > 0:
            raise ValueError(f"Invalid max_grad_norm: {max_grad_norm}; expected a positive number")
        opt.check_bindings(full=True)  # names a parameter frozen, moved or cast since construction
        # the graph records the gradient buffers' addresses: zero_grad() must not free them while it exists; let
        # go once, at release(), when this object is collected, or when capture fails
        hold = opt.engine.hold_grads
        hold()
        self._unhold = weakref.finalize(self, hold, False)
        try:
            self._record(opt, train_step, example_inputs, warmup, max_grad_norm, scaler)
        except BaseException:
            self._unhold()
            raise

    def _record(self, opt, train_step, example_inputs, warmup, max_grad_norm, scaler):
        """Warm up and record (see the module docstring)."""
        cls = type(opt).__name__
        self.opt = opt
        self.static = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in example_inputs]
        if all(isinstance(s, torch.Tensor) and s.is_cuda for s in self.static):
            self.signature = [(s.shape, s.dtype, s.get_device()) for s in self.static]
        module = opt.module() if opt.module is not None else None
        engine = opt.engine

        engine.refresh_hparams()  # may allocate a state buffer (SGD momentum): before the snapshot
        if scaler is not None and getattr(scaler, "_scale", None) is None and scaler.is_enabled():
            scaler._lazy_init_scale_growth_tracker(engine.buffers[0].device)  # as its first scale() would
        snapshot = Snapshot(opt, scaler, module)
        # its gathering sources are built on the caller's stream, where the replays read them
        self.body = RecordedBody(opt, train_step, self.static, max_grad_norm=max_grad_norm)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side):
                # First iteration as in eager code (it also compiles the kernels); the others as recorded.
                self.steps_in_fn = self.body.warmup(graph_mode=False)
                if self.steps_in_fn > 1:
                    raise RuntimeError(
                        f"train_step called {cls}.step() {self.steps_in_fn} times; a captured step holds at most one"
                    )
                if self.steps_in_fn and max_grad_norm is not None:
                    raise RuntimeError(
                        "train_step steps the optimizer itself, so capture(max_grad_norm=...) cannot clip before "
                        f"the step: call opt.clip_grad_norm_({max_grad_norm}) in train_step before stepping (after "
                        "scaler.unscale_(opt) when a GradScaler is used)"
                    )
                if self.steps_in_fn:
                    self.body.sources = None  # the step is train_step's: nothing to gather into
                for i in range(1, warmup):
                    self.body.warmup(graph_mode=True, check_sync=i == warmup - 1)
        finally:
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            snapshot.restore()
        del snapshot
        engine.refresh_hparams()
        self.buffers = list(engine.buffers)
        self.tables = dict(opt.hparams.tables)
        self.layout = self._layout()

        self.graph = torch.cuda.CUDAGraph()
        self.body.recorded = {}
        try:
            with torch.cuda.graph(self.graph):
                self.outputs = self.body.run(gather=True)
            for buf, addresses in self.body.recorded.items():
                self.body.sources[buf].point_at(addresses)  # the graph's pool puts them there at each replay
        except RuntimeError as e:
            self.graph = None
            text = str(e)
            if "captur" in text or "synchroniz" in text or "not permitted" in text:
                raise RuntimeError(_SYNC_HINT.format(cause=text.splitlines()[0]) + " (failed during capture)") from e
            raise
        # Recording runs nothing: parameters, states and counters are as the snapshot put them back.

    def _inputs_fit(self, inputs):
        """check_inputs()'s common case in little host time (it runs before every replay): as many
        inputs as recorded, all of them CUDA tensors, each of its static input's shape, dtype and device."""
        sig = self.signature
        if sig is None or len(inputs) != len(sig):
            return False
        for (shape, dtype, index), x in zip(sig, inputs):
            if not isinstance(x, torch.Tensor) or x.shape != shape or x.dtype is not dtype:
                return False
            if not x.is_cuda or x.get_device() != index:
                return False
        return True

    def _layout(self):
        """What the recorded kernels were specialised on, per buffer."""
        return [(tuple(b.states), b.meta.uniform) for b in self.opt.engine.buffers]

    def __call__(self, *inputs):
        """Copy ``inputs`` into the static inputs, refresh the hyper-parameters, replay; returns the
        static outputs (overwritten by the next replay: clone what you keep)."""
        if self.graph is None:
            raise RuntimeError("this captured step was released; capture again")
        opt = self.opt
        if not self._inputs_fit(inputs):
            check_inputs(self.static, inputs)  # says what differs, or passes (equal constants)
        engine = opt.engine
        if engine.buffers != self.buffers:
            raise RuntimeError(
                f"the parameters of {type(opt).__name__} were laid out again since capture (add_param_group); "
                "capture again"
            )
        if not engine.ends_bound():  # as step() checks; the graph lands the gradients itself
            engine.check_data_bindings(full=False)
        if engine.members_changed():  # identity tests per parameter, as step() makes
            raise RuntimeError(
                f"param_groups' params or a frozen parameter's requires_grad changed since capture, which the "
                f"recorded step of {type(opt).__name__} cannot follow (it steps the parameters laid out when it was "
                "recorded); step eagerly once (opt.step() or opt.zero_grad() lays them out again), then capture again"
            )
        engine.sync_state()  # opt.state edited (a reset, an assigned tensor): into the buffers the graph reads
        engine.landing.restore_if_released()  # so .grad shows them after the replay, also after zero_grad()
        engine.refresh_hparams()
        if any(opt.hparams.tables.get(d) is not t for d, t in self.tables.items()):
            raise RuntimeError("the number of param groups changed since capture; capture again")
        if self._layout() != self.layout:
            raise RuntimeError(
                "the optimizer state changed shape since capture (a state buffer was added, for example SGD "
                "momentum turned on, or a loaded state_dict made the step counts differ); capture again"
            )
        for s, x in zip(self.static, inputs):
            if isinstance(s, torch.Tensor) and x is not s:
                if s.requires_grad or x.requires_grad:  # train_step made it a leaf (requires_grad_()), or x has history
                    with torch.no_grad():
                        s.copy_(x)
                else:
                    s.copy_(x)  # entering no_grad costs more host time than this copy's launch
        self.graph.replay()
        return self.outputs

    def release(self):
        """Free the graph and its private memory pool (activations and temporaries of train_step)."""
        self.graph = None
        self.outputs = None
        self.static = None
        self.body = None
        self._unhold()  # once: a second release() lets go of nothing


class RecordedBody:
    """What a captured step records, as code that also runs eagerly: zero_grad(), ``train_step(*static)``,
    the gradients' landing and the optimizer step. Warm-up runs it, the recording records it, and the CPU
    tests run it against eager training (the recorded step, without a GPU).

    Args:
        opt (FlatOptimizer): the optimizer (flat, step mode).
        train_step (Callable): forward and backward (and maybe the step).
        static (list): the inputs ``train_step`` is called with (replays copy new inputs into them).
        max_grad_norm (float, optional): clip before the step (default: None)

    Attributes:
        sources: {FlatBuffer: GradSources}, for a step that reads the gradients where backward left them
            (``run(gather=True)``), or None when the step cannot (see :meth:`gather_sources`).
        recorded: {FlatBuffer: [address]}, the gathered gradients' addresses while recording.
    """

    def __init__(self, opt, train_step, static, *, max_grad_norm=None):
        self.opt = opt
        self.fn = train_step
        self.static = static
        self.max_grad_norm = max_grad_norm
        self.sources = self.gather_sources()
        self.recorded = {}

    def gather_sources(self):
        """{buffer: GradSources} for the recorded step to read the gradients where backward left them
        (in the graph's pool) instead of a copy into the flat buffer before it: a read and a write of every
        gradient's bytes less. Their addresses are set after recording; until then they point at the
        views, so that warm-up (which copies the gradients in) compiles and runs the same kernels. None
        when the step cannot: the gradients are clipped first (max_grad_norm), or the optimizer does not
        launch Triton kernels (and dropped after the first warm-up iteration when train_step steps the
        optimizer itself; a step pre-hook makes the recording copy them in instead: see run)."""
        opt = self.opt
        if self.max_grad_norm is not None or opt.backend != "triton":
            return None
        return {buf: GradSources.of(buf, [None] * len(buf.params)) for buf in opt.engine.buffers}

    @contextmanager
    def _counting_steps(self):
        """Count the optimizer's steps inside (train_step's own and the body's), with torch's public step
        post-hook; yields a list whose length is the count."""
        steps = []
        handle = self.opt.register_step_post_hook(lambda *args: steps.append(1))
        try:
            yield steps
        finally:
            handle.remove()

    def run(self, gather=False):
        """What the graph records. ``gather``: the step reads the gradients left in the graph's pool where
        they lie (self.sources); their addresses are kept in self.recorded, for after capture (nothing runs
        while recording), or set now when this runs eagerly. Otherwise, and when a step pre-hook is
        registered (it reads the .grad views before the kernel runs), the gradients are copied in first
        and the step reads them from the views (in warm-up through the same sources, pointing at the views:
        that compiles the gathering kernel)."""
        opt = self.opt
        engine = opt.engine
        grads = engine.landing
        with self._counting_steps() as steps, engine.recorded(), grads.deferring():
            try:
                grads.release()  # zero_grad(): the gradients are copied in after backward (see flatopt.grads)
                out = self.fn(*self.static)
                sources = None
                if steps or not (gather and self.sources) or not engine.gathers():
                    grads.settle()
                    sources = None if steps or gather else self.sources
                else:
                    taken = grads.settle_gathering(GradSources.fits)  # alive until the step is launched
                    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
                    for buf in engine.buffers:
                        addresses = GradSources.addresses(buf, [taken.get(p) for p in buf.params])
                        if capturing:
                            self.recorded[buf] = addresses
                        else:
                            self.sources[buf].point_at(addresses)
                    sources = self.sources
                if not steps:
                    if self.max_grad_norm is not None:
                        opt.clip_grad_norm_(self.max_grad_norm)
                    engine.gather_from(sources)
                    opt.step()
            except BaseException:
                grads.restore()  # launching nothing: a failed recording leaves the stream unusable until it ends
                raise
        return out

    def warmup(self, graph_mode, check_sync=False):
        """One warm-up iteration; returns how many times train_step stepped the optimizer."""
        opt = self.opt
        try:
            if check_sync:
                torch.cuda.set_sync_debug_mode("error")
            if graph_mode:
                self.run()
            else:
                with self._counting_steps() as steps:
                    opt.zero_grad()
                    self.fn(*self.static)
                n = len(steps)
                if not n:
                    if self.max_grad_norm is not None:
                        opt.clip_grad_norm_(self.max_grad_norm)
                    opt.step()
                return n
        except RuntimeError as e:
            if check_sync and "synchroniz" in str(e):
                raise RuntimeError(_SYNC_HINT.format(cause=str(e).splitlines()[0])) from e
            raise
        finally:
            if check_sync:
                torch.cuda.set_sync_debug_mode("default")
        return 0
