"""The megatron_release table: Megatron-LM's release tests (measured peak
allocated memory of the last rank, steady step time), written from the
mirror, every row predicted or skipped with a reason."""
import importlib.util
import shutil
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parent.parent
MEGATRON = Path("/work/.mirror/NVIDIA+Megatron-LM/repo")
CSV = ROOT / "autopar" / "data" / "published" / "megatron_release.csv"


def _writer():
    spec = importlib.util.spec_from_file_location(
        "write_megatron_release_table", ROOT / "benchmarks" / "write_megatron_release_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(not MEGATRON.is_dir(), reason="no Megatron-LM mirror (CI): the CSV is committed")
def test_writer_reproduces_the_csv_byte_for_byte():
    w = _writer()
    assert w.render(w.rows(MEGATRON, w.COMMIT)) == CSV.read_text(encoding="utf-8")


def test_writer_steady_window_and_batch_schedule():
    """Steady steps start after step 100 (after half a shorter log) and skip
    NaN; the schedule's first batch holds only while its next threshold lies
    beyond the logged steps."""
    w = _writer()
    after, vals = w.steady({"values": {"1": 1.0, "50": "nan", "150": 3.0, "200": 5.0}})
    assert after == 100 and vals == [(150, 3.0), (200, 5.0)]
    after, vals = w.steady({"values": {"1": 9.0, "5": 2.0, "10": 4.0}})
    assert after == 5 and vals == [(10, 4.0)]
    assert w.batch_size({"--step-batch-size-schedule": "0:384 200B:768"}, 51000) == 384
    assert w.batch_size({"--step-batch-size-schedule": "0:384 1K:768"}, 51000) is None
    assert w.batch_size({"--global-batch-size": 512}, 10) == 512
    assert w.command_line({"--bf16": True, "--no-x": False, "--data-path": "$D",
                           "--tp": 2}) == "--bf16 --tp 2"


def test_every_row_predicted_or_skipped_with_a_reason():
    from autopar.studies.published import TABLES, predict
    rows = predict(TABLES["megatron_release"], rank=False)
    frame = pd.read_csv(CSV)
    assert len(rows) == len(frame) == 21
    assert set(rows.status) <= {"predicted", "skipped"}
    assert rows.reason[rows.status == "skipped"].str.len().gt(0).all()
    # the CSV states no GPU count (the release recipes are not public)
    assert frame.n_gpus.isna().all()
    assert (rows.status == "skipped").all()
    # (Nemotron 3 Super reads since the importer takes RMSNorm with
    # --squared-relu on a hybrid model: its two rows lack only the GPU count)
    nemotron = rows[rows.label.str.startswith("nemotron3_super")]
    assert len(nemotron) == 2 and nemotron.reason.str.startswith("GPU count not stated").all()
    # the tp4/pp2 case's A100 file is the same blob as the tp8 case's: a copy
    copy = rows[rows.label == "gpt3_15b_8t_release_sm_gb200 lts dgx_a100"]
    assert copy.reason.str.contains("byte-identical to gpt/gpt3_15b_8t_release_sm/").all()
    assert rows.reason.str.startswith("GPU count not stated").sum() == 20


def test_rows_with_a_gpu_count_are_predicted(tmp_path, monkeypatch):
    """With a GPU count filled in, the GPT-15B rows go through the importer to
    a prediction with measured memory and tokens/s/GPU; the peak memory
    compared is allocated bytes (no allocator reserve)."""
    for f in (ROOT / "autopar" / "data" / "published").glob("*.csv"):
        shutil.copy(f, tmp_path / f.name)
    frame = pd.read_csv(tmp_path / "megatron_release.csv", dtype=str, keep_default_na=False)
    gpt = frame.case == "gpt3_15b_8t_release"
    frame.loc[gpt, "n_gpus"] = "64"
    pp2 = (frame.case == "gpt3_15b_8t_release_sm_gb200") & (frame.machine == "dgx_gb200")
    frame.loc[pp2, "n_gpus"] = "64"
    frame.to_csv(tmp_path / "megatron_release.csv", index=False)
    monkeypatch.setenv("AUTOPAR_PUBLISHED", str(tmp_path))
    from autopar.studies.published import TABLES, cases, predict
    rows = predict(TABLES["megatron_release"], rank=False)
    done = rows[rows.status == "predicted"]
    assert len(done) == gpt.sum() + pp2.sum() == 3
    assert done.feasible.all() and done.pred_mem_gib.gt(0).all()
    got = [c for _, c in cases(TABLES["megatron_release"]) if hasattr(c, "execution")]
    # the last rank's peak is compared with the last pipeline stage's need,
    # which on the tp4/pp2 row is below the fuller (first) stage's
    from autopar.model import evaluate_one
    last = next(c for c in got if c.execution["pipeline_par"] == 2)
    fuller = evaluate_one(last.model, last.system, last.execution)["proc_mem_tier1_cap_req"]
    pred = float(done[done.label.str.startswith("gpt3_15b_8t_release_sm_gb200")].pred_mem_gib.iloc[0])
    assert pred * 1024 ** 3 < fuller
    got = [c for c in got if c.execution["pipeline_par"] == 1]
    ex, m = got[0].execution, got[0].model
    assert (ex["tensor_par"], ex["data_par"], ex["batch_size"], ex["microbatch_size"]) == \
        (8, 8, 384, 4)
    assert m.vocab_size == 256000 and m.num_blocks == 32 and m.kv_heads == 8
    h100 = frame[gpt & (frame.machine == "dgx_h100")].iloc[0]
    assert got[0].measured["peak_mem_gib"] == pytest.approx(int(h100.peak_mem_bytes) / 1024 ** 3)


def test_padded_vocab_and_framework():
    from autopar.studies.published_release import framework_for, padded_vocab
    assert padded_vocab(256000, 128, 8) == 256000
    assert padded_vocab(50257, 128, 2) == 50432
    assert framework_for("--cross-entropy-loss-fusion --cross-entropy-fusion-impl te") == \
        "megatron-core-te-ce"
    assert framework_for("--cross-entropy-loss-fusion --cross-entropy-fusion-impl native") == \
        "megatron-core"
