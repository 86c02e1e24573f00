"""Sampling from a TransformerLM with its KV cache: temperature, top-k and nucleus (top-p).

Shape legend: B sequences (1 here), T prompt tokens, V vocabulary.

The prompt is run once through the model with a fresh cache; every further token costs one
single-token forward that attends over the cache (cached decoding gives the same logits as a full
forward pass: docs/interfaces.md). Mixture-of-Depths models switch to their causal router in
cache mode by themselves, so nothing here is model-specific.

Long generations: a model trained on chunks of T tokens has seen at most its context (plus one
chunk of XL memory) behind any token. ``window`` bounds the tokens in the cache: when the next
token would exceed it, the cache is rebuilt from the last ``window // 2`` tokens, so the model
never attends further back than it was trained to (None keeps everything; the CLI uses 2T for XL
models and T otherwise).
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

import torch


def filter_logits(logits_BV: torch.Tensor, *, top_k: int | None = None,
                  top_p: float | None = None) -> torch.Tensor:
    """Logits with every token outside the top-k and outside the nucleus set to -inf.

    top_p keeps the smallest set of most probable tokens whose probability reaches ``top_p``
    (the token that crosses the threshold is kept, so at least one token always survives)."""
    out = logits_BV.clone()
    V = out.shape[-1]
    if top_k is not None and top_k < V:
        kth_B1 = torch.topk(out, top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth_B1, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_BV, order_BV = torch.sort(out, dim=-1, descending=True)
        probs_BV = torch.softmax(sorted_BV, dim=-1)
        # Mass strictly before each token: a token is dropped once that already reaches top_p.
        before_BV = torch.cumsum(probs_BV, dim=-1) - probs_BV
        drop_sorted_BV = before_BV >= top_p
        drop_BV = torch.zeros_like(drop_sorted_BV).scatter(-1, order_BV, drop_sorted_BV)
        out = out.masked_fill(drop_BV, float("-inf"))
    return out


def sample_next(logits_BV: torch.Tensor, *, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Token ids [B]: argmax when ``temperature`` == 0, else a sample of the filtered softmax."""
    logits_BV = logits_BV.float()
    if temperature == 0:
        return logits_BV.argmax(-1)
    filtered_BV = filter_logits(logits_BV / temperature, top_k=top_k, top_p=top_p)
    probs_BV = torch.softmax(filtered_BV, dim=-1)
    return torch.multinomial(probs_BV.cpu(), 1, generator=generator).squeeze(-1).to(
        logits_BV.device)


# One call's limit: more is almost always a typo (and would run for hours on a CPU); streaming
# re-decodes the continuation per token, which stays cheap up to this length.
MAX_NEW_TOKENS = 10_000


def check_sampling_args(max_new_tokens: int, temperature: float, top_k: int | None,
                        top_p: float | None) -> None:
    if max_new_tokens < 0 or max_new_tokens > MAX_NEW_TOKENS:
        raise ValueError(f"max_new_tokens must lie in [0, {MAX_NEW_TOKENS}], got "
                         f"{max_new_tokens}; generate longer texts in several calls")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must lie in (0, 1], got {top_p}")


def generate(model: torch.nn.Module, prompt_ids: Sequence[int], *, max_new_tokens: int = 100,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             seed: int | None = None, window: int | None = None,
             stop_ids: Sequence[int] = (),
             should_stop: Callable[[list[int]], bool] | None = None) -> list[int]:
    """The new token ids (not the prompt) sampled after ``prompt_ids``.

    Generation ends after a token in ``stop_ids`` or once ``should_stop(new_ids)`` is true
    (checked after every token; stop strings are tested on the decoded text this way)."""
    return list(iter_generate(model, prompt_ids, max_new_tokens=max_new_tokens,
                              temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                              window=window, stop_ids=stop_ids, should_stop=should_stop))


# Special tokens a document starts after, most specific first (Llama 3, Llama 2 / Mistral,
# Gemma, GPT-2 and Qwen).
START_TOKENS = ("<|begin_of_text|>", "<s>", "<bos>", "<|endoftext|>")


def start_ids(tokenizer) -> list[int]:
    """The prompt of unconditional sampling (an empty prompt): the tokenizer's start-of-document
    or end-of-text token when it has one, else a newline (byte-level and SentencePiece
    tokenizers, whose corpora separate documents by lines)."""
    lookups = [getattr(getattr(tokenizer, "tok", None), "token_to_id", None),
               getattr(getattr(tokenizer, "encoder", None), "get", None)]
    for lookup in lookups:
        if lookup is None:
            continue
        for name in START_TOKENS:
            i = lookup(name)
            if i is not None and 0 <= int(i) < tokenizer.vocab_size:
                return [int(i)]
    ids = tokenizer.encode("\n")
    if not ids:
        raise ValueError(f"the {tokenizer.name} tokenizer has no start-of-text token and encodes "
                         "a newline to nothing: give a prompt")
    return ids[-1:]


def iter_generate(model: torch.nn.Module, prompt_ids: Sequence[int], *, max_new_tokens: int = 100,
                  temperature: float = 1.0, top_k: int | None = None,
                  top_p: float | None = None, seed: int | None = None,
                  window: int | None = None, stop_ids: Sequence[int] = (),
                  should_stop: Callable[[list[int]], bool] | None = None) -> Iterator[int]:
    """``generate``, yielding each new token id as soon as it is sampled (for streaming)."""
    with torch.no_grad():
        yield from _sample_loop(model, prompt_ids, max_new_tokens, temperature, top_k, top_p,
                                seed, window, stop_ids, should_stop)


def _sample_loop(model, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, window,
                 stop_ids, should_stop) -> Iterator[int]:
    check_sampling_args(max_new_tokens, temperature, top_k, top_p)
    if len(prompt_ids) == 0:
        raise ValueError("the prompt is empty: give at least one token (one character for byte "
                         "tokenizers)")
    V = model.config.vocab_size
    if min(prompt_ids) < 0 or max(prompt_ids) >= V:
        raise ValueError(f"prompt token ids must lie in [0, {V})")
    if window is not None and window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    was_training = model.training
    model.eval()
    try:
        tokens = list(prompt_ids)
        new: list[int] = []

        def prefill(ids: list[int]):
            cache = model.new_cache()
            out = model(torch.tensor([ids], dtype=torch.long, device=device), cache=cache)
            return cache, out.logits[:, -1], len(ids)

        too_long = window is not None and len(tokens) > window
        cache, logits_BV, cached = prefill(tokens[-(window // 2):] if too_long else tokens)
        stop = set(stop_ids)
        for _ in range(max_new_tokens):
            if not bool(torch.isfinite(logits_BV).all()):
                raise ValueError("the model's output is not finite (NaN or inf): its weights "
                                 "diverged in training; use an earlier checkpoint")
            next_B = sample_next(logits_BV, temperature=temperature, top_k=top_k, top_p=top_p,
                                 generator=generator)
            tok = int(next_B[0])
            yield tok
            new.append(tok)
            tokens.append(tok)
            if tok in stop or len(new) == max_new_tokens or (should_stop and should_stop(new)):
                break
            if window is not None and cached + 1 > window:
                cache, logits_BV, cached = prefill(tokens[-(window // 2):])
                continue
            out = model(next_B.view(1, 1), cache=cache)
            logits_BV = out.logits[:, -1]
            cached += 1
    finally:
        model.train(was_training)
