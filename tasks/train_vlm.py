"""Train a vision/audio-language model: `bash train.sh tasks/train_vlm.py CONFIG.yaml [--group.key value ...]`.

Qwen2.5-VL, Qwen3-VL (dense and MoE), Qwen2.5-Omni / Qwen3-Omni-MoE thinkers, on conversations with images,
videos (frames) and audio (veomni/trainer/vlm_trainer.py). `python tasks/train_vlm.py --help [GROUP]` lists every
config key. Exit codes as tasks/train_text.py.
"""

from veomni.arguments import VeOmniArguments, parse_args


def main():
    args = parse_args(VeOmniArguments)  # --help and config mistakes answer before the model is built
    from veomni.distributed import destroy_parallel_state
    from veomni.trainer.vlm_trainer import VLMTrainer

    trainer = VLMTrainer(args)
    trainer.fit()
    destroy_parallel_state()


if __name__ == "__main__":
    from veomni.utils.lifecycle import run_worker

    run_worker(main)
