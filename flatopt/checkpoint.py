"""state_dict() and load_state_dict() in torch.optim's format.

A state_dict saved by flatopt loads into the matching torch.optim optimizer and the reverse:
parameters are numbered across groups in order, a parameter has state once it has been stepped,
AdamW's ``step`` is a float32 CPU tensor, SGD keeps only ``momentum_buffer`` (once the parameter was
stepped with momentum; kept through a stretch of momentum=0, and loaded then too) and Lion only
``exp_avg``. State tensors are views of the flat buffers, live like torch.optim's own state tensors.
Any other key of a parameter's ``opt.state`` entry (the caller's: ``opt.state[p]["note"] = 1``) is
exported as it is and loaded back as torch.optim loads it (a tensor cast to the parameter's device,
and dtype if the parameter is floating point), beside the states (:meth:`_cast_extra`).

With fewer bytes per parameter (:mod:`flatopt.precision`) the states are exported in the dtype they are
stored in (float32 or bfloat16: torch.optim casts them to the parameters' dtype when it loads them), and a
top-level ``"flatopt"`` entry, which torch.optim ignores, carries what torch.optim has no place for: the
options, stochastic rounding's seed, the step counts, each parameter's master copy (float32) or remainder
(int16), and 8-bit states' codes and scales (exported dequantized, as float32, in torch.optim's part), so that
flatopt resumes exactly. Loading copies every state into the optimizer's own storage: a checkpoint
never changes the dtype the states are kept in.

In in-backward mode with ``max_grad_norm`` the ``"flatopt"`` entry (then present with the default options too)
also carries, once a pass was clipped, ``"clip"``: the previous pass's total norm ``N_prev`` that the next pass
is clipped by (:mod:`flatopt.engines.backward_clip`), so that a resumed run clips as the uninterrupted one.
"""

import warnings
from collections import Counter
from copy import deepcopy
from dataclasses import dataclass

import torch

from flatopt.options import NORM_TYPES
from flatopt.precision import SEED_BOUND, join_master, split_master
from flatopt.quantize import ABSMAX, dequantize_param
from flatopt.torch_compat import is_dtensor, normal_tensors

COMPACT_KEY = "flatopt"  # the state dict's entry for what torch.optim's format has no place for


@dataclass
class GivenEntries:
    """How a param group given a parameter more than once (``[w, b, w]``) listed its parameters, which it keeps once
    (``[w, b]``): ``order`` holds the position among ``kept`` of each entry given (``[0, 1, 0]``), ``names`` the
    ``param_names`` given with them (None without names). ``group`` is the param group (identity) and ``kept`` its
    parameters then: a group whose parameters were replaced since has no entries given any more."""

    group: dict
    kept: tuple
    order: list
    names: list | None


def first_entries(order, values):
    """``values`` at the first entry of each kept position of ``order``: ``[0, 1, 0]`` keeps entries 0 and 1."""
    first = {}
    for j, value in zip(order, values):
        first.setdefault(j, value)
    return [first[j] for j in sorted(first)]


def positions(entries):
    """The position of each of ``entries`` among the distinct ones, in their order: ``[2, 1, 2]`` -> ``[0, 1, 0]``."""
    first = {}
    return [first.setdefault(k, len(first)) for k in entries]


def times(n):
    return "twice" if n == 2 else f"{n} times"


