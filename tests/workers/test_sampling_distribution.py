"""The sampler's token frequencies against the exact distribution, computed in float64.

For each option (temperature, top-k, top-p, min-p, penalties and their combinations) a row of
logits is repeated NUM_DRAWS times, one token is drawn per row, and the counts are compared
with NUM_DRAWS x the exact probabilities by Pearson's chi-square statistic. The bound is a p-value of 1e-6: a
correct sampler falls below it once in a million runs (every draw here is seeded, so a run is
fixed), a token drawn that the exact distribution gives 0 fails at once, and the same bound
rejects a sampler whose nucleus is off by one token
(test_bound_rejects_a_nucleus_off_by_one_token). The sampler this one replaced, an
exponential race over the masked softmax, passes it too (the "previous" sampler below).

The exact distribution is computed here on its own, from the definitions: divide by the
temperature; rank the tokens by logit (ties by index); keep the first k; keep a token while the
kept tokens before it hold less than top_p of the top-k set's probability; keep p >= min_p *
p_max; renormalize.
"""

from __future__ import annotations

import math

import pytest
import torch

from scheduler.sampling_params import SamplingParams
from workers.kernels.sampling import RowParams, apply_penalties, native_sampler_available, sample_rows_torch
from workers.sampler import Sampler, SamplingBatch

NUM_DRAWS = 100_000
VOCAB = 48
P_VALUE_BOUND = 1e-6


def skewed_logits() -> list[float]:
    """Probabilities decaying by about 0.7 a rank, so every boundary token holds 1% or more, with
    the ranks scattered over the indices (the draw walks the vocabulary in index order)."""
    generator = torch.Generator().manual_seed(5)
    ranked = [3.0 - 0.35 * rank + 0.05 * float(torch.rand(1, generator=generator)) for rank in range(VOCAB)]
    order = torch.randperm(VOCAB, generator=generator).tolist()
    logits = [0.0] * VOCAB
    for rank, index in enumerate(order):
        logits[index] = ranked[rank]
    return logits


HISTORY = [4, 17, 30, 17, 9, 9, 9]  # prompt, then output
NUM_PROMPT = 3

CASES = {
    "temperature": SamplingParams(temperature=1.0),
    "low temperature": SamplingParams(temperature=0.6),
    "high temperature": SamplingParams(temperature=1.7),
    "top-k": SamplingParams(temperature=1.0, top_k=6),
    "top-p": SamplingParams(temperature=1.0, top_p=0.8),
    "min-p": SamplingParams(temperature=1.0, min_p=0.05),
    "top-k + top-p": SamplingParams(temperature=0.9, top_k=8, top_p=0.85),
    "top-p + min-p": SamplingParams(temperature=1.3, top_p=0.9, min_p=0.03),
    "top-k + top-p + min-p": SamplingParams(temperature=1.1, top_k=12, top_p=0.95, min_p=0.01),
    "repetition": SamplingParams(temperature=1.0, repetition_penalty=1.5),
    "presence + frequency": SamplingParams(temperature=1.0, presence_penalty=0.7, frequency_penalty=0.4),
    "penalties + top-p": SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.3, presence_penalty=0.3,
                                        frequency_penalty=0.2),
}


def exact_distribution(logits: list[float], p: SamplingParams, history: list[int] = (), num_prompt: int = 0) -> list[float]:
    x = [float(value) for value in logits]
    output = list(history[num_prompt:])
    for token in set(history):
        if p.repetition_penalty != 1.0:
            x[token] = x[token] / p.repetition_penalty if x[token] > 0 else x[token] * p.repetition_penalty
        count = output.count(token)
        x[token] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    scaled = [value / p.temperature for value in x]
    top = max(scaled)
    weight = [math.exp(value - top) for value in scaled]
    ranked = sorted(range(len(x)), key=lambda i: (-scaled[i], i))
    if p.top_k is not None:
        ranked = ranked[: p.top_k]
    total = sum(weight[i] for i in ranked)
    kept, before = [], 0.0
    for i in ranked:
        if before >= p.top_p * total:
            break
        kept.append(i)
        before += weight[i]
    kept = [i for i in kept if weight[i] >= p.min_p]  # p_i >= min_p p_max: the top token's weight is 1
    mass = sum(weight[i] for i in kept)
    probs = [0.0] * len(x)
    for i in kept:
        probs[i] = weight[i] / mass
    return probs


