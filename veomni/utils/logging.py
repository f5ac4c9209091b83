"""Rank-aware logging: rank 0 speaks at INFO, other ranks only at WARNING and above."""

import logging
import os
import sys


def get_logger(name: str = "veomni") -> logging.Logger:
    logger = logging.getLogger(name)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        rank = os.environ.get("RANK", "0")
        handler.setFormatter(
            logging.Formatter(f"[%(asctime)s rank{rank} %(levelname)s %(name)s] %(message)s", "%H:%M:%S")
        )
        logger.addHandler(handler)
        logger.setLevel(logging.INFO if rank == "0" else logging.WARNING)
        logger.propagate = False
    return logger
