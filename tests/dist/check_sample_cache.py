"""Under torchrun: the first run over a mapping dataset builds its sample cache with every rank transforming its own
share. argv: DATA CACHE OUT [expect-failure]. Writes OUT/calls_<rank>.json (the records this rank transformed) and
OUT/batches_<rank>.json (this rank's micro-batches of each global step)."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

import test_sample_cache as t  # noqa: E402

from veomni.distributed import destroy_parallel_state, init_parallel_state  # noqa: E402


def main(data: str, cache: str, out: str, mode: str = "") -> None:
    state = init_parallel_state()
    t.CALLS.clear()
    dataset = t._dataset(data, cache)
    if mode == "expect-failure":  # one rank's share holds a bad record: every rank raises at once
        try:
            dataset.prepare()
        except Exception as err:
            with open(os.path.join(out, f"error_{state.dp_rank}.txt"), "w") as f:
                f.write(f"{type(err).__name__}: {err}")
        destroy_parallel_state()
        return
    assert len(dataset) == sum(1 for _ in open(data))  # builds the cache (collective)
    with open(os.path.join(out, f"calls_{state.dp_rank}.json"), "w") as f:
        json.dump(list(t.CALLS), f)
    loader = t.token_loader(
        dataset, rank=state.dp_rank, dp=state.dp_size, max_seq_len=t.MAX_LEN, dyn=True, micro=3, dlbs=1,
        dyn_bsz_buffer_size=8,
    )  # fmt: skip
    loader.set_epoch(0)
    batches = [[mb["input_ids"].tolist() for mb in step] for step in loader]
    with open(os.path.join(out, f"batches_{state.dp_rank}.json"), "w") as f:
        json.dump(batches, f)
    destroy_parallel_state()


if __name__ == "__main__":
    main(*sys.argv[1:])
