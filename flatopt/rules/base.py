"""What every update rule holds, apart from any kernel (see :class:`Rule`), and the checks of a param
group that several rules share, in torch's words."""

from dataclasses import dataclass
from typing import Callable

import torch

from flatopt.layout import compute_dtype


@dataclass(frozen=True, eq=False)
class Rule:
    """One optimizer's update rule, apart from any kernel; ``flatopt.rules.adamw`` and its siblings hold one.

    Each param group becomes one row of a hyper-parameter table, ``[groups, num_hparams]``, float32 (float64
    for float64 buffers: see :meth:`check_table`). The Triton kernel (``flatopt.kernels``), the pure-torch
    reference (``flatopt.reference``) and the optimizer class all find a value in that row by its column
    name, at the position ``columns`` gives it.

    Args:
        name (str): the optimizer's class name, as messages say it (``"AdamW"``).
        key (str): its name in ``flatopt.functional`` (``"adamw"``).
        columns (tuple[str, ...]): the table's columns, in order; column ``"lr"`` holds 0.0 where the
            group's lr is a tensor (the optimizer copies the tensor into it on the device).
        values (Callable[[dict], dict]): a complete param group -> ``{column: value}``.
        check (Callable[[dict], None]): raises ValueError, in torch's words, for a param group the rule
            cannot step.
        math (Callable): the update in torch, on float32 tensors (float64 for float64 buffers):
            ``math(p, g, *states, steps=..., **row)`` with ``steps`` the completed steps and ``row`` every
            column by name (floats or tensors that broadcast against the data); returns the new
            ``(p, *states)`` and writes nothing. A state passed as None is returned as None.
        state_names (tuple[str, ...]): the state buffers, in the kernel's argument order.
        exported_step (bool): whether torch's state for this optimizer holds a ``step``.
        state_used (Callable[[str, dict], bool] or None): whether a param group uses a state (None: every
            group uses every state).
        check_args (Callable[[dict], None] or None): what torch checks of the constructor's arguments only
            (not of later param groups), after ``check``.
        torch_keys (tuple[tuple[str, object], ...]): the implementation keys torch.optim keeps in each param
            group (``foreach``, ``fused``, ...), with torch's defaults: carried in flatopt's groups so that code
            reading them works, and neutral for a torch.optim optimizer that loads flatopt's state dict. flatopt
            steps the same whatever they say.
        kept_keys (tuple[tuple[str, object], ...]): group keys that loading a state dict sets back to this value,
            as torch.optim's ``__setstate__`` does (AdamW's ``decoupled_weight_decay``, which an Adam state dict
            has False).
        nonnegative_states (tuple[str, ...]): the states that are never negative (AdamW's second moment): 8-bit
            storage (``state_dtype="int8"``) gives them unsigned codes (see :mod:`flatopt.quantize`).
        zeros_stay_zero (Callable[[dict], bool] or None): whether a param group's update keeps a zero parameter
            with a zero gradient and zero states at zero (None: always); where it does not (AdamW with
            ``eps=0``: 0/0), the engines zero the buffers' alignment padding after the step.
    """

    name: str
    key: str
    columns: tuple
    values: Callable
    check: Callable
    math: Callable
    state_names: tuple
    exported_step: bool = False
    state_used: Callable | None = None
    check_args: Callable | None = None
    torch_keys: tuple = ()
    kept_keys: tuple = ()
    nonnegative_states: tuple = ()
    zeros_stay_zero: Callable | None = None

    def __post_init__(self):
        if len(set(self.columns)) != len(self.columns) or "lr" not in self.columns:
            raise ValueError(f"{self.name}: columns must be distinct and include 'lr', got {self.columns}")

    @property
    def num_hparams(self):
        """The width of the hyper-parameter table."""
        return len(self.columns)

    @property
    def lr_column(self):
        """Where a tensor lr is copied into the table."""
        return self.columns.index("lr")

    @property
    def functional(self):
        """The ``flatopt.functional`` entry point that steps flat buffers with this rule."""
        from flatopt import functional  # functional -> reference -> rules: imported when asked for

        return getattr(functional, self.key)

    def row(self, group):
        """The table row of a complete param group: a list of floats in column order."""
        values = self.values(group)
        return [float(values[c]) for c in self.columns]

    def switches(self, group):
        """The group's implementation keys (``torch_keys``), which a step validates again (``check``) when they
        change, as it does when the row changes: torch.optim reads some of them at every step (AdamW's
        ``amsgrad`` and ``decoupled_weight_decay``)."""
        return tuple(group.get(k, default) for k, default in self.torch_keys)

    def uses_state(self, name, group):
        """Whether param group ``group`` uses state ``name`` (SGD without momentum has no buffer)."""
        return self.state_used is None or self.state_used(name, group)

    def named(self, table):
        """``{column: table[i]}``: the columns of a row (or of a ``[num_hparams, ...]`` tensor) by name."""
        return {c: table[i] for i, c in enumerate(self.columns)}

    def check_table(self, hparams, dtype=torch.float32):
        """Raise ValueError unless ``hparams`` is a ``[groups, num_hparams]`` table of this rule for buffers of
        ``dtype``: float64 for float64 buffers, float32 for float32, bfloat16 and float16 ones (the dtype the
        update math runs in: a float64 step reads its hyper-parameters unrounded, as torch.optim's Python
        floats are)."""
        want = compute_dtype(dtype)
        if hparams.dim() != 2 or hparams.shape[1] != self.num_hparams or hparams.dtype != want:
            raise ValueError(
                f"{self.name}'s hyper-parameter table is {str(want).removeprefix('torch.')} "
                f"[groups, {self.num_hparams}] (columns {', '.join(self.columns)}), got {hparams.dtype} of shape "
                f"{tuple(hparams.shape)}; for {dtype} buffers build it as torch.tensor(rows, dtype={want}) with "
                f"the rows of flatopt.{self.name}.rule.row(group)"
            )


