"""Rank-aware logging: rank 0 speaks at INFO and up; other ranks only at ERROR and up, plus the warnings that are
their own (`logger.warning(..., extra=EVERY_RANK)`: a bad record in this rank's share). A warning about the run as
a whole (a setting, a count every rank computes alike) is said once, by rank 0, not once per rank."""

import logging
import os
import sys

EVERY_RANK = {"every_rank": True}


def _said_by_this_rank(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR or getattr(record, "every_rank", False)


def get_logger(name: str = "veomni") -> logging.Logger:
    logger = logging.getLogger(name)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        rank = os.environ.get("RANK", "0")
        handler.setFormatter(
            logging.Formatter(f"[%(asctime)s rank{rank} %(levelname)s %(name)s] %(message)s", "%H:%M:%S")
        )
        if rank != "0":
            handler.addFilter(_said_by_this_rank)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO if rank == "0" else logging.WARNING)
        logger.propagate = False
    return logger
