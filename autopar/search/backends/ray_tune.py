"""The ray backend: the model as a Ray Tune trainable, run by a Tuner.

(The sampler's searcher comes from its family, ``Sampler.ray``; a skeleton
search's is wrapped by ``SkeletonCache`` around the shared repeat cache,
``backends.repeats``.)

Ray Tune's defaults are made for trials that train for minutes; ours take
milliseconds, so the settings that matter are the per-trial overheads:
actors are reused on one node (``reuse_actors``), Tune's automatic CSV/JSON/TensorBoard
loggers are off (``TUNE_DISABLE_AUTO_CALLBACK_LOGGERS``, set only while the
Tuner is built and run), no checkpoints are taken, and every trial reports
once with ``done=True``.  Results are collected on the driver by a callback
(``_Collector``), not read back from files.

Spreading over a cluster's nodes is by placement, not by timing.  Every trial
holds one CPU (Tune's default for a function trainable), so with concurrency
up to the cluster's CPUs the trials running at once are placed on different
nodes whenever one node's CPUs are taken, and each waits for the actor Ray
starts for it there.  Tune's FIFO scheduler would undo that with actor reuse:
it picks the first pending trial, whose actor is still starting on a cold
node (shipping the package, importing numpy and Ray), and hands it an actor
that has just finished on a warm node, cancelling the cold one
(``TuneController._maybe_reuse_cached_actor``); with trials quicker than an
actor's start every trial ends up on the first node.  ``KeepPlacement`` (the
scheduler used unless the sampler brings its own) never picks a trial, so
Tune starts pending trials in order.  That is not enough on its own: after
the scheduler's pick and the pending trials in order, Tune hands any cached
actor to any pending trial of the same resources (the third step of
``TuneController._maybe_add_actors``, a set's ``pop``), a trial whose actor
is still starting on the other node included, so on a loaded machine a run
once placed every trial on one node.  On a cluster of more than one node
with CPUs actors are therefore not reused (``reuse_actors_here``): every
trial gets an actor of its own where Ray placed it, and with each trial
holding one CPU the trials running at once fill every node whatever the
timing (each trial pays an actor's start; on one node, actors are reused).

A Ray started here is local, listens on loopback only and has no dashboard;
with ``address`` (or ``RAY_ADDRESS``) an existing cluster is joined instead,
and the autopar package travels with the job (runtime_env ``py_modules``) so
nodes need only Ray installed.

Results: with ``storage_path`` the experiment is kept at
``storage_path/name`` (any path Ray Tune accepts: a local or shared folder,
``s3://...``, ``gs://...``) and ``resume(path)`` finishes a killed run with
``Tuner.restore``: the trials asked for, each once.  Without it a temporary
folder is used and removed.  Failed trials (a lost node) are retried
``max_failures`` times (``FailureConfig``).  The trials table is read from the
experiment's results at the end, so a resumed run reports every trial.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import ray
from ray import tune
from ray.tune.logger import JsonLoggerCallback
from ray.tune.schedulers import FIFOScheduler
from ray.tune.search import Searcher
from ray.tune.search.basic_variant import BasicVariantGenerator

from autopar.io.specs import SpecError
from autopar.search.backends.repeats import SkeletonRepeats
from autopar.search.cluster import ray_session
from autopar.search.trainable import PAYLOAD_KEY, layout_trainable
from autopar.search.trial_rows import BREAKDOWN, METRIC


class KeepPlacement(FIFOScheduler):
    """FIFO order without handing a placed trial to another node's actor.

    Returning no trial to run leaves Tune's own pass over the pending trials
    in creation order: a trial with no actor yet takes a cached one or asks
    Ray for a new one; a trial whose actor is starting keeps it (see the
    module docstring).
    """

    def choose_trial_to_run(self, tune_controller):
        return None

    def debug_string(self) -> str:
        return "FIFO scheduling; trials keep their placement."


class SkeletonCache(Searcher):
    """A searcher of skeletons whose repeated proposals are not new trials.

    A proposal of a skeleton already proposed is answered from the cache (the
    wrapped searcher is told the known result, under an id of its own) and
    Tune gets the nearest unseen skeleton instead
    (``SkeletonEncoder.nearest_unseen``), which is also recorded in the
    wrapped Optuna study when it finishes.  So every Tune trial is a distinct
    skeleton, as on the optuna backend.
    """

    def __init__(self, searcher, encoder, seed: int | None = None):
        super().__init__(metric=METRIC, mode="max")
        self.searcher, self.encoder = searcher, encoder
        # skeleton -> the Tune trial id that evaluates it (backends.repeats)
        self.repeats = SkeletonRepeats(encoder, seed)
        self.result: dict = {}      # skeleton -> its finished result (metric only)
        self.waiting: dict = {}     # skeleton -> inner ids told when it finishes
        self.placed: dict = {}      # Tune trial id -> skeleton given in place of a repeat
        self.inner_of: dict = {}    # Tune trial id -> the inner searcher's id for it

    def set_search_properties(self, metric, mode, config, **spec):
        return self.searcher.set_search_properties(metric, mode, config, **spec)

    def set_max_concurrency(self, max_concurrent: int) -> bool:
        return self.searcher.set_max_concurrency(max_concurrent)

    def _key(self, config):
        from autopar.search.encodings import Invalid
        raw = {**self.encoder.raw_defaults(),
               **{k: v for k, v in config.items() if k in self.encoder.searched or "|" in k}}
        try:
            return self.repeats.key(self.encoder.decode(raw))
        except (Invalid, KeyError):
            return None

    def suggest(self, trial_id):
        inner_id = trial_id
        config = self.searcher.suggest(inner_id)
        if config is None or config == Searcher.FINISHED:
            return config
        key = self._key(config)
        if key is None or key not in self.repeats:
            if key is not None:
                self.repeats.claim(key, trial_id)
            self.inner_of[trial_id] = inner_id
            return config
        # A repeat: the inner searcher hears the known result (now or when
        # the skeleton finishes); Tune runs the nearest unseen skeleton.
        if key in self.result:
            self.searcher.on_trial_complete(inner_id, result=self.result[key])
        else:
            self.waiting.setdefault(key, []).append(inner_id)
        sk = self.repeats.instead(key, trial_id)
        if sk is None:
            return Searcher.FINISHED
        self.placed[trial_id] = sk
        return self.encoder.raw_for(sk)

    def on_trial_result(self, trial_id, result):
        if trial_id in self.inner_of:
            self.searcher.on_trial_result(self.inner_of[trial_id], result)

    def on_trial_complete(self, trial_id, result=None, error=False):
        metric = {METRIC: (result or {}).get(METRIC)}
        sk = self.placed.pop(trial_id, None)
        if trial_id in self.inner_of:
            self.searcher.on_trial_complete(self.inner_of.pop(trial_id), result=result, error=error)
        elif sk is not None and not error:
            _add_to_study(self.searcher, self.encoder, sk, metric[METRIC])
        for key, owner in self.repeats.owner.items():
            if owner == trial_id:
                if not error:
                    self.result[key] = metric
                for inner in self.waiting.pop(key, []):
                    self.searcher.on_trial_complete(inner, result=metric)
                break

    # Saved as Ray's ConcurrencyLimiter is: this wrapper's state, then the
    # wrapped searcher's own files.
    def get_state(self) -> dict:
        state = {k: v for k, v in self.__dict__.items()
                 if k not in ("searcher", "encoder", "repeats")}
        return {**state, "owner": self.repeats.owner, "rng": self.repeats.rng}

    def set_state(self, state: dict) -> None:
        state = dict(state)
        self.repeats = SkeletonRepeats(self.encoder, owner=state.pop("owner"),
                                       rng=state.pop("rng"))
        self.__dict__.update(state)

    def save(self, checkpoint_path: str):
        self.searcher.save(checkpoint_path)

    def restore(self, checkpoint_path: str):
        self.searcher.restore(checkpoint_path)


def _add_to_study(searcher, encoder, skeleton, value) -> None:
    """Record a skeleton Tune ran in place of a repeat in an OptunaSearch's study."""
    study = getattr(searcher, "_ot_study", None)
    if study is None:
        return
    import optuna
    from optuna.trial import TrialState
    params, dists = encoder.trial_params(skeleton)
    ok = isinstance(value, (int, float)) and math.isfinite(value)
    study.add_trial(optuna.trial.create_trial(
        params=params, distributions=dists, value=value if ok else None,
        state=TrialState.COMPLETE if ok else TrialState.PRUNED))


