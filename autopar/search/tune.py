"""Sampled search: ``tune(case, space, options)`` runs a sampler over a space
and returns its trials.

``tune`` takes typed specs: a ``Case`` (``make_case``), a ``Space``
(``autopar.search.space.load_space``) and ``TuneOptions`` (``tune_options``
checks keyword arguments once and builds them; experiment files are checked
by ``autopar.io.experiment``).  ``tune_arguments`` is the same search from
files, dicts or specs and keywords (``autopar.tune``).  How trials run is a
backend's (``autopar.search.backends``); what is proposed, a sampler's
(``autopar.search.samplers``).

Each trial is one layout, evaluated by the analytical model (see
``autopar.search.trainable``).  A trial ends ``COMPLETE`` (the layout runs; its
``sample_rate`` is the objective, maximised) or ``PRUNED`` (invalid or
infeasible: ``feasible`` is False and ``reason`` says why) -- never as an
error and never as the best.

Backends:

``optuna`` (default)
    An Optuna study in this process: the fastest on one machine.  With
    ``storage`` (any Optuna storage URL, e.g. ``sqlite:///tune.db``) the study
    is kept there, optuna-dashboard can open it, and running the same command
    again resumes it until it holds ``trials`` finished trials (one process
    per study: trials a killed run left RUNNING are marked FAIL and left out;
    SQLite runs in WAL mode).  With ``concurrency`` C, C trials are asked at
    once and evaluated by the model in one vectorised call (random at 1,000
    trials: 82 trials/s alone, 448 with C=32).  The same seed gives the same
    trials.
``ray``
    A Ray Tune ``Tuner`` with the model as a function trainable
    (``autopar.search.trainable.layout_trainable``): a local Ray (loopback only, no
    dashboard) unless ``address`` names a cluster.

Samplers and encodings: see ``autopar.search.samplers`` and ``autopar.search.encodings``.

The table (``TRIAL_COLUMNS``, one row per finished trial, in trial order):
``trial`` (the Optuna trial number; on Ray, the order trials were created),
``state, feasible, reason, sample_rate``, the breakdown (total_time,
memory per tier, efficiencies), the 23 execution fields of the layout,
``node_id`` (the Ray node that ran it; empty on the optuna backend) and
``elapsed_s`` (seconds from the start of the search to the trial's end).
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Callable, Mapping

from autopar.io.experiment import (BACKENDS, DEFAULT_SAMPLER,  # noqa: F401  (file vocabulary)
                                   DEFAULT_SPACE)
from autopar.io.layouts import ALL_FIELDS, execution_from_row
from autopar.io.specs import SpecError
from autopar.search import samplers
from autopar.search.backends import optuna_loop
from autopar.search.backends.shared_study import removed_on_failure, sqlite_file
from autopar.search.encodings import ENCODINGS
from autopar.search.trial_rows import BREAKDOWN, METRIC

TRIAL_COLUMNS: tuple[str, ...] = (
    "trial", "state", "feasible", "reason", METRIC, *BREAKDOWN, *ALL_FIELDS,
    "node_id", "elapsed_s", "layouts",
)
SOURCE = "arguments"     # SpecError source for bad arguments


# --------------------------------------------------------------------------
# Arguments

def _bad(field: str, message: str):
    raise SpecError(SOURCE, field, message)


def _int(name: str, v, minimum: int, optional: bool = False):
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        _bad(name, f"expected an integer >= {minimum}, got {v!r}")
    return int(v)


def _choice(name: str, v, options) -> str:
    if v not in options:
        _bad(name, f"expected one of {', '.join(options)}, got {v!r}")
    return v


def make_case(model, system, num_procs, max_batch_size, datatype, batch_policy=None,
              training=True):
    """Files, dicts or specs -> a validated ``autopar.search.space.Case``."""
    from autopar.search.space import Case
    from autopar.io.specs import load_model, load_system
    m, s = load_model(model), load_system(system)
    num_procs = _int("num_procs", num_procs, 1)
    max_batch_size = _int("max_batch_size", max_batch_size, 1)
    if datatype not in s.datatypes:
        raise SpecError(s.source, "datatype",
                        f"{datatype!r} is not supported by this system "
                        f"(supported: {', '.join(s.datatypes)})")
    return Case(model=m, system=s, num_procs=num_procs, max_batch_size=max_batch_size,
                datatype=datatype, batch_policy=batch_policy, training=training)


# --------------------------------------------------------------------------
# The options

@dataclass(frozen=True)
class TuneOptions:
    """How a search runs: everything but the case and the space, checked
    (``tune_options``).  ``choice``: the sampler (``samplers.Choice``);
    ``encoding``: how it sees the space (None: the sampler's default).
    Backend optuna: ``storage`` (an Optuna storage URL; None: in memory),
    ``study_name``, ``return_study``.  Backend ray: ``address``,
    ``storage_path``/``name`` (where the experiment is kept),
    ``max_failures``, ``on_start(path)``."""
    choice: samplers.Choice
    trials: int = 100
    backend: str = "optuna"
    seed: int | None = None
    encoding: str | None = None
    concurrency: int | None = None
    progress: bool | None = None
    storage: str | None = None
    study_name: str | None = None
    return_study: bool = False
    address: str | None = None
    storage_path: str | None = None
    name: str | None = None
    max_failures: int = 3
    on_start: Callable | None = None


def tune_options(sampler: str = DEFAULT_SAMPLER, trials: int = 100, *, backend: str = "optuna",
                 seed: int | None = None, storage: str | None = None,
                 address: str | None = None, concurrency: int | None = None,
                 encoding: str | None = None, progress: bool | None = None,
                 study_name: str | None = None, storage_path: str | None = None,
                 name: str | None = None, max_failures: int = 3, on_start=None,
                 return_study: bool = False) -> TuneOptions:
    """Keyword arguments -> checked ``TuneOptions``; bad ones raise
    ``SpecError("arguments", name, ...)``."""
    choice = samplers.parse(sampler, SOURCE, "sampler")
    backend = _choice("backend", backend, BACKENDS)
    trials = _int("trials", trials, 1)
    seed = _int("seed", seed, 0, optional=True)
    if seed is not None and seed > 2 ** 32 - 1:
        _bad("seed", f"must be between 0 and 2**32-1 (the samplers' seeds), got {seed}")
    concurrency = _int("concurrency", concurrency, 1, optional=True)
    encoding = _choice("encoding", encoding or choice.default_encoding(), ENCODINGS)
    if why := choice.sampler.refuses(encoding):
        _bad("encoding", why)
    if why := choice.sampler.missing():
        _bad("sampler", why)
    if backend == "optuna" and address:
        _bad("address", "a Ray address needs backend ray")
    if backend == "ray" and storage:
        _bad("storage", "an Optuna storage needs backend optuna")
    if backend == "optuna" and storage_path:
        _bad("storage_path", "a Ray Tune storage path needs backend ray "
                             "(backend optuna keeps its study in storage)")
    max_failures = _int("max_failures", max_failures, 0)
    if return_study and backend != "optuna":
        _bad("return_study", "only backend optuna has an Optuna study to return")
    return TuneOptions(choice=choice, trials=trials, backend=backend, seed=seed,
                       encoding=encoding, concurrency=concurrency, progress=progress,
                       storage=storage, study_name=study_name, return_study=return_study,
                       address=address, storage_path=storage_path, name=name,
                       max_failures=max_failures, on_start=on_start)


# --------------------------------------------------------------------------
# The search

def tune_arguments(model, system, num_procs: int, max_batch_size: int, datatype: str,
                   sampler: str = DEFAULT_SAMPLER, trials: int = 100, *, space=DEFAULT_SPACE,
                   backend: str = "optuna", seed: int | None = None, storage: str | None = None,
                   address: str | None = None, concurrency: int | None = None,
                   encoding: str | None = None, progress: bool | None = None,
                   study_name: str | None = None, batch_policy: str | None = None,
                   training: bool = True, storage_path: str | None = None,
                   name: str | None = None, max_failures: int = 3, on_start=None,
                   return_study: bool = False):
    """``tune`` from arguments (``autopar.tune``): ``model``/``system`` file
    paths, dicts (Calculon JSON) or specs; ``space`` a space file, a name
    under ``search_spaces/``, a dict or a Space; the options as keywords
    (``tune_options``).  Bad arguments raise ``autopar.io.specs.SpecError``."""
    from autopar.search.space import load_space
    options = tune_options(sampler, trials, backend=backend, seed=seed, storage=storage,
                           address=address, concurrency=concurrency, encoding=encoding,
                           progress=progress, study_name=study_name,
                           storage_path=storage_path, name=name, max_failures=max_failures,
                           on_start=on_start, return_study=return_study)
    case = make_case(model, system, num_procs, max_batch_size, datatype, batch_policy, training)
    return tune(case, load_space(space), options)


def tune(case, space, options: TuneOptions):
    """Search layouts of ``case`` (an ``autopar.search.space.Case``) in
    ``space`` (a ``Space``) as ``options`` say; returns the trials.

    ``options.progress``: a progress bar on stderr (None: when stderr is a
    terminal).  Returns a pandas DataFrame with ``TRIAL_COLUMNS``; backend
    optuna: its ``attrs`` hold ``study_name`` and ``new_trials`` (0 when a
    rerun of a finished study had nothing to do), and with
    ``return_study`` the result is ``(table, study)`` (the ``optuna.Study``).
    A space with no layout for the case, or no skeleton for a skeleton
    search, raises ``SpecError`` naming the space.
    """
    from autopar.search.skeleton import DEFAULT_BATCH
    from autopar.search.trainable import make_problem

    o, choice = options, options.choice
    trials, concurrency = o.trials, o.concurrency
    encoding = o.encoding or choice.default_encoding()
    size = space.size(case)
    if size == 0:
        raise SpecError(space.source, "space", "has no layout for this case "
                        f"({case.num_procs} procs, batch {case.max_batch_size})")
    if choice.skeleton:
        if not space.skeleton:
            raise SpecError(space.source, "skeleton", "no searched parameter forms a skeleton; "
                            "list some under skeleton:")
        prob = make_problem(case, space, choice.problem_encoding(encoding))
        prob.encoder.reset()          # each run enumerates the completions it needs
        # distinct skeletons: no more trials than the space has skeletons
        skeletons = len(prob.encoder.all)
        trials = min(trials, skeletons)
        if concurrency is None and o.backend == "optuna":
            concurrency = DEFAULT_BATCH
    else:
        prob = make_problem(case, space, encoding)
    grid = grid_params(space, case, min(trials, size)) if choice.sampler.grid else None
    if grid is not None:
        trials = len(grid)

    show = sys.stderr.isatty() if o.progress is None else bool(o.progress)
    bar = _Progress(trials, choice.name, show)
    study, new = None, None
    try:
        with removed_on_failure(sqlite_file(o.storage)):
            if o.backend == "optuna":
                rows, study, new = optuna_loop.run(
                    prob, choice, trials, o.seed, o.storage, o.study_name, concurrency or 1,
                    grid, bar, kept=o.storage is not None or o.return_study)
            else:
                from autopar.search.backends import ray_tune
                rows = ray_tune.run(prob, choice, trials, o.seed, o.address, concurrency, grid,
                                    on_row=bar.update, storage_path=o.storage_path,
                                    name=o.name, max_failures=o.max_failures,
                                    on_start=o.on_start)
    finally:
        bar.close()
    table = trials_table(rows)
    if choice.skeleton:
        # every skeleton of the space evaluated: the cache covers the skeleton
        # space and no new trial is possible, whatever the budget asked
        table.attrs.update(skeletons=skeletons,
                           skeleton_space_covered=bool(len(table) >= skeletons))
    if study is not None:
        table.attrs.update(study_name=study.study_name, new_trials=new)
    return (table, study) if o.return_study else table


def resume(path: str, address: str | None = None):
    """Finish a ray-backend experiment kept at ``path`` (``storage_path/name``);
    returns the trials table of all its trials."""
    from autopar.search.backends import ray_tune as tune_ray
    if not isinstance(path, str) or not path:
        _bad("resume", f"expected an experiment path, got {path!r}")
    if "://" not in path:           # a local folder (Ray reads a relative one as a URI)
        import os
        path = os.path.abspath(path)
        if not os.path.isdir(path):
            _bad("resume", f"{path} is not a folder (expected STORAGE_PATH/NAME of an "
                           "autopar tune --backend ray run)")
    if not tune_ray.can_resume(path):
        _bad("resume", f"{path} holds no Ray Tune experiment (expected "
                       "STORAGE_PATH/NAME of an autopar tune --backend ray run)")
    return trials_table(tune_ray.resume(path, address))


def trials_table(rows: list[dict]):
    """Result rows -> the trials DataFrame (``TRIAL_COLUMNS``, stable dtypes)."""
    import pandas as pd
    table = pd.DataFrame(rows, columns=list(TRIAL_COLUMNS))
    table["feasible"] = table["feasible"].astype(bool)
    for c in (METRIC, *BREAKDOWN, "elapsed_s"):
        table[c] = table[c].astype(float)
    table["layouts"] = table["layouts"].fillna(1).astype("int64")
    # integer layout fields stay integers (a pruned trial's unproposed field is
    # <NA>, which would otherwise turn the column into floats: dp=128.0)
    from autopar.io.layouts import EXT_INT_FIELDS, INT_FIELDS
    for c in INT_FIELDS | EXT_INT_FIELDS:
        if c in table.columns:
            table[c] = pd.to_numeric(table[c]).round().astype("Int64")
    return table


def grid_params(space, case, n: int) -> list[dict]:
    """``n`` layouts spread evenly over the space's enumeration (stratum centres)."""
    from autopar.io.layouts import record
    size = space.size(case)
    out = []
    for g in range(n):
        i = (2 * g + 1) * size // (2 * n)
        ex = record(space.layouts(case, i, i + 1), 0)
        out.append({p: ex[p] for p in space.searched})
    return out


class _Progress:
    """A tqdm bar with the best sample rate and the pruned count, or nothing."""

    def __init__(self, total: int, label: str, show: bool):
        self.best, self.pruned, self.bar = -math.inf, 0, None
        if show:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=f"tune {label}", unit="trial",
                            file=sys.stderr, dynamic_ncols=True)

    def update(self, row: Mapping) -> None:
        if row["state"] == "PRUNED":
            self.pruned += 1
        elif row[METRIC] > self.best:
            self.best = row[METRIC]
        if self.bar is not None:
            best = f"{self.best:.4g}" if self.best > -math.inf else "-"
            self.bar.set_postfix_str(f"best {best}/s, pruned {self.pruned}", refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# --------------------------------------------------------------------------
# The best trial and the outputs

def best_trial(table, fastest: bool = False):
    """The row of the recommended COMPLETE trial, or None: the highest
    sample_rate, and among the trials within 0.1% of it the simplest (no
    offload, less memory, fewer stages...; ``autopar.search.ranking``),
    first run on ties.  ``fastest``: the highest sample_rate, first run on
    ties (the optimum, as co-design measures a system by)."""
    from autopar.search import ranking
    done = table[table["state"] == "COMPLETE"]
    if done.empty:
        return None
    return done.iloc[ranking.fastest(done) if fastest else int(ranking.order(done)[0])]


def best_execution(table, fastest: bool = False) -> dict | None:
    """The best trial's layout as a Calculon execution dict (23 fields)
    (``best_trial``)."""
    row = best_trial(table, fastest)
    if row is None:
        return None
    return execution_from_row(row)




def write_best(table, path) -> dict | None:
    """Write the best execution (Calculon JSON), atomically; returns it (None: nothing written)."""
    from autopar.io.writers import write_json
    ex = best_execution(table)
    if ex is not None:
        write_json(ex, path)
    return ex


def write_trials(table, path) -> None:
    """Write the trials table as CSV, atomically."""
    from autopar.io.writers import write_atomic_csv
    write_atomic_csv(table, path)
