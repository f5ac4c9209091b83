"""Train a causal LM on text: `bash train.sh tasks/train_text.py CONFIG.yaml [--group.key value ...]`.

`python tasks/train_text.py --help [GROUP]` lists every config key with its type, default and doc.

Exit codes: 0 done; 1 an error (said once, by the first rank that failed); 130/143 stopped by SIGINT/SIGTERM
after saving a checkpoint, 129 the same after the launcher died (see veomni.utils.lifecycle).
"""

from veomni.arguments import VeOmniArguments, parse_args


def main():
    args = parse_args(VeOmniArguments)  # --help and config mistakes answer before the model is built
    from veomni.distributed import destroy_parallel_state
    from veomni.trainer import TextTrainer

    trainer = TextTrainer(args)
    trainer.fit()
    destroy_parallel_state()


if __name__ == "__main__":
    from veomni.utils.lifecycle import run_worker

    run_worker(main)
