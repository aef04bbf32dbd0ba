"""Defences against inversion (noise, quantisation, weight tying, pooling) and their utility cost."""

from defenses.base import Chain, Defense, DefenseParamError, PooledExposureError, require_per_position
from defenses.registry import DEFENSES, make_chain, make_defense

__all__ = ["Chain", "DEFENSES", "Defense", "DefenseParamError", "PooledExposureError",
           "make_chain", "make_defense", "require_per_position"]
