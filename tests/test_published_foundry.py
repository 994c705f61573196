"""The llm-foundry MPT and NeMo-Megatron-Launcher tables: rows mapped, shapes
as benchmarked, every published layout predicted to fit."""
import pytest


def test_mpt_shapes_match_the_tables_parameter_counts(reference):
    """The MPT shapes (d_model, heads, layers) with biases and learned position
    embeddings give the table's NumParams exactly, for every model and
    sequence length."""
    import pandas as pd

    from autopar.studies.published_foundry import MPT_SHAPES, mpt_params
    # NumParams is in the source table only (autopar's own keeps what it predicts from)
    frame = pd.read_csv(reference / "measured" / "published" / "llm_foundry_mpt_throughput.csv")
    assert set(frame.Model) == set(MPT_SHAPES)
    for _, row in frame.iterrows():
        assert mpt_params(row.Model, int(row["SeqLen (T)"])) == int(row.NumParams)
    assert mpt_params("7b", 2048) != mpt_params("7b", 4096)


def test_foundry_rows_all_predicted_and_fit(reference):
    """All 216 llm-foundry rows (the 78 on A100 40GB included) are predicted
    and predicted to fit; FULL_SHARD rows shard weights, SHARD_GRAD_OP rows
    do not but shard gradients; PURE rows reduce gradients in bf16."""
    from autopar.studies.published import PublishedCase, TABLES, cases, predict
    table = TABLES["llm_foundry_mpt"]
    rows = predict(table, rank=False)
    assert len(rows) == 216
    assert (rows.status == "predicted").all() and rows.feasible.all()
    assert rows.label.str.contains("a100_40gb").sum() == 78
    got = [c for _, c in cases(table)]
    assert all(isinstance(c, PublishedCase) for c in got)
    zero2 = [c for c in got if not c.execution.get("weight_sharding", False)]
    assert zero2 and all(c.execution["optimizer_sharding"]
                         and not c.execution.get("unsharded_grads", False) for c in zero2)
    a100_40 = [c for c in got if c.system.name == "a100_40g"]
    assert len(a100_40) == 78 and all(not c.execution.get("fp32_grads", False) for c in a100_40)
    assert a100_40[0].system.mem1.GiB == 40 and a100_40[0].system.mem1.GBps == 1555


def test_launcher_rows_all_predicted_and_fit(reference):
    """Every NeMo-Launcher row is predicted to fit with the launcher's default
    layouts; the convergence run's 1440 global batch on 160 GPUs takes
    micro-batch 3."""
    from autopar.studies.published import TABLES, cases, predict
    table = TABLES["nemo_launcher_a100"]
    rows = predict(table, rank=False)
    assert len(rows) == 12
    assert (rows.status == "predicted").all() and rows.feasible.all()
    conv = [c for _, c in cases(table) if c.execution["batch_size"] == 1440]
    assert len(conv) == 1 and conv[0].execution["microbatch_size"] == 3
    big = [c for _, c in cases(table) if c.model.num_blocks == 96]
    assert big and all(c.execution["tensor_par"] == 4 and c.execution["pipeline_par"] == 8
                       and c.execution.get("pipeline_interleaving") == 12 for c in big)


@pytest.mark.parametrize("name", ["llm_foundry_mpt", "nemo_launcher_a100"])
def test_tables_are_registered(name):
    from autopar.studies.published import TABLES
    assert name in TABLES and TABLES[name].framework
