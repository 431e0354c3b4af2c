"""Command-line options; every flag also reads ``TOKENRELAY_<FLAG>`` from the environment.

``--detach-timeout`` reads ``TOKENRELAY_DETACH_TIMEOUT`` and so on: the
environment gives the default, the command line wins.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from tokenrelay.core.tracing import DEFAULT_CLIENT_TRACE, ClientTrace
from tokenrelay.core.wire.keys import DEFAULT_PREFIX
from tokenrelay.core.wire.log_ledger import DEFAULT_MAX_LOG_BYTES
from tokenrelay.core.wire.requests import (
    DEFAULT_MAX_DETACH_TIMEOUT,
    DEFAULT_MAX_OUTPUT_ENTRIES,
    DEFAULT_MAX_TOKENS_LIMIT,
)

# Defaults that settings dataclasses share with their flags (gateway/state.py,
# gateway/access/auth.py, gateway/http/common.py): one definition each.
DETACH_TIMEOUT = 30.0
MAX_DETACH_TIMEOUT = DEFAULT_MAX_DETACH_TIMEOUT  # the most a request's detach_timeout asks
STREAM_TTL = 3600.0
DRAIN_TIMEOUT = 30.0
HEARTBEAT = 20.0
MAX_FRAME_BYTES = 1 << 20
MAX_CONNECTIONS = 10_000
MAX_STREAMS_PER_CONNECTION = 64
MAX_RESUMES_PER_STREAM = 4  # resumes reading one stream at once, one gateway
MAX_PENDING = 4096
HTTP_MAX_STREAMS_PER_CLIENT = 256
SSE_KEEPALIVE = 10.0
WS_TOKEN_TTL = 60.0
MAX_STREAMS_PER_KEY = 256
MAX_STREAMS_PER_ADDRESS = 64  # without keys, per client address off this host
RATE_LIMIT_PER_ADDRESS = 600.0  # requests per minute, the same
REDIS_MAXMEMORY = "1gb"  # the embedded Redis' limit (core/redis/embedded.py)
UPSTREAM_TIMEOUT = 60.0  # worker/upstream/config.py
MAX_INFLIGHT = 64


def env_name(flag: str) -> str:
    return "TOKENRELAY_" + flag.lstrip("-").replace("-", "_").upper()


def add(parser: argparse.ArgumentParser, flag: str, *, default: Any, help: str, **kw: Any) -> None:
    """Add ``flag`` with its default taken from the environment when set there."""
    env = env_name(flag)
    raw = os.environ.get(env)
    typ = kw.get("type")
    value = default
    if raw is not None:
        if kw.get("action") == "store_true":
            value = raw.strip().lower() in ("1", "true", "yes", "on")
        else:
            try:
                value = typ(raw) if typ else raw
            except ValueError as exc:
                raise ValueError(f"{env}={raw!r}: {exc}") from None
    parser.add_argument(flag, default=value, help=f"{help} [env {env}; default {default}]", **kw)


def add_common_options(p: argparse.ArgumentParser) -> None:
    add(p, "--log-level", default="info", help="debug, info, warning or error")
    add(p, "--log-format", default=None, help="json or text (default: text on a terminal)")
    add(p, "--otlp-endpoint", default=None,
        help="OTLP/HTTP collector to send request traces to, e.g. http://localhost:4318 "
        "(needs tokenrelay[tracing]; default: no tracing)")  # fmt: skip


def add_redis_url(p: argparse.ArgumentParser, *, required: bool) -> None:
    hint = "shared Redis URL" if required else "Redis URL (default: start an embedded Redis)"
    add(p, "--redis-url", default=None, help=hint)
    add(
        p,
        "--redis-prefix",
        default=DEFAULT_PREFIX,
        help="prefix of every Redis key (one namespace)",
    )
    add(p, "--redis-cluster", default=False, action="store_true",
        help="--redis-url names a node of a Redis Cluster (Redis >= 7: sharded pub/sub); "
        "every gateway and worker of the fleet must say so")  # fmt: skip


def add_stream_options(p: argparse.ArgumentParser) -> None:
    add(p, "--detach-timeout", default=DETACH_TIMEOUT, type=float,
        help="seconds a stream keeps generating with no client attached")  # fmt: skip
    add(p, "--stream-ttl", default=STREAM_TTL, type=float,
        help="seconds a finished stream stays resumable")  # fmt: skip
    add(p, "--drain-timeout", default=DRAIN_TIMEOUT, type=float,
        help="seconds running streams may take to finish on SIGTERM")  # fmt: skip


def add_http_options(p: argparse.ArgumentParser) -> None:
    add(p, "--host", default="127.0.0.1", help="address to listen on")
    add(p, "--port", default=8000, type=int, help="port to listen on")
    add(p, "--forwarded-allow-ips", default="127.0.0.1",
        help="proxies whose X-Forwarded-For/-Proto are believed (list, CIDRs, *)")  # fmt: skip
    add(p, "--heartbeat", default=HEARTBEAT, type=float, help="seconds between server pings")
    add(
        p,
        "--max-frame-bytes",
        default=MAX_FRAME_BYTES,
        type=int,
        help="largest client frame accepted",
    )
    add_model_name(p)
    add(p, "--max-connections", default=MAX_CONNECTIONS, type=int,
        help="WebSockets accepted at once (more are closed with 1013)")  # fmt: skip
    add(p, "--max-streams-per-connection", default=MAX_STREAMS_PER_CONNECTION, type=int,
        help="concurrent streams one WebSocket may carry")  # fmt: skip
    add(p, "--max-resumes-per-stream", default=MAX_RESUMES_PER_STREAM, type=int,
        help="resumes reading one stream at once through this gateway; more get "
        "'overloaded', but one replaces the oldest after it has read for 2 s")  # fmt: skip
    add(p, "--max-detach-timeout", default=MAX_DETACH_TIMEOUT, type=float,
        help="most seconds a request's detach_timeout may keep its stream generating with "
        "no client attached (at least --detach-timeout)")  # fmt: skip
    add(p, "--max-pending", default=MAX_PENDING, type=int,
        help="queued + running requests before new ones get 'overloaded'")  # fmt: skip
    add(p, "--http-max-streams-per-client", default=HTTP_MAX_STREAMS_PER_CLIENT, type=int,
        help="concurrent HTTP generations per API key or client address")  # fmt: skip
    add(p, "--sse-keepalive", default=SSE_KEEPALIVE, type=float,
        help="seconds of silence before an SSE ': keep-alive' comment")  # fmt: skip
    add(p, "--grpc-port", default=0, type=int,
        help="port of the gRPC API on --host (docs/grpc.md; 0: off)")  # fmt: skip
    add(p, "--client-traceparent", default=DEFAULT_CLIENT_TRACE.value,
        choices=[c.value for c in ClientTrace],
        help="a client's W3C traceparent (HTTP header, WebSocket field, gRPC metadata), with "
        "--otlp-endpoint: follow (the parent of its request's spans), link (a new trace "
        "linked to it) or ignore")  # fmt: skip
    add_security_options(p)


def add_model_name(p: argparse.ArgumentParser) -> None:
    add(p, "--model-name", default=None,
        help="a worker: the name clients use for its model (default: --model as given; a "
        "relay: its --upstream-model names, else the upstream's list); a gateway: the model "
        "of requests that name none (default: the first model of an engine worker)")  # fmt: skip


def add_engine_options(p: argparse.ArgumentParser) -> None:
    add(p, "--model", default="default", help="default, a HF model folder or a .gguf file")
    add(p, "--device", default="auto", help="auto, cpu or cuda[:N]")
    add(p, "--weights", default="auto", choices=("auto", "native", "fp32", "bf16"),
        help="native: a GGUF's quantized blocks as they are (CPU); fp32/bf16: dense")  # fmt: skip
    add(p, "--kv-cache-memory", default=None, type=float,
        help="GiB for the KV cache (default: share of free GPU memory; on CPU 16384 "
             "tokens of the model's KV, at most a quarter of available memory)")  # fmt: skip
    add(p, "--kv-cache-dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"),
        help="KV cache elements (auto: float16 under the fused CPU decoder, else the "
             "compute dtype)")  # fmt: skip
    add(p, "--max-num-seqs", default=64, type=int, help="most sequences in one batch")
    add(p, "--max-num-batched-tokens", default=None, type=int,
        help="token budget per step (default: 8192 on CUDA, 1024 on CPU)")  # fmt: skip
    add(p, "--max-prefill-while-decoding", default=None, type=int,
        help="prompt tokens of a step that also decodes (default: 256 on CPU, the "
             "step budget on CUDA)")  # fmt: skip
    add(p, "--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
        help="compute dtype (auto: bfloat16 on CUDA, float32 on CPU)")  # fmt: skip
    add(p, "--attention-backend", default="auto",
        choices=("auto", "cpu", "torch", "triton", "flash-attn"),
        help="auto: flash-attn if installed, else triton on CUDA, else cpu")  # fmt: skip
    add(p, "--block-size", default=None, type=int,
        help="tokens per KV block (default: the backend's, 16; flash-attn 256)")  # fmt: skip
    add(p, "--enforce-eager", default=False, action="store_true",
        help="no CUDA graphs for decode steps")  # fmt: skip
    add(p, "--tensor-parallel-size", default=1, type=int,
        help="split the model over N ranks: N GPUs (NCCL) or N CPU processes (gloo)")  # fmt: skip
    add(p, "--worker-id", default=None, help="consumer name in the request group")


def add_upstream_options(p: argparse.ArgumentParser) -> None:
    """A relay worker (worker/upstream/): no model, an OpenAI-compatible server instead."""
    add(p, "--upstream", default=None,
        help="relay to this OpenAI-compatible server (base URL, e.g. http://host:8000/v1) "
        "instead of loading a model")  # fmt: skip
    add(p, "--upstream-model", default=None,
        help="model names sent upstream, a comma list (default: what it lists; a request "
        "naming none gets the first)")  # fmt: skip
    add(p, "--upstream-api-key", default=None,
        help="bearer key for the upstream (prefer the env var: argv is visible in ps)")  # fmt: skip
    add(p, "--upstream-timeout", default=UPSTREAM_TIMEOUT, type=float,
        help="seconds without a byte from the upstream before a call fails")  # fmt: skip
    add(p, "--max-inflight", default=MAX_INFLIGHT, type=int,
        help="upstream calls at once (a relay worker takes no more requests)")  # fmt: skip


def add_gateway_options(p: argparse.ArgumentParser) -> None:
    add_common_options(p)
    add_redis_url(p, required=True)
    add_http_options(p)
    add_stream_options(p)


def add_worker_options(p: argparse.ArgumentParser) -> None:
    add_common_options(p)
    add_redis_url(p, required=True)
    add_engine_options(p)
    add_model_name(p)
    add_upstream_options(p)
    add_stream_options(p)
    add_health_options(p)


def add_health_options(p: argparse.ArgumentParser) -> None:
    """The worker's own ``/healthz`` and ``/metrics`` port (worker/health.py); not on serve."""
    add(p, "--health-port", default=0, type=int,
        help="port of the worker's /healthz and /metrics (0: off)")  # fmt: skip
    add(p, "--health-host", default="127.0.0.1", help="address of --health-port")


