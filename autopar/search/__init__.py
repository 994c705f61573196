"""Search over layouts: spaces, exhaustive enumeration, samplers, the
tuning backends (in-process Optuna, Ray Tune) and the trainable they share.

Imports ``autopar.io`` and ``autopar.model``; nothing above.  Modules are
imported on use (``autopar.search.tune``), so importing this package is light.
"""