class CheckpointMixin:
    """state_dict() and load_state_dict() of :class:`flatopt.optimizer.FlatOptimizer`: torch.optim's format,
    through the optimizer's ``rule`` (which states it keeps) and ``engine`` (where they live)."""

    @normal_tensors
    def state_dict(self):
        """Returns the state of the optimizer as a dict, in torch.optim's format.

        Runs the hooks registered with ``register_state_dict_pre_hook`` before and those
        registered with ``register_state_dict_post_hook`` after, as torch.optim does (a post hook
        may return a state dict that replaces the one made).
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        self.engine.sync_state()  # edits of opt.state (a reset): the state exported is the one the next step uses
        index, groups = {}, []
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = [index.setdefault(p, len(index)) for p in group["params"]]
            given = self._given_order(group)
            if given is not None:  # a parameter given more than once: listed as often as given, as torch.optim lists it
                ids, names = packed["params"], group.get("param_names")
                packed["params"] = [ids[j] for j in given.order]
                if isinstance(names, (list, tuple)) and len(names) == len(ids):
                    same = given.names is not None and first_entries(given.order, given.names) == list(names)
                    packed["param_names"] = list(given.names) if same else [names[j] for j in given.order]
            groups.append(packed)
        state = {k: entry for k, entry in self._exported_entries(index)}
        state_dict = {"state": state, "param_groups": groups}
        clip = self._backward_clip()
        saved_clip = None if clip is None else clip.export()
        if not self.precision.default or saved_clip is not None:
            state_dict[COMPACT_KEY] = {} if self.precision.default else self._compact_state(index)
            if saved_clip is not None:  # in-backward clipping's N_prev, which the next pass is clipped by
                state_dict[COMPACT_KEY]["clip"] = saved_clip
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            hook_result = post_hook(self, state_dict)
            if hook_result is not None:
                state_dict = hook_result
        return state_dict

    def _exported_entries(self, index=None):
        """(key, entry) of each entry state_dict()'s ``"state"`` holds, in its order (``index``: {parameter: its
        index}; None: the parameters themselves as keys, for a test of whether there is any)."""
        steps = self.engine.host_steps()
        # torch.optim's step tensors: float64 under torch.set_default_dtype(torch.float64), float32 otherwise
        step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        own_keys = self._own_keys()
        # SGD's momentum buffer is exported once started (at the first step with momentum, or given), and stays through
        # a stretch of momentum=0, as torch.optim keeps it; not for a parameter only stepped with momentum=0
        unstarted = self.engine.unstarted
        for group in self.param_groups:
            for p in group["params"]:
                key = p if index is None else index[p]
                own = self.state.get(p, {})
                if p not in steps:  # never stepped by this optimizer: keep whatever was loaded
                    if own:
                        yield key, own
                    continue
                extra = {k: v for k, v in own.items() if k not in own_keys}  # the caller's keys, as they are
                # step 0 with a state that is not all zeros: a step count assigned (opt.state[p]["step"] = 0), whose
                # entry torch.optim exports with the moments it keeps
                zero = p in unstarted or (steps[p] == 0 and not self._holds_values(own))
                if zero and not self.engine.exports_unstepped:
                    if extra:  # no state yet, as in torch.optim, whose entry then holds the caller's keys only
                        yield key, extra
                    continue
                entry = {
                    n: self.engine.export_state(p, self._exported(own, n, p))
                    for n in self.rule.state_names
                    if own.get(n) is not None and p not in unstarted
                }
                if self.rule.exported_step:
                    entry = {"step": torch.tensor(steps[p], dtype=step_dtype, device="cpu"), **entry}
                entry.update(extra)
                if entry:
                    yield key, entry
        for k, v in self.state.items():  # keys that are no parameter (a hook's opt.state["test"]), as torch.optim
            if not isinstance(k, torch.Tensor):
                yield k, v

    def _holds_values(self, own):
        """Whether any of the rule's states in ``own`` (a parameter's opt.state entry) holds a value other than zero
        (a read of each, for a parameter whose step count is 0 only)."""
        return any(
            isinstance(t, torch.Tensor) and bool(t.any())
            for n in self.rule.state_names
            if (t := own.get(n)) is not None
        )

    def _has_exported_state(self):
        """Whether state_dict() would export any state: what ``bool(opt.state)`` says, as torch.optim's ``opt.state``
        is empty until a parameter's first step (see :class:`flatopt.state.OptimizerState`)."""
        return next(self._exported_entries(), None) is not None

    def _keep_given_entries(self, group):
        """Remember the entries of param group ``group``, given a parameter more than once, before the group keeps
        each parameter once (:class:`GivenEntries`): state_dict() lists the group as it was given, as torch.optim
        keeps it, so that a torch.optim optimizer built from the same list loads flatopt's state dict."""
        params, names = group["params"], group.get("param_names")
        order = positions(params)
        kept = tuple(first_entries(order, params))
        self._given_entries[id(group)] = GivenEntries(group, kept, order, None if names is None else list(names))

    def _given_order(self, group):
        """The :class:`GivenEntries` of param group ``group``, or None when it was given each parameter once (or its
        parameters were replaced since)."""
        given = self._given_entries.get(id(group))
        if given is None or given.group is not group:
            return None
        kept = group["params"]
        if len(kept) != len(given.kept) or any(p is not q for p, q in zip(kept, given.kept)):
            return None
        return given

    def _size_mismatch(self, gi, group, entries, distinct):
        """The error for loaded param group ``gi``, listing parameters ``entries`` (``distinct`` of them), that does
        not fit this optimizer's ``group``: torch.optim's message, and, where a parameter listed or given more than
        once is why, which one."""
        msg = "loaded state dict contains a parameter group that doesn't match the size of optimizer's group"
        repeated = [f"parameter {k} {times(n)}" for k, n in Counter(entries).items() if n > 1]
        given = self._given_order(group)
        if not repeated and given is None:
            return ValueError(msg)
        saved = f"param group {gi} of the state dict lists {len(entries)} entries, {distinct} distinct parameters"
        if repeated:
            saved += (
                f" ({', '.join(repeated)}: torch.optim keeps a parameter given more than once as many times, flatopt "
                "once)"
            )
        ours = f"this optimizer's param group {gi} holds {len(group['params'])} distinct parameters"
        if given is not None:
            twice = [f"{self.names(given.kept[j])} {times(n)}" for j, n in Counter(given.order).items() if n > 1]
            ours += f" (it was given {', '.join(twice)}, and keeps {'it' if len(twice) == 1 else 'each'} once)"
        return ValueError(
            f"{msg}: {saved}, and {ours}; create the optimizer from the parameter list the state dict was saved from"
        )

    @staticmethod
    def _exported(own, name, p):
        """State ``name`` of ``own`` (a parameter's ``opt.state`` entry) as torch.optim keeps it: the view itself,
        or, for 8-bit codes (``state_dtype="int8"``), their float32 values."""
        scales = own.get(name + ABSMAX)
        return own[name] if scales is None else dequantize_param(own[name], scales, p.shape, p.stride())

    def _own_keys(self):
        """The keys of a parameter's ``opt.state`` entry that are flatopt's: the rule's states (with
        ``state_dtype="int8"``, their 8-bit scales too) and ``step`` where torch.optim's state has one. Every other
        key is the caller's, carried through state dicts as torch.optim carries it."""
        rule = self.rule
        keys = set(rule.state_names) | ({"step"} if rule.exported_step else set())
        if self.precision.state_dtype == "int8":
            keys |= {n + ABSMAX for n in rule.state_names}
        return keys

    @classmethod
    def _cast_extra(cls, value, p, fused, key=None):
        """A value of a loaded parameter state under a key that is no state of the rule, as torch.optim's
        ``load_state_dict`` casts it (``Optimizer._process_value_according_to_param_policy``): a tensor goes to
        ``p``'s device, and to ``p``'s dtype when ``p`` is floating point, except one under the key ``"step"``,
        kept as it is unless its saved group is ``fused`` or capturable (then float32 on ``p``'s device); the values
        of a dict (with their keys), list, tuple or set are cast the same way; anything else is kept as it is (a
        str too, which torch.optim turns into the text of a generator). A tensor the cast did not copy is copied,
        so that the optimizer shares no storage with the state dict, as for its states."""
        if isinstance(value, torch.Tensor):
            if key == "step":
                cast = value.to(dtype=torch.float32, device=p.device) if fused else value
            elif p.is_floating_point():
                cast = value.to(dtype=p.dtype, device=p.device)
            else:
                cast = value.to(device=p.device)
            return value.clone(memory_format=torch.preserve_format) if cast is value else cast
        if isinstance(value, dict):
            return {k: cls._cast_extra(v, p, fused, k) for k, v in value.items()}
        if type(value) in (list, tuple, set, frozenset):
            return type(value)(cls._cast_extra(v, p, fused) for v in value)
        return value

    def _compact_state(self, index):
        """The ``"flatopt"`` entry of a state dict: the storage options, stochastic rounding's seed and, by
        parameter index, each parameter's master copy (float32) or remainder (int16), as live views."""
        precision = self.precision
        masters = self.engine.masters_by_param() if hasattr(self.engine, "masters_by_param") else {}
        return {
            "precision": {
                "master_weights": precision.master_weights,
                "stochastic_rounding": precision.stochastic_rounding,
                "state_dtype": None if precision.state_dtype is None else str(precision.state_dtype),
            },
            "rounding_seed": self.rounding_seed,
            "master": {index[p]: view for p, view in masters.items() if p in index},
            "codes": {index[p]: views for p, views in self._codes().items() if p in index},
            # stochastic rounding's stream advances with them, and torch.optim's SGD and Lion do not save them
            "steps": {index[p]: s for p, s in self.engine.host_steps().items() if p in index},
        }

    def _backward_clip(self):
        """In-backward clipping's running norm (:class:`flatopt.engines.backward_clip.BackwardClip`), or None
        without ``max_grad_norm`` (and in step mode)."""
        return getattr(self.engine, "clip", None)

    def _parse_clip(self, compact):
        """``N_prev`` from a state dict's ``"flatopt"`` entry, checked: (True, a one-element tensor) when this
        optimizer clips in backward by a norm of the same ``norm_type``; (True, None) when it clips and the entry
        has no N_prev (an older state dict, torch.optim's, one saved before the first stepped pass): N_prev is
        unknown, as at a run's start; (False, None) when it does not clip (N_prev is not taken)."""
        saved = compact.get("clip") if isinstance(compact, dict) else None
        what = f"loaded state dict has '{COMPACT_KEY}' 'clip'"
        if saved is not None:
            if not isinstance(saved, dict) or set(saved) != {"norm_type", "prev_norm"}:
                got = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
                raise ValueError(
                    f"{what} {got}; it is the dict state_dict() saves ({{'norm_type': float, 'prev_norm': tensor}}: "
                    "in-backward clipping's previous pass norm), or absent"
                )
            norm_type, prev = saved["norm_type"], saved["prev_norm"]
            if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or norm_type not in NORM_TYPES:
                raise ValueError(f"{what} 'norm_type' {norm_type!r}; it is one of {NORM_TYPES}")
            if not (
                isinstance(prev, torch.Tensor)
                and prev.numel() == 1
                and prev.layout == torch.strided
                and not prev.is_meta
                and prev.is_floating_point()
            ):
                got = (
                    f"a {prev.layout} {prev.dtype} tensor of shape {tuple(prev.shape)} on {prev.device}"
                    if isinstance(prev, torch.Tensor)
                    else f"a {type(prev).__name__}"
                )
                raise ValueError(
                    f"{what} 'prev_norm' as {got}; it is a one-element floating-point tensor (the previous stepped "
                    "pass's total gradient norm, saved as a float32 or float64 CPU tensor)"
                )
            value = float(prev)
            if not value >= 0:
                raise ValueError(
                    f"{what} 'prev_norm' {value}; a norm is >= 0 (inf included). A NaN norm comes from a pass whose "
                    f"gradients were not finite, which left the parameters NaN; delete state_dict['{COMPACT_KEY}']"
                    "['clip'] to load the rest with N_prev unknown, as at a run's start"
                )
        clip = self._backward_clip()
        if clip is None:
            return False, None
        if saved is None or float(saved["norm_type"]) != clip.norm_type:
            return True, None  # a norm of another order tells nothing of this one: unknown, as at a run's start
        return True, saved["prev_norm"]

    def _warn_prev_norm_dropped(self):
        """A state dict keyed by parameter names (torch.distributed.checkpoint's set_optimizer_state_dict gives one)
        and without the ``"flatopt"`` entry: torch.distributed.checkpoint carries ``"state"`` and ``"param_groups"``
        only, so N_prev, if the checkpoint was saved after a stepped pass, did not come with it."""
        warnings.warn(
            f"{type(self).__name__}(in_backward=True, max_grad_norm=...) loaded a state dict keyed by parameter names "
            f"and without its '{COMPACT_KEY}' entry, as torch.distributed.checkpoint's get_optimizer_state_dict / "
            "set_optimizer_state_dict make it: they carry only 'state' and 'param_groups', and in-backward clipping's "
            f"N_prev (the previous stepped pass's total gradient norm) lives in '{COMPACT_KEY}'. N_prev is unknown "
            "now: the next pass is clipped by its own running norm, as a run's first pass is, where the uninterrupted "
            "run would clip it by max(N_prev, its norm). To resume bit for bit, save opt.state_dict() on each rank "
            "(torch.save) and load it with opt.load_state_dict() on the same number of ranks. See docs/distributed.md, "
            "'Checkpoints'",
            stacklevel=4,
        )

    def _codes(self):
        """{parameter: {name: view}} of the 8-bit codes and scales of the parameters whose states have them."""
        codes = {}
        for p, own in self.state.items():
            if isinstance(own, dict) and any(isinstance(k, str) and k.endswith(ABSMAX) for k in own):
                names = [n for n in self.rule.state_names if n + ABSMAX in own]
                codes[p] = {k: own[k] for n in names for k in (n, n + ABSMAX)}
        return codes

    def _parse_compact(self, compact, id_map):
        """The master copies ({parameter: tensor}), the seed, the step counts ({parameter: count}) and the 8-bit
        codes and scales ({parameter: {name: tensor}}) a state dict's ``"flatopt"`` entry gives this optimizer,
        checked. Masters saved under another ``master_weights`` are not
        taken (each parameter's master starts again from the parameter), nor a seed when this optimizer does not
        round stochastically."""
        if compact is None:
            return {}, None, {}, {}
        if not isinstance(compact, dict) or not isinstance(compact.get("master", {}), dict):
            raise ValueError(
                f"loaded state dict has a '{COMPACT_KEY}' entry of type {type(compact).__name__}; it is the dict "
                "flatopt's state_dict() saves (master copies, seed), or absent"
            )
        saved = compact.get("precision") or {}
        if not isinstance(saved, dict):
            raise ValueError(
                f"loaded state dict has a '{COMPACT_KEY}' 'precision' entry of type {type(saved).__name__}; it is the "
                "dict of storage options flatopt's state_dict() saves, or absent"
            )
        seed = compact.get("rounding_seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_BOUND):
            raise ValueError(f"loaded state dict has rounding_seed {seed!r}; a seed is an int in [0, 2**31)")
        steps = compact.get("steps", {})
        if not isinstance(steps, dict) or not all(
            k in id_map and self._is_step_count(s) and float(s) >= 0 for k, s in steps.items()
        ):
            raise ValueError(
                f"loaded state dict has '{COMPACT_KEY}' step counts that are not a dict of parameter index -> count "
                ">= 0"
            )
        masters = {}
        mode, saved_mode = self.precision.master_weights, saved.get("master_weights")
        if mode and saved_mode in MASTER_DTYPES:
            kept = MASTER_DTYPES[saved_mode]
            for k, t in compact.get("master", {}).items():
                p = id_map.get(k)
                if p is None:
                    raise ValueError(f"loaded state dict has a master copy for parameter {k}, which it does not have")
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(p.shape) or t.dtype != kept:
                    what = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                    raise ValueError(
                        f"loaded state dict has a master copy for parameter {k} ({self.names(p)}) that is {what}; "
                        f"master_weights={saved_mode!r} keeps {kept} of shape {tuple(p.shape)}"
                    )
                self._check_copyable(f"a master copy for parameter {k} ({self.names(p)})", t, p)
                if saved_mode == mode:
                    masters[p] = t
                elif p.dtype == torch.bfloat16 and not is_dtensor(p):  # the other mode's form of the same master
                    masters[p] = _convert_master(t, p)
        steps = {id_map[k]: float(s) for k, s in steps.items()}
        codes = {}
        if saved.get("state_dtype") == "int8" == self.precision.state_dtype:
            ours = self._codes()
            laid = getattr(self.engine, "where", {})
            for k, saved_codes in (compact.get("codes") or {}).items():
                p = id_map.get(k)
                want = ours.get(p)
                if want is None and p is not None and p not in laid:  # frozen now, not laid out: its float values
                    continue  # (the state dict's) are kept, and quantized when it is laid out
                if want is None or not isinstance(saved_codes, dict) or set(saved_codes) != set(want):
                    raise ValueError(
                        f"loaded state dict has 8-bit codes for parameter {k} that do not fit: this optimizer keeps "
                        f"{sorted(want) if want else 'no codes'} for it; the state dict belongs to another model"
                    )
                for name, t in saved_codes.items():
                    if not isinstance(t, torch.Tensor) or t.shape != want[name].shape or t.dtype != want[name].dtype:
                        raise ValueError(
                            f"loaded state dict has 8-bit '{name}' for parameter {k} ({self.names(p)}) that is not "
                            f"{want[name].dtype} of shape {tuple(want[name].shape)}"
                        )
                    self._check_copyable(f"8-bit '{name}' for parameter {k} ({self.names(p)})", t, p)
                codes[p] = saved_codes
        return masters, seed if self.rounding_seed is not None else None, steps, codes

    def _parse_state(self, k, p, saved, group, saved_group):
        """Check one parameter's saved state against the parameter; returns (step, {name: tensor}, {key: value}),
        the last the keys that are no state of the rule (the caller's), cast as torch.optim casts them."""
        cls = type(self).__name__
        rule = self.rule
        names = [n for n in rule.state_names if rule.uses_state(n, {**group, **saved_group})]
        allowed = set(rule.state_names) | ({"step"} if rule.exported_step else set())
        if not isinstance(saved, dict):
            raise ValueError(f"loaded state dict has state {type(saved).__name__} for parameter {k}; expected a dict")
        if not saved:  # torch.optim saves {} for a parameter whose state was emptied: none, as at its first step
            return 0.0, {}, {}
        # AdamW: torch.optim's amsgrad state, which flatopt.AdamW does not implement (SGD and Lion carry it as the
        # caller's key, as torch.optim.SGD keeps any key); with 8-bit states the names their scales are kept under in
        # opt.state: refused rather than carried as the caller's keys
        scales = self._own_keys() - allowed
        amsgrad = {"max_exp_avg_sq"} if "exp_avg_sq" in rule.state_names else set()
        unexpected = sorted(set(saved) & (amsgrad | scales))
        if unexpected:
            if "max_exp_avg_sq" in unexpected:
                hint = " (amsgrad state: flatopt.AdamW does not implement amsgrad)"
            else:
                hint = " (with state_dtype='int8' opt.state keeps the 8-bit states' scales under these names)"
            raise ValueError(
                f"loaded state dict has unexpected state {unexpected} for parameter {k}{hint}; {cls} keeps "
                f"{sorted(allowed)}"
            )
        extra = {}
        fused = any(saved_group.get(flag, False) for flag in ("fused", "capturable"))  # as torch.optim reads them
        for key, value in saved.items():
            if key in allowed:
                continue
            try:
                extra[key] = self._cast_extra(value, p, fused, key)
            except Exception as e:  # whatever the value is, the load must not stop halfway through
                raise ValueError(
                    f"loaded state dict has {key!r} for parameter {k} ({self.names(p)}), which cannot be cast as "
                    f"torch.optim casts a state (to the parameter's device, {p.device}, and dtype, {p.dtype}): {e}"
                ) from e
        if not any(key in allowed for key in saved):  # only the caller's keys: no state, as at the first step
            return 0.0, {}, extra
        tensors = {}
        # the states the group uses, and any other it carries (checked all the same: torch.optim would keep it)
        for name in names + [n for n in rule.state_names if n not in names and saved.get(n) is not None]:
            t = saved.get(name)
            if t is None:
                if name == "momentum_buffer":
                    continue  # torch.optim.SGD before its first momentum step
                raise ValueError(f"loaded state dict has no '{name}' for parameter {k} ({self.names(p)})")
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(p.shape):
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(
                    f"loaded state dict has '{name}' of shape {shape} for parameter {k} ({self.names(p)}), "
                    f"whose shape is {tuple(p.shape)}; the state dict belongs to another model"
                )
            self._check_copyable(f"'{name}' for parameter {k} ({self.names(p)})", t, p)
            tensors[name] = t  # kept where the group does not use it now (SGD at momentum 0), as torch.optim keeps it
        if rule.exported_step:
            if "step" not in saved:
                raise ValueError(f"loaded state dict has no 'step' for parameter {k} ({self.names(p)})")
            step = saved["step"]
            if not self._is_step_count(step):
                if isinstance(step, torch.Tensor):
                    layout = "" if step.layout == torch.strided else f"{step.layout} "
                    what = f"a {layout}{step.dtype} tensor of shape {tuple(step.shape)} on {step.device}"
                else:
                    what = f"a {type(step).__name__}"
                raise ValueError(
                    f"loaded state dict has 'step' for parameter {k} ({self.names(p)}) as {what}; a step count is a "
                    "number or a one-element real tensor with a value, as torch.optim saves it (torch.tensor(10.0))"
                )
            step = float(step)
            if not step >= 0:
                raise ValueError(f"loaded state dict has step {step} for parameter {k}; it must be >= 0")
        else:
            step = 1.0 if tensors else 0.0
        return step, tensors, extra

    def _codes_hold(self, p, saved_codes, parsed):
        """Whether the 8-bit codes and scales ``saved_codes`` of parameter ``p`` (the ``"flatopt"`` entry's) still
        read back as the float values beside them in torch.optim's part (``parsed``: (step, {name: tensor}), or
        None): not when those values were edited, or the parameter's entry removed, after the state dict was saved.
        Where they hold, the exact codes are loaded; where not, the values are, quantized (or no state at all), as
        torch.optim would load them."""
        tensors = parsed[1] if parsed is not None else {}
        for name in self.rule.state_names:
            if name not in saved_codes:
                continue
            t = tensors.get(name)
            if t is None:
                return False
            values = dequantize_param(saved_codes[name], saved_codes[name + ABSMAX], p.shape, p.stride())
            if not torch.equal(values, t.to(values.device, torch.float32)):
                return False
        return True

    @staticmethod
    def _is_step_count(step):
        """Whether ``float(step)`` is a step count: a number, or a one-element real tensor with a value."""
        if isinstance(step, torch.Tensor):
            return step.numel() == 1 and step.layout == torch.strided and not step.is_meta and not step.is_complex()
        return isinstance(step, (int, float)) and not isinstance(step, bool)

    @staticmethod
    def _check_copyable(what, t, p):
        """Raise ValueError unless the loaded state tensor ``t`` (``what`` names it) can be copied into a state
        of parameter ``p``: dense, with values, real, and copyable to ``p``'s device and dtype (tried on one
        element, so that a failure cannot come halfway through the load)."""
        if t.layout != torch.strided or t.is_meta or t.is_complex() or t.is_quantized:
            if t.is_meta:
                kind = "on the meta device (no values: saved from a model that was not materialised)"
            elif t.layout != torch.strided:
                kind = f"as a {t.layout} tensor"
            else:
                kind = f"of dtype {t.dtype}"
            raise ValueError(
                f"loaded state dict has {what} {kind}; a state is a dense real tensor with values, like the "
                f"parameter ({p.dtype}), as torch.optim saves it"
            )
        if is_dtensor(t):  # a state sharded like its DTensor parameter: its local shard is what gets copied
            t = t.to_local()
        if t.numel():
            try:
                with torch.no_grad():
                    torch.empty((), dtype=p.dtype, device=p.device).copy_(t[(0,) * t.dim()])
            except Exception as e:  # whatever the tensor is, the load must not stop halfway through
                raise ValueError(
                    f"loaded state dict has {what} on {t.device} of dtype {t.dtype}, which cannot be copied into a "
                    f"{p.dtype} state on {p.device}: {e}"
                ) from e

    def _check_group_tensors(self, gi, saved):
        """Raise ValueError for a tensor under a loaded param group's hyper-parameter (a tensor lr, betas) that cannot
        be one: one element, real, dense, with a value. The hyper-parameters are the keys of ``defaults`` (the
        constructor's arguments, and torch.optim's flags): any other key is the caller's (a library's record of the
        group), which the optimizer does not read and keeps as it is given, whatever it holds, as torch.optim does."""
        for key, value in saved.items():
            if key not in self.defaults:
                continue
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor) and (
                    t.numel() != 1 or t.layout != torch.strided or t.is_meta or t.is_complex()
                ):
                    raise ValueError(
                        f"loaded state dict has param group {gi} '{key}' holding a {t.layout} {t.dtype} tensor of "
                        f"shape {tuple(t.shape)} on {t.device}; a hyper-parameter is a number or a one-element real "
                        "tensor with a value"
                    )

    def _load_given_names(self, group, saved, kept):
        """The ``param_names`` of loaded group ``saved``, which lists a parameter more than once (``kept``: its
        entries, each once), become those of its first entries, as the group keeps each parameter once; the names
        given with the others are exported by state_dict() where the group was given the same list."""
        entries, names = saved["params"], saved.get("param_names")
        if len(kept) == len(entries) or not isinstance(names, (list, tuple)) or len(names) != len(entries):
            return
        order = positions(entries)
        saved["param_names"] = first_entries(order, names)
        given = self._given_order(group)
        if given is not None and given.order == order:
            given.names = list(names)

    @normal_tensors
    def load_state_dict(self, state_dict):
        """Loads a state dict saved by this optimizer or by the matching torch.optim optimizer.

        Everything is checked before anything changes: a state dict that does not fit raises
        and leaves the optimizer as it was. As in torch.optim, the hooks registered with
        ``register_load_state_dict_pre_hook`` run first, on a shallow copy of ``state_dict`` (one
        may return a state dict to load instead), and those registered with
        ``register_load_state_dict_post_hook`` run once it is loaded.
        """
        state_dict = state_dict.copy()  # shallow, as torch.optim: the pre hooks may change it in place
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            hook_result = pre_hook(self, state_dict)
            if hook_result is not None:
                state_dict = hook_result
        self._load_checked(state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _load_checked(self, state_dict):
        # edits of opt.state (a reset) first, as state_dict() and step() honour them: the checks below read opt.state
        # (the 8-bit codes a parameter keeps) as the next step would find it
        self.engine.sync_state()
        groups = self.param_groups
        saved_groups = deepcopy(state_dict["param_groups"])
        if len(groups) != len(saved_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        # a parameter listed more than once (a group given it more than once, which torch.optim keeps as given) is
        # mapped from its first entry, as this optimizer keeps it once
        kept = [list(dict.fromkeys(s["params"])) for s in saved_groups]
        for gi, (group, saved, ids) in enumerate(zip(groups, saved_groups, kept)):
            if len(group["params"]) != len(ids):
                raise self._size_mismatch(gi, group, saved["params"], len(ids))
        id_map, group_of = {}, {}
        for group, saved, ids in zip(groups, saved_groups, kept):
            for k, p in zip(ids, group["params"]):
                id_map[k] = p
                group_of[k] = (group, saved)
        for gi, (group, saved) in enumerate(zip(groups, saved_groups)):
            self._check_group_tensors(gi, saved)
            self.rule.check({**group, **{k: v for k, v in saved.items() if k != "params"}, **dict(self.rule.kept_keys)})
        parsed, extra, others = {}, {}, {}
        for k, saved in state_dict["state"].items():
            if k not in id_map:
                if not isinstance(k, int):  # no parameter's (a hook's state["test"]): kept as is, as torch.optim
                    others[k] = saved
                    continue
                raise ValueError(
                    f"loaded state dict has state for parameter {k}, but the optimizer has {len(id_map)} parameters"
                )
            step, tensors, keys = self._parse_state(k, id_map[k], saved, *group_of[k])
            parsed[id_map[k]] = (step, tensors)
            if keys:
                extra[id_map[k]] = keys
        masters, seed, steps, codes = self._parse_compact(state_dict.get(COMPACT_KEY), id_map)
        codes = {p: c for p, c in codes.items() if self._codes_hold(p, c, parsed.get(p))}
        clips, prev_norm = self._parse_clip(state_dict.get(COMPACT_KEY))
        for k, p in id_map.items():  # the step counts torch.optim's format leaves out (SGD, Lion)
            if p in steps and not self.rule.exported_step:
                _, tensors = parsed.get(p, (0.0, {}))
                group = {**group_of[k][0], **group_of[k][1]}
                if tensors or not any(self.rule.uses_state(n, group) for n in self.rule.state_names):
                    parsed[p] = (steps[p], tensors)

        # Checked: now change things.
        # flags torch.optim added after an optimizer's first release, missing from an older state dict: torch.optim
        # takes the saved group and its __setstate__ fills them with their defaults, so the loaded group has them
        later = {"maximize": False, "nesterov": False, **dict(self.rule.torch_keys)}
        for group, saved, ids in zip(groups, saved_groups, kept):
            self._load_given_names(group, saved, ids)
            for key, default in later.items():
                if key in group and key not in saved:
                    saved[key] = default
            group.update({k: v for k, v in saved.items() if k != "params"})  # param_names too, as torch.optim
            group.update(self.rule.kept_keys)
        self.hparams.invalidate()
        placed = self.engine.load(parsed)  # a new opt.state, holding the parameters it placed
        self.engine.load_extra({p: keys for p, keys in extra.items() if p in placed})
        if hasattr(self.engine, "load_masters"):
            self.engine.load_masters(masters)
        with torch.no_grad():  # the exact 8-bit codes over their quantized float values
            for p, saved_codes in codes.items():
                for name, t in saved_codes.items():
                    self.state[p][name].copy_(t)
        if seed is not None:
            self.rounding_seed = seed
        if clips:
            self.engine.restore_prev_norm(prev_norm)
            if COMPACT_KEY not in state_dict and any(isinstance(k, str) for k in id_map):
                self._warn_prev_norm_dropped()
        for p, (step, tensors) in parsed.items():
            keys = extra.get(p, {})
            if p in placed or not (tensors or keys):  # nothing (saved as {}): no state, as at the first step
                continue
            # in the dtype its buffer will keep them in once it is laid out (float32 values for 8-bit states)
            kept = self.precision.of_buffer(p.dtype, small=self.precision.small(p), rule=self.rule).state_dtype
            kept = torch.float32 if kept == "int8" else kept
            own = {n: t.to(p.device, kept).clone(memory_format=torch.preserve_format) for n, t in tensors.items()}
            if tensors and self.rule.exported_step:
                own["step"] = torch.tensor(step, dtype=torch.float32, device="cpu")
            self.state[p] = {**own, **keys}
        for k, v in others.items():
            self.state[k] = v


MASTER_DTYPES = {"fp32": torch.float32, "remainder": torch.int16}  # how each master_weights mode saves a master


def _convert_master(t, p):
    """A bfloat16 parameter ``p``'s master saved in the other ``master_weights`` mode, in this one's form: a float32
    master's remainder (its low 16 bits, exact: both modes round the master to the parameter to nearest, ties away
    from zero), or the float32 master of a remainder joined with the parameter as it is now (exact when the model's
    own checkpoint was loaded first; otherwise the parameter takes over at the next step, as after any write)."""
    t = t.detach().to(p.device)
    with torch.no_grad():
        if t.dtype == torch.float32:
            return split_master(t)[1]
        return join_master(p.detach(), t)
