"""The contract both sides of Redis agree on: keys, ids, events, Lua scripts, requests, stats."""
