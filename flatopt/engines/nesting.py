"""Backward passes run inside another one, seen from a gradient hook of in-backward mode.

Reentrant activation checkpointing (``torch.utils.checkpoint(..., use_reentrant=True)``) records one
autograd Function node per checkpointed segment, ``CheckpointFunction``; its backward recomputes the
segment and runs a second backward pass through it, inside the first one. In-backward mode cannot
step such a pass, and must say so before it steps anything, so the first gradient of every pass
asks :func:`reentrant_segment` whether the pass will run one: the pass's roots are read from the
frame of torch's engine call (``torch.autograd.graph._engine_run_backward``, which
``torch.autograd.backward`` and ``torch.autograd.grad`` go through), on the thread that runs the hook,
or on the thread waiting in that call when a device's worker thread runs the hook, and the graph is
walked from them once, looking for a checkpointing Function whose node the engine will execute
(``torch._C._will_engine_execute_node``: its pass, not another thread's, and needed for the
``inputs`` asked for). Where the roots cannot be found (a torch without that call, a backward pass
started from C++), and for a nested pass run by any other Function's backward or by a hook, the
nested pass is seen at its own first gradient by :func:`nesting_backward`, from the hook's frames.
"""

import sys
import threading

import torch


def _code(obj, *path):
    for name in path:
        obj = getattr(obj, name, None)
    return getattr(obj, "__code__", None)


_FUNCTION_BACKWARD = _code(torch.autograd.function, "BackwardCFunction", "apply")  # runs a Function's backward
_ENGINE_RUN = _code(torch.autograd.graph, "_engine_run_backward")  # torch.autograd.backward's and grad's engine call
_OUTPUTS = _ENGINE_RUN.co_varnames[0] if _ENGINE_RUN is not None else None  # its first argument: the roots

# Autograd Functions whose backward runs a backward pass through the segment it recomputed: torch's
# reentrant checkpoint, and those of DeepSpeed, Megatron-LM and FairScale, which share its name.
CHECKPOINT_FUNCTIONS = frozenset({"CheckpointFunction"})
_checkpointing_of = {}  # node type -> the name of its checkpointing Function, or None (most types: not one)


def nesting_backward():
    """What runs the backward pass in progress inside another one, seen from a gradient hook of it:
    the autograd Function whose backward started it (``CheckpointFunction`` for reentrant activation
    checkpointing), ``"a hook"`` for a second engine run below this one, or None for a pass that is
    not nested. A nested pass runs on the thread of the node that started it, below that node's
    Python frames, on the thread that called backward() as on a device's worker thread."""
    frame, runs = sys._getframe(1), 0
    while frame is not None:
        code = frame.f_code
        if code is _FUNCTION_BACKWARD and code is not None:
            fn = getattr(frame.f_locals.get("self"), "_forward_cls", None)
            return getattr(fn, "__name__", "an autograd Function")
        if code is _ENGINE_RUN and code is not None:
            runs += 1
            if runs > 1:
                return "a hook"
        frame = frame.f_back
    return None


def _roots_below(frame):
    """The nodes the innermost engine call below ``frame`` starts its pass from, or None if none is below."""
    while frame is not None:
        if frame.f_code is _ENGINE_RUN:
            outputs = frame.f_locals.get(_OUTPUTS) or ()
            nodes = (t.grad_fn if isinstance(t, torch.Tensor) else getattr(t, "node", None) for t in outputs)
            return [n for n in nodes if n is not None]
        frame = frame.f_back
    return None


def _checkpointing(kind):
    """The name of the checkpointing Function whose backward nodes are of type ``kind``, or None."""
    name = getattr(getattr(kind, "_forward_cls", None), "__name__", None)
    _checkpointing_of[kind] = name = name if name in CHECKPOINT_FUNCTIONS else None
    return name


def reentrant_segment():
    """The name of the checkpointing autograd Function (``CheckpointFunction``) of a segment that the
    backward pass in progress will run, whose backward runs a backward pass inside this one; None when
    it runs none, or when the pass's roots cannot be found. Called from a gradient hook of the pass
    (not a nested one), once per pass: one walk of the pass's autograd graph."""
    will_run = getattr(torch._C, "_will_engine_execute_node", None)
    if _ENGINE_RUN is None or will_run is None:
        return None
    roots = _roots_below(sys._getframe(1))  # the hook runs on the thread that called backward (CPU)
    if roots is None:  # on a device's worker thread (CUDA): the caller waits in the engine call on its own
        me, roots = threading.get_ident(), []
        for ident, frame in sys._current_frames().items():
            theirs = _roots_below(frame) if ident != me else None
            # a waiting caller's pass is this one if the engine will run a node its roots lead to
            if theirs and any(will_run(n) for r in theirs for n, _ in r.next_functions if n is not None):
                roots += theirs
    first, seen, stack = set(roots), {None, *roots}, list(roots)
    while stack:
        node = stack.pop()
        kind = type(node)
        name = _checkpointing_of[kind] if kind in _checkpointing_of else _checkpointing(kind)
        if name is not None and (node in first or will_run(node)):  # roots run; the engine does not list them
            return name
        for nxt, _ in node.next_functions:
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return None
