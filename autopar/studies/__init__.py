"""Studies built on search: sampler comparisons and regret, hardware
co-design (dimensions, nested search, Pareto fronts, efficiency cliffs) and
validation against published measurements.

Imports ``autopar.io``, ``autopar.model`` and ``autopar.search``; nothing above.
"""
