"""Train a vision/audio-language model: `bash train.sh tasks/train_vlm.py CONFIG.yaml [--group.key value ...]`.

Qwen2.5-VL, Qwen3-VL (dense and MoE), Qwen2.5-Omni / Qwen3-Omni-MoE thinkers, on conversations with images,
videos (frames) and audio (veomni/trainer/vlm_trainer.py). `python tasks/train_vlm.py --help [GROUP]` lists every
config key. Exit codes as tasks/train_text.py.
"""

from veomni.trainer.task import run_task


def build_trainer(args):
    from veomni.plan.runlog import PlanCheckCallback  # imported after the config is parsed: --help answers at once
    from veomni.trainer.vlm_trainer import VLMTrainer

    return VLMTrainer(args, callbacks=[PlanCheckCallback()])  # the planner's memory prediction, checked


if __name__ == "__main__":
    run_task(build_trainer)
