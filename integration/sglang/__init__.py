"""Penelope inside SGLang 0.5.23: the ``penelope`` radix-cache backend (``PenelopeRadixCache``),
phantom-request scheduler hooks and a Triton attention backend that runs phantom batches through
Penelope's ragged kernel. Importing this package imports SGLang; ``plugin.register`` is the
``sglang.srt.plugins`` entry point."""

from .keys import MatchRef
from .options import PenelopeOptions, options_from
from .plugin import register
from .radix_cache import PenelopeRadixCache, SGLangSlots

__all__ = ["MatchRef", "PenelopeOptions", "PenelopeRadixCache", "SGLangSlots", "options_from", "register"]
