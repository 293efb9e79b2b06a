"""``opt.state`` of the flat engines: torch.optim's dict of per-parameter dicts, whose tensors are
views into the flat buffers, with the changes made to it recorded so that the next step honours them.

Code written for torch.optim resets or replaces an optimizer's state by editing ``opt.state``:
``opt.state.clear()``, ``opt.state[p] = {}``, ``del opt.state[p]``, ``opt.state = defaultdict(dict)``,
``opt.state[p]["exp_avg"] = tensor``. torch.optim reads ``opt.state`` afresh at every step; the flat
engines step their buffers, so :class:`OptimizerState` (a ``defaultdict(dict)``) and its per-parameter
:class:`ParamState` dicts note which parameters such an edit touched, and the engine reconciles the
buffers with ``opt.state`` before its next step (:meth:`flatopt.engines.base.FlatEngine.sync_state`).
When nothing changed, that costs one identity check and one flag test. Writing into a state tensor
in place (``opt.state[p]["exp_avg"].zero_()``) writes into the buffer and needs no reconciling.

Copies (``copy.copy``, ``copy.deepcopy``, pickle) of these dicts are plain ``dict`` and
``defaultdict(dict)``.
"""

from collections import defaultdict
from collections.abc import Mapping

import torch


class Changes:
    """What was edited since the last reconciliation: the parameters whose entry (or whose dict) changed,
    or ``everything`` (a ``clear()``, ``update()``...)."""

    __slots__ = ("params", "everything")

    def __init__(self):
        self.params = set()
        self.everything = False

    def __bool__(self):
        return self.everything or bool(self.params)

    def touch(self, key):
        if isinstance(key, torch.Tensor):  # other keys (a hook's ``opt.state["test"] = 1``) are no parameter's
            self.params.add(key)

    def reset(self):
        self.params = set()
        self.everything = False


class ParamState(dict):
    """One parameter's state dict (``opt.state[p]``); any edit of it marks ``p`` changed."""

    __slots__ = ("changes", "param")

    def __init__(self, values, changes, param):
        super().__init__(values)
        self.changes = changes
        self.param = param

    def _touch(self):
        self.changes.params.add(self.param)

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self._touch()

    def __delitem__(self, key):
        super().__delitem__(key)
        self._touch()

    def __ior__(self, other):
        result = super().__ior__(other)
        self._touch()
        return result

    def clear(self):
        super().clear()
        self._touch()

    def pop(self, *args):
        self._touch()
        return super().pop(*args)

    def popitem(self):
        self._touch()
        return super().popitem()

    def setdefault(self, key, default=None):
        self._touch()
        return super().setdefault(key, default)

    def update(self, *args, **kwargs):
        super().update(*args, **kwargs)
        self._touch()

    def __reduce__(self):
        return dict, (dict(self),)


