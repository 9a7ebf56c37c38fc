"""Models written against the neutral ops: the GPT (and its presets)."""

from .gpt import GPT, GPTConfig, Norm, Positions, PRESETS, rotary_tables

__all__ = ["GPT", "GPTConfig", "Norm", "Positions", "PRESETS", "rotary_tables"]
