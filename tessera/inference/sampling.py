"""Choosing the next token: penalties, temperature, top-k, top-p, min-p, seeded sampling, log-probs.

    params = SamplingParams(temperature=0.7, top_p=0.9, seed=1, logprobs=2)
    samples = Sampler(vocab_size, eos_token_ids)(logits, requests)   # one row of logits per request

Order, as Hugging Face's logits processors: repetition penalty, presence and frequency
penalties, min_tokens (stop tokens masked), then for sampled rows temperature, top-k, top-p,
min-p, and a draw; temperature 0 takes the argmax of the penalised logits (greedy).

Semantics, and where Megatron's differ (megatron/core/inference/sampling_params.py, SamplingParams;
transformers' generation/logits_process.py):
- repetition_penalty: Hugging Face's (CTRL): every distinct token of the prompt and the
  output so far has its logit divided by the penalty when positive, multiplied when negative.
- presence/frequency penalties: OpenAI's: minus presence once per token that occurs in the
  output, minus frequency times its count there (output only, as vLLM). Megatron has no penalties.
- top-k and top-p together: applied one after the other (Hugging Face, vLLM); Megatron refuses
  the pair. top-p is Hugging Face's rule (sort ascending, drop tokens whose cumulative
  probability is <= 1 - top_p, always keep the most likely); top_p = 1 is off, where
  Megatron's "off" is 0. Ties at the k-th logit survive top-k, as in Hugging Face.
- min-p: Hugging Face's: drop tokens less likely than min_p times the most likely one.
- log-probs: of the model's own distribution (log-softmax of the raw logits, before any
  penalty or filter): Megatron's default `raw_logprobs`, and vLLM's.
- the draw: argmax(p / E) with E ~ Exp(1) is a sample from p (the exponential race) and
  needs no host sync. E comes from a counter-based hash of (seed, position of the new
  token, token id), not from a generator's state: a request's samples depend only on its
  seed and logits, not on the batch it shares, and every tensor-parallel rank draws the
  same tokens without talking. `seed=None` takes a seed from the engine's generator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops."""

    max_tokens: int = 16
    temperature: float = 1.0          # 0 = greedy
    top_k: int = 0                    # 0 = off
    top_p: float = 1.0                # in (0, 1]; 1 = off
    min_p: float = 0.0                # in [0, 1]; 0 = off
    repetition_penalty: float = 1.0   # > 0; 1 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    seed: int | None = None           # None: one drawn from the engine's generator
    logprobs: int | None = None       # None: none; 0: the chosen token's; n > 0: also the top n

    def validate(self) -> None:
        """Raise ValueError naming the first field out of range."""
        checks = (
            ("max_tokens", _is_int(self.max_tokens) and self.max_tokens >= 1, "an integer >= 1"),
            ("temperature", self.temperature >= 0, ">= 0"),
            ("top_k", _is_int(self.top_k) and self.top_k >= 0, "an integer >= 0 (0 = off)"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0, "> 0"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            ("stop_token_ids", all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "token ids >= 0"),
            ("min_tokens", _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
             "an integer in [0, max_tokens]"),
            ("seed", self.seed is None or _is_int(self.seed), "an integer or None"),
            ("logprobs", self.logprobs is None or (_is_int(self.logprobs) and self.logprobs >= 0),
             "None or an integer >= 0"),
        )
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class SampledRequest(Protocol):
    """What the sampler reads of a request."""

    params: SamplingParams
    seed: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass
class Samples:
    """One step's choice for each row: the token, and its log-probs where asked for."""

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[dict[int, float] | None]


class Sampler:
    """Picks one token per row of logits [rows, vocab] (fp32, the real vocabulary only)."""

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int] = ()):
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._token_hashes: torch.Tensor | None = None   # _mix32(token id), per device

    def __call__(self, logits: torch.Tensor, requests: Sequence[SampledRequest]) -> Samples:
        raw = logits
        logits = self._penalised(logits, requests)
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
        if sampled:
            index = torch.tensor(sampled, device=logits.device)
            chosen = self._draw(logits[index], [requests[i] for i in sampled])
            tokens = tokens.index_copy(0, index, chosen)
        token_ids = tokens.tolist()
        logprobs, top = _logprobs(raw, token_ids, [r.params.logprobs for r in requests])
        return Samples(token_ids, logprobs, top)

    def _penalised(self, logits: torch.Tensor, requests: Sequence[SampledRequest]) -> torch.Tensor:
        repetition = [i for i, r in enumerate(requests) if r.params.repetition_penalty != 1]
        if repetition:
            histories = [requests[i].prompt_token_ids + requests[i].output_token_ids for i in repetition]
            penalty = [requests[i].params.repetition_penalty for i in repetition]
            logits = _rows_update(logits, repetition, lambda rows: apply_repetition_penalty(
                rows, token_counts(histories, self.vocab_size, rows.device) > 0, _column(penalty, rows)))
        additive = [i for i, r in enumerate(requests) if r.params.presence_penalty or r.params.frequency_penalty]
        if additive:
            outputs = [requests[i].output_token_ids for i in additive]
            presence = [requests[i].params.presence_penalty for i in additive]
            frequency = [requests[i].params.frequency_penalty for i in additive]
            logits = _rows_update(logits, additive, lambda rows: apply_presence_frequency_penalties(
                rows, token_counts(outputs, self.vocab_size, rows.device), _column(presence, rows),
                _column(frequency, rows)))
        banned = [(i, self._stop_ids(r)) for i, r in enumerate(requests)
                  if len(r.output_token_ids) < r.params.min_tokens]
        banned = [(i, ids) for i, ids in banned if ids]
        if banned:
            logits = logits.clone()
            for i, ids in banned:
                logits[i, list(ids)] = float("-inf")
        return logits

    def _stop_ids(self, request: SampledRequest) -> tuple[int, ...]:
        eos = () if request.params.ignore_eos else self.eos_token_ids
        return tuple(t for t in (*eos, *request.params.stop_token_ids) if t < self.vocab_size)

    def _draw(self, logits: torch.Tensor, requests: Sequence[SampledRequest]) -> torch.Tensor:
        params = [r.params for r in requests]
        logits = logits / _column([p.temperature for p in params], logits)
        if any(p.top_k for p in params):
            logits = top_k_filter(logits, torch.tensor([p.top_k for p in params], device=logits.device))
        if any(p.top_p < 1 for p in params):
            logits = top_p_filter(logits, _column([p.top_p for p in params], logits))
        if any(p.min_p > 0 for p in params):
            logits = min_p_filter(logits, _column([p.min_p for p in params], logits))
        positions = [len(r.prompt_token_ids) + len(r.output_token_ids) for r in requests]
        noise = self.exponential_noise([r.seed for r in requests], positions, logits.device)
        return (logits.softmax(dim=-1) / noise).argmax(dim=-1)

    def exponential_noise(self, seeds: Sequence[int], positions: Sequence[int], device) -> torch.Tensor:
        """E ~ Exp(1) [rows, vocab] (fp32) from a hash of (seed, position, token id); no generator state."""
        if self._token_hashes is None or self._token_hashes.device != torch.device(device):
            self._token_hashes = _mix32(torch.arange(self.vocab_size, dtype=torch.int64, device=device))
        keys = torch.tensor([_row_key(s, p) for s, p in zip(seeds, positions)], dtype=torch.int64, device=device)
        bits = _mix32(keys[:, None] ^ self._token_hashes)
        uniform = (bits.double() + 0.5) * 2.0 ** -32    # in (0, 1): never log(0)
        return (-uniform.log()).float()


