"""Benchmarks and load-test tools for tokenrelay: hand-run, never part of serving.

Each module measures one part of the system (the engine against transformers,
the HTTP API against the engine in process, the gateway against a bare
WebSocket server, the Redis append against redis-py's way, fault injection, a
soak) and prints Markdown tables on stdout. Every table compares against a peer
measured in the same run, on the same machine and under the same load (the
benches alternate or interleave the two), so a ratio means something even on a
shared machine; the numbers of one run are not comparable with another's.

Run them as modules from the repository root, with the project's venv:

    .venv/bin/python -m bench.engine_throughput --quick
    .venv/bin/python -m bench.gateway --quick
    .venv/bin/python -m bench.faults
    .venv/bin/python -m bench.<name> --help

A bench never edits docs/benchmarks.md: where one can save its report
(``--out``), it goes to the gitignored bench/results/ unless given another path.
The load-test helpers live here too: common (machine, load, results folder),
netproxy (a TCP proxy that can cut connections), ws_client (a light WebSocket
client), and token_source, which bench.gateway starts as a child process the
same way (``python -m bench.token_source``, in the repository root).
"""
