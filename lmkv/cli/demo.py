"""``lmkv demo``: cold vs warm time to first token on a locally built Llama.

Builds a random-weight Llama and a tokenizer on this machine (no download),
runs prompts that share a long prefix twice through the transformers
integration (first computing and storing their KV, then reusing it) and checks
that the reused KV gives exactly the tokens and logits of a full recompute.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

from lmkv.base.errors import ConfigError
from lmkv.metrics.tier_text import format_tier_stats


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    size = parser.add_argument_group("model size (default: the 'default' preset, ~75M params)")
    size.add_argument("--preset", choices=["tiny", "default"], default="default")
    size.add_argument("--hidden-size", type=int, help=_range("hidden_size"))
    size.add_argument("--layers", type=int, dest="num_layers", help=_range("num_layers"))
    size.add_argument("--heads", type=int, dest="num_heads", help=_range("num_heads"))
    size.add_argument("--kv-heads", type=int, dest="num_kv_heads",
                      help=_range("num_kv_heads"))
    size.add_argument("--head-dim", type=int, help=_range("head_dim", "even"))
    size.add_argument("--intermediate-size", type=int, help=_range("intermediate_size"))
    work = parser.add_argument_group("workload")
    work.add_argument("--prompts", type=int, default=4,
                      help=_range("prompts", "number of prompts, default 4"))
    work.add_argument("--prefix-tokens", type=int, default=2816,
                      help=_range("prefix_tokens", "tokens every prompt shares, default 2816"))
    work.add_argument("--suffix-tokens", type=int, default=320,
                      help=_range("suffix_tokens", "tokens unique to each prompt, default 320"))
    work.add_argument("--new-tokens", type=int, default=8,
                      help=_range("new_tokens", "tokens generated per prompt, default 8"))
    work.add_argument("--seed", type=int, default=0, help=_range("seed", "default 0"))
    parser.add_argument("--config", help="lmkv config file (default: built-in cpu tier)")
    parser.add_argument("--threads", type=int,
                        help=_range("threads", "torch threads, default torch's choice"))


def _range(name: str, what: str = "") -> str:
    _, low, high = _LIMITS[name]
    return f"{what}; {low}-{high}" if what else f"{low}-{high}"


@dataclass
class PromptRun:
    ttft: float
    hit_tokens: int
    tokens: list[int]
    logits: object
    kv: list  # the prompt's KV as computed (cold) or as loaded from lmkv (warm)


# argparse dest -> the flag a user typed, for messages.
_SIZE_FLAGS = {"hidden_size": "--hidden-size", "num_layers": "--layers", "num_heads": "--heads",
               "num_kv_heads": "--kv-heads", "head_dim": "--head-dim",
               "intermediate_size": "--intermediate-size"}

#: The most each flag may ask for: a demo runs in seconds to minutes on a laptop,
#: so every size is bounded (an unbounded --new-tokens ran for hours).
MAX_PROMPT_TOKENS = 16384
_LIMITS: dict[str, tuple[str, int, int]] = {
    "prompts": ("--prompts", 1, 64),
    "prefix_tokens": ("--prefix-tokens", 1, MAX_PROMPT_TOKENS),
    "suffix_tokens": ("--suffix-tokens", 1, MAX_PROMPT_TOKENS),
    "new_tokens": ("--new-tokens", 1, 1024),
    "seed": ("--seed", 0, (1 << 32) - 1),
    "threads": ("--threads", 1, 256),
    "hidden_size": ("--hidden-size", 1, 8192),
    "num_layers": ("--layers", 1, 128),
    "num_heads": ("--heads", 1, 128),
    "num_kv_heads": ("--kv-heads", 1, 128),
    "head_dim": ("--head-dim", 2, 512),
    "intermediate_size": ("--intermediate-size", 1, 32768),
}
#: The largest model the demo builds (float32: 8 GB of weights).
MAX_PARAMETERS = 2_000_000_000


def _validate_args(args: argparse.Namespace) -> None:
    for name, (flag, low, high) in _LIMITS.items():
        value = getattr(args, name)
        if value is None or low <= value <= high:
            continue
        allowed = (f"a positive integer of at most {high}" if low == 1
                   else f"an integer from {low} to {high}")
        raise ConfigError(f"{flag} = {value}: must be {allowed}")
    total = args.prefix_tokens + args.suffix_tokens + args.new_tokens
    if total > MAX_PROMPT_TOKENS:
        raise ConfigError(f"--prefix-tokens + --suffix-tokens + --new-tokens = {total}: "
                          f"must be at most {MAX_PROMPT_TOKENS} tokens")


def _parameters(size: dict[str, int]) -> int:
    """A Llama's parameter count: embeddings and head, attention and MLP per layer."""
    hidden, q = size["hidden_size"], size["num_heads"] * size["head_dim"]
    kv = size["num_kv_heads"] * size["head_dim"]
    layer = hidden * (2 * q + 2 * kv) + 3 * hidden * size["intermediate_size"] + 2 * hidden
    return 2 * size["vocab_size"] * hidden + size["num_layers"] * layer + hidden