class OptimizerState(defaultdict):
    """``opt.state`` (a ``defaultdict(dict)``, as torch.optim's) that records which parameters' entries
    were set, deleted or cleared. :meth:`put` and :meth:`drop` are the engine's own writes, not recorded."""

    def __init__(self, *args, **kwargs):
        super().__init__(dict, *args, **kwargs)
        self.changes = Changes()
        self.owner = None  # weakref to the optimizer, whose state_dict() says whether there is any state

    def __bool__(self):
        """True once any parameter has state, as torch.optim's ``opt.state``, empty until a parameter's first step
        (``torch.distributed.checkpoint`` reads ``if optim.state`` to know whether the optimizer must step once
        before its state_dict() can serve as a template): the flat engines' entries exist from construction (zeros,
        step 0), so it is whether state_dict() would export any (it reads the step counts: a device synchronisation
        on a GPU; ``len(opt.state)`` still counts every entry). With edits pending (``opt.state.clear()``...), the
        dict's own length, which they set."""
        owner = self.owner() if self.owner is not None else None
        if owner is None or self.changes:
            return dict.__len__(self) > 0
        return owner._has_exported_state()

    def copy(self):
        return defaultdict(self.default_factory, self)

    __copy__ = copy

    def put(self, key, value):
        dict.__setitem__(self, key, value)

    def drop(self, key):
        dict.pop(self, key, None)

    def __setitem__(self, key, value):  # defaultdict's __missing__ comes here too
        super().__setitem__(key, value)
        self.changes.touch(key)

    def __delitem__(self, key):
        super().__delitem__(key)
        self.changes.touch(key)

    def __ior__(self, other):
        result = super().__ior__(other)
        self.changes.everything = True
        return result

    def clear(self):
        super().clear()
        self.changes.everything = True

    def pop(self, key, *default):
        self.changes.touch(key)
        return super().pop(key, *default)

    def popitem(self):
        self.changes.everything = True
        return super().popitem()

    def setdefault(self, key, default=None):
        self.changes.touch(key)
        return super().setdefault(key, default)

    def update(self, *args, **kwargs):
        super().update(*args, **kwargs)
        self.changes.everything = True

    def __reduce__(self):
        return defaultdict, (dict,), None, None, iter(dict(self).items())


# ---------------------------------------------------------------------------------------------- checks


def check_state_tensor(cls, name, key, t, p, dtype=None):
    """Raise ValueError unless ``t`` can stand as the state ``key`` of parameter ``p`` (named ``name``): a dense
    tensor with ``p``'s shape, dtype (or ``dtype``, the states' storage dtype) and device, whose values the flat
    buffer can take. Nothing is changed."""
    where = f"opt.state[{name}][{key!r}]"
    if not isinstance(t, torch.Tensor):
        raise ValueError(
            f"{cls}: {where} is a {type(t).__name__}; it must be a tensor like the parameter, "
            "torch.zeros_like(p) to start it again, or delete the parameter's whole state to restart it"
        )
    if t.layout != torch.strided or t.is_meta or tuple(t.shape) != tuple(p.shape) or t.dtype not in (p.dtype, dtype):
        what = "a tensor"
        if t.is_meta:
            what = "a tensor on the meta device"
        elif t.layout != torch.strided:
            what = f"a {t.layout} tensor"
        raise ValueError(
            f"{cls}: {where} is {what} of shape {tuple(t.shape)} and dtype {t.dtype}; the parameter is a dense "
            f"{p.dtype} tensor of shape {tuple(p.shape)}: assign a tensor like it (t.to(p.dtype) or "
            "torch.zeros_like(p))"
        )
    if t.device != p.device:
        raise ValueError(f"{cls}: {where} is on {t.device}, the parameter on {p.device}: assign t.to(p.device)")


def step_value(cls, name, t):
    """The step count that ``t`` (a ``step`` assigned into ``opt.state[name]``) gives, checked: a tensor with
    one real element, finite and >= 0."""
    where = f"opt.state[{name}]['step']"
    if (
        not isinstance(t, torch.Tensor)
        or t.numel() != 1
        or t.is_meta
        or t.layout != torch.strided
        or t.is_complex()
        or t.dtype == torch.bool
    ):
        shape = f"a tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else f"a {type(t).__name__}"
        raise ValueError(
            f"{cls}: {where} is {shape}; it must be the completed step count as a one-element float tensor, "
            "as torch.optim keeps it (torch.tensor(0.0))"
        )
    value = float(t)
    if not 0 <= value < float("inf"):
        raise ValueError(f"{cls}: {where} is {value}; a step count must be finite and >= 0")
    return value


def check_state_mapping(cls, state):
    """Raise TypeError unless ``state`` (what ``opt.state`` holds) is a dict."""
    if not isinstance(state, Mapping):
        raise TypeError(
            f"{cls}: opt.state is a {type(state).__name__}; it must be a dict of per-parameter dicts, as in "
            "torch.optim (opt.state = collections.defaultdict(dict) restarts every parameter's state)"
        )
