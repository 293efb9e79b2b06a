"""flatopt: fused PyTorch optimizers over flat buffers."""

from flatopt.adamw import AdamW
from flatopt.inspection import inspect
from flatopt.layout import FlatBuffer
from flatopt.lion import Lion
from flatopt.sgd import SGD

__version__ = "0.1.0"

__all__ = ["AdamW", "SGD", "Lion", "FlatBuffer", "inspect", "__version__"]
