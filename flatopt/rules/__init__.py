"""The update rules, apart from any kernel: each optimizer's hyper-parameter columns by name, how a param
group fills them and is checked, its states, and its math in torch. The Triton kernels, the reference and
the optimizer classes all read them from here (see :class:`flatopt.rules.base.Rule`)."""

from flatopt.rules.adamw import ADAMW
from flatopt.rules.base import Rule
from flatopt.rules.lion import LION
from flatopt.rules.sgd import SGD

__all__ = ["ADAMW", "LION", "SGD", "Rule"]
