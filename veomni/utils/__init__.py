"""Utilities: device and backend selection, rank-aware logging."""

from .device import get_device, get_device_type, get_dist_backend, get_nccl_backend
from .logging import get_logger

__all__ = ["get_device", "get_device_type", "get_dist_backend", "get_logger", "get_nccl_backend"]