def ray_search(choice, encoder, seed: int | None, trials: int,
               concurrency: int | None, grid: list[dict] | None = None):
    """The sampler's Ray Tune pieces (``samplers.base.RayPieces``); a skeleton
    search's searcher wrapped by the repeat cache (``SkeletonCache``)."""
    pieces = choice.sampler.ray(encoder, seed, trials, concurrency, grid,
                                skeleton=choice.skeleton)
    if choice.skeleton:
        pieces.search_alg = SkeletonCache(pieces.search_alg, encoder, seed)
    return pieces


class _Collector(tune.Callback):
    """Keeps each finished trial's result row, numbered in creation order.

    A trial's number (``numbers``: Tune trial id -> number) is given when the
    collector first sees the trial in Tune's trial list, in the list's order
    (the order trials were created), and is kept with the experiment
    (``get_state``: Tune saves it beside its own state).  A restore must not
    number trials by their place in the list: Tune puts restored trials back
    in order of their last result, newest first
    (``TuneController._requeue_restored_trials``), so the best trial of a
    resumed run was reported by its place in that order ("trial 4") rather
    than its number ("trial 46").  ``restored``: the collector Tune restored
    in this process (``resume`` reads its numbers)."""

    restored = None

    def __init__(self, on_row=None):
        self.rows: dict[int, dict] = {}
        self.errors: list[str] = []
        self.numbers: dict[str, int] = {}
        self._t0 = time.monotonic()
        self._on_row = on_row

    def restart_clock(self) -> None:
        self._t0 = time.monotonic()

    def __getstate__(self):
        # Tune pickles its callbacks into the experiment (tuner.pkl); the
        # progress hook and the rows belong to this process only.
        return {**self.__dict__, "_on_row": None, "rows": {}, "errors": [],
                "numbers": {}}

    def get_state(self) -> dict:
        return {"numbers": dict(self.numbers)}

    def set_state(self, state: dict) -> None:
        self.numbers = {str(k): int(v) for k, v in (state or {}).get("numbers", {}).items()}
        _Collector.restored = self

    def _number(self, trials, trial) -> int:
        for t in trials:            # trials not seen yet, in the list's (creation) order
            if t.trial_id not in self.numbers:
                self.numbers[t.trial_id] = len(self.numbers)
        return self.numbers.setdefault(trial.trial_id, len(self.numbers))

    def on_trial_start(self, iteration, trials, trial, **info):
        self._number(trials, trial)

    def on_trial_complete(self, iteration, trials, trial, **info):
        r = trial.last_result or {}
        row = {"trial": self._number(trials, trial)}
        if "state" not in r:          # finished without reporting: cannot happen for ours
            self.errors.append(f"trial {trial.trial_id} ended without a result")
            return
        for k in ("state", "feasible", "reason"):
            row[k] = r[k]
        for k in (METRIC, *BREAKDOWN):
            row[k] = math.nan if r.get(k) is None else r[k]
        from autopar.io.layouts import ALL_FIELDS
        for f in ALL_FIELDS:
            row[f] = r.get(f)
        row["node_id"] = r.get("node_id", "")
        row["elapsed_s"] = _elapsed(r)
        row["layouts"] = r.get("layouts", 1)
        self.rows[row["trial"]] = row
        if self._on_row is not None:
            self._on_row(row)

    def on_trial_error(self, iteration, trials, trial, **info):
        self.errors.append(f"trial {trial.trial_id}: {trial.error_file or 'error'}")