def number(value, what):
    """``float(value)`` for a number (a float, an int, a 1-element tensor, a numpy scalar); a TypeError naming the
    hyper-parameter ``what`` for anything else, a string above all, which ``float()`` would parse silently where
    torch.optim fails (a hand-edited or JSON-converted checkpoint)."""
    kind = type(value)
    if hasattr(kind, "__float__") or hasattr(kind, "__index__"):
        return float(value)
    raise TypeError(f"{what} must be a number, got {kind.__name__} {value!r}")


def group_number(group, key):
    """``group[key]`` as a float (see :func:`number`)."""
    return number(group[key], key)


def lr_value(group):
    """Column ``"lr"``: the group's lr, or 0.0 where it is a tensor (copied in on the device)."""
    lr = group["lr"]
    return 0.0 if isinstance(lr, torch.Tensor) else number(lr, "lr")


def beta_values(group):
    """Columns ``beta1``, ``one_minus_beta1``, ``beta2`` and ``one_minus_beta2`` of a group's ``betas``."""
    beta1, beta2 = (number(b, f"betas[{i}]") for i, b in enumerate(group["betas"]))
    return dict(beta1=beta1, one_minus_beta1=1.0 - beta1, beta2=beta2, one_minus_beta2=1.0 - beta2)


def _below_zero(value, what, nan_ok):
    """Whether ``value`` is out of range below zero (``value < 0.0`` with ``nan_ok``, else ``not 0.0 <= value``);
    a value that cannot be compared with a float (a string from a hand-edited checkpoint) is a TypeError that
    names the hyper-parameter."""
    try:
        return (value < 0.0) if nan_ok else not 0.0 <= value
    except TypeError:
        raise TypeError(f"{what} must be a number, got {type(value).__name__} {value!r}") from None


def check_lr(lr, *, nan_ok=False):
    """A float lr >= 0 or a 1-element tensor. ``nan_ok``: compare ``lr < 0.0`` as torch.optim.SGD does,
    which lets NaN through, rather than ``not 0.0 <= lr`` (torch.optim.AdamW)."""
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if _below_zero(lr, "lr", nan_ok):
        raise ValueError(f"Invalid learning rate: {lr}")


def check_betas(betas, *, one_ok):
    """A pair of betas in [0, 1) (AdamW), or in [0, 1] with ``one_ok`` (Lion)."""
    if len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas}")
    for i, beta in enumerate(betas):
        if _below_zero(beta, f"betas[{i}]", False) or not (beta <= 1.0 if one_ok else beta < 1.0):
            raise ValueError(f"Invalid beta parameter at index {i}: {beta}")


def check_at_least_zero(group, key, what, *, nan_ok=False):
    """``group[key] >= 0``, else torch's ``Invalid {what} value: ...``; ``nan_ok`` as for check_lr."""
    value = group[key]
    if _below_zero(value, key, nan_ok):
        raise ValueError(f"Invalid {what} value: {value}")
