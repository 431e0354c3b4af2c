"""Tensor parallelism: one model split over ranks of ``torch.distributed``.

``layout`` (torch-free) checks a size against a model and gives each rank's
shapes; ``sharding`` cuts a checkpoint's fused tensors into one rank's share;
``group`` holds the process group and the step's collectives; ``workers``
starts ranks 1..N-1 and feeds them each step's batch from rank 0.
"""