class _Quiet(logging.Filter):
    """Drops Tune's complaint that trials wrote no result files (we keep none)."""

    def filter(self, record):
        return "Failed to fetch metrics" not in record.getMessage()


@contextlib.contextmanager
def _tune_settings():
    import optuna
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    env = {"TUNE_DISABLE_AUTO_CALLBACK_LOGGERS": "1",   # no per-trial CSV/JSON/TB files
           "RAY_AIR_NEW_OUTPUT": "0",                   # no tables printed on stdout
           # Ctrl-C is an interrupt (exit 130, the experiment kept resumable),
           # not Tune's graceful stop that returns the trials so far as a result
           "TUNE_DISABLE_SIGINT_HANDLER": "1"}
    if "TUNE_MAX_PENDING_TRIALS_PG" not in os.environ and ray.is_initialized():
        # Tune lets a searcher other than random/grid have one pending trial
        # at a time: a trial waiting for its actor on a second node then
        # blocks every other start, and the first node's reused actor takes
        # them all.  As many pending trials as the cluster has CPUs lets each
        # node's slots fill (benchmarks/skeleton_search.py).
        cpus = int(ray.cluster_resources().get("CPU", 1))
        env["TUNE_MAX_PENDING_TRIALS_PG"] = str(max(1, cpus))
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    quiet = _Quiet()
    lg = logging.getLogger("ray.tune")
    level = lg.level
    lg.setLevel(logging.WARNING)
    ea = logging.getLogger("ray.tune.analysis.experiment_analysis")
    ea.addFilter(quiet)
    try:
        yield
    finally:
        optuna.logging.set_verbosity(verbosity)
        ea.removeFilter(quiet)
        lg.setLevel(level)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _short_name(trial) -> str:
    return f"t{trial.trial_id}"


