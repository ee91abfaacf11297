"""Chi-square goodness-of-fit checks for sampled tokens, at p = 0.001."""

import torch

# Chi-square critical values at p = 0.001, by degrees of freedom (used without scipy).
CHI2_CRITICAL_0_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 30: 59.703}


def critical(df: int) -> float:
    try:
        from scipy.stats import chi2
    except ImportError:
        return CHI2_CRITICAL_0_001[df]
    return float(chi2.ppf(0.999, df))


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Statistic and degrees of freedom of observed counts [..., V] against probs [..., V]
    (one independent goodness-of-fit test per leading index, summed). Categories with zero
    probability must never be observed."""
    probs = probs.reshape(-1, probs.shape[-1])
    counts = counts.reshape(probs.shape).double()
    assert counts[probs == 0].sum() == 0, "a token of probability zero was emitted"
    expected = counts.sum(dim=1, keepdim=True) * probs.double()
    support = probs > 0
    stat = ((counts - expected)[support] ** 2 / expected[support]).sum().item()
    return stat, int(support.sum().item()) - counts.shape[0]


def assert_distribution(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    stat, df = chi_square(torch.bincount(tokens, minlength=probs.shape[-1]), probs)
    assert stat < critical(df), f"chi-square {stat:.1f} >= critical at p=0.001 (df {df})"
