"""The engine in a process: takes requests from Redis, runs them, writes their stream logs."""
