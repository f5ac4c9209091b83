"""Under torchrun (2 ranks, 2 loader workers each): a streamed epoch delivers every record exactly once across
all ranks and workers. argv: data folder, number of records."""

import sys
from functools import partial

import torch
import torch.distributed as dist

from veomni.data import build_dataloader, build_dataset
from veomni.data.data_transform import process_pretrain_example
from veomni.distributed import destroy_parallel_state, init_parallel_state


def main(folder, n):
    init_parallel_state()
    transform = partial(process_pretrain_example, tokenizer=None, max_seq_len=64)
    dataset = build_dataset(train_path=folder, datasets_type="iterable", transform=transform, shuffle_buffer_size=16)
    loader = build_dataloader(dataset=dataset, micro_batch_size=2, max_seq_len=64, dyn_bsz=True, num_workers=2,
                              drop_last=False)  # dp rank and size come from the parallel state
    loader.set_epoch(0)
    mine = []
    for step in loader:
        for mb in step:
            ids, pos = mb["input_ids"][0], mb["position_ids"][0]
            mine += [int(ids[i]) - 1000 for i in torch.nonzero(pos == 0).flatten()]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    seen = [r for part in everyone for r in part]
    assert len(seen) == len(set(seen)) == int(n), (len(seen), len(set(seen)))
    assert set(seen) == set(range(int(n)))
    assert all(len(part) > 0 for part in everyone)
    print(f"EXACTLY_ONCE_OK {dist.get_rank()} {len(mine)}", flush=True)
    destroy_parallel_state()


if __name__ == "__main__":
    main(*sys.argv[1:])
