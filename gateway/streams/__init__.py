"""The Redis stream store as a gateway sees it: create, authorise, replay and tail streams."""
