"""meshfl.node"""

import os

# MKL, through which torch multiplies matrices on a CPU, keeps a cache of work buffers
# for every thread that ever multiplied, and a node host runs such a thread for each of
# its nodes: memory held for nothing between rounds (docs/measurements.md, "Memory with
# a real model"). MKL reads this when torch loads it, so it is set here, before any
# node module imports torch; a value the user set stands.
os.environ.setdefault("MKL_DISABLE_FAST_MM", "1")
