"""The hyper-parameter table: one row per param group, on every device the optimizer steps.

Each optimizer's rule names the columns and builds a row from a param group (see
:mod:`flatopt.rules`); the kernels and the reference read the row on the device. An LR scheduler
changes ``lr`` before every step, so the table is rebuilt on the host at each step and copied to
the device only when a row changed (asynchronously, through :class:`flatopt.staging.PinnedStaging`).
A tensor ``lr`` is a placeholder in its row and is copied on the device at every refresh.

A table is float32, the dtype of the math for float32, bfloat16 and float16 parameters, or float64 on a
device that holds float64 parameters: their math is float64 and reads the values unrounded, as torch.optim
reads its Python floats. The float32, bfloat16 and float16 buffers of such a device step with the table
rounded to float32, the values a float32 table holds (:func:`flatopt.functional.table_for`).
"""

import operator

import torch

from flatopt.staging import PinnedStaging


class HParamTable:
    """The device tables of one optimizer's hyper-parameters.

    Args:
        row (Callable[[dict], list[float]]): a param group's row.
        check (Callable[[dict], None]): validates a param group (raises ValueError).
        lr_column (int): where a tensor lr is copied into a row (default: 0)
    """

    def __init__(self, row, check, lr_column=0, switches=None):
        self.row = row
        self.check = check
        self.lr_column = lr_column
        self.switches = switches  # a param group's keys outside the row that a change of must validate too
        self.switch_rows = None
        self.tables = {}  # device -> [groups, columns], float32 or float64 (see table_dtype)
        self.dtypes = {}  # device -> the dtype of its table, found when the groups last changed
        self.rows = None  # the rows last uploaded
        self.lrs = None  # the tensor lrs (or None) the rows were last validated with, by identity
        self.staging = {}  # device -> PinnedStaging of its table

    def on(self, device):
        """The table on ``device`` (after a refresh that covered it)."""
        return self.tables[device]

    def invalidate(self):
        """The next refresh validates and uploads every row, and finds each table's dtype again (after a
        state_dict load or a re-layout)."""
        self.rows = None

    def refresh(self, groups, devices, on_change=None):
        """Copy every group's hyper-parameters into the tables on ``devices``, only when they changed.

        The rows are validated again when they change, when a group's ``switches`` change, or when a group's lr
        is replaced by another tensor (compared by identity: an in-place change of the same tensor is not
        validated, as in torch.optim); then ``on_change()`` runs (the optimizer allocates a state a group starts
        to use), before anything is uploaded. Returns whether the rows changed.
        """
        rows, tensor_lrs, lrs = [], [], []
        for gi, group in enumerate(groups):
            lr = group["lr"]
            if isinstance(lr, torch.Tensor):
                tensor_lrs.append((gi, lr))
            lrs.append(lr if isinstance(lr, torch.Tensor) else None)
            rows.append(self.row(group))
        switches = None if self.switches is None else [self.switches(group) for group in groups]
        old = self.lrs or ()
        changed = rows != self.rows or len(lrs) != len(old) or not all(map(operator.is_, lrs, old))
        changed = changed or switches != self.switch_rows
        if changed:
            for group in groups:
                self.check(group)
            if on_change is not None:
                on_change()
            if self.rows is None or len(rows) != len(self.rows):  # a re-layout, a load or a new group
                self.dtypes = {}
            shape = (len(rows), len(rows[0]))
            for device in devices:
                dtype = self.dtypes.get(device)
                if dtype is None:
                    dtype = self.dtypes[device] = table_dtype(groups, device)
                table = self.tables.get(device)
                if table is None or table.shape != shape or table.dtype != dtype:
                    table = self.tables[device] = torch.empty(shape, dtype=dtype, device=device)
                if device.type == "cuda":
                    self.staging.setdefault(device, PinnedStaging()).upload(table, rows)
                else:
                    table.copy_(torch.tensor(rows, dtype=dtype, device="cpu"))
            self.rows, self.lrs, self.switch_rows = rows, lrs, switches
        for gi, lr in tensor_lrs:
            for table in self.tables.values():
                table[gi, self.lr_column].copy_(lr.detach().reshape(()), non_blocking=True)  # no autograd history
        return changed


def table_dtype(groups, device):
    """The dtype of the table on ``device``: float64 when a float64 parameter of ``groups`` lies there (trainable
    or not, so that unfreezing one needs no new table), else float32. A walk over the parameters, made only
    when the groups change (see refresh), not at every step."""
    for group in groups:
        for p in group["params"]:
            if p.dtype == torch.float64 and p.device == device:
                return torch.float64
    return torch.float32
