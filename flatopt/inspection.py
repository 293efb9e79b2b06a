"""``flatopt.inspect(opt)``: a read-only look at what an optimizer built, for tests, benchmarks and
debugging. Nothing here is needed to train; the objects it returns are the live ones, so change
nothing through them."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Inspection:
    """What :func:`inspect` returns.

    Attributes:
        engine: the engine doing the optimizer's work (:mod:`flatopt.engines`); in in-backward mode
            it has ``launches`` (kernel launches so far), ``peak_held`` (the most staging-gradient
            elements allocated at once) and ``buckets``.
        buffers (list[flatopt.layout.FlatBuffer]): the flat buffers (empty with ``flat=False``). In step
            mode on a GPU ``zero_grad()`` releases the storage of each gradient buffer (``buf.grad``) until the
            next gradient arrives (the CPU keeps it): reading it then crashes the process;
            ``landing.slots.acquire()`` brings it back (its values undefined until the next backward or step).
        tables (dict): device -> the hyper-parameter table, one row per param group (float64 on a device
            with float64 parameters, float32 otherwise).
        landing: the :class:`flatopt.grads.GradLanding` of the flat step engine, else None.
        step_graph: the :class:`flatopt.step_graph.StepGraph` of ``step()``'s launches, or None.
    """

    engine: object
    buffers: list
    tables: dict
    landing: object
    step_graph: object


def inspect(opt):
    """A read-only look at the engine, buffers and tables of the flatopt optimizer ``opt``."""
    engine = opt.engine
    return Inspection(
        engine=engine,
        buffers=list(engine.buffers),
        tables=opt.hparams.tables,
        landing=getattr(engine, "landing", None),
        step_graph=getattr(engine, "step_graph", None),
    )
