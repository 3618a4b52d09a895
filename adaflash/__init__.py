"""AdaFlash: adaptive speculative decoding with an on-policy distilled DFlash drafter.

The package is the pure algorithm and the engine; it imports no web, database or scheduler
library. See docs/ARCHITECTURE.md for the map.
"""

__version__ = "0.1.0"