def add_serve_options(p: argparse.ArgumentParser) -> None:
    add_common_options(p)
    add_redis_url(p, required=False)
    add_http_options(p)
    add_engine_options(p)
    add_upstream_options(p)
    add_stream_options(p)
    add(p, "--data-dir", default=None, help="embedded Redis data folder (default: under the cache)")
    add(p, "--redis-maxmemory", default=REDIS_MAXMEMORY,
        help="embedded Redis' memory limit (512mb, 2gb, bytes; 0: none); when full it "
        "refuses new streams, never drops one")  # fmt: skip


def add_security_options(p: argparse.ArgumentParser) -> None:
    """Auth, origins and per-key limits (read by ``gateway.access.auth.SecuritySettings``)."""
    add(p, "--api-keys", default=None,
        help="comma-separated API keys; when set, HTTP and WebSocket need one")  # fmt: skip
    add(p, "--api-keys-file", default=None, help="file with one API key per line")
    add(p, "--allowed-hosts", default=None,
        help="Host names answered besides IP addresses, localhost and --host (comma list; "
        ".example.com for subdomains; * for any)")  # fmt: skip
    add(p, "--insecure-no-auth", default=False, action="store_true",
        help="allow a non-loopback --host without API keys (logged as INSECURE)")  # fmt: skip
    add(p, "--ws-token-ttl", default=WS_TOKEN_TTL, type=float,
        help="seconds a token from POST /v1/ws-token stays valid")  # fmt: skip
    add(p, "--key-id-secret", default=None,
        help="secret of the key ids in logs and Redis (HMAC of each key; the same on every "
        "gateway; prefer the env var: argv is visible in ps); default: derived from all "
        "the keys, so the ids change with the key set")  # fmt: skip
    env = env_name("--allow-origin")
    raw = os.environ.get(env)
    p.add_argument(
        "--allow-origin",
        action="append",
        default=[raw] if raw else None,
        help="Origin allowed besides same-origin and localhost (repeatable or comma list; "
        f"* for any) [env {env}; default None]",
    )
    add(p, "--rate-limit", default=0.0, type=float,
        help="requests per minute per API key (or address), across gateways; 0: off")  # fmt: skip
    add(p, "--rate-limit-burst", default=0, type=int,
        help="requests a key may make at once (0: same as --rate-limit)")  # fmt: skip
    add(p, "--max-streams-per-key", default=MAX_STREAMS_PER_KEY, type=int,
        help="concurrent streams per API key on one gateway (with keys configured)")  # fmt: skip
    add(p, "--max-streams-per-address", default=MAX_STREAMS_PER_ADDRESS, type=int,
        help="no keys: concurrent streams per client address, one gateway (0: off)")  # fmt: skip
    add(p, "--rate-limit-per-address", default=RATE_LIMIT_PER_ADDRESS, type=float,
        help="no keys: requests per minute per client address (0: off)")  # fmt: skip
    add(p, "--max-tokens-limit", default=DEFAULT_MAX_TOKENS_LIMIT, type=int,
        help="largest max_tokens accepted")  # fmt: skip
    add(p, "--max-output-entries", default=DEFAULT_MAX_OUTPUT_ENTRIES, type=int,
        help="most token entries one request may ask for: n x max_tokens x "
             "(1 + top_logprobs)")  # fmt: skip
    add(p, "--max-log-bytes-per-key", default=DEFAULT_MAX_LOG_BYTES,
        help="stream-log bytes one API key (without keys: one client address) may hold in "
             "Redis at once (256mb, 1gb, bytes; 0: no limit)")  # fmt: skip
