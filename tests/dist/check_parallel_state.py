"""Under torchrun (2 ranks): the meshes and groups the seed's snippet reads, for fsdp2 and an ep dim."""

import torch.distributed as dist

from veomni.distributed.parallel_state import destroy_parallel_state, get_parallel_state, init_parallel_state

init_parallel_state(dp_size=2, extra_parallel_sizes=[2], extra_parallel_names=["ep"], mode="fsdp2")
ps = get_parallel_state()
rank = dist.get_rank()
assert ps.dp_mesh.size() == 2 and ps.dp_rank == rank and dist.get_world_size(ps.dp_group) == 2
assert ps.sp_rank == 0 and dist.get_world_size(ps.sp_group) == 1 and not ps.sp_enabled
assert ps.tp_mesh.size() == 1 and dist.get_world_size(ps.tp_group) == 1
assert ps.fsdp_mesh.size() == 2 and ps.ep_size == 2 and ps.ep_rank == rank and ps.ep_enabled
assert ps.extra_mesh("ep")["ep_fsdp"].size() == 1
print(f"PARALLEL_STATE_OK {rank}", flush=True)
destroy_parallel_state()
