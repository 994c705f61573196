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
