"""Draw statistics shared by the samplers' interpreter scripts (unit_tests/test_triton_sample.py,
unit_tests/test_triton_sample_topk.py): they run in a fresh Python with the repository on its path."""
from __future__ import annotations

import torch


def chi2_ok(counts: torch.Tensor, want: torch.Tensor, n: int) -> bool:
    """Whether `n` draws binned as `counts` follow the probabilities `want`: Pearson's statistic over the
    tokens `want` keeps against its 1e-6 tail (Wilson-Hilferty); a draw outside them fails at once."""
    support = want > 0
    assert counts[~support].sum() == 0, (counts, want)
    df = int(support.sum()) - 1
    if df == 0:
        return True
    e = n * want[support]
    stat = float(((counts[support] - e) ** 2 / e).sum())
    return stat <= df * (1 - 2 / (9 * df) + 4.75 * (2 / (9 * df)) ** 0.5) ** 3
