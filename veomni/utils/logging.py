"""Rank-aware logging: rank 0 speaks at INFO and up; other ranks only at ERROR and up, plus the warnings that are
their own (`logger.warning(..., extra=EVERY_RANK)`: a bad record in this rank's share). A warning about the run as
a whole (a setting, a count every rank computes alike) is said once, by rank 0, not once per rank."""

import logging
import os
import sys

EVERY_RANK = {"every_rank": True}


def _said_by_this_rank(record: logging.LogRecord) -> bool:
    """Decided when the record is emitted, not when the logger was made: a module first imported while RANK named
    another rank (a planner's fake world, a test) must not stay quiet on rank 0 for the rest of the process. Stamps
    the record with the rank the format names."""
    record.rank = os.environ.get("RANK", "0")
    return (
        record.rank == "0"
        or record.levelno >= logging.ERROR
        or (record.levelno >= logging.WARNING and getattr(record, "every_rank", False))
    )


def get_logger(name: str = "veomni") -> logging.Logger:
    logger = logging.getLogger(name)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(
            logging.Formatter("[%(asctime)s rank%(rank)s %(levelname)s %(name)s] %(message)s", "%H:%M:%S")
        )
        handler.addFilter(_said_by_this_rank)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger
