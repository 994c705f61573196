"""The optuna backend: an Optuna study in this process, asked and told.

``run`` opens the study (``shared_study``: in storage or in memory), rebuilds
the rows of trials it already holds (a resumed study), gives a skeleton
search's whole space at once when the budget covers it (``whole_space``),
then asks ``concurrency`` trials at a time, evaluates them in one model call
and tells them (``_Run.step``) until the run has its trials.  Runs sharing a
study count each other's trials; skeletons proposed again are answered from
the run's repeat cache (``backends.repeats``).  An interrupt ends the loop at
its next step and leaves no trial RUNNING (``backends.signals``).
"""
from __future__ import annotations

import contextlib
import datetime
import math

from autopar.search.backends.repeats import SkeletonRepeats
from autopar.search.backends.shared_study import (OWNER, join_runs, leave_runs, open_study,
                                                   orphaned_trials, other_runs_trials,
                                                   others_trials, same_search)
from autopar.search.backends.signals import interrupts_held, interrupts_noted
from autopar.search.encodings import Invalid
from autopar.search.trial_rows import METRIC


def default_study_name(prob, sampler: str, seed: int | None) -> str:
    c = prob.case
    return (f"autopar-{c.model.name or 'model'}-{c.system.name or 'system'}-"
            f"n{c.num_procs}-b{c.max_batch_size}-{c.datatype}-{prob.space.name}-"
            f"{sampler}-{prob.encoder.encoding}-"
            + (f"seed{seed}-" if seed is not None else "unseeded-") + prob.key[:8])


def add_trials(study, encoder, skeletons: list, rows: list,
               why: str = "nearest_unseen") -> list[int]:
    """Record skeletons the sampler did not propose (``why``: each evaluated
    in place of a repeated proposal, or with the whole space) as finished
    trials of the study, with their result ``rows``; returns their numbers."""
    import optuna
    from optuna.trial import TrialState
    made = []
    for skeleton, row in zip(skeletons, rows):
        params, dists = encoder.trial_params(skeleton)
        ok = row["state"] == "COMPLETE"
        made.append(optuna.trial.create_trial(
            params=params, distributions=dists, value=row[METRIC] if ok else None,
            state=TrialState.COMPLETE if ok else TrialState.PRUNED,
            user_attrs={why: True, **({} if ok else {"reason": row["reason"]})},
            system_attrs={"autopar_owner": OWNER}))
    if not made:
        return []
    study.add_trials(made)
    return [t.number for t in study.get_trials(deepcopy=False)[-len(made):]]


@contextlib.contextmanager
def _quiet_optuna():
    import optuna
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        yield
    finally:
        optuna.logging.set_verbosity(verbosity)


def run(prob, choice, trials: int, seed, storage, study_name, concurrency: int, grid, bar,
        kept: bool = True):
    """The optuna backend's run: ``(rows, study, new)``, the rows of this
    run's trials in trial order, the study, and how many trials this run
    added.  ``kept``: the study outlives the run (in storage, or returned),
    so that trials no sampler proposed are recorded in it too."""
    from optuna.trial import TrialState
    from autopar.search.samplers import run_seed

    with _quiet_optuna():
        name = study_name or default_study_name(prob, choice.name, seed)
        study = open_study(storage, name)
        same_search(study, storage, {"problem": prob.key, "sampler": choice.name,
                                     "encoding": prob.encoder.encoding,
                                     "grid_points": len(grid) if grid else 0})
        # Trials a killed run left RUNNING cannot finish: fail them (they are
        # not part of the table; their layouts are sampled again).  Those of a
        # run still going on this machine (another `autopar tune` on the same
        # study) are left to it.
        for number in orphaned_trials(study):
            study.tell(number, state=TrialState.FAIL, skip_if_finished=True)
        joined = storage is not None
        try:
            rank = join_runs(study) if joined else 0
            old = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
            # another run's finished trials are its own to report (they stay
            # in the cache: this run does not evaluate them again)
            theirs = other_runs_trials(study) if joined else set()
            study.sampler = choice.sampler.optuna(prob.encoder, run_seed(seed, len(old), rank),
                                                  concurrency=concurrency,
                                                  grid_points=len(grid) if grid else 0)
            state = _Run(study, prob, grid, storage, bar, concurrency,
                         None if seed is None else seed + len(old) + 7_919 * rank)
            # an interrupt ends the run at its next step (a second one at once)
            with interrupts_noted() as noted:
                start = state.resume(old)
                done = start
                if prob.encoder.skeleton and grid is None:
                    done += whole_space(state, trials - done, kept)
                while done < trials:
                    if noted:
                        raise KeyboardInterrupt
                    want = state.wanted(trials, done)
                    if want <= 0:
                        break
                    added = state.step(want)
                    done += added
                    if prob.encoder.skeleton and not added:
                        break                # every skeleton has been evaluated
                if noted:
                    raise KeyboardInterrupt
            frozen = {t.number: t for t in study.get_trials(deepcopy=False)}
        finally:
            if joined:
                with contextlib.suppress(Exception):     # a failed storage stays failed
                    leave_runs(study)
    return state.table(frozen, theirs), study, max(done - start, 0)


