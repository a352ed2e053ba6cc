"""``lmkv replay TRACE``: flags, then every policy at every capacity, then the report."""

from __future__ import annotations

import argparse
import json
import sys

from lmkv.base.errors import LMKVError, byte_size_type
from lmkv.replay.defaults import (
    DEFAULT_CAPACITIES,
    DTYPE_BYTES,
    FORMATS,
    MOONCAKE_BLOCK_SIZE,
    PHYSICAL_CHUNK_BYTES,
)

# Everything heavier (numpy, torch, pydantic) is imported when the command runs:
# `lmkv --help` builds this parser.

DESCRIPTION = f"""\
Replay a request trace through lmkv's real storage manager and tiers (from --config;
default: one cpu tier), once per eviction policy and capacity, and print the prefix hit
ratio (chunks reused / chunks requested, strict prefix as vLLM counts it) beside Belady's
offline optimum on the same trace and capacity, and the bytes each tier wrote and read.

Scaled: nothing is computed and real payloads are not held (one 512-token chunk of
Llama-3-8B is 64 MiB). The tiers run on {PHYSICAL_CHUNK_BYTES // 1024} KiB chunks with
every capacity scaled by the same factor, so a tier holds exactly as many chunks as it
would at the model's size; sizes and bytes are given at the model's size (chunks x tokens
a chunk x layers x KV heads x head dim x 2 x dtype bytes). See docs/replay.md."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1 or not text.strip().isascii():
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value



def add_replay_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("trace", metavar="TRACE",
                        help="JSONL trace: Mooncake records (hash_ids) or token-id lists")
    parser.add_argument("--config", metavar="FILE", help="config file whose tiers replay the trace "
                        "(default: LMKV_CONFIG / defaults: one cpu tier); --capacity sizes "
                        "its first tier")
    parser.add_argument("--format", choices=FORMATS,
                        help="trace format (default: told by the first record)")
    parser.add_argument("--block-size", type=_positive_int, metavar="TOKENS",
                        default=MOONCAKE_BLOCK_SIZE,
                        help="tokens per Mooncake hash id, one chunk each "
                             f"(default {MOONCAKE_BLOCK_SIZE})")
    parser.add_argument("--chunk-size", type=_positive_int, metavar="TOKENS",
                        help="tokens per chunk for token-id traces (default: the config's)")
    parser.add_argument("--capacity", default=DEFAULT_CAPACITIES, metavar="LIST",
                        help="comma-separated capacities of the first tier: percents of the "
                             "trace's unique chunks (5%%) or sizes at the model's scale "
                             "(40GiB) (default " + DEFAULT_CAPACITIES.replace("%", "%%") + ")")
    parser.add_argument("--policies", metavar="LIST",
                        help="comma-separated eviction policies (default: every installed one)")
    model = parser.add_argument_group(
        "model shape (sizes the chunks; default Llama-3-8B in bf16: 128 KiB a token)")
    model.add_argument("--layers", type=_positive_int, default=32, metavar="N",
                       help="default 32")
    model.add_argument("--kv-heads", type=_positive_int, default=8, metavar="N",
                       help="default 8")
    model.add_argument("--head-dim", type=_positive_int, default=128, metavar="N",
                       help="default 128")
    model.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bfloat16",
                       help="default bfloat16")
    model.add_argument("--bytes-per-token", type=byte_size_type(1), metavar="SIZE",
                       help="KV bytes a token, instead of the four flags above")
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true",
                     help="machine-readable output (progress still goes to stderr)")
    out.add_argument("--plot", metavar="FILE.png",
                     help="write hit ratio against capacity as a PNG (needs matplotlib: "
                          "pip install 'lmkv[plot]')")


def run_replay(args: argparse.Namespace) -> int:
    from lmkv.config.model import load_config
    from lmkv.keys.chunking import KeyMeta, kv_geometry
    from lmkv.plugins.registry import describe_exception
    from lmkv.replay.belady import belady_hits, next_uses
    from lmkv.replay.report import Row, as_json, as_table, check_plot_available, write_plot
    from lmkv.replay.run import Progress, ReplayFailed, replay
    from lmkv.replay.sizing import ModelShape, parse_capacities
    from lmkv.replay.trace import load_trace

    if args.plot:
        check_plot_available()
    policies = _policies(args.policies)
    config = load_config(args.config)
    shape = ModelShape(args.layers, args.kv_heads, args.head_dim, args.dtype,
                       args.bytes_per_token)
    meta = KeyMeta(config.model_name or "replay", dtype=args.dtype,
                   geometry=kv_geometry(args.layers, args.kv_heads, args.head_dim))
    trace = load_trace(args.trace, fmt=args.format, meta=meta, block_size=args.block_size,
                       chunk_size=args.chunk_size or config.chunk_size,
                       save_partial_chunk=config.save_partial_chunk)
    chunk_bytes = shape.chunk_bytes(trace.tokens_per_chunk)
    capacities = parse_capacities(args.capacity, trace.unique_chunks, chunk_bytes)
    uses = next_uses(trace.requests)
    optimum = {c.chunks: belady_hits(trace.requests, c.chunks, uses) for c in capacities}
    rows = []
    failed: list[str] = []
    for policy in policies:
        for capacity in capacities:
            progress = Progress(f"{policy} at {capacity.label}", len(trace.requests))
            try:
                run = replay(trace, config, policy, capacity.chunks,
                             model_chunk_bytes=chunk_bytes, progress=progress.update)
            except LMKVError as exc:
                if not _about_policy(exc, policy):
                    raise  # the config's or the trace's: no policy would do better
                print(f"lmkv replay: eviction policy {policy!r} cannot be used: {exc}; "
                      "skipped", file=sys.stderr)
                failed.append(policy)
                break
            except Exception as exc:  # the policy's: report it, the others go on
                why = str(exc) if isinstance(exc, ReplayFailed) else describe_exception(exc)
                print(f"lmkv replay: eviction policy {policy!r} failed at "
                      f"{capacity.label}: {why}; skipped", file=sys.stderr)
                failed.append(policy)
                break
            rows.append(Row(capacity, run, optimum[capacity.chunks]))
    if not rows:
        raise LMKVError(f"every eviction policy replayed failed ({', '.join(failed)}): "
                        "nothing to report")
    if args.plot:
        write_plot(args.plot, trace, rows)
    if args.json:
        print(json.dumps(as_json(trace, shape, rows), indent=2))
    else:
        print(as_table(trace, shape, rows))
        if args.plot:
            print(f"plot: {args.plot}")
    sys.stdout.flush()
    return 0


def _about_policy(exc: LMKVError, policy: str) -> bool:
    """Whether ``exc`` is about the eviction policy (its options, its constructor),
    not the config's tiers or the trace."""
    text = str(exc)
    return f"eviction policy '{policy}'" in text or ".eviction" in text


def _policies(text: str | None) -> list[str]:
    """The policies to replay: ``text``'s, each one installed, or every installed one."""
    from lmkv.plugins.manager import get_plugin_manager

    installed = get_plugin_manager().registry.names("eviction_policy")
    if text is None:
        if not installed:
            raise LMKVError("no eviction policy is installed: nothing to replay")
        return installed
    by_lower = {name.lower(): name for name in installed}
    chosen = [part.strip() for part in text.split(",")]
    for name in chosen:
        if name.lower() not in by_lower:
            shown = repr(name) if name else "an empty name"
            raise LMKVError(f"--policies: unknown eviction policy {shown}; allowed: "
                            f"{', '.join(installed) or 'none installed'}")
    return list(dict.fromkeys(by_lower[name.lower()] for name in chosen))