def chi_square(counts: list[int], probs: list[float], n: int) -> tuple[float, int]:
    """(Pearson's statistic, degrees of freedom); inf if a token of probability 0 was drawn.
    The least likely tokens are pooled into one cell until it expects 5 draws, the usual rule
    for the chi-square approximation (a token expected 0.002 times and drawn once would
    otherwise add 500)."""
    if any(count and prob == 0.0 for count, prob in zip(counts, probs)):
        return math.inf, 0
    cells = sorted((n * prob, count) for count, prob in zip(counts, probs) if prob > 0.0)
    pooled_expected = pooled_count = 0.0
    while cells and pooled_expected < 5.0:
        expected, count = cells.pop(0)
        pooled_expected += expected
        pooled_count += count
    cells.append((pooled_expected, pooled_count))
    statistic = sum((count - expected) ** 2 / expected for expected, count in cells)
    return statistic, len(cells) - 1


def p_value(statistic: float, df: int) -> float:
    """P(a chi-square variable of df degrees of freedom > statistic): the regularized upper
    incomplete gamma Q(df / 2, statistic / 2), by its series below a + 1 and its continued
    fraction above (modified Lentz). df 0 (one kept token): 1 if statistic is 0, else 0."""
    if df == 0:
        return 1.0 if statistic == 0.0 else 0.0
    if math.isinf(statistic):
        return 0.0
    a, x = df / 2.0, statistic / 2.0
    scale = math.exp(-x + a * math.log(x) - math.lgamma(a)) if x > 0 else 0.0
    if x < a + 1.0:
        term = total = 1.0 / a
        n = 0
        while term > total * 1e-16:
            n += 1
            term *= x / (a + n)
            total += term
        return 1.0 - scale * total
    b, c, d = x + 1.0 - a, 1e300, 1.0 / (x + 1.0 - a)
    fraction = d
    for i in range(1, 10_000):
        term = -i * (i - a)
        b += 2.0
        d = term * d + b
        d = 1.0 / (d if abs(d) > 1e-300 else 1e-300)
        c = b + term / c
        c = c if abs(c) > 1e-300 else 1e-300
        fraction *= d * c
        if abs(d * c - 1.0) < 1e-16:
            break
    return scale * fraction


