"""Dataclass fields that carry their help text, so each config key is documented where it is defined."""

from dataclasses import field


def documented(text: str, **kwargs):
    """`field` with its help text (shown by `--help` and the README's tables)."""
    return field(metadata={"help": text}, **kwargs)