def _elapsed(r) -> float:
    """Seconds from the experiment's start to the trial's end (wall clocks)."""
    start = r.get("started_at")
    if start is None:           # an experiment whose configs carried the payload
        start = (r.get("config") or {}).get(PAYLOAD_KEY, {}).get("started_at")
    end = r.get("finished_at")
    return float(end - start) if start is not None and end is not None else math.nan


def result_rows(results, numbers: dict | None = None) -> list[dict]:
    """A ResultGrid -> one row per trial that reported, in trial order:
    ``numbers`` (Tune trial id -> number, ``_Collector.numbers``), else the
    order of the results."""
    from autopar.io.layouts import ALL_FIELDS
    rows = []
    for res in results:
        r = res.metrics or {}
        if "state" not in r:
            continue
        number = (numbers or {}).get(r.get("trial_id"))
        row = {"trial": len(rows) if number is None else number, "state": r["state"],
               "feasible": r["feasible"], "reason": r["reason"]}
        for k in (METRIC, *BREAKDOWN):
            row[k] = math.nan if r.get(k) is None else r[k]
        for f in ALL_FIELDS:
            row[f] = r.get(f)
        row["node_id"] = r.get("node_id", "")
        row["elapsed_s"] = _elapsed({**r, "config": res.config})
        row["layouts"] = r.get("layouts", 1)
        rows.append(row)
    return sorted(rows, key=lambda row: row["trial"])


def default_name(sampler: str) -> str:
    return f"autopar-tune-{sampler}-{time.strftime('%Y%m%d-%H%M%S')}"


def _finish(results, collector_errors, numbers: dict | None) -> list[dict]:
    errors = list(results.errors)
    if errors or collector_errors:
        first = errors[0] if errors else collector_errors[0]
        raise RuntimeError(f"{len(errors) or len(collector_errors)} trial(s) failed; first: {first}")
    return result_rows(results, numbers)


