"""Constrained decoding: a request's Constraint compiled for a model's tokenizer, and its per-answer matcher.

MLX-free (llguidance and numpy only): constraints compile on worker threads
(GrammarCompiler, from Engine.submit), the engine thread advances the
matcher and turns its masks into MLX arrays (engine/constrained_sampling.py).
``forced_tool_call`` builds the constraint of a tool call in a model's format.
"""

from .compiler import ConstraintError, GrammarCompiler, grammar_text
from .grammar_state import GrammarState
from .tool_call_grammar import forced_tool_call

__all__ = ["ConstraintError", "GrammarCompiler", "GrammarState", "forced_tool_call", "grammar_text"]
