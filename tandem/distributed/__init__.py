"""Tensor-parallel ranks and their collectives: the only package that talks to torch.distributed.

group.py: TPGroup, the group a model's layers communicate in (all-reduce path per message, symmetric buffers);
all_reduce.py: the peer-to-peer all-reduce over symmetric memory; ranks.py: a rank's place, liveness and rank 0's
step message; launch.py: creating or joining the ranks' process groups, and leaving them.
"""
