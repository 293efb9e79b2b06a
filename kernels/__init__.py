"""Triton kernels of flatopt, installed as ``flatopt.kernels``: one launch steps one flat buffer."""

from .adamw import adamw_step
from .lion import lion_step
from .sgd import sgd_step

__all__ = ["adamw_step", "lion_step", "sgd_step"]
