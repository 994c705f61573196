"""The NeMo long-sequence table's throughput: the page's TFLOP/s per GPU read
back into tokens/s with the FLOP count NeMo reported them with
(docs/validation.md, "Long-context attention under context parallelism,
counted")."""
import pandas as pd
import pytest

from autopar.studies.published import TABLES, cases, published_dir
from autopar.studies.published_base import flops_per_token, model


def _nemo_v230_flops_per_token(name: str, seq: int, vocab: int) -> float:
    """NVIDIA/NeMo nemo/utils/flops_formulas.py ``llama3`` (and ``llama2``,
    the same bracket) at v2.3.0, divided by the tokens of the batch
    (gbs * seq): L h^2 (12 + 12 g/a + 18 f/h + 12 s/h + 6 V / (L h)); the
    attention core term 12 s/h is the whole square (no causal half before
    6251117f4c)."""
    h, L, a, g, f = {"llama3-8B": (4096, 32, 32, 8, 14336),
                     "llama2-7B": (4096, 32, 32, 32, 11008)}[name]
    return L * h * h * (12 + 12 * g / a + 18 * f / h + 12 * seq / h + 6 * vocab / (L * h))


@pytest.mark.parametrize("name,vocab", [("llama3-8B", 128256), ("llama2-7B", 32000)])
@pytest.mark.parametrize("seq", [4096, 131072, 1048576])
def test_flops_per_token_is_nemo_v230_formula(name, vocab, seq):
    m = model(name, seq_size=seq)
    assert m.vocab_size == vocab
    assert flops_per_token(m) == pytest.approx(_nemo_v230_flops_per_token(name, seq, vocab),
                                               rel=1e-12)


def test_long_cp_tokens_from_tflops_with_the_whole_square():
    """Every row's measured tokens/s is the page's TFLOP/s over NeMo's count;
    at 1M tokens that is about half of what the causal half would give."""
    table = TABLES["nemo_long_cp"]
    frame = pd.read_csv(published_dir() / table.csv)
    seen = 0
    for idx, c in cases(table):
        row = frame.iloc[idx]
        name = {"LLAMA3-8B": "llama3-8B", "LLAMA2-7B": "llama2-7B"}[row.model]
        per_token = _nemo_v230_flops_per_token(name, int(row.seq_len), c.model.vocab_size)
        tok = float(row.tflops_per_gpu_with_cp) * 1e12 / per_token
        assert c.measured["tokens_per_s_per_gpu"] == pytest.approx(tok, rel=1e-9), c.label
        if int(row.seq_len) == 1048576:
            core = 6 * c.model.num_blocks * int(row.seq_len) * c.model.attn_heads \
                * c.model.attn_size
            causal = float(row.tflops_per_gpu_with_cp) * 1e12 / (per_token - core)
            assert 1.9 < causal / tok < 2.0, c.label
        seen += 1
    assert seen == 17


def test_nemo1_launcher_rows_run_flash_attention_2():
    """NeMo 1.x's launcher exports NVTE_FUSED_ATTN=0 (docs/validation.md,
    "Long-context rows, round 2"): its H100 rows, with context parallelism or
    without, run FlashAttention-2 at its published 35% of the dense peak
    (the llm-foundry H100 rows' figure, one system builder for both); the
    NeMo 2 (25.04) B200 rows keep the model's default (cuDNN attention,
    which NeMo's performance scripts turn on)."""
    from autopar.studies.published_base import system_attention_at
    from autopar.studies.published_foundry import FA2_H100_PEAK_FRACTION, foundry_system
    assert foundry_system("h100_80g_nvl8") is system_attention_at(
        "h100_80g_nvl8", "llm-foundry", FA2_H100_PEAK_FRACTION)
    seen = {"h100": 0, "b200": 0}
    for name in ("nemo_long_cp", "nemo_h100"):
        for _, c in cases(TABLES[name]):
            t = c.system.time_overhead
            if "B200" in c.label:
                assert not t.attention_speed, c.label
                seen["b200"] += 1
                continue
            plateau = max(e for _, e in c.system.matrix["bfloat16"].gflops_efficiency)
            assert t.attention_speed * plateau == pytest.approx(FA2_H100_PEAK_FRACTION, abs=1e-4)
            assert not t.attention_backward_speed and not t.attention_tile
            seen["h100"] += 1
    assert seen == {"h100": 9 + 18, "b200": 8}


def test_long_cp_h100_rows_within_the_bar_and_b200_rows_still_fast():
    """With FlashAttention-2 the H100 rows' error no longer grows with the
    attention's share (+8% at 4k to +64% at 1M before): every row within
    7%.  The B200 rows: +21% to +27% fast on every row on the model's
    one attention rate; with the B200 files' measured attention rates by
    call size (``attention`` record, SimuMax's TE measurements; docs/
    validation.md "Attention kernel rates by shape (hardware record)")
    +12% to +27%, the long rows (256k-1M: 64k-token local blocks of 8
    heads per rank, 8.8 TFLOP a call, read at the 4.4 TFLOP measurement:
    58% / 44% of the peak forward / backward) +12% to +15%."""
    from autopar.studies.published import predict
    rows = predict(TABLES["nemo_long_cp"], rank=False)
    assert len(rows) == 17 and rows.feasible.all()
    h100 = rows[rows.label.str.contains("H100")]
    b200 = rows[rows.label.str.contains("B200")]
    assert len(h100) == 9 and len(b200) == 8
    assert h100.tok_error.abs().max() < 0.07
    assert (b200.tok_error > 0.10).all() and (b200.tok_error < 0.28).all()
    longest = b200[b200.label.str.contains(r"seq (?:262144|524288|1048576) ")]
    assert len(longest) == 3 and (longest.tok_error < 0.15).all()