class _Run:
    """One run's state on its study: the rows of its trials by number, the
    skeleton repeat cache, the trials numbered but not recorded in the study
    (``unrecorded``: number -> (start, end))."""

    def __init__(self, study, prob, grid, storage, bar, concurrency: int, seed):
        self.study, self.prob, self.grid, self.storage = study, prob, grid, storage
        self.bar, self.concurrency = bar, concurrency
        self.rows: dict[int, dict] = {}
        self.unrecorded: dict[int, tuple] = {}
        self.repeats = SkeletonRepeats(prob.encoder, seed)

    # -- proposals -------------------------------------------------------------

    def suggest(self, trial):
        if self.grid is not None:
            return self.grid[trial.suggest_int("grid_point", 0, len(self.grid) - 1)]
        return self.prob.encoder.suggest(trial)

    def decode(self, raw):
        if self.grid is not None:
            return self.grid[raw["grid_point"]]
        try:
            return self.prob.encoder.decode(raw)
        except Invalid as e:
            return e

    def tell(self, t, row) -> None:
        from optuna.trial import TrialState
        if row["state"] == "COMPLETE":
            self.study.tell(t, row[METRIC])
        else:
            t.set_user_attr("reason", row["reason"])
            self.study.tell(t, state=TrialState.PRUNED)

    def record(self, number: int, row: dict) -> None:
        self.rows[number] = row
        self.bar.update(row)

    # -- resume ------------------------------------------------------------------

    def resume(self, old: list) -> int:
        """The finished trials' rows, from their parameters (a resumed study;
        a skeleton proposed again, ``repeat_of``, has none of its own);
        returns how many."""
        from autopar.search.trainable import evaluate_params
        if old:
            distinct = [t for t in old if "repeat_of" not in t.user_attrs]
            params = [self.decode(t.params) for t in distinct]
            for t, p, row in zip(distinct, params, evaluate_params(self.prob, params)):
                self.rows[t.number] = row
                if (k := self.repeats.key(p)) is not None:
                    self.repeats.claim(k, t.number)
        for row in self.rows.values():
            self.bar.update(row)
        return len(self.rows)

    # -- the loop ----------------------------------------------------------------

    def wanted(self, trials: int, done: int) -> int:
        """How many trials to ask now: runs sharing a study together make the
        trials asked for (finished, or asked and not yet told)."""
        others = others_trials(self.study, self.rows) if self.storage is not None else 0
        return min(self.concurrency, trials - done - others)

    def step(self, want: int) -> int:
        """Ask ``want`` trials, evaluate them in one model call, tell them;
        returns how many new rows (skeletons proposed again are told the
        known result and add none; the nearest unseen ones in their place do)."""
        from optuna.trial import TrialState
        from autopar.search.trainable import evaluate_params
        asked = []
        try:
            for _ in range(want):
                # a trial is in ``asked`` (failed on an interrupt) as soon as it exists
                with interrupts_held():
                    asked.append(self.study.ask())
                    if self.storage is not None:
                        asked[-1].storage.set_trial_system_attr(
                            asked[-1]._trial_id, "autopar_owner", OWNER)
            fresh, fresh_params, repeated, near = [], [], [], []
            for t, p in zip(asked, [self.suggest(t) for t in asked]):
                k = self.repeats.key(p)
                if k is not None and k in self.repeats:
                    repeated.append((t, k))
                    # in its place, the nearest skeleton not yet evaluated
                    if (sk := self.repeats.instead(k)) is not None:
                        near.append(sk)
                    continue
                if k is not None:
                    self.repeats.claim(k, t.number)
                fresh.append(t)
                fresh_params.append(p)
            searched = self.prob.encoder.searched
            results = evaluate_params(self.prob,
                                      fresh_params + [dict(zip(searched, sk)) for sk in near])
            for t, row in zip(fresh, results):
                self.tell(t, row)
                self.record(t.number, row)
            placed = results[len(fresh):]
            for sk, row, number in zip(near, placed, add_trials(self.study, self.prob.encoder,
                                                                near, placed)):
                self.repeats.claim(sk, number)
                self.record(number, row)
            for t, k in repeated:
                t.set_user_attr("repeat_of", self.repeats.owner[k])
                self.tell(t, self.rows[self.repeats.owner[k]])
        except BaseException:
            with interrupts_held():    # interrupted: leave no trial RUNNING
                for t in asked:
                    self.study.tell(t, state=TrialState.FAIL, skip_if_finished=True)
            raise
        return len(fresh) + len(near)

    # -- the table ---------------------------------------------------------------

    def table(self, frozen: dict, theirs: set) -> list[dict]:
        """This run's rows in trial order, with ``elapsed_s`` from the first
        trial's start (``theirs``: trials of other runs, left out)."""
        when = {n: (t.datetime_start, t.datetime_complete) for n, t in frozen.items()}
        when.update(self.unrecorded)
        t0 = min((start for start, _ in when.values() if start), default=None)
        out = []
        for n in sorted(set(self.rows) - theirs):
            end = when[n][1]
            out.append({"trial": n, **self.rows[n], "node_id": "",
                        "elapsed_s": (end - t0).total_seconds() if end and t0 else math.nan})
        return out