# -- the steps, each on a block of rows ------------------------------------------------

def token_counts(histories: Sequence[Sequence[int]], vocab_size: int, device) -> torch.Tensor:
    """How often each token occurs in each history: [len(histories), vocab_size] (fp32)."""
    longest = max(1, max(len(h) for h in histories))
    padded = torch.full((len(histories), longest), vocab_size, dtype=torch.int64)
    for row, history in enumerate(histories):
        padded[row, :len(history)] = torch.tensor(history, dtype=torch.int64)
    counts = torch.zeros(len(histories), vocab_size + 1, device=device)   # the last column takes the padding
    counts.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab_size]


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """CTRL / Hugging Face: seen tokens' logits divided by the penalty if positive, multiplied if not."""
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def apply_presence_frequency_penalties(logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor,
                                       frequency: torch.Tensor) -> torch.Tensor:
    """OpenAI: logit - frequency * count - presence * (count > 0), counts over the output so far."""
    return logits - frequency * counts - presence * (counts > 0).float()


def top_k_filter(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's top_k largest logits (and ties with the k-th); top_k 0 keeps all."""
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Hugging Face's nucleus rule: drop the tokens whose ascending cumulative probability is
    <= 1 - top_p; the most likely token always stays."""
    ascending, order = logits.sort(dim=-1)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1 - top_p
    drop[:, -1] = False
    return logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))


def min_p_filter(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's largest."""
    probs = logits.softmax(dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))


def _logprobs(raw: torch.Tensor, token_ids: list[int], wanted: list[int | None]
              ) -> tuple[list[float | None], list[dict[int, float] | None]]:
    rows = [i for i, n in enumerate(wanted) if n is not None]
    logprobs: list[float | None] = [None] * len(wanted)
    top: list[dict[int, float] | None] = [None] * len(wanted)
    if not rows:
        return logprobs, top
    index = torch.tensor(rows, device=raw.device)
    log_softmax = raw[index].log_softmax(dim=-1)
    chosen = log_softmax.gather(1, torch.tensor([[token_ids[i]] for i in rows], device=raw.device))[:, 0]
    most = max(wanted[i] for i in rows)
    values, ids = log_softmax.topk(min(most, raw.shape[-1]), dim=-1) if most else (None, None)
    for j, i in enumerate(rows):
        logprobs[i] = chosen[j].item()
        n = wanted[i]
        top[i] = dict(zip(ids[j, :n].tolist(), values[j, :n].tolist())) if n else {}
    return logprobs, top


def _rows_update(logits: torch.Tensor, rows: list[int], update) -> torch.Tensor:
    """logits with update(logits[rows]) written into those rows."""
    index = torch.tensor(rows, device=logits.device)
    return logits.index_copy(0, index, update(logits[index]))


def _column(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]


# -- counter-based noise: a 32-bit integer hash (Wellons' lowbias32) in int64 tensors ------

def _mul32(x, constant: int):
    """(x * constant) mod 2^32 for x in [0, 2^32), in halves so no int64 product overflows."""
    return (x * (constant & 0xFFFF) + (((x * (constant >> 16)) & 0xFFFF) << 16)) & _MASK32


def _mix32(x):
    """A bijection of [0, 2^32) that scatters nearby inputs (works on ints and int64 tensors)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _row_key(seed: int, position: int) -> int:
    seed %= 2**64
    return _mix32(_mix32(_mix32(seed & _MASK32) ^ (seed >> 32)) ^ (position & _MASK32))
