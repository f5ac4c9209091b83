"""Train a causal LM on text: `bash train.sh tasks/train_text.py CONFIG.yaml [--group.key value ...]`."""

from veomni.arguments import VeOmniArguments, parse_args
from veomni.distributed import destroy_parallel_state
from veomni.trainer import TextTrainer


def main():
    args = parse_args(VeOmniArguments)
    trainer = TextTrainer(args)
    try:
        trainer.fit()
    finally:
        destroy_parallel_state()


if __name__ == "__main__":
    main()