def whole_space(run: _Run, budget: int, kept: bool) -> int:
    """When the budget covers every skeleton not yet evaluated, there is
    nothing left for the sampler to choose: evaluate them all, a model call
    per ``WHOLE_SPACE_MAX`` layouts, in the space's enumeration order, and
    record them as trials of the study (``whole_space``), or, when the study
    is not ``kept`` (it ends with the run and no sampler will read it),
    number them as the study would and note their start and end in
    ``run.unrecorded``.  Returns how many (0, and nothing done, when the
    budget is smaller or another run shares the study)."""
    from autopar.search.skeleton import WHOLE_SPACE_MAX, evaluate_all_skeletons
    from autopar.search.trainable import evaluate_params
    prob, study = run.prob, run.study
    enc = prob.encoder
    unseen = run.repeats.unseen()
    if not unseen or len(unseen) > budget:
        return 0
    if run.storage is not None and others_trials(study, run.rows):
        return 0
    start = datetime.datetime.now()
    got = evaluate_all_skeletons(prob, unseen)      # a small space: one gather, one call
    if got is None:
        per_call = max(1, WHOLE_SPACE_MAX * len(enc.all) // max(1, prob.space.size(prob.case)))
        got = []
        for a in range(0, len(unseen), per_call):
            got += evaluate_params(prob, [dict(zip(enc.searched, sk))
                                          for sk in unseen[a:a + per_call]])
    if kept:
        numbers = add_trials(study, enc, unseen, got, "whole_space")
    else:
        first = len(study.get_trials(deepcopy=False))
        numbers = range(first, first + len(unseen))
        end = datetime.datetime.now()
        run.unrecorded.update((n, (start, end)) for n in numbers)
    for sk, row, number in zip(unseen, got, numbers):
        run.repeats.claim(sk, number)
        run.record(number, row)
    return len(unseen)
