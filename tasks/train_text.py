"""Train a causal LM on text: `bash train.sh tasks/train_text.py CONFIG.yaml [--group.key value ...]`.

`python tasks/train_text.py --help [GROUP]` lists every config key with its type, default and doc.
"""

from veomni.arguments import VeOmniArguments, parse_args


def main():
    args = parse_args(VeOmniArguments)  # --help and config mistakes answer before torch is even imported
    from veomni.distributed import destroy_parallel_state
    from veomni.trainer import TextTrainer

    trainer = TextTrainer(args)
    try:
        trainer.fit()
    finally:
        destroy_parallel_state()


if __name__ == "__main__":
    main()
