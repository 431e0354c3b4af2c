"""tokenrelay's shared core: CLI, options, logs, runtime facts, the wire contract and Redis.

Everything here is what the gateway, the worker and the engine agree on. It imports
none of them (the CLI names their handlers by string: core/entry.py), nor torch."""
