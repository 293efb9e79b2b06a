"""The per-parameter engine (``flat=False``): the same kernels, one launch per parameter, over the
caller's own tensors, with torch.optim's per-parameter state tensors."""

from collections import defaultdict
from collections.abc import Mapping

import torch

from flatopt.engines.base import Engine, trainable
from flatopt.layout import StepMeta, is_dense
from flatopt.state import check_state_mapping, check_state_tensor, step_value
from flatopt.step_graph import StepGraph


class PerParamEngine(Engine):
    def __init__(self, opt):
        super().__init__(opt)
        self.metas = {}  # parameter -> its StepMeta (a step counter on the device)
        self.step_views = {}  # parameter -> the view of its step counter put in opt.state[p]["step"]
        self.step_graph = StepGraph()
        self.build()

    def build(self):
        self.devices = list(dict.fromkeys(p.device for p in trainable(self.opt.param_groups)))

    def step(self, closure, grad_scale, found_inf):
        """Every parameter with a gradient is checked before any is stepped."""
        loss = self.run_closure(closure)
        opt = self.opt
        self.sync_state()
        with torch.no_grad():
            todo = [(gi, g, p) for gi, g in enumerate(opt.param_groups) for p in g["params"] if p.grad is not None]
            for _, group, p in todo:
                self._check(p, group)
            self.refresh_hparams()
            for gi, group, p in todo:
                meta, tensors = self._state(p, gi, group)
                opt.rule.functional(
                    *tensors, hparams=opt.hparams.on(p.device)[gi : gi + 1], meta=meta, backend=opt.backend,
                    grad_scale=None if grad_scale is None else grad_scale.to(p.device),
                    found_inf=None if found_inf is None else found_inf.to(p.device),
                )  # fmt: skip
        return loss

    def _check(self, p, group):
        """What one launch over ``p``'s own tensors needs, checked before anything is stepped."""
        opt, cls, g = self.opt, self.cls, p.grad
        if p.is_complex():  # frozen at construction (not checked then), trainable now: the constructor's refusal
            opt.check_param(p)
        if g.layout != torch.strided:
            raise RuntimeError(
                f"{cls} does not support sparse gradients: parameter {opt.names(p)} has a {g.layout} .grad; use "
                "sparse=False on the embedding (nn.Embedding(..., sparse=False)) that produces it"
            )
        if not is_dense(p):
            raise RuntimeError(  # refused at construction too (FlatOptimizer.check_param); p.data changed since
                f"{cls}(flat=False) needs dense parameters (no gaps or overlaps); {opt.names(p)} has strides "
                f"{p.stride()}: make it contiguous (p.data = p.data.contiguous())"
            )
        if g.stride() != p.stride() or g.dtype != p.dtype:
            raise RuntimeError(
                f"{cls}(flat=False): the .grad of {opt.names(p)} has strides {g.stride()} and dtype {g.dtype}, the "
                f"parameter {p.stride()} and {p.dtype}; they must match: give the gradient the parameter's layout "
                "(p.grad = torch.empty_like(p).copy_(p.grad))"
            )
        state = opt.state.get(p) or {}
        if not isinstance(state, Mapping):
            raise ValueError(
                f"{cls}: opt.state[{opt.names(p)}] is a {type(state).__name__}; a parameter's state is a dict, as in "
                "torch.optim (opt.state[p] = {} or del opt.state[p] restarts it)"
            )
        used = [n for n in opt.rule.state_names if opt.rule.uses_state(n, group)]
        managed = used + (["step"] if opt.rule.exported_step else [])
        present = [k for k in managed if state.get(k) is not None]
        missing = [k for k in managed if k not in present]
        if present and missing:
            raise ValueError(
                f"{cls}: opt.state[{opt.names(p)}] has {present} but not {missing} (torch.optim would fail on it "
                "with a KeyError); a parameter's state is complete or empty: opt.state[p] = {} or del opt.state[p] "
                "restarts it as at its first step"
            )
        if "step" in present and state["step"] is not self.step_views.get(p):
            step_value(cls, opt.names(p), state["step"])
        for name in used:
            t = state.get(name)
            if t is None:
                continue
            check_state_tensor(cls, opt.names(p), name, t, p)
            if t.stride() != p.stride():
                raise RuntimeError(
                    f"{cls}(flat=False): the state '{name}' of {opt.names(p)} has strides {t.stride()} and dtype "
                    f"{t.dtype}, the parameter {p.stride()} and {p.dtype}; they must match: load a state_dict whose "
                    "tensors have the parameters' layouts and dtypes"
                )

    def _state(self, p, gi, group):
        """``p``'s StepMeta and the flat (1-D) views of its parameter, gradient and states, creating them
        at its first step."""
        opt = self.opt
        state = opt.state.get(p) or {}  # no entry where there is no state (SGD without momentum), as in torch.optim
        meta = self.metas.get(p)
        if meta is None:
            dev = p.device
            meta = StepMeta(
                param_of_granule=torch.zeros(1, dtype=torch.int32, device=dev),
                param_group=torch.zeros(1, dtype=torch.int32, device=dev),
                steps=torch.zeros(1, dtype=torch.float32, device=dev),
                counter=torch.zeros(1, dtype=torch.int32, device=dev),
                uniform=True,
            )
            if state.get("step") is not None:
                meta.steps.fill_(float(state["step"]))
            elif any(state.get(n) is not None for n in opt.rule.state_names):
                meta.steps.fill_(1.0)
            self.metas[p] = meta
        for name in opt.rule.state_names:
            if state.get(name) is None and opt.rule.uses_state(name, group):
                state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
                meta.steps.zero_()
        if opt.rule.exported_step:
            state["step"] = self.step_views[p] = meta.steps[0]
        if state:
            opt.state[p] = state
        tensors = [p, p.grad] + [state.get(n) for n in opt.rule.state_names]
        flat = [None if t is None else t.as_strided((t.numel(),), (1,), t.storage_offset()) for t in tensors]
        return meta, flat

    def zero_grad(self, set_to_none):
        torch.optim.Optimizer.zero_grad(self.opt, set_to_none=set_to_none)

    def clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite):
        # every parameter step() steps: those with a .grad, frozen since the backward or not (torch.optim steps them)
        params = list(dict.fromkeys(p for g in self.opt.param_groups for p in g["params"] if p.grad is not None))
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)

    def host_steps(self):
        return {p: float(meta.steps[0]) for p, meta in self.metas.items()}

    def sync_state(self):
        """Forget the step counter of a parameter whose state was emptied (``opt.state.clear()``, ``del
        opt.state[p]``...) or given another ``step``: its next step starts from what ``opt.state`` holds, as
        torch.optim reads it at every step (the states themselves are the tensors in ``opt.state``)."""
        state = self.opt.state
        check_state_mapping(self.cls, state)
        names = self.opt.rule.state_names
        for p in list(self.metas):
            entry = state.get(p)
            if (
                not isinstance(entry, Mapping)
                or not any(entry.get(k) is not None for k in (*names, "step"))
                or (self.opt.rule.exported_step and entry.get("step") is not self.step_views.get(p))
            ):
                del self.metas[p]
                self.step_views.pop(p, None)

    def load(self, parsed):
        self.metas.clear()  # the loaded states carry their steps
        self.step_views.clear()
        self.opt.state = defaultdict(dict)  # a new dict, as torch.optim's load puts there; the optimizer fills it
        return set()
