"""What every engine shares: the protocol the optimizer calls, and the flat layout of the parameters
and states that the flat step and in-backward engines keep.

An engine is chosen once, at construction, by :func:`flatopt.engines.make_engine`, and does one
optimizer's work behind torch.optim's interface (:class:`flatopt.optimizer.FlatOptimizer`). It
reads the optimizer's public attributes (``param_groups``, ``state``, ``rule``, ``options``,
``backend``, ``names``, ``hparams``, ``module``, ``model``, ``use_step_graph``) and writes only
``state`` (torch.optim's per-parameter dicts, as views into its buffers).
"""

import operator
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Mapping

import torch

from flatopt.bindings import FULL_CHECK_EVERY, check_data_bindings, check_own_memory, ends_bound
from flatopt.distributed import world_size
from flatopt.landing import LandingSlots
from flatopt.layout import FlatBuffer
from flatopt.precision import SEED_BOUND
from flatopt.quantize import ABSMAX, QBLOCK, quantize_into
from flatopt.state import OptimizerState, ParamState, check_state_mapping, check_state_tensor, step_value
from flatopt.step_graph import StepGraph
from flatopt.torch_compat import outside_stacklevel

MAX_MASKS = 8  # masks of parameters left out kept per buffer (see FlatEngine._set_masks), least recently used dropped


class Engine:
    """The protocol: what :class:`flatopt.optimizer.FlatOptimizer` asks of its engine."""

    buffers = ()  # the flat buffers (FlatBuffer), for capture() and flatopt.inspect()
    exports_unstepped = False  # state_dict() carries parameters not stepped yet (their zeros, step 0)
    unstarted = frozenset()  # parameters whose optional states (SGD's momentum buffer) have not started: none here
    devices = ()  # the devices of the trainable parameters

    def __init__(self, opt):
        self._opt = weakref.ref(opt)  # the optimizer holds its engine: no cycle, so `del opt` frees both at once
        self.cls = type(opt).__name__

    @property
    def opt(self):
        """The optimizer this engine works for."""
        return self._opt()

    def build(self):
        """(Re)lay out the trainable parameters: at construction and after add_param_group()."""

    def step(self, closure, grad_scale, found_inf):
        """``opt.step()`` (after torch.optim's pre-hooks); returns the closure's loss."""
        raise NotImplementedError

    @staticmethod
    def run_closure(closure):
        """``step(closure)``'s closure run with gradients enabled, as torch.optim runs it; its loss (or None)."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def zero_grad(self, set_to_none):
        raise NotImplementedError

    def clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite):
        raise NotImplementedError

    def check_bindings(self, full):
        """Raise if a parameter no longer lives where the engine laid it out."""

    def host_steps(self):
        """{parameter: completed steps} of every parameter the engine has stepped or laid out."""
        return {}

    def export_state(self, p, t):
        """A state tensor of ``p`` as ``state_dict()`` exports it."""
        return t

    def load(self, parsed):
        """Put the checked states of a state dict in place (``parsed`` is {parameter: (step, {name: tensor})}), in a
        new ``opt.state`` that holds the parameters placed; returns them."""
        raise NotImplementedError

    def load_extra(self, extra):
        """After :meth:`load`: ``extra`` ({parameter it placed: {key: value}}) holds the keys of a loaded state that
        are no state of the rule (checked and cast already); they join the parameters' ``opt.state`` entries
        beside the states, as torch.optim keeps every key of a parameter's state."""
        for p, keys in extra.items():
            self.opt.state[p].update(keys)

    def sync_state(self):
        """Bring the engine in line with ``opt.state`` after the caller edited it (reset a parameter's state,
        assigned a tensor): called where a step begins and by ``state_dict()``; raises, changing nothing,
        for an edit it cannot honour."""

    def refresh_hparams(self):
        """Bring the device tables of hyper-parameters up to date with ``param_groups``."""
        opt = self.opt
        if opt.hparams.refresh(opt.param_groups, self.devices, on_change=self.ensure_states):
            stay = opt.rule.zeros_stay_zero
            self.padding_at_risk = stay is not None and not all(stay(g) for g in opt.param_groups)

    padding_at_risk = False  # a group's update can turn the zero padding into NaN (see Rule.zeros_stay_zero)
    data_padding = ()  # views of the flat parameter buffers' alignment padding

    def keep_padding_zero(self):
        """After a step whose update can turn zeros into NaN (AdamW with eps=0): zero the parameters'
        alignment padding again (one batched op), so that it stays zero."""
        if self.padding_at_risk and self.data_padding:
            torch._foreach_zero_(self.data_padding)

    def ensure_states(self):
        """Allocate the states a group starts to use (SGD's momentum buffer once momentum is turned on)."""

    def no_step(self):
        """The context of ``opt.no_step()`` (nothing, outside in-backward mode)."""
        from contextlib import nullcontext

        return nullcontext()


