"""A worker with no model of its own: a relay to an upstream OpenAI-compatible server.

``tokenrelay worker --upstream URL`` runs the same worker loop (worker/main.py,
worker/intake.py, worker/outbox.py) over :class:`worker.upstream.engine.UpstreamEngine`,
an :class:`worker.engine_client.EngineClient` whose requests are streaming HTTP calls to
vLLM, TGI, llama.cpp's server, Ollama or another tokenrelay. One concept per module:

- ``config``: the upstream's URL, model, key, deadlines and caps, from the command line;
- ``openai``: request bodies, server-sent events (capped) and chunks in OpenAI's shapes
  (sans I/O);
- ``failures``: what went wrong, typed (retry, refuse, or end mid-stream), and the
  backoff between attempts, ``Retry-After`` honoured (sans I/O);
- ``http1``: HTTP/1.1 requests as bytes, responses parsed from bytes (sans I/O);
- ``client``: the HTTP client over it (asyncio protocols, a keep-alive pool, timeouts);
- ``inbox``: what the calls produced, handed from the HTTP thread to the worker loop;
- ``deadlines``: one attempt's head, first-token and total deadlines;
- ``call``: one request's HTTP exchange, with its retries and its stop at ``max_tokens``;
- ``engine``: the engine the worker drives, and the thread its calls run on.

Nothing here imports torch or the engine package (tests/test_architecture.py).
"""
