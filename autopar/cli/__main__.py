"""``python -m autopar.cli ...`` runs the ``autopar`` command."""
import sys

from autopar.cli import entry

sys.exit(entry())