def run(prob, choice, trials: int, seed: int | None, address: str | None,
        concurrency: int | None, grid: list[dict] | None, on_row=None,
        trainable=layout_trainable, keep: dict | None = None,
        storage_path: str | None = None, name: str | None = None,
        max_failures: int = 3, on_start=None) -> list[dict]:
    """Run the search on Ray; returns the rows of all trials, in trial order.

    ``keep``: a dict that receives the ``search_alg`` (to inspect its study).
    ``storage_path``/``name``: where the experiment is kept (None: a temporary
    folder, removed at the end).  ``on_start(path)`` is told the experiment's
    path before the first trial.
    """
    collector = _Collector(on_row)
    temp = storage_path is None
    storage = tempfile.mkdtemp(prefix="autopar-ray-") if temp else storage_path
    name = name or ("autopar-tune" if temp else default_name(choice.name))
    try:
        with ray_session(address), _tune_settings():
            pieces = ray_search(choice, prob.encoder, seed, trials, concurrency, grid)
            payload = {**prob.payload(), "started_at": time.time()}
            param_space = dict(pieces.param_space)
            where = None if temp else _join(storage, name)
            if where is not None and "://" not in where:
                # the problem travels by tune.with_parameters, kept beside the
                # experiment for a restore (configs hold only searched values)
                _write_problem(where, payload)
                trainable_p = tune.with_parameters(trainable, problem=payload)
            elif temp:
                trainable_p = tune.with_parameters(trainable, problem=payload)
            else:                 # a URI: the config carries the problem, as before
                param_space[PAYLOAD_KEY] = payload
                trainable_p = trainable
            if keep is not None:
                keep["search_alg"] = pieces.search_alg
            alg = pieces.search_alg
            # A SearchGenerator (random, grid) limits itself (its max_concurrent);
            # Tune would only warn "max_concurrent_trials will be ignored".
            limit = None if isinstance(alg, BasicVariantGenerator) else concurrency
            tuner = tune.Tuner(
                _with_concurrency(trainable_p, concurrency),
                param_space=param_space,
                tune_config=tune.TuneConfig(
                    metric=METRIC, mode="max", num_samples=pieces.num_samples,
                    search_alg=pieces.search_alg,
                    scheduler=pieces.scheduler or KeepPlacement(),
                    max_concurrent_trials=limit, reuse_actors=reuse_actors_here(),
                    trial_dirname_creator=_short_name, trial_name_creator=_short_name),
                run_config=tune.RunConfig(
                    name=name, storage_path=storage, verbose=0,
                    # kept experiments: each trial's result.json, so that
                    # Tuner.restore(...).get_results() has the metrics
                    callbacks=[collector] + ([] if temp else [JsonLoggerCallback()]),
                    log_to_file=False,
                    checkpoint_config=tune.CheckpointConfig(checkpoint_at_end=False),
                    failure_config=tune.FailureConfig(max_failures=max_failures)))
            if on_start is not None and not temp:
                on_start(_join(storage, name))
            collector.restart_clock()
            results = tuner.fit()
            return _finish(results, collector.errors, collector.numbers)
    finally:
        if temp:
            shutil.rmtree(storage, ignore_errors=True)


def reuse_actors_here() -> bool:
    """Whether trials may reuse finished trials' actors: only on a Ray of one
    node with CPUs (on more, reuse moves trials between nodes by timing; see
    the module docstring)."""
    nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0]
    return len(nodes) <= 1


def _with_concurrency(trainable, concurrency: int | None):
    """Ask less than a CPU per trial when more trials should run at once than
    the cluster has CPUs (a trial is one model call: mostly waiting on Tune)."""
    cpus = float(ray.cluster_resources().get("CPU", 1))
    if not concurrency or concurrency <= cpus:
        return trainable
    return tune.with_resources(trainable, {"cpu": max(0.01, round(cpus / concurrency, 2))})


