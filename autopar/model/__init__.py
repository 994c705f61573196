"""The analytical performance model (see ``autopar.model.evaluate``)."""
from autopar.model.evaluate import *  # noqa: F401,F403
from autopar.model.evaluate import (MAX_TIERS, REASONS, STATS, evaluate_columns,  # noqa: F401
                                    evaluate_one, reason_text)
