"""The optimizer step's kernel launches, recorded once as a CUDA graph and replayed.

Launching a Triton kernel costs tens of microseconds of host time (argument binding,
specialisation, cache lookup), more than the step itself on small models. The flat buffers
never move, so after a launch configuration has run once (and compiled), ``step()`` records its
launches into a CUDA graph and replays the graph from then on: a few microseconds of host time,
whatever the number of parameters. The graph is keyed on everything the launches depend on
(buffer, state, table and meta addresses, and the UNIFORM specialisation); a change records a
new one. Hyper-parameters stay in the device table that ``step()`` refreshes before the replay,
and the step counters advance on the device, so a replay is the same kernel with the same
arguments.

Steps that pass per-call tensors (GradScaler's ``grad_scale`` / ``found_inf``, ``skip_unused``'s
mask), steps inside a stream capture (``optimizer.capture``, or the caller's own graph), buffers
on several devices and the torch backend launch directly.
"""

import torch


class StepGraph:
    def __init__(self):
        self.key = None
        self.graph = None
        self.seen = set()  # keys launched once directly (so their kernels are compiled)
        self.failed = False  # recording failed once: launch directly from then on

    @staticmethod
    def key_of(opt):
        hp = opt._hp[opt._buffers[0].device]
        return (hp.data_ptr(),) + tuple(
            (
                buf.data.data_ptr(),
                buf.grad.data_ptr(),
                tuple((name, t.data_ptr()) for name, t in buf.states.items()),
                buf.meta.steps.data_ptr(),
                buf.meta.uniform,
            )
            for buf in opt._buffers
        )

    @staticmethod
    def usable(opt, grad_scale, found_inf):
        return (
            opt.backend == "triton"
            and grad_scale is None
            and found_inf is None
            and not opt.skip_unused
            and len(opt._devices) == 1
            and opt._devices[0].type == "cuda"
            and not torch.cuda.is_current_stream_capturing()
        )

    def run(self, opt, launch):
        """Run ``launch()`` (which launches every buffer's kernel on the current stream) through the graph."""
        key = self.key_of(opt)
        if key == self.key and self.graph is not None:
            self.graph.replay()
            return
        self.key, self.graph = key, None
        if key not in self.seen:  # first launch of this configuration: compile it
            self.seen.add(key)
            launch()
            return
        self.graph = self._record(launch)
        if self.graph is None:
            launch()
        else:
            self.graph.replay()

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