def previous_sampler(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """The sampler this one replaced: scaled logits, one sort for top-k and top-p, min-p on the
    masked softmax, then argmax(probs / E), E ~ Exp(1) per token (an exponential race)."""
    scaled = logits / p.temperature
    vocab = scaled.shape[1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab)
    sorted_logits = sorted_logits.masked_fill(ranks >= (p.top_k or vocab), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    sorted_logits = sorted_logits.masked_fill(probs.cumsum(dim=-1) - probs >= p.top_p, float("-inf"))
    scaled = torch.full_like(scaled, float("-inf")).scatter_(1, order, sorted_logits)
    probs = scaled.softmax(dim=-1)
    scaled = scaled.masked_fill(probs < p.min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    probs = scaled.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def draw(sampler_name: str, p: SamplingParams, n: int = NUM_DRAWS) -> list[int]:
    logits = torch.tensor([skewed_logits()], dtype=torch.float32).repeat(n, 1)
    batch = SamplingBatch([p] * n, list(range(n)), [HISTORY] * n, [NUM_PROMPT] * n)
    if sampler_name == "kernel":
        if not native_sampler_available():
            pytest.skip("the C kernels do not build here")
        tokens = Sampler(seed=1).sample(logits, batch).token_ids
    else:
        one = SamplingBatch([p], [0], [HISTORY], [NUM_PROMPT])  # every row is this one: penalize it once
        penalized = apply_penalties(logits[:1], Sampler().row_params(one)).repeat(n, 1)
        if sampler_name == "torch":
            tokens = sample_rows_torch(penalized, Sampler(seed=2).row_params(batch)).tolist()
        else:
            tokens = previous_sampler(penalized, p, torch.Generator().manual_seed(3)).tolist()
    return torch.bincount(torch.tensor(tokens), minlength=VOCAB).tolist()


@pytest.mark.parametrize("sampler_name", ["kernel", "torch", "previous"])
@pytest.mark.parametrize("case", list(CASES))
def test_token_frequencies_follow_the_exact_distribution(case: str, sampler_name: str):
    p = CASES[case]
    probs = exact_distribution(skewed_logits(), p, HISTORY, NUM_PROMPT)
    statistic, df = chi_square(draw(sampler_name, p), probs, NUM_DRAWS)
    assert p_value(statistic, df) >= P_VALUE_BOUND, f"{case}: chi-square {statistic:.1f} over {df} degrees of freedom"


def test_exact_distribution_cuts_where_the_definitions_say():
    """The float64 reference itself, on the test logits: what each filter keeps."""
    logits = skewed_logits()
    ranked = sorted(range(VOCAB), key=lambda i: -logits[i])
    kept = lambda params: [i for i, prob in enumerate(exact_distribution(logits, params)) if prob > 0]  # noqa: E731
    assert sorted(kept(SamplingParams(top_k=6))) == sorted(ranked[:6])
    weights = [math.exp(logits[i] - logits[ranked[0]]) for i in ranked]
    mass = [sum(weights[:r]) / sum(weights) for r in range(VOCAB)]  # held by the ranks before r
    nucleus = next(r for r in range(VOCAB) if mass[r] >= 0.8)
    assert sorted(kept(SamplingParams(top_p=0.8))) == sorted(ranked[:nucleus])
    assert min(exact_distribution(logits, SamplingParams(top_p=0.8))[i] for i in ranked[:nucleus]) > 0.01
    assert all(weights[r] >= 0.05 for r in range(len(kept(SamplingParams(min_p=0.05)))))


@pytest.mark.parametrize("case", ["top-p", "top-k + top-p", "top-p + min-p"])
def test_bound_rejects_a_nucleus_off_by_one_token(case: str):
    """Draws from the exact distribution with the nucleus's last token dropped, or the next one
    added (at its share of the mass), fail the bound the samplers pass."""
    p = CASES[case]
    probs = exact_distribution(skewed_logits(), p)
    kept = [i for i, prob in enumerate(probs) if prob > 0]
    last = min(kept, key=lambda i: probs[i])
    scaled = [value / p.temperature for value in skewed_logits()]
    outside = max((i for i in range(VOCAB) if probs[i] == 0), key=lambda i: scaled[i])
    generator = torch.Generator().manual_seed(4)
    for wrong in ([0.0 if i == last else prob for i, prob in enumerate(probs)],
                  [prob + (math.exp(scaled[i] - scaled[last]) * probs[last] if i == outside else 0.0)
                   for i, prob in enumerate(probs)]):
        tokens = torch.multinomial(torch.tensor(wrong, dtype=torch.float64), NUM_DRAWS, replacement=True,
                                   generator=generator)
        statistic, df = chi_square(torch.bincount(tokens, minlength=VOCAB).tolist(), probs, NUM_DRAWS)
        assert p_value(statistic, df) < P_VALUE_BOUND


def test_p_value_at_known_quantiles():
    """The chi-square's upper 1e-6 quantiles (computed to 12 digits with mpmath), and two
    everyday values: the median of 1 degree of freedom and the 0.05 point of 10."""
    for df, quantile in [(1, 23.9281269769), (5, 35.8881868797), (10, 46.8630468468), (47, 108.177128697)]:
        assert p_value(quantile, df) == pytest.approx(1e-6, rel=1e-6)
    assert p_value(0.454936423, 1) == pytest.approx(0.5, rel=1e-6)
    assert p_value(18.3070380533, 10) == pytest.approx(0.05, rel=1e-6)


def test_mixed_batch_rows_keep_their_own_parameters():
    """Rows of three parameter sets interleaved in one batch: each set's draws follow its own
    distribution (the kernel reads each row's parameters, not its neighbours')."""
    if not native_sampler_available():
        pytest.skip("the C kernels do not build here")
    params = [CASES["top-k"], CASES["top-p"], SamplingParams(temperature=0.0)]
    n = 3 * 40_000
    logits = torch.tensor([skewed_logits()], dtype=torch.float32).repeat(n, 1)
    rows = [params[row % 3] for row in range(n)]
    tokens = torch.tensor(Sampler(seed=6).sample(logits, SamplingBatch(rows, [0] * n, [[]] * n, [0] * n)).token_ids)
    for offset, p in enumerate(params[:2]):
        counts = torch.bincount(tokens[offset::3], minlength=VOCAB).tolist()
        statistic, df = chi_square(counts, exact_distribution(skewed_logits(), p), n // 3)
        assert p_value(statistic, df) >= P_VALUE_BOUND
    assert set(tokens[2::3].tolist()) == {max(range(VOCAB), key=lambda i: skewed_logits()[i])}


def test_torch_path_takes_the_same_tokens_from_the_same_numbers():
    """sample_rows_torch is the kernel's oracle: given the same uniform numbers, the same tokens."""
    if not native_sampler_available():
        pytest.skip("the C kernels do not build here")
    from workers.kernels.sampling import sample_rows_native

    n = 2000
    logits = torch.tensor([skewed_logits()], dtype=torch.float32).repeat(n, 1)
    for p in CASES.values():
        rows = RowParams.of([p.temperature] * n, [p.top_k or 0] * n, [p.top_p] * n, [p.min_p] * n,
                            torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(7)))
        assert sample_rows_native(logits, rows).tolist() == sample_rows_torch(logits, rows).tolist()
