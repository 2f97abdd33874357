"""SamplingParams and the numpy reference sampler every stage uses.

Order of operations (the same as vLLM / transformers' logits processors):
  1. penalties   repetition (prompt + output, divides positive logits),
                 presence and frequency (output only, subtract)
  2. greedy      temperature == 0 -> argmax, nothing else applies
  3. temperature logits / T
  4. filters     top-k, then top-p (nucleus), then min-p; excluded tokens get -inf
  5. draw        from the softmax of what is left, with the request's own RNG
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from common.config import ConfigError, read_json

GREEDY_BELOW = 1e-5                   # a temperature below this is greedy (as vLLM's _SAMPLING_EPS)
NO_TOKEN = -1                         # Sampler's answer to logits with no distribution in them


@dataclass
class SamplingParams:
    temperature: float = 1.0          # 0 = greedy
    top_k: int = 0                    # keep the k most likely tokens; 0 (or -1) = off
    top_p: float = 1.0                # keep the smallest set whose probability reaches top_p
    min_p: float = 0.0                # drop tokens below min_p * p(most likely)
    repetition_penalty: float = 1.0   # >1 discourages any token already seen (prompt or output)
    presence_penalty: float = 0.0     # subtracted once from every token already in the output
    frequency_penalty: float = 0.0    # subtracted per occurrence in the output
    seed: int | None = None           # per-request RNG seed: same seed, same tokens
    max_tokens: int = 512             # tokens to generate at most
    # stop strings (matched on text by the outer layer)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)  # extra ids that end the sequence
    ignore_eos: bool = False          # keep generating past end-of-sequence ids (benchmarks)

    def __post_init__(self):
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        names = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty")
        # NaN and inf pass no comparison below, or turn logits into NaN
        for name in names:
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, numbers.Real)
                    or not math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if 0 < self.temperature < GREEDY_BELOW:
            # logits / 1e-30 overflow float32: that close to 0 is greedy
            self.temperature = 0.0
        checks = [
            (self.temperature >= 0, "temperature must be >= 0"),
            (isinstance(self.top_k, int) and self.top_k >= 0,
             "top_k must be a non-negative integer (0 or -1 = off)"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1,
             "max_tokens must be a positive integer"),
            (all(isinstance(s, str) and s for s in self.stop),
             "stop must be a non-empty string or a list of them"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids must be non-negative integers"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @classmethod
    def from_generation_config(cls, folder: str | Path | None, **overrides) -> "SamplingParams":
        """Defaults from the model's generation_config.json, then the caller's overrides
        (None values in overrides are ignored, so a request's missing fields keep the defaults)."""
        return cls.from_defaults(generation_defaults(folder), **overrides)

    @classmethod
    def from_defaults(cls, defaults: dict, **overrides) -> "SamplingParams":
        """`defaults` (from generation_defaults(), read once), then the non-None overrides."""
        values = dict(defaults)
        names = {f.name for f in fields(cls)}
        for key, value in overrides.items():
            if key not in names:
                raise TypeError(f"unknown sampling parameter {key!r}")
            if value is not None:
                values[key] = value
        return cls(**values)


def generation_defaults(folder: str | Path | None) -> dict:
    """The sampling defaults in a model folder's generation_config.json ({} without one), its
    max_new_tokens as max_tokens (as vLLM reads it). A server reads them once, at start-up."""
    values: dict = {}
    path = Path(folder) / "generation_config.json" if folder else None
    if path is not None and path.is_file():
        g = read_json(path)
        # presence / frequency: not Hugging Face keys, but a file may name them (ours does)
        for key in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty"):
            if g.get(key) is not None:
                values[key] = g[key]
        if g.get("do_sample") is False:
            values["temperature"] = 0.0
        if g.get("max_new_tokens") is not None:
            values["max_tokens"] = g["max_new_tokens"]
        try:
            SamplingParams(**values)      # a bad default fails here, naming the file
        except ValueError as e:
            raise ConfigError(f"{path}: {e}") from None
    return values


def apply_penalties(logits: np.ndarray, params: SamplingParams,
                    prompt_ids: list[int], output_ids: list[int]) -> np.ndarray:
    """logits [V] -> a penalised copy [V] (float32)."""
    logits = np.array(logits, dtype=np.float32, copy=True)
    # exercise 1.12 begin
    if params.repetition_penalty != 1.0:
        seen = np.unique(np.asarray(list(prompt_ids) + list(output_ids), dtype=np.int64))
        if seen.size:
            x = logits[seen]
            logits[seen] = np.where(
                x > 0, x / params.repetition_penalty, x * params.repetition_penalty)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        ids, counts = np.unique(np.asarray(output_ids, dtype=np.int64), return_counts=True)
        logits[ids] -= (
            params.presence_penalty + params.frequency_penalty * counts.astype(np.float32))
    # exercise 1.12 end
    return logits


def filter_logits(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Temperature, then top-k / top-p / min-p: excluded tokens become -inf.  [V] -> [V]"""
    logits = logits.astype(np.float32) / np.float32(params.temperature)
    # exercise 1.13 begin
    V = logits.shape[0]
    if 0 < params.top_k < V:
        kth = np.partition(logits, V - params.top_k)[V - params.top_k]   # k-th largest value
        logits[logits < kth] = -np.inf
    if params.top_p < 1.0 or params.min_p > 0.0:
        # float64: the cumulative mass of a 150k vocabulary in float32 drifts by ~1e-4,
        # enough to move the top-p cut by a token; ties at the cut are then decided by it
        probs = _softmax(logits.astype(np.float64))
        if params.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cum = np.cumsum(probs[order])
            # keep every token whose preceding mass is below top_p (the most likely token always
            # stays)
            keep_sorted = (cum - probs[order]) < params.top_p
            drop = order[~keep_sorted]
            logits[drop] = -np.inf
            probs[drop] = 0.0
        if params.min_p > 0.0:
            logits[probs < params.min_p * probs.max()] = -np.inf
    # exercise 1.13 end
    return logits


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


class Sampler:
    """One request's sampler: its parameters and its own random generator."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray, prompt_ids: list[int], output_ids: list[int]) -> int:
        """logits [V] of the last position -> the next token id, or NO_TOKEN (the request ends)."""
        p = self.params
        logits = apply_penalties(logits, p, prompt_ids, output_ids)
        logits = filter_logits(logits, p) if p.temperature else logits   # / T, -inf where excluded
        if not np.isfinite(logits.max()):                                 # NaN, +inf, or all -inf
            return NO_TOKEN
        if p.temperature == 0.0:
            return int(np.argmax(logits))
        probs = _softmax(logits.astype(np.float64))                     # [V], sums to 1 in float64
        return int(self.rng.choice(probs.shape[0], p=probs))