def _validate_size(size: dict[str, int]) -> None:
    """The shape rules a Llama has, checked before transformers sees them (its own
    errors are long tracebacks that name its config fields, not our flags)."""
    heads, kv_heads = size["num_heads"], size["num_kv_heads"]
    if heads % kv_heads:
        raise ConfigError(f"--heads = {heads} must be a multiple of --kv-heads = {kv_heads}")
    if size["hidden_size"] % heads:
        raise ConfigError(f"--hidden-size = {size['hidden_size']} must be a multiple of "
                          f"--heads = {heads}")
    if size["head_dim"] % 2:
        raise ConfigError(f"--head-dim = {size['head_dim']}: must be even (rotary "
                          "embeddings rotate pairs of dimensions)")
    params = _parameters(size)
    if params > MAX_PARAMETERS:
        flags = ", ".join(f"{f} = {size[k]}" for k, f in _SIZE_FLAGS.items())
        raise ConfigError(f"the model flags ({flags}) make a Llama of {params / 1e6:,.0f}M "
                          f"parameters; the demo builds at most "
                          f"{MAX_PARAMETERS / 1e6:,.0f}M")


def _step(message: str) -> float:
    print(f"  {message} ...", end="", flush=True)
    return time.perf_counter()


def _done(t0: float, extra: str = "") -> None:
    print(f" done in {time.perf_counter() - t0:.2f} s{extra}", flush=True)


def run_demo(args: argparse.Namespace) -> int:
    _validate_args(args)
    try:
        import torch

        from lmkv.integrations import hf_model
        from lmkv.integrations.transformers import BLOCK_TOKENS, HFCacheEngine
    except ImportError as exc:
        raise ConfigError(f"the demo needs transformers: pip install 'lmkv[transformers]' "
                          f"({exc})") from None
    from lmkv.config.model import load_config

    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = {k: v for k in ("hidden_size", "num_layers", "num_heads", "num_kv_heads",
                                "head_dim", "intermediate_size")
                 if (v := getattr(args, k)) is not None}
    size = {**vars(hf_model.PRESETS[args.preset]), **overrides}
    total = args.prefix_tokens + args.suffix_tokens
    if total + args.new_tokens > size["max_position_embeddings"]:
        size["max_position_embeddings"] = total + args.new_tokens
    _validate_size(size)
    config = load_config(args.config,
                         overrides={} if args.config else {"tiers.0.options.max_bytes": "2GiB"})

    print(f"lmkv demo: {args.prompts} prompts of {total} tokens sharing a "
          f"{args.prefix_tokens}-token prefix; torch threads: {torch.get_num_threads()}")
    t0 = _step("building the tokenizer")
    tokenizer = hf_model.build_tokenizer(size["vocab_size"])
    _done(t0)
    t0 = _step(f"building a random-weight Llama ({size['num_layers']} layers, "
               f"hidden {size['hidden_size']}, {size['num_heads']} heads / "
               f"{size['num_kv_heads']} KV heads)")
    prompts = hf_model.synthetic_prompts(tokenizer, args.prompts, args.prefix_tokens,
                                         args.suffix_tokens, seed=args.seed)
    try:
        model = hf_model.build_model(seed=args.seed, **size)
        hf_model.prefill(model, prompts[0][:64])  # warm up kernels, not part of any timing
    except (ValueError, RuntimeError, TypeError) as exc:
        # Any shape rule _validate_size does not know yet: still one line, naming flags.
        flags = ", ".join(f"{f} = {size[k]}" for k, f in _SIZE_FLAGS.items())
        reason = " ".join(str(exc).split())
        raise ConfigError(f"the model flags ({flags}) do not make a valid Llama: "
                          f"{reason}") from None
    params = sum(p.numel() for p in model.parameters())
    _done(t0, f" ({params / 1e6:.1f}M parameters)")
    block = config.block_size or BLOCK_TOKENS
    if total <= block:
        print(f"  note: prompts of {total} tokens are no longer than a block of {block} "
              "tokens: lmkv stores and reuses whole blocks only (and leaves the last "
              "token to compute), so nothing is reused", flush=True)

    engine = HFCacheEngine(model, config, model_name=f"lmkv-demo-{args.preset}-{args.seed}")
    try:
        cold = [_run(engine, hf_model, p, args, i, "cold", reuse=False)
                for i, p in enumerate(prompts)]
        warm = [_run(engine, hf_model, p, args, i, "warm", reuse=True)
                for i, p in enumerate(prompts)]
        stats = engine.engine.stats()
    finally:
        engine.close()
    # The KV lmkv handed back must be, bit for bit, the KV the cold pass computed
    # (a warm run that reused nothing recomputed its KV: nothing to compare).
    lossless = all(
        torch.equal(w_t, c_t[:, :, :w.hit_tokens])
        for c, w in zip(cold, warm, strict=True) if w.hit_tokens
        for c_layer, w_layer in zip(c.kv, w.kv, strict=True)
        for c_t, w_t in zip(c_layer, w_layer, strict=True))
    return _report(cold, warm, stats, lossless)


