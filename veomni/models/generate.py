"""One assistant turn through the model's chat template and transformers' `generate`: what `python -m veomni.chat`
answers and what `train.eval_prompts` logs during training."""

import re
from typing import Dict, List

# Qwen3-style templates train replies behind an empty thinking block; shown, it is only noise
_EMPTY_THINKING = re.compile(r"^\s*<think>\s*</think>\s*")


def reply(
    model, tokenizer, messages: List[Dict[str, str]], max_new_tokens: int = 128, chat_template=None, **generate_kwargs
) -> str:
    """The model's next assistant turn after `messages` (through `chat_template`, default the tokenizer's), greedy
    unless `generate_kwargs` say otherwise."""
    import torch

    ids = tokenizer.apply_chat_template(
        messages, chat_template=chat_template, add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    device = next(model.parameters()).device
    ids = {k: v.to(device) for k, v in ids.items()}
    pad_token_id = tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_token_id)
    with torch.no_grad():
        out = model.generate(**ids, **{**kwargs, **generate_kwargs})
    return visible_reply(tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True))


def visible_reply(text: str) -> str:
    """A decoded reply as shown: stripped, without a leading empty `<think></think>` block (a thinking block with
    content stays)."""
    return _EMPTY_THINKING.sub("", text).strip()
