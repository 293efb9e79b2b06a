"""Kernel launches recorded once as CUDA graphs and replayed.

Launching a Triton kernel costs tens of microseconds of host time (argument binding,
specialisation, cache lookup), more than the step itself on small models. The flat buffers
never move, so after a launch configuration has run once (and compiled), its launches are
recorded into a CUDA graph and replayed from then on: a few microseconds of host time, whatever
the number of parameters. A graph is keyed on everything its launches depend on (buffer, state,
table and meta addresses, and the UNIFORM specialisation); another key records another graph.
Hyper-parameters stay in the device table that is refreshed before the replay, and the step
counters advance on the device, so a replay is the same kernel with the same arguments.

``step()`` uses one :class:`StepGraph` for all its launches. In-backward mode uses one per
bucket, keyed also on the gradient's address: the gradient a bucket is stepped from is allocated
anew by every backward pass, and the caching allocator usually hands out the same block again.

GradScaler's ``grad_scale`` and ``found_inf`` are new tensors at every ``scaler.step(opt)``; a
replay reads them where the graph was recorded, so their addresses (and dtypes) are part of the
key. In a training loop the caching allocator hands the same blocks out step after step and the
graphs are reused; where it does not, recording stops (see ``run_keyed``) and the steps launch
directly.

A step that leaves out parameters whose ``.grad`` is None reads a mask of them; the masks are kept
per pattern (see ``FlatStepEngine._set_masks``), and their addresses are part of the key. Steps
inside a stream capture (``optimizer.capture``, or the caller's own graph), buffers on several
devices and the torch backend launch directly.
"""

from collections import OrderedDict

import torch

MAX_GRAPHS = 4  # graphs kept per StepGraph, the least recently replayed dropped first
MAX_SEEN = 8  # keys remembered as launched once (a key is recorded the second time it is seen)


class StepGraph:
    def __init__(self):
        self.graphs = OrderedDict()  # key -> CUDAGraph, least recently replayed first
        self.seen = OrderedDict()  # keys launched once directly (so their kernels are compiled)
        self.key = None  # the key of the last run
        self.failed = False  # recording failed once, or graphs are not reused: launch directly from then on
        self.recorded = 0  # graphs recorded
        self.reused = 0  # replays of a graph recorded at an earlier run

    @property
    def graph(self):
        """The graph of the last run's key, or None if that run launched directly."""
        return self.graphs.get(self.key)

    @staticmethod
    def key_of(buffers, table, grad_scale=None, found_inf=None):
        """The key of a step over flat ``buffers`` reading the hyper-parameter ``table``."""
        amp = None  # the usual step: no GradScaler tensors, nothing to build
        if grad_scale is not None or found_inf is not None:
            amp = tuple(
                None if t is None else (t.data_ptr(), t.dtype, t.device, t.numel()) for t in (grad_scale, found_inf)
            )
        return (table.data_ptr(), amp) + tuple(
            (
                buf.data.data_ptr(),
                buf.grad.data_ptr(),
                tuple((name, t.data_ptr()) for name, t in buf.states.items()),
                None if buf.master is None else buf.master.data_ptr(),
                buf.meta.steps.data_ptr(),
                None if buf.meta.active is None else buf.meta.active.data_ptr(),
                buf.meta.uniform,
            )
            for buf in buffers
        )

    @staticmethod
    def usable(enabled, backend, devices):
        """Whether launches may go through graphs: ``enabled`` (the optimizer's ``use_step_graph``), Triton
        kernels on one CUDA device, and not inside the caller's own stream capture."""
        return (
            enabled
            and backend == "triton"
            and len(devices) == 1
            and devices[0].type == "cuda"
            and not torch.cuda.is_current_stream_capturing()
        )

    def run_keyed(self, key, launch):
        """Replay the graph recorded for ``key``; without one, launch directly the first time ``key`` is
        seen (which compiles the kernels) and record a graph the second time."""
        self.key = key
        graph = self.graphs.get(key)
        if graph is not None:
            self.graphs.move_to_end(key)
            self.reused += 1
            graph.replay()
            return
        if self.failed or key not in self.seen:
            _remember(self.seen, key, True, MAX_SEEN)
            launch()
            return
        if self.recorded >= 2 * MAX_GRAPHS and self.reused < self.recorded:
            self.failed = True  # keys keep changing (a gradient's address, say): recording costs more than it saves
            launch()
            return
        graph = self._record(launch)
        if graph is None:
            launch()
            return
        self.recorded += 1
        _remember(self.graphs, key, graph, MAX_GRAPHS)
        graph.replay()

    def _record(self, launch):
        """Record ``launch()`` on a side stream; returns None (and stops trying) if recording fails."""
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    launch()
                finally:
                    graph.capture_end()
        except RuntimeError:
            self.failed = True
            return None
        finally:
            current.wait_stream(side)
        return graph


def _remember(cache, key, value, most):
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > most:
        cache.popitem(last=False)
