"""The sampler registry (autopar.search.samplers): one module per family,
the file vocabulary of io/experiment.py checked against it, skeleton search a
wrapper parsed once from the user-facing name, and what adding a sampler takes."""
from __future__ import annotations

import importlib
import sys

import pytest

from autopar.io import experiment
from autopar.io.errors import SpecError
from autopar.search import samplers
from autopar.search.samplers.base import Sampler


def test_file_vocabulary_is_the_registry():
    fams = samplers.families()
    assert experiment.LAYOUT_SAMPLERS == tuple(f.name for f in fams)
    assert set(experiment.SKELETON_SAMPLERS) == {
        samplers.SKELETON_PREFIX + f.name for f in fams if f.skeleton_encoding}
    assert set(experiment.SAMPLERS) == set(samplers.user_names())
    assert samplers.SAMPLERS == samplers.user_names()
    # the inner searches of co-design files: exhaustive and every sampler
    assert set(experiment.INNER_SEARCHES) == {"exhaustive", *samplers.user_names()}
    assert experiment.DEFAULT_SAMPLER in samplers.user_names()
    for f in fams:
        assert f.encoding in experiment.ENCODINGS
        assert f.skeleton_encoding in (None, *experiment.ENCODINGS)


def test_every_family_is_a_module_stating_its_needs():
    for name, module in samplers.REGISTRY.items():
        s = importlib.import_module(f"autopar.search.samplers.{module}").SAMPLER
        assert isinstance(s, Sampler) and s.name == name
        assert (s.package is None) == (s.install is None)
        # what it refuses is what it states
        for enc in experiment.ENCODINGS:
            refused = s.refuses(enc) is not None
            assert refused == ((s.only_encoding not in (None, enc))
                               or (s.static_only and enc == "named")), (name, enc)


def test_the_registry_imports_no_heavy_package():
    code = ("import sys; from autopar.search import samplers; samplers.user_names(); "
            "samplers.parse('skeleton-smac'); "
            "print(sorted(m for m in ('optuna', 'ray', 'hpbandster', 'smac', 'ConfigSpace') "
            "if m in sys.modules))")
    import subprocess
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


def test_skeleton_is_a_wrapper_parsed_once():
    c = samplers.parse("skeleton-tpe")
    assert c.skeleton and c.sampler is samplers.get("tpe") and c.name == "skeleton-tpe"
    assert c.default_encoding() == "index" and c.problem_encoding("index") == "skeleton-index"
    plain = samplers.parse("tpe")
    assert not plain.skeleton and plain.default_encoding() == "named"
    assert samplers.parse("skeleton-smac").default_encoding() == "flat"
    for bad in ("skeleton-grid", "skeleton-bohb", "sgd", "skeleton-", None, 3):
        with pytest.raises(SpecError) as e:
            samplers.parse(bad, "f.yaml", "sampler")
        assert e.value.source == "f.yaml" and e.value.field == "sampler"


def test_adding_a_sampler_is_one_module_and_one_registry_line(monkeypatch, tmp_path):
    """A new family 'halton' in a module of its own, registered by one line,
    is a sampler tune runs (docs/architecture.md shows the same example)."""
    import textwrap
    pkg = tmp_path / "extra"
    pkg.mkdir()
    (pkg / "halton.py").write_text(textwrap.dedent('''
        from autopar.search.samplers.base import Sampler

        class Halton(Sampler):
            name = "halton"
            skeleton_encoding = None

            def optuna(self, encoder, seed, concurrency=1, grid_points=0):
                import optuna
                return optuna.samplers.QMCSampler(qmc_type="halton", seed=seed)

        SAMPLER = Halton()
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(samplers.REGISTRY, "halton", "halton")
    monkeypatch.setattr(samplers, "get", lambda name: importlib.import_module(
        f"extra.{samplers.REGISTRY[name]}" if name == "halton" else
        f"autopar.search.samplers.{samplers.REGISTRY[name]}").SAMPLER)
    assert "halton" in samplers.user_names() and "skeleton-halton" not in samplers.user_names()
    from autopar.search.tune import tune_arguments as tune
    from test_tune import CASE, MODEL, SYSTEM
    table = tune(MODEL, SYSTEM, **CASE, sampler="halton", trials=5, seed=0, progress=False)
    assert len(table) == 5 and table["trial"].tolist() == list(range(5))
