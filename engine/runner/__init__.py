"""One engine step on the device: the varlen batch, paged attention, KV pool, sampler."""