def _join(storage: str, name: str) -> str:
    return storage.rstrip("/") + "/" + name if "://" in storage else \
        os.path.join(os.path.abspath(os.path.expanduser(storage)), name)


PROBLEM_FILE = "autopar_problem.json"


def _write_problem(exp_dir: str, payload: dict) -> None:
    import json
    from autopar.io.writers import atomic_path
    Path(exp_dir).mkdir(parents=True, exist_ok=True)
    # in place at once: a killed driver's experiment is resumed from it
    with atomic_path(Path(exp_dir) / PROBLEM_FILE, now=True) as tmp:
        Path(tmp).write_text(json.dumps(payload))


def restore_trainable(path: str, trainable=layout_trainable):
    """The trainable to restore the experiment at ``path`` with: the layout
    trainable with the problem kept beside the experiment (or, for an
    experiment whose configs carry it, the trainable as it is)."""
    import json
    problem = None if "://" in path else Path(path) / PROBLEM_FILE
    if problem is not None and problem.is_file():
        try:
            payload = json.loads(problem.read_text())
        except (OSError, ValueError) as e:
            raise SpecError(str(problem), "(file)", f"cannot read the problem: {e}") from None
        return tune.with_parameters(trainable, problem=payload)
    return trainable


def restore(path: str) -> "tune.Tuner":
    """``Tuner.restore`` of an autopar experiment (for ``get_results()``: a
    ResultGrid whose metrics hold the layout, ``sample_rate`` and the breakdown)."""
    return tune.Tuner.restore(path, trainable=restore_trainable(path))


def can_resume(path: str) -> bool:
    return tune.Tuner.can_restore(path)


def resume(path: str, address: str | None = None, trainable=layout_trainable) -> list[dict]:
    """Finish the experiment at ``path`` (Tuner.restore); rows of all its trials.

    Trials a killed driver left running or pending are run; finished ones are
    kept; errored ones are run again.  The search algorithm (its study and
    trial count) is restored with the experiment, so the run ends with the
    trials first asked for.
    """
    with ray_session(address), _tune_settings():
        node = ray._private.worker._global_node
        roots = [Path(node.get_session_dir_path()).parent] if node is not None else []
        mend_experiment_state(path, roots + [Path(tempfile.gettempdir()) / "ray"])
        _Collector.restored = None
        tuner = tune.Tuner.restore(path, trainable=restore_trainable(path, trainable),
                                   resume_unfinished=True, resume_errored=True)
        results = tuner.fit()
        restored = _Collector.restored
        return _finish(results, [], restored.numbers if restored is not None else None)


def mend_experiment_state(path: str, ray_roots) -> None:
    """Put back the state files a killed driver left cut off in ``path``.

    Tune writes its state (``experiment_state-<session>.json`` and the search
    algorithm's files) to a staging folder in the Ray session folder of the
    driver's node, then copies them to the experiment folder.  A driver killed
    during that copy leaves an empty or cut-off file, and a restore from it
    loses every trial's configuration.  The staging copy, under one of
    ``ray_roots`` (Ray temp folders holding ``session_*``), is whole: those of
    the cut-off session are copied back.
    """
    if "://" in path:
        return
    exp = Path(path)
    for state in exp.glob("experiment_state-*.json"):
        if _whole_json(state):
            continue
        session = state.name.removeprefix("experiment_state-").removesuffix(".json")
        pattern = f"session_*/artifacts/*/{exp.name}/driver_artifacts/{state.name}"
        copies = sorted((c for root in dict.fromkeys(ray_roots) for c in Path(root).glob(pattern)
                         if _whole_json(c)), key=lambda c: c.stat().st_mtime)
        if not copies:
            raise SpecError(str(exp), state.name, "cut off when the driver was killed, and no "
                            "whole copy is on this node: the experiment cannot be resumed")
        for f in copies[-1].parent.iterdir():
            if f.is_file() and session in f.name:
                shutil.copyfile(f, exp / f.name)


def _whole_json(path: Path) -> bool:
    import json
    try:
        json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return True
