"""Talk to a trained model, through its own chat template and transformers' `generate` (greedy by default).

    python -m veomni.chat outputs/sft_demo                       # interactive: a line per turn, /reset, empty line quits
    python -m veomni.chat outputs/sft_demo --prompt "Who are you?"
    python -m veomni.chat outputs/sft_demo/hf --prompt-file prompts.txt --output answers.jsonl

MODEL is any of: a run's output_dir (its `hf/` export, else its newest checkpoint), an HF folder (config.json +
safetensors), a LoRA adapter folder (PEFT's adapter_config.json: the base is loaded from the path or hub name it
records), a DCP checkpoint of a run (`checkpoints/global_step_N`, consolidated into a temporary HF folder first), or
a hub name `org/name[@rev]` (veomni.utils.hub). A prompt file holds one prompt a line, or jsonl records with
`prompt` or `messages`; each answer is a jsonl record {"prompt", "response"}.
"""

import argparse
import contextlib
import json
import os
import sys
import tempfile
from typing import Dict, List, Optional, Sequence, Tuple

from .models.generate import reply  # noqa: F401  (the chat's turn; also train.eval_prompts')


class ChatError(ValueError):
    """A MODEL that cannot be loaded, said in one line."""


def model_folder(path: str, scratch: str) -> Tuple[str, str]:
    """(folder transformers or PEFT loads, what it is: "hf", "adapter" or "checkpoint") for any MODEL form."""
    from .utils.hub import download

    path = download(path, "MODEL")
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        return path, "adapter"
    if os.path.isfile(os.path.join(path, "config.json")):
        return path, "hf"
    if os.path.isdir(os.path.join(path, "model_optimizer")):  # a DCP checkpoint of a run
        from .checkpoint import dcp_to_hf

        out = os.path.join(scratch, "hf")
        dcp_to_hf(path, out)
        return out, "checkpoint"
    if os.path.isdir(os.path.join(path, "hf")):
        return model_folder(os.path.join(path, "hf"), scratch)
    from .checkpoint import list_checkpoints

    steps = list_checkpoints(os.path.join(path, "checkpoints"))
    if steps:  # a run without an hf/ export: its newest checkpoint
        return model_folder(os.path.join(path, "checkpoints", f"global_step_{steps[-1]}"), scratch)
    raise ChatError(
        f"{path}: not a run's output_dir (no hf/ export, no checkpoint), an HF folder (config.json), a LoRA adapter "
        f"folder (adapter_config.json) or a DCP checkpoint (model_optimizer/)"
    )


def load(path: str, scratch: str, device: Optional[str] = None):
    """(model in eval mode on `device`, tokenizer) of MODEL `path`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, kind = model_folder(path, scratch)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "adapter":
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(folder, dtype="auto")
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if not tokenizer.chat_template:
        raise ChatError(f"{folder}: its tokenizer has no chat template (tokenizer_config.json chat_template)")
    return model.to(device).eval(), tokenizer


def read_prompts(path: str) -> List[List[Dict[str, str]]]:
    """Each line of `path` as the messages of one conversation: plain text, or json with `prompt` or `messages`."""
    conversations = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line.strip():
                continue
            record = json.loads(line) if line.lstrip().startswith("{") else {"prompt": line}
            conversations.append(record.get("messages") or [{"role": "user", "content": record["prompt"]}])
    return conversations


def interactive(model, tokenizer, max_new_tokens: int, system: Optional[str], stdin=sys.stdin) -> None:
    history = [{"role": "system", "content": system}] if system else []
    start = list(history)
    print("chat: one line per turn; /reset forgets the conversation, an empty line or Ctrl-D quits", flush=True)
    while True:
        print("> ", end="", flush=True)
        line = stdin.readline()
        if not line.strip():
            print()
            return
        if line.strip() == "/reset":
            history = list(start)
            continue
        history.append({"role": "user", "content": line.strip()})
        answer = reply(model, tokenizer, history, max_new_tokens)
        history.append({"role": "assistant", "content": answer})
        print(answer, flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m veomni.chat", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "model", metavar="MODEL", help="run output_dir, HF folder, LoRA adapter, checkpoint or hub name"
    )
    parser.add_argument("--prompt", help="answer this one prompt and exit")
    parser.add_argument("--prompt-file", help="answer each prompt of this file (a line each, or jsonl) and exit")
    parser.add_argument("--output", help="where --prompt-file's answers go (jsonl; default: stdout)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--system", help="a system message before the conversation")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when present)")
    args = parser.parse_args(argv)
    from .utils.hub import HubNameError

    with tempfile.TemporaryDirectory(prefix="veomni-chat-") as scratch:
        try:
            model, tokenizer = load(args.model, scratch, args.device)
        except (ChatError, HubNameError, FileNotFoundError, ValueError) as err:  # (a LoRA DCP checkpoint)
            print(f"error: {err}", file=sys.stderr)
            return 2
        system = [{"role": "system", "content": args.system}] if args.system else []
        if args.prompt is None and args.prompt_file is None:
            interactive(model, tokenizer, args.max_new_tokens, args.system)
            return 0
        prompts = [[{"role": "user", "content": args.prompt}]] if args.prompt is not None else []
        prompts += read_prompts(args.prompt_file) if args.prompt_file else []
        with open(args.output, "w", encoding="utf-8") if args.output else contextlib.nullcontext(sys.stdout) as out:
            for messages in prompts:
                answer = reply(model, tokenizer, system + messages, args.max_new_tokens)
                if args.prompt is not None and not args.prompt_file:
                    print(answer, file=out, flush=True)
                else:
                    record = {"prompt": messages[-1]["content"], "response": answer}
                    print(json.dumps(record, ensure_ascii=False), file=out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