SET = "set"  # Reconciled.step: at least 1 (a rule without exported step counts whether its states are set)


class Reconciled:
    """What :meth:`FlatEngine.sync_state` does to one parameter: ``reset`` its states (zeros), ``copies``
    [(state name, tensor)] into them (a state its buffer lacks is allocated first), give it ``step`` (a count, SET,
    or None: unchanged), keep ``extra`` keys."""

    __slots__ = ("p", "buf", "i", "extra", "reset", "copies", "step")

    def __init__(self, p, buf, i, extra, reset=False, copies=(), step=None):
        self.p, self.buf, self.i, self.extra = p, buf, i, extra
        self.reset, self.copies, self.step = reset, copies, step


def clip_coefficient(total, max_norm, norm_type, error_if_nonfinite):
    """``torch.nn.utils.clip_grad_norm_``'s factor for gradients of total norm ``total`` (a device tensor), after
    its check of a non-finite norm (a host sync, only with ``error_if_nonfinite``)."""
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def trainable(param_groups):
    for group in param_groups:
        for p in group["params"]:
            if p.requires_grad:
                yield p


class FlatEngine(Engine):
    """Parameters and states in flat buffers, one per (device, dtype): the layout of the flat step
    and in-backward engines, their state views, step counts, binding checks and unused-parameter
    report. Subclasses say how gradients reach a step (:meth:`detach`, :meth:`attach`, :meth:`order`)."""

    has_grad_buffer = True

    def __init__(self, opt):
        super().__init__(opt)
        self.buffers = []
        self.devices = []
        self.frozen = []  # parameters with requires_grad=False at the last layout
        self.left_out = []  # those of them not laid out (no .grad then)
        self.members = []  # per param group at the last layout: (its params list, a copy of it)
        self.removed = weakref.WeakSet()  # parameters removed from param_groups (not replaced in the module)
        self.group_states = []  # per param group: the state names it uses, as ensure_states last saw it
        # parameters of groups that leave a state unused now (SGD at momentum 0) whose state has not started:
        # torch.optim has no momentum buffer for them. Their step counts advance all the same (SGD reads them only
        # as "the buffer is set"), and go back to 0 when their group uses the state again (see ensure_states)
        self.unstarted = set()
        self.checked_steps = 0  # steps whose binding check passed (a full one every FULL_CHECK_EVERY)
        self.unused_reported = False
        self.step_graph = StepGraph()
        self.installed = None  # the OptimizerState put in opt.state (see flatopt.state)
        self.views = {}  # parameter -> {key: tensor}: what put_state placed in its opt.state entry
        self.slots = None  # parameter -> (FlatBuffer, index), for self.slots_of
        self.where = {}  # parameter -> (buffer index, index in the buffer)
        self.detached = False  # build() failed between detaching the old layout and attaching the new one
        # parameter -> its master copy (or remainder) from a load, while it is not laid out (frozen at the load): laid
        # out when it is unfrozen, and exported by state_dict() meanwhile
        self.pending_masters = {}
        self.masks = []  # per buffer: {indices of the parameters left out: uint8 mask on the device}
        self.idle_seen = set()

    # ------------------------------------------------------------------ layout
    def order(self, params, groups):
        """The order of one (device, dtype)'s parameters in its buffer (param-group order here)."""
        return params, groups

    def detach(self):
        """Before a re-layout: remove what holds on to the old buffers."""

    def attach(self, without_grad, with_grad):
        """After a layout: connect gradients to the new buffers. ``without_grad``: the parameters whose
        ``.grad`` was None before the layout (under skip_unused, they stay None); ``with_grad``: those
        that had a gradient (it was copied into the buffer)."""

    def new_buffer(self, params, groups, state_names, precision=None):
        """The FlatBuffer of one (device, dtype)'s ``params`` (in their order), before they are adopted
        (``precision``: how its states and master copy are stored, see :mod:`flatopt.precision`)."""
        grad = self.has_grad_buffer
        if grad and LandingSlots.keeps(params[0].device):  # never released: laid out as the other flat tensors
            grad = "kept"
        return FlatBuffer(params, groups, state_names, grad=grad, precision=precision)

    def adopt(self, buf):
        """Copy the parameters of a new buffer into it and make their data views of it."""
        buf.adopt()

    def release(self, p):
        """A parameter removed from the groups: give it storage of its own, off the buffers."""
        p.data = p.data.clone()
        if p.grad is not None:
            p.grad = p.grad.clone()

    def build(self):
        """(Re)lay out every trainable parameter into flat buffers, keeping values, grads and state."""
        opt = self.opt
        rule = opt.rule
        keys, members = [], {}
        placed = {p for buf in self.buffers for p in buf.params}  # laid out before: they keep their place
        for gi, group in enumerate(opt.param_groups):
            for p in group["params"]:
                # trainable, given a gradient by hand (torch.optim steps any .grad), or laid out before
                if p.requires_grad or p.grad is not None or p in placed:
                    key = (p.device, p.dtype, opt.precision.small(p))  # small: float32 states under "int8"
                    if key not in members:
                        keys.append(key)
                        members[key] = ([], [])
                    members[key][0].append(p)
                    members[key][1].append(gi)
        check_own_memory(self.cls, opt.names, [p for ps, _ in members.values() for p in ps], placed)
        old_steps = {p: float(s) for p, s in self.steps_by_param().items()}
        for ps, _ in members.values():  # one left out of the layout (frozen at a load) keeps the state loaded
            for p in ps:
                if p not in old_steps:
                    old_steps[p] = self.entry_step(p)
        old_masters = self.masters_by_param()
        self.detached = True  # until the new layout is attached: a failure in between leaves it disconnected
        self.detach()
        with_grad = [p for ps, _ in members.values() for p in ps if p.grad is not None]
        without_grad = [p for ps, _ in members.values() for p in ps if p.grad is None] if opt.skip_unused else []
        buffers = []
        for key in keys:
            params, groups = self.order(*members[key])
            used = [
                n
                for n in rule.state_names
                if any(rule.uses_state(n, opt.param_groups[g]) for g in groups)
                or any(isinstance(self.entry_of(p).get(n), torch.Tensor) for p in params if p not in placed)
            ]
            precision = opt.precision.of_buffer(key[1], small=key[2], rule=rule)
            buf = self.new_buffer(params, groups, used, precision)
            buf.ordinal = len(buffers)  # mixed into stochastic rounding's seed (see rounding_seed)
            with torch.no_grad():
                for i, p in enumerate(params):
                    for name, views in buf.state_views.items():
                        old = self.entry_of(p).get(name)
                        if not isinstance(old, torch.Tensor):
                            continue
                        if buf.quantized and old.is_floating_point() and not views[i].is_floating_point():
                            # values (a load's, while the parameter was not laid out) into 8-bit codes and scales
                            quantize_into(views[i], buf.state_views[name + ABSMAX][i], old)
                        else:
                            views[i].copy_(old)
                    buf.meta.steps[i] = old_steps.get(p, 0.0)
            self.adopt(buf)
            with torch.no_grad():  # a parameter laid out before keeps its master copy (or remainder)
                for i, p in enumerate(params):
                    old = old_masters.get(p)
                    if old is not None and buf.master is not None and old.dtype == buf.master.dtype:
                        buf.master_views[i].copy_(old)
            buffers.append(buf)
        self.buffers = buffers
        self.devices = list(dict.fromkeys(b.device for b in buffers))
        self.data_padding = [
            pad for buf in buffers for flat in (buf.data, buf.master) if flat is not None for pad in buf.padding(flat)
        ]
        held = {p for buf in buffers for p in buf.params}
        # frozen at this layout (laid out or not): one that requires grad again is laid out anew, with its hooks
        self.frozen = [p for group in opt.param_groups for p in group["params"] if not p.requires_grad]
        self.left_out = [p for p in self.frozen if p not in held]  # laid out once a .grad is put on them
        self.members = [(group["params"], list(group["params"])) for group in opt.param_groups]
        with torch.no_grad():
            for p in placed - held:  # removed from the groups: off the old buffers, which would stay alive for it
                self.removed.add(p)
                self.release(p)
                self.own_state().drop(p)  # no longer the optimizer's (torch.optim's state_dict() fails on it)
                self.views.pop(p, None)
        for buf in buffers:
            for i, p in enumerate(buf.params):
                self.put_state(p, buf, i)
            self.refresh_uniform(buf)
        opt.hparams.invalidate()
        self.step_graph = StepGraph()  # graphs of the old layout read its freed tables: never replay them
        self.where = {p: (b, i) for b, buf in enumerate(self.buffers) for i, p in enumerate(buf.params)}
        held = {q for group in opt.param_groups for q in group["params"]}
        self.pending_masters = {q: t for q, t in self.pending_masters.items() if q not in self.where and q in held}
        self.masks = [OrderedDict() for _ in self.buffers]
        self.idle_seen = set()  # buffers found with no parameter to step since the layout (see _set_masks)
        self.unstarted = {
            p
            for buf in buffers
            for p, g, s in zip(buf.params, buf.group_ids, buf.meta.steps.tolist())
            if self.leaves_unused(g) and (p in self.unstarted or s == 0)
        }
        self.attach(without_grad, with_grad)
        self.detached = False

    def entry_of(self, p):
        """``p``'s ``opt.state`` entry, or {} where there is none (or no dict)."""
        entry = self.opt.state.get(p)
        return entry if isinstance(entry, Mapping) else {}

    def entry_step(self, p):
        """The step count of ``p``, laid out for the first time, from its ``opt.state`` entry: the state that
        load_state_dict() put there while it was left out (frozen), which torch.optim goes on from; 0 without one."""
        opt = self.opt
        entry = self.entry_of(p)
        if opt.rule.exported_step:
            step = entry.get("step")
            return 0.0 if step is None else step_value(self.cls, opt.names(p), step)
        return 1.0 if any(isinstance(entry.get(n), torch.Tensor) for n in opt.rule.state_names) else 0.0

    def leaves_unused(self, g):
        """Whether param group ``g`` leaves a state of the rule unused (SGD at momentum 0), as ensure_states last
        saw it: its parameters without that state started are in ``unstarted``."""
        return g < len(self.group_states) and len(self.group_states[g]) < len(self.opt.rule.state_names)

    def members_changed(self):
        """Whether the parameters to lay out differ from the last layout's: a group's params list edited or
        replaced, or a parameter frozen at the layout that requires grad now. O(parameters) identity tests
        (what torch.optim's step does anyway), run at every step. Also after a layout that failed part way (out of
        memory), to lay them out again."""
        groups = self.opt.param_groups
        if len(groups) != len(self.members) or self.detached:
            return True
        for group, (params, copy) in zip(groups, self.members):
            now = group["params"]
            if now is not params or len(now) != len(copy) or not all(map(operator.is_, now, copy)):
                return True
        return any(p.requires_grad for p in self.frozen) or any(p.grad is not None for p in self.left_out)

    def follow_members(self):
        """Lay the parameters out again when ``param_groups`` or ``requires_grad`` say so (see members_changed),
        keeping every value, gradient and state, as torch.optim simply steps what the groups hold: a parameter
        that starts requiring grad or is appended to a group's params joins the buffers (its state starts
        empty, as in torch), one removed from a group leaves them (with its state). Checked first, changing
        nothing on error. Returns whether it laid out again."""
        if not self.members_changed():
            return False
        self.check_data_bindings(full=True)  # a parameter moved or cast meanwhile is refused, not laid out anew
        self.check_members()
        self.build()
        return True

    def check_members(self):
        """What :meth:`follow_members` checks of ``param_groups`` before it lays them out: as many groups as laid
        out, tensors only, each parameter once, a new one fit to be optimized. Raises; changes nothing but a group's
        ``params`` sequence made a list."""
        opt = self.opt
        if len(opt.param_groups) != len(self.members):
            raise RuntimeError(
                f"{self.cls}: opt.param_groups has {len(opt.param_groups)} groups, and the optimizer was laid out "
                f"for {len(self.members)}. Add a group with opt.add_param_group(); to remove one, create a new "
                "optimizer (save opt.state_dict() first and load it, without the group, to keep the state)"
            )
        laid_out = {p for buf in self.buffers for p in buf.params}
        seen = set()
        for gi, group in enumerate(opt.param_groups):
            params = group["params"]
            if not isinstance(params, list):  # a tuple or another sequence assigned by hand: torch iterates it
                params = group["params"] = list(params)
            for p in params:
                if not isinstance(p, torch.Tensor):
                    raise TypeError(
                        f"{self.cls}: param group {gi} holds a {type(p).__name__} in its params; only tensors "
                        "can be optimized"
                    )
                if p in seen:
                    raise ValueError(
                        f"{self.cls}: parameter {opt.names(p)} appears more than once in opt.param_groups' params "
                        "(torch.optim's add_param_group refuses that too); remove the repeat"
                    )
                seen.add(p)
                if p not in laid_out:  # new, or trainable since: checked as the constructor checks a trainable one
                    opt.check_param(p)

    def state_of(self, buf, i):
        """torch.optim's per-parameter state, as views into the flat buffers."""
        state = {name: views[i] for name, views in buf.state_views.items()}
        if self.opt.rule.exported_step:
            state = {"step": buf.meta.steps[i], **state}
        return state

    def put_state(self, p, buf, i, extra=None):
        """``opt.state[p]`` as views into the buffers, with ``extra``: the caller's keys that are no state of the
        rule (``opt.state[p]["note"] = 1``), kept as they are, as torch.optim keeps every key; None keeps those
        the entry holds now (a new layout, a state that starts to be used). No entry where there is none (SGD
        without momentum and no key of the caller's), as torch.optim keeps none."""
        state = self.own_state()
        views = self.state_of(buf, i)
        if extra is None:
            extra = self.extra_keys(p, state.get(p), views)
        self.views[p] = views
        if views or extra:
            state.put(p, ParamState({**views, **extra}, state.changes, p))
        else:
            state.drop(p)

    def extra_keys(self, p, entry, views):
        """The keys of ``entry`` (``p``'s ``opt.state`` entry, reconciled) that the caller put there: those that
        are neither ``views`` nor what :meth:`put_state` placed before."""
        if not isinstance(entry, Mapping):
            return {}
        placed = self.views.get(p, {})
        return {k: v for k, v in entry.items() if k not in views and k not in placed}

    def own_state(self):
        """``opt.state`` as the OptimizerState this engine keeps track of. At the first call it takes over
        torch.optim's ``defaultdict``; if the caller has put another object there since, it takes that one
        over too, with every parameter's entry to be reconciled at the next :meth:`sync_state`."""
        opt = self.opt
        state = opt.state
        if state is not self.installed:
            check_state_mapping(self.cls, state)
            replaced = self.installed is not None
            state = OptimizerState(state)
            state.changes.everything = replaced
            self.install(state)
        return state

    def install(self, state):
        """Put the OptimizerState ``state`` in ``opt.state``, as the one this engine keeps track of."""
        state.owner = self._opt  # for bool(opt.state)
        self.opt.state = self.installed = state

    def slots_of(self):
        """{parameter: (FlatBuffer, its index there)} of the current layout."""
        if self.slots is None or self.slots[0] is not self.buffers:
            self.slots = (self.buffers, {p: (buf, i) for buf in self.buffers for i, p in enumerate(buf.params)})
        return self.slots[1]

    def sync_state(self):
        """Reconcile the buffers with the edits made to ``opt.state`` since the last call, as torch.optim,
        which reads ``opt.state`` at every step, would see them:

        * a parameter whose entry was deleted or emptied (``opt.state.clear()``, ``opt.state[p] = {}``, ``del
          opt.state[p]``, ``opt.state = defaultdict(dict)``) starts again as at its first step: step count 0,
          zero moments;
        * a tensor assigned to a state (``opt.state[p]["exp_avg"] = t``) is copied into the buffer, and a
          ``step`` assigned becomes the step count; the entry then holds the buffer's views again.

        Everything is checked before anything changes: an entry that lacks some of the states (torch.optim
        fails on it with a KeyError), or a tensor of another shape, dtype or device, raises ValueError naming
        the parameter and the key. O(1) when nothing was edited: an identity check of ``opt.state`` and a flag.
        """
        state = self.opt.state
        for buf in self.buffers:  # opt.state[p]["step"] written in place: the counts may differ within a buffer now
            if buf.meta.steps._version != buf.meta.steps_version:
                self.refresh_uniform(buf)
        if state is self.installed and not state.changes:
            return
        self.reconcile(state)

    def reconcile(self, state):
        """:meth:`sync_state`'s work, once ``opt.state`` was edited or replaced."""
        cls = self.cls
        check_state_mapping(cls, state)
        slots = self.slots_of()
        everything = state is not self.installed or state.changes.everything
        todo = list(slots) if everything else [p for p in state.changes.params if p in slots]
        plan = [self.plan_entry(state, p, *slots[p]) for p in todo]  # checked; nothing changed yet

        # Now change things. A tensor read from a state buffer is copied first (states swapped between parameters).
        storages = {t.untyped_storage().data_ptr() for buf in self.buffers for t in buf.states.values()}
        steps = {}  # FlatBuffer -> {index: new step count, or SET}
        with torch.no_grad():
            grown = {}  # a buffer given a state it did not hold (SGD's momentum buffer assigned at momentum 0)
            for e in plan:
                for k, _ in e.copies:
                    if k not in e.buf.state_views:
                        e.buf.add_state(k)
                        grown[id(e.buf)] = e.buf
            copies = [
                (e.buf.state_views[k][e.i], v.clone() if v.untyped_storage().data_ptr() in storages else v)
                for e in plan
                for k, v in e.copies
            ]
            for view, v in copies:
                view.copy_(v)
            for e in plan:
                if e.reset:
                    for views in e.buf.state_views.values():
                        views[e.i].zero_()
                    if self.leaves_unused(e.buf.group_ids[e.i]):
                        self.unstarted.add(e.p)
                if e.step is not None:
                    steps.setdefault(e.buf, {})[e.i] = e.step
                if e.copies:  # a state given is started
                    self.unstarted.discard(e.p)
            for buf, new in steps.items():
                if SET in new.values():  # keep a step count that is above 0 already
                    host = buf.meta.steps.tolist()
                    new = {i: max(host[i], 1.0) if s is SET else s for i, s in new.items()}
                index = torch.tensor(list(new), dtype=torch.long, device=buf.device)
                buf.meta.steps[index] = torch.tensor(list(new.values()), dtype=torch.float32).to(buf.device)
                self.refresh_uniform(buf)
        if state is not self.installed:  # keep what is no laid-out parameter's state (a hook's opt.state["test"])
            kept = OptimizerState()
            for k, v in state.items():
                if k not in slots:
                    kept.put(k, v)
            self.install(kept)
        for buf in grown.values():  # the other parameters' entries show the new state's views too
            for i, p in enumerate(buf.params):
                self.put_state(p, buf, i)
        for e in plan:
            self.put_state(e.p, e.buf, e.i, e.extra)
        self.installed.changes.reset()

    def plan_entry(self, state, p, buf, i):
        """What reconciling ``p`` (parameter ``i`` of ``buf``) with its ``opt.state`` entry does, checked."""
        opt, cls = self.opt, self.cls
        entry = state.get(p)
        if entry is None:
            entry = {}
        if not isinstance(entry, Mapping):
            raise ValueError(
                f"{cls}: opt.state[{opt.names(p)}] is a {type(entry).__name__}; a parameter's state is a dict, as "
                "in torch.optim (opt.state[p] = {} or del opt.state[p] restarts it)"
            )
        # the rule's states whether the buffer holds them or not: SGD's momentum buffer assigned at momentum 0 is kept
        managed = list(dict.fromkeys([*buf.state_views, *opt.rule.state_names])) + (
            ["step"] if opt.rule.exported_step else []
        )
        present = [k for k in managed if entry.get(k) is not None]
        extra = {k: v for k, v in entry.items() if k not in managed}
        if not present:  # torch.optim's lazy initialisation: as at the first step
            return Reconciled(p, buf, i, extra, reset=True, step=0.0)
        missing = [k for k in managed if k not in present]
        if missing:
            raise ValueError(
                f"{cls}: opt.state[{opt.names(p)}] has {present} but not {missing} (torch.optim would fail on it "
                "with a KeyError); a parameter's state is complete or empty: opt.state[p] = {} or del opt.state[p] "
                "restarts it as at its first step"
            )
        views = self.views.get(p, {})
        copies, step = [], None
        for k in present:
            v = entry[k]
            if v is views.get(k):
                continue
            if buf.quantized and k != "step":
                raise ValueError(
                    f"{cls}: opt.state[{opt.names(p)}][{k!r}] was replaced, and with state_dtype='int8' the entries "
                    "are views of the 8-bit codes and scales, which a tensor cannot be copied into as it is. Load "
                    "states with opt.load_state_dict() (it quantizes them), or restart the parameter's state with "
                    "opt.state[p] = {}"
                )
            if k == "step":
                step = step_value(cls, opt.names(p), v)
            else:
                check_state_tensor(cls, opt.names(p), k, v, p, buf.state_dtype)
                copies.append((k, v))
        if copies and not opt.rule.exported_step:
            step = SET  # a state given is set (SGD's momentum buffer: not taken from the next gradient)
        return Reconciled(p, buf, i, extra, copies=copies, step=step)

    def masters_by_param(self):
        """{parameter: its view of the master buffer} of the laid-out parameters of buffers that have one, and the
        masters a load gave parameters not laid out (frozen at the load)."""
        laid = {
            p: buf.master_views[i] for buf in self.buffers if buf.master is not None for i, p in enumerate(buf.params)
        }
        return {**self.pending_masters, **laid} if self.pending_masters else laid

    def rounding_seed(self, buf):
        """Stochastic rounding's seed for ``buf`` (None: it rounds to nearest): the optimizer's, mixed with the
        buffer's place so that two buffers draw different bits."""
        seed = self.opt.rounding_seed
        if not buf.stochastic or seed is None:
            return None
        return (seed + 0x9E3779B9 * buf.ordinal) % SEED_BOUND

    def steps_by_param(self):
        """Each laid-out parameter's step count, after the edits made to ``opt.state`` (see :meth:`sync_state`)."""
        self.sync_state()
        return {p: buf.meta.steps[i] for buf in self.buffers for i, p in enumerate(buf.params)}

    def host_steps(self):
        """Completed steps of every laid-out parameter, read with one copy per buffer."""
        steps = {}
        for buf in self.buffers:
            steps.update(zip(buf.params, buf.meta.steps.tolist()))
        return steps

    def refresh_uniform(self, buf):
        """Whether ``buf`` launches UNIFORM (one group, equal step counts); a step with a mask of parameters
        left out launches otherwise (see _set_masks)."""
        steps = buf.meta.steps
        buf.meta.uniform = len(set(buf.group_ids)) == 1 and bool((steps == steps[0]).all())
        buf.meta.steps_version = steps._version

    def steps_written(self):
        """Whether the caller wrote a step count in place since the engine last looked (see StepMeta.steps_version):
        one integer compared per buffer."""
        return any(b.meta.steps._version != b.meta.steps_version for b in self.buffers)

    def ensure_states(self):
        """Allocate a state buffer that a group needs now but did not at construction (SGD's momentum buffer once a
        scheduler turns momentum on), and keep track of which parameters have their state started, as torch.optim,
        which gives a parameter its momentum buffer at its first step with momentum and keeps it through a stretch
        of momentum=0: when a group stops using a state, its parameters not stepped yet (step count 0) join
        ``unstarted``; when it uses the state again, those of ``unstarted`` start as at a first step (their step
        counts go to 0: SGD's next step sets the buffer to the update) and the others go on from their buffer.
        AdamW and Lion use every state in every group, so none of this happens to them. Called when a group's
        hyper-parameters change (and at a load): O(groups) per buffer, more only where a group switches."""
        opt = self.opt
        rule = opt.rule
        everything = set(rule.state_names)
        before = self.group_states
        used_by_group = [{n for n in rule.state_names if rule.uses_state(n, group)} for group in opt.param_groups]
        starting = {g for g, used in enumerate(used_by_group) if g < len(before) and used - before[g]}
        stopping = {
            g for g, used in enumerate(used_by_group) if used != everything and (g >= len(before) or before[g] - used)
        }
        self.group_states = used_by_group
        for buf in self.buffers:
            missing = [
                n for n in rule.state_names if n not in buf.states and any(n in used_by_group[g] for g in buf.group_set)
            ]
            for name in missing:
                buf.add_state(name)
            first = []
            if (starting | stopping) & buf.group_set:
                steps = buf.meta.steps.tolist()
                for i, (p, g) in enumerate(zip(buf.params, buf.group_ids)):
                    if g in starting and p in self.unstarted:
                        self.unstarted.discard(p)
                        first.append(i)
                    elif g in stopping and steps[i] == 0:
                        self.unstarted.add(p)
            if first:
                buf.meta.steps[first] = 0.0
            if missing:
                for i, p in enumerate(buf.params):
                    self.put_state(p, buf, i)
            if missing or first:
                self.refresh_uniform(buf)

    def load(self, parsed):
        """Put the checked states of a state dict into the buffers (zeroes for a parameter without state), in a
        new ``opt.state`` of views, as torch.optim puts a new dict there; returns the parameters it placed."""
        placed = set()
        with torch.no_grad():
            self.ensure_states()
            for buf in self.buffers:  # a state given for a group that does not use it now (SGD at momentum 0) is kept
                given = {n for p in buf.params for n in parsed.get(p, (0.0, {}))[1]}
                for name in self.opt.rule.state_names:
                    if name in given and name not in buf.states:
                        buf.add_state(name)
            self.unstarted = set()
            for buf in self.buffers:
                steps = []
                for i, p in enumerate(buf.params):
                    placed.add(p)
                    step, tensors = parsed.get(p, (0.0, {}))
                    for name, views in buf.state_views.items():
                        if name in tensors and buf.quantized:
                            quantize_into(views[i], buf.state_views[name + ABSMAX][i], tensors[name])
                        elif name in tensors:
                            views[i].copy_(tensors[name])
                        elif not (buf.quantized and name.endswith(ABSMAX) and name[: -len(ABSMAX)] in tensors):
                            views[i].zero_()
                    steps.append(step)
                    if self.leaves_unused(buf.group_ids[i]) and not tensors:
                        self.unstarted.add(p)
                buf.meta.steps.copy_(torch.tensor(steps, dtype=torch.float32, device="cpu"))
                self.refresh_uniform(buf)
        self.install(OptimizerState())
        for buf in self.buffers:
            for i, p in enumerate(buf.params):
                self.put_state(p, buf, i)
        return placed

    def load_extra(self, extra):
        slots = self.slots_of()
        for p, keys in extra.items():
            self.put_state(p, *slots[p], keys)

    def _set_masks(self, without, on_new=None):
        """torch.optim's rule (``skip_unused=True``): the parameters whose ``.grad`` is None (``without``: the
        settling plan's (parameter, view) pairs to zero) are not stepped. A buffer whose parameters all have a
        gradient launches with no mask, as it would without the rule; one with parameters left out launches
        with a uint8 mask that is uploaded once per pattern and kept (a few per buffer), so a loop with the
        same unused parameters at every step replays its step graph too. ``on_new()`` runs first when the pattern
        is new (a mask not kept, a buffer idle for the first time). Returns the indices of the buffers with no
        parameter to step."""
        left_out = {}
        for p, _ in without:
            b, i = self.where[p]
            left_out.setdefault(b, []).append(i)
        idle, keys = set(), {}
        for b, off in left_out.items():
            if len(off) == len(self.buffers[b].params):
                idle.add(b)
            else:
                keys[b] = tuple(sorted(off))
        if on_new is not None and (not idle <= self.idle_seen or any(k not in self.masks[b] for b, k in keys.items())):
            on_new()  # a pattern not seen before (raises, changing nothing)
            self.idle_seen |= idle
        for b, buf in enumerate(self.buffers):
            if b in idle:
                continue
            key = keys.get(b)
            if key is None:
                buf.meta.active = None
            else:
                buf.meta.active = self._mask(b, key)
                buf.meta.uniform = False  # their step counts fall behind the others' from now on
        return idle

    def _mask(self, b, off):
        """The device mask of buffer ``b`` with the parameters at indices ``off`` left out."""
        cache = self.masks[b]
        mask = cache.get(off)
        if mask is not None:
            cache.move_to_end(off)
            return mask
        buf = self.buffers[b]
        if buf.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            names = self.opt.names.of([buf.params[i] for i in off])
            raise RuntimeError(
                f"{self.cls}: a captured step left out parameters whose .grad is None ({names}) in a pattern the "
                "warm-up steps did not show, and its mask cannot be uploaded while a CUDA graph is recorded. Make "
                "train_step give the same parameters a gradient at every call, or set requires_grad=False on those "
                "it does not train"
            )
        host = torch.ones(len(buf.params), dtype=torch.uint8, device="cpu")
        host[list(off)] = 0
        cache[off] = mask = host.to(buf.device, non_blocking=True)
        while len(cache) > MAX_MASKS:
            cache.popitem(last=False)
        return mask

    def load_masters(self, masters):
        """After a load: each parameter's master copy (or remainder) from ``masters`` ({parameter: tensor}), or,
        for a parameter it does not hold, started again from the parameter (float32 copy, zero remainder)."""
        # a parameter not laid out keeps its master until it is (see build)
        self.pending_masters = {p: t.detach().clone() for p, t in masters.items() if p not in self.where}
        with torch.no_grad():
            for buf in self.buffers:
                if buf.master is None:
                    continue
                for i, p in enumerate(buf.params):
                    view, saved = buf.master_views[i], masters.get(p)
                    if saved is not None:
                        view.copy_(saved)
                    elif buf.master.dtype == torch.float32:
                        view.copy_(buf.data_views[i])
                    else:
                        view.zero_()

    # ------------------------------------------------------------------ checks
    def ends_bound(self):
        return ends_bound(self.buffers)

    def check_data_bindings(self, full):
        opt = self.opt
        module = opt.module() if full and opt.module is not None else None
        check_data_bindings(
            self.cls, self.buffers, opt.names, full=full, frozen=self.frozen, removed=self.removed,
            skip_unused=opt.skip_unused,
            module=module,
        )  # fmt: skip

    def frozen_since(self):
        """With ``skip_unused=False``, whether a parameter laid out has ``requires_grad=False`` now: it would be
        stepped with a zero gradient, which the binding check refuses. A look at every parameter, made at every step
        (and pass) with that option only."""
        return not self.opt.skip_unused and not all(p.requires_grad for b in self.buffers for p in b.params)

    def full_check_due(self):
        """Whether this step's binding check looks at every parameter: at the first step, and every
        FULL_CHECK_EVERY-th after it."""
        return not self.unused_reported or self.checked_steps % FULL_CHECK_EVERY == 0

    def warn_unused(self, unused):
        """Name the parameters that received no gradient before the first step (called once), at the
        caller's line (``opt.step()``, or ``loss.backward()`` in in-backward mode)."""
        opt = self.opt
        names = opt.names.of(unused)
        action = (
            "does not step them (no weight decay, no state update), as torch.optim does not; set "
            "requires_grad=False on parameters you do not train"
            if opt.skip_unused
            else "steps them with a zero gradient (skip_unused=False: weight decay and state decay apply, as in "
            "torch.optim after zero_grad(set_to_none=False)); drop skip_unused=False to leave them untouched as "
            "torch.optim does, or set requires_grad=False on parameters you do not train"
        )
        ranks = world_size()
        where = "" if ranks == 1 else f" from this rank's backward pass (one of {ranks} ranks)"
        ddp = (
            ""
            if ranks == 1
            else ". Under DistributedDataParallel a parameter another rank used gets the averaged gradient from DDP "
            "and is stepped with it; this concerns those no rank used"
        )
        warnings.warn(
            f"{self.cls}: {len(unused)} parameter(s) received no gradient{where} before the first "
            f"step: {names}. flatopt {action}{ddp}",
            stacklevel=outside_stacklevel(),
        )

    def launch(self, buf, grad, *, hparams, meta, grad_scale=None, found_inf=None, sources=None, span=None):
        """One kernel launch of the optimizer's rule over ``buf`` (its elements ``span`` = (start, end), or
        all of them) with the gradient ``grad``."""
        opt = self.opt
        data, master, states = buf.data, buf.master, [buf.states.get(n) for n in opt.rule.state_names]
        scales = [buf.states.get(n + ABSMAX) for n in opt.rule.state_names] if buf.quantized else None
        s = 0
        if span is not None:
            s, e = span
            data, states = data[s:e], [None if t is None else t[s:e] for t in states]
            master = None if master is None else master[s:e]
            if scales is not None:
                scales = [None if t is None else t[s // QBLOCK : e // QBLOCK] for t in scales]
        opt.rule.functional(
            data, grad, *states, hparams=hparams, meta=meta, backend=opt.backend,
            grad_scale=None if grad_scale is None else grad_scale.to(buf.device),
            found_inf=None if found_inf is None else found_inf.to(buf.device),
            sources=sources, master=master, rounding_seed=self.rounding_seed(buf), rng_base=s, scales=scales,
        )  # fmt: skip
