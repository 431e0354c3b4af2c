"""End-to-end suites: real redis-servers, engine and relay workers and gateways, with faults.

- test_chaos.py, test_chaos_grpc.py, test_chaos_relay.py, cluster/test_chaos_cluster.py:
  clients that drop and resume (WebSocket, gRPC, over a relay, on a Redis Cluster);
- test_faults.py (Redis restarted, a worker SIGKILLed), test_fault_table.py (bench.faults,
  the table of docs/reliability.md), test_relay_faults.py (a failing upstream behind a
  fault proxy), cluster/test_master_kill.py (a Redis Cluster master SIGKILLed);
- test_relay_fleet.py (relay workers of two model names behind one gateway);
- test_soak.py (bench/soak.py's smoke run).

Their fixtures: the session's ``redis_server``, ``redis_cluster`` and
``fresh_redis_cluster`` (tests/conftest.py), ``stack`` (tests/gateway/stack.py) and the
relay servers (tests/worker/upstream/servers.py), fixtures of the whole suite that the
unit folders share; the cluster fleet in cluster/conftest.py; the rest in their modules.
"""
