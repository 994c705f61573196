"""The analytical performance model (Calculon's method), array-native.

``evaluate_columns`` (``autopar.model.evaluate``) composes the parts, one
module per concern: ``hardware`` (compute engines, memory and network
tiers), ``context`` (per-layout quantities the layers share), ``layers``,
``communication``, ``block``, ``pipeline``, ``memory`` and ``rules``.
``frame`` is the DataFrame API behind ``autopar.evaluate``.
"""
from autopar.model.evaluate import STATS, evaluate_columns, evaluate_one, reason_text
from autopar.model.hardware import MAX_TIERS
from autopar.model.rules import REASON_CODE, REASONS

__all__ = ["STATS", "REASONS", "REASON_CODE", "MAX_TIERS", "evaluate_columns",
           "evaluate_one", "reason_text"]
