"""A request's sampling parameters (host-side, no torch: the scheduler and the stress import them), and the
stress's: the sampler's worst paths (engine.sampling samples them)."""
from __future__ import annotations

from dataclasses import dataclass

PREFILTER = 1024  # top-k via torch.topk up to this k; top-p searched in this many tokens first
MAX_LOGPROBS = 20  # most top logprobs a row asks for (OpenAI's bound; autoprofile.engine.logprobs)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = 0  # 0 = whole vocabulary
    seed: int | None = None  # OpenAI `seed`: the engine gives the request its own seed stream (SeedStream)
    # raw-logit logprobs (autoprofile.engine.logprobs): of each sampled token with its top `logprobs`; of
    # each prompt token (but the first) with its top `prompt_logprobs`. None: not computed.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # logits processors (autoprofile.engine.logits_process, vLLM's semantics)
    presence_penalty: float = 0.0  # output tokens: logit -= presence * (count > 0)
    frequency_penalty: float = 0.0  # output tokens: logit -= frequency * count
    repetition_penalty: float = 1.0  # prompt and output tokens: positive logits / r, negative * r
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    min_p: float = 0.0  # sampled rows: keep tokens whose probability >= min_p * the row's largest
    min_tokens: int = 0  # stop tokens (EOS, stop_token_ids) masked until this many tokens are out

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int)
                                  or not 0 <= k <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {k!r}")
        if not -2 <= self.presence_penalty <= 2 or not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"presence_penalty and frequency_penalty must be in [-2, 2], got "
                             f"{self.presence_penalty}, {self.frequency_penalty}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if any(not -100 <= b <= 100 for _, b in self.logit_bias):
            raise ValueError(f"logit_bias values must be in [-100, 100], got {self.logit_bias}")

    @property
    def penalized(self) -> bool:
        """Whether a penalty reads the row's token counts."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def processed(self) -> bool:
        """Whether a logits processor runs on the row (host-side: a batch with none skips them all)."""
        return (self.penalized or bool(self.logit_bias) or self.min_tokens > 0
                or (self.min_p > 0 and self.temperature > 0))


GREEDY = SamplingParams()
# The sampler's memory worst case (top_k above PREFILTER: the full sort, SORT_ROWS rows at a time)
# Every stress row runs every logits processor too (their per-row transients: logits_process), with a bias
# and a min_tokens that masks its stop tokens.
# min_p's memory does not depend on its value; 1e-6 masks nothing that STRESS_WIDE's nucleus would keep.
PROCESSORS = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2, min_p=1e-6,
                  min_tokens=1 << 30, logit_bias=((0, 1.0),))
# Every stress row asks for the most logprobs, of its sampled token and of each of its prompt tokens
STRESS = SamplingParams(temperature=0.8, top_p=0.9, top_k=PREFILTER + 1, logprobs=MAX_LOGPROBS,
                        prompt_logprobs=MAX_LOGPROBS, **PROCESSORS)
# The other memory-heavy path: top-p without top-k whose nucleus outgrows the prefilter (a temperature
# of 10 flattens any logits), so every row is prefiltered and then sorted. On an H200 it peaked 0.1% above
# STRESS (330.9 vs 330.6 MB at 256 rows): the stress samples with both (autoprofile.engine.stress).
STRESS_WIDE = SamplingParams(temperature=10.0, top_p=0.99, logprobs=MAX_LOGPROBS,
                             prompt_logprobs=MAX_LOGPROBS, **PROCESSORS)
STRESS_PARAMS = (STRESS, STRESS_WIDE)
