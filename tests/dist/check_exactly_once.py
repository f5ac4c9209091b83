"""Under torchrun (2 ranks, 2 loader workers each): a streamed epoch delivers no record twice across all ranks and
workers, and every record it does not deliver is counted (the slots' streams end with the first that runs dry).
argv: data folder, number of records."""

import sys
from functools import partial

import torch
import torch.distributed as dist

from veomni.data import build_dataloader, build_dataset, data_report
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
    report = data_report(loader)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (mine, report["unread"] + report["dropped"]))
    seen = [r for part, _ in everyone for r in part]
    assert len(seen) == len(set(seen)), (len(seen), len(set(seen)))
    assert len(seen) + sum(lost for _, lost in everyone) == int(n), (len(seen), everyone)
    assert set(seen) <= set(range(int(n))) and all(len(part) > 0 for part, _ in everyone)
    print(f"EXACTLY_ONCE_OK {dist.get_rank()} {len(mine)}", flush=True)
    destroy_parallel_state()


if __name__ == "__main__":
    main(*sys.argv[1:])
