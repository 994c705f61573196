"""Files in, files out: typed specs (model, system, execution), the layout
table, experiment files, and writers that never leave a half-written file.

The bottom layer: it imports nothing else of autopar.
"""