def _run(engine, hf_model, prompt: list[int], args: argparse.Namespace, i: int, label: str,
         *, reuse: bool) -> PromptRun:
    t0 = time.perf_counter()
    hit, cache = engine.retrieve(prompt) if reuse else (0, None)
    if hit:
        kv = hf_model.cache_to_kv(cache)  # appends replace these tensors, never write them
        logits, cache = hf_model.prefill(engine.model, prompt[hit:], cache)
    else:  # cold, or nothing to reuse (a prompt of at most one block): full prefill
        logits, cache = hf_model.prefill(engine.model, prompt)
        kv = hf_model.cache_to_kv(cache)
    ttft = time.perf_counter() - t0
    logits = logits.clone()
    stored = 0 if reuse else engine.store(prompt, cache)
    tokens = hf_model.greedy_generate(engine.model, logits, cache, args.new_tokens)
    note = f"stored {stored} tokens" if not reuse else f"reused {hit} tokens"
    print(f"  [{label} {i + 1}/{args.prompts}] TTFT {ttft * 1e3:8.1f} ms  ({note})", flush=True)
    return PromptRun(ttft, hit, tokens, logits, kv)


def _report(cold: list[PromptRun], warm: list[PromptRun], stats: list[dict],
            lossless: bool) -> int:
    cold_ttft = statistics.mean(r.ttft for r in cold)
    warm_ttft = statistics.mean(r.ttft for r in warm)
    same_tokens = all(c.tokens == w.tokens for c, w in zip(cold, warm, strict=True))
    max_diff = max(float((c.logits - w.logits).abs().max()) for c, w in zip(cold, warm,
                                                                            strict=True))
    exact = max_diff == 0.0
    close = max_diff <= 1e-4
    print("\nresults")
    print(f"  cold TTFT (full prefill)      : {cold_ttft * 1e3:9.1f} ms (mean)")
    print(f"  warm TTFT (KV from lmkv)      : {warm_ttft * 1e3:9.1f} ms (mean)")
    print(f"  speedup                       : {cold_ttft / warm_ttft:9.1f}x")
    print(f"  generated tokens identical    : {'yes' if same_tokens else 'NO'}")
    verdict = "bit-identical" if exact else (
        "equal within float32 rounding" if close else "DIFFERENT")
    print(f"  logits vs full recompute      : max |diff| = {max_diff:.3g} ({verdict})")
    if not any(w.hit_tokens for w in warm):
        print("  reused KV vs computed KV      : nothing reused (prompts of one block?)")
    else:
        print(f"  reused KV vs computed KV      : "
              f"{'bit-identical' if lossless else 'DIFFERENT'} (lmkv adds no error)")
    print("lmkv tiers")
    for line in format_tier_stats(stats):
        print(line)
    ok = same_tokens and close and lossless
    if not ok:
        print("lmkv demo: reused KV did NOT reproduce the full recompute", file=sys.stderr)
    return 0 if ok else 1
