"""The training loop of the seed's "Train Loop", made exact for data parallelism.

One optimizer step:
    micro_batches = next(loader)                       # dataloader_batch_size packed micro-batches
    N = all_reduce(loss tokens of this step)           # over data- and sequence-parallel ranks
    for mb in micro_batches: (sum CE(mb) * dp*sp / N).backward()   # FSDP/DDP average over dp*sp: net sum / N
    clip (DTensor-aware) -> optimizer.step -> scheduler.step -> zero_grad
so every token weighs the same whatever the packing, the micro-batch split or the number of ranks.

The trainer is a set of named components, each built once and handed what it reads:

    run_dir            the output folder, locked; the checkpoint this run resumes from   (checkpointing.RunDir)
    train_dataloader   the data, batched for this rank                                   (build_dataloader)
    step plan          steps per epoch and in total                                      (compute_train_steps)
    model, loss_module the parallelised model and its loss (CausalLMLoss)                (build_model)
    optimizer, lr_scheduler                                                              (build_optimizer)
    checkpointer       saves and restores the run                             (checkpointing.TrainCheckpointer)
    evaluator          the held-out loss, or None                                        (evaluation.Evaluator)
    callbacks          metrics.jsonl, progress, plots, wandb/TensorBoard, and the task's own
    state              where the loop is (step, epoch, tokens)                           (checkpointing.TrainState)
"""

import dataclasses
import math
import os
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..arguments import save_args
from ..checkpoint import save_hf_model, save_lora_model
from ..compat.torch import set_found_inf, skips_on_found_inf
from ..data.chat_template import export_chat_template
from ..data.data_collator import MainCollator
from ..distributed.clip_grad_norm import clip_grad_norm_tensor
from ..distributed.mixed_precision import resolve_precision, set_tf32
from ..distributed.parallel_state import init_parallel_state_from_config
from ..distributed.torch_parallelize import parallelize
from ..models import build_foundation_model
from ..models.lora import attach_lora, base_checkpoint_names, place_adapters
from ..ops import CausalLMLoss, LossOutput, count_loss_tokens
from ..ops.kernels import bind_kernels, resolve_loss_implementation
from ..ops.moe import load_balancing_loss_sum
from ..optim import build_lr_scheduler, build_optimizer
from ..utils.collectives import HostGroup
from ..utils.device import get_device, get_device_type
from ..utils.logging import get_logger
from . import lifecycle
from .callbacks import Callback, standard_callbacks
from .checkpointing import RunDir, TrainCheckpointer, TrainState
from .evaluation import Evaluator, build_eval_loader
from .moe_metrics import MoEMetrics
from .preflight import check_first_records, check_paths, check_vocab
from .step_count import close_loader, plan_steps, set_epoch
from .step_metrics import PendingMetrics, host_loss_tokens, timed

logger = get_logger(__name__)


class NonFiniteError(RuntimeError):
    pass


def build_model_from_args(args, device_type: str, init_device: str):
    """The model `args` describe, before LoRA and sharding, in the dtype its parameters train in on `device_type`:
    fp32 master weights by default (bf16 compute on CUDA through the FSDP2 policy), pure bf16 only when asked. The
    planner builds its meta model with it too (veomni.plan.real_plan)."""
    fsdp, ops = args.train.accelerator.fsdp_config, args.model.ops_implementation
    precision = resolve_precision(fsdp.mixed_precision, device_type, fsdp.fsdp_mode)
    return build_foundation_model(
        config_path=args.model.config_path,
        weights_path=args.model.model_path,
        init_device=init_device,
        torch_dtype=precision.param_dtype,
        attn_implementation=ops.attn_implementation,
        moe_implementation=ops.moe_implementation,
        trust_remote_code=args.model.trust_remote_code,
    )


class BaseTrainer:
    """Builds everything from `args` and runs `fit()`. Subclasses choose the data (`build_dataset`,
    `build_dataloader`); `callbacks` are the task's own (e.g. the planner's check, veomni.plan.runlog)."""

    # micro-batch keys that are not model inputs (the loss takes the labels itself, and their host-counted tokens)
    non_model_keys: Sequence[str] = ("labels", "shift_labels", "num_loss_tokens")

    def __init__(self, args, callbacks: Sequence[Callback] = ()):
        self.args = args
        train = args.train
        torch.manual_seed(train.seed)
        if train.enable_full_determinism:  # before CUDA starts: cuBLAS reads its workspace setting once
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
            torch.use_deterministic_algorithms(True)
        self.parallel_state = init_parallel_state_from_config(train.accelerator)
        self.is_main = self.parallel_state.is_main_process
        self.device = get_device()
        self.host_group = HostGroup(train.accelerator.dist_timeout_minutes, reuse_gloo_world=True)  # step totals
        # Everything a user can get wrong is checked before the model is built, so a mistake costs seconds.
        self.run_dir = RunDir(train.checkpoint)
        self.output_dir = self.run_dir.output_dir
        check_paths(args)
        # set by the data's transform (TextTrainer); the template: the jinja conversations train on (HF export)
        self.tokenizer = self.training_chat_template = None
        self.train_dataset = self.build_dataset()
        # the transform on the first records, the tokenizer against the model's vocabulary: seconds, not minutes
        check_first_records(self.train_dataset, args.data)
        check_vocab(self.tokenizer, args.model)
        self.train_dataloader = self.build_dataloader()
        self.compute_train_steps()
        self.run_dir.refuse_completed(self.total_steps)
        logger.info(self.run_dir.message)  # (once the run is known to go ahead: not before a refusal just above)
        self.eval_data = None  # (dataset, loader, collator) of data.eval_path
        if args.data.eval_path:  # before the model too: a held-out file that fails, fails in seconds
            self.eval_data = build_eval_loader(args, self.build_data_transform(), self.build_collator())
        if self.is_main:
            save_args(args, self.output_dir)
        self.state = TrainState()
        self.data_ran_out = False  # an epoch ended where its data did (not at a step count)
        self.build_model()
        self.build_optimizer()
        self.checkpointer = TrainCheckpointer(
            args, self.run_dir, self.parallel_state, self.model, self.optimizer, self.lr_scheduler,
            self.train_dataloader, self.state,
        )  # fmt: skip
        self.checkpointer.resume(self.is_main)
        self.evaluator = self.build_evaluator(*self.eval_data) if self.eval_data else None
        self.callbacks: List[Callback] = self.build_callbacks() + list(callbacks)

    # the loop's position, as callbacks and subclasses read it
    global_step = property(lambda self: self.state.global_step)
    epoch = property(lambda self: self.state.epoch)

    # ------------------------------------------------------------------------------------------ building
    def build_model(self) -> None:
        args = self.args
        set_tf32(args.train.tf32, get_device_type())
        model = build_model_from_args(args, get_device_type(), args.train.init_device)
        # fused kernels on this instance only, before adapters, sharding and compile wrap its modules
        ops = args.model.ops_implementation
        bind_kernels(model, ops.kernels, get_device_type(), args.train.accelerator.tp_size, ops.compile)
        model = self.prepare_model(model)
        # LoRA adapters go in before sharding, so FSDP2/DDP wrap them with their layers; {} without LoRA
        adapters = attach_lora(model, args.model.lora, args.train.seed, args.model.model_path)
        with base_checkpoint_names(model, adapters):  # a meta model then loads the base checkpoint unchanged
            self.model = parallelize(model, self.parallel_state, args)
        place_adapters(self.model, adapters)
        self.model.train()
        backend = resolve_loss_implementation(ops.loss_implementation, get_device_type(), self.parallel_state.tp_size)
        self.loss_module = CausalLMLoss(self.model, ops.loss_chunk_size, backend)
        self.moe_metrics = MoEMetrics(self.model, self.device)  # routing counts hooked on the experts modules
        self.num_params = sum(p.numel() for p in self.model.parameters())
        logger.info(f"model: {type(model).__name__}, {self.num_params / 1e6:.1f}M parameters ({self.num_params:,})")

    def prepare_model(self, model):
        """Hook between building the model and sharding it (e.g. freezing a vision tower); returns the model."""
        return model

    def build_dataset(self):
        raise NotImplementedError

    def build_dataloader(self):
        raise NotImplementedError

    def compute_train_steps(self) -> None:
        """The step plan (step_count.py): sets `train.train_steps`, `epoch_steps`, `total_steps`, `whole_epochs`."""
        dataset = getattr(self, "train_dataset", None)  # (None: a step plan without the data's description)
        self.epoch_steps, self.whole_epochs = plan_steps(
            self.args, self.train_dataloader, dataset, self._count_loader_steps
        )
        self.total_steps = sum(self.epoch_steps)

    def _count_loader_steps(self, limit: Optional[int]) -> Optional[int]:
        """Steps every data-parallel rank can take this epoch (the fewest of any rank), or None for streamed data."""
        counter = getattr(self.train_dataloader, "num_batches", None)
        mine = counter(limit=limit) if counter is not None else None
        steps = torch.tensor([-1 if mine is None else mine], dtype=torch.int64, device=self.device)
        dist.all_reduce(steps, op=dist.ReduceOp.MIN, group=self.parallel_state.dp_group)
        return None if int(steps) < 0 else int(steps)

    def build_data_transform(self):
        """The record -> sample transform (the held-out data is read with it too)."""
        raise NotImplementedError

    def collate_fn_kwargs(self) -> Dict[str, Any]:
        """MainCollator's keyword arguments for this rank."""
        state = self.parallel_state
        return {"sp_size": state.sp_size, "sp_rank": state.sp_rank}

    def build_collator(self):
        """Samples -> one packed micro-batch (the DPO trainer packs pairs with its own)."""
        return MainCollator(max_seq_len=self.args.data.max_seq_len, **self.collate_fn_kwargs())

    def build_evaluator(self, dataset, loader, collate) -> Evaluator:
        """The held-out loss, through this trainer's LM loss (no auxiliary losses)."""

        def stats(micro_batch):  # [loss sum, loss tokens]
            loss = self.lm_loss(self._to_device(micro_batch)).loss_sum.double()
            return torch.stack([loss, loss.new_tensor(count_loss_tokens(micro_batch["labels"]))])

        state, steps = self.parallel_state, self.args.train.eval_steps
        return Evaluator(dataset, loader, collate, stats, ("loss",), "tokens", self.model, state, self.device, steps)

    def build_optimizer(self) -> None:
        opt = self.args.train.optimizer
        kwargs = {k: getattr(opt, k) for k in ("lr", "weight_decay", "betas", "eps")}
        if opt.type != "anyprecision_adamw":
            kwargs["fused"] = opt.fused
        if opt.type == "muon":  # the muon_* keys are Muon's (its AdamW sibling group takes the keys above)
            kwargs.update({k: v for k, v in dataclasses.asdict(opt).items() if k.startswith("muon_")})
        self.optimizer = build_optimizer(self.model, optimizer_type=opt.type, **kwargs)
        keys = ("lr", "lr_min", "lr_decay_style", "lr_decay_ratio", "lr_warmup_ratio", "lr_start")
        schedule = {k: getattr(opt, k) for k in keys}
        self.lr_scheduler = build_lr_scheduler(self.optimizer, train_steps=self.total_steps, **schedule)

    def build_callbacks(self) -> List[Callback]:
        return standard_callbacks(self)  # metrics.jsonl, progress, plots, samples, best eval, wandb/TensorBoard

    # -------------------------------------------------------------------------------------------- step
    def _to_device(self, micro_batch: Dict[str, Any]) -> Dict[str, Any]:
        # pinned host memory makes the copy truly asynchronous on CUDA (on CPU there is nothing to copy)
        pin = self.device.type == "cuda"
        on_device = {
            k: (v.pin_memory() if pin else v).to(self.device, non_blocking=True) if torch.is_tensor(v) else v
            for k, v in micro_batch.items()
            if k != "shift_labels"  # (transformers' name for the labels: the trainer reads `labels`)
        }
        # counted on the loader's host copy, so the chunked loss selects its rows without a device sync
        on_device["num_loss_tokens"] = host_loss_tokens(micro_batch)
        return on_device

    def lm_loss(self, micro_batch: Dict[str, Any]) -> LossOutput:
        """The language-model loss of one micro-batch (on the device): its token sum, loss tokens, model outputs."""
        inputs = {k: v for k, v in micro_batch.items() if k not in self.non_model_keys}
        num_loss_tokens = micro_batch.get("num_loss_tokens")
        return self.loss_module(micro_batch["labels"], num_loss_tokens=num_loss_tokens, **inputs, use_cache=False)

    def forward_loss_sum(self, micro_batch: Dict[str, Any]) -> torch.Tensor:
        """Summed training loss of one micro-batch: the LM loss, plus the MoE load-balancing loss of a model that
        returns router logits (per document, so no layout moves it). Override for custom losses."""
        out = self.lm_loss(micro_batch)
        router_logits = getattr(out.outputs, "router_logits", None)
        if not router_logits:
            return out.loss_sum
        config, state = self.model.config, self.parallel_state
        group = state.sp_group if state.sp_enabled else None  # a document's statistics summed over its shards
        labels, position_ids = micro_batch["labels"], micro_batch.get("position_ids")
        aux_sum = load_balancing_loss_sum(router_logits, config.num_experts_per_tok, labels, position_ids, group)
        self.moe_metrics.add_aux(aux_sum)  # logged as aux_loss, beside the LM loss
        return out.loss_sum + config.router_aux_loss_coef * aux_sum

    def _step_totals(self, micro_batches: Optional[List[Dict[str, Any]]]) -> Optional[Dict[str, Any]]:
        """Global loss tokens and input tokens of this step, and the stop signal any rank got (None: none); None
        when any rank has run out of data.

        The same all-reduce carries the stop requests (SIGINT/SIGTERM/SIGHUP) of every rank, so all ranks agree, at no
        extra cost, to make this step their last. It runs on a gloo group in host memory: the loop's decisions are
        read on the host, and a read of an accelerator's all-reduce would wait for the previous step's kernels.
        """
        # a short last batch (streamed data without drop_last) counts as out of data: each micro-batch's backward
        # issues its own FSDP reduce-scatters, so every rank must run the same number of them
        have = micro_batches is not None and len(micro_batches) == self.args.train.dataloader_batch_size
        loss_tokens = sum(host_loss_tokens(mb) for mb in micro_batches) if have else 0
        tokens = sum(mb["input_ids"].numel() for mb in micro_batches) if have else 0
        asked = lifecycle.stop_requested()
        stops = [int(asked == sig) for sig in lifecycle.STOP_EXIT_CODES]  # which stop signal this rank got
        stats = torch.tensor([loss_tokens, tokens, int(have), *stops], dtype=torch.float64)  # in host memory
        lifecycle.set_progress(self.global_step + 1, "all-reduce of the step's token counts")
        group = self.host_group.get()  # made on first use, by every rank alike
        dist.all_reduce(stats, group=group)
        lifecycle.set_progress(self.global_step + 1, "forward/backward and optimizer step")
        # every rank of the group counted; tensor-parallel ranks hold copies of their data rank's tokens
        copies = dist.get_world_size(group) // self.parallel_state.dp_sp_size
        loss_tokens, tokens, ranks_with_data, *stop_counts = stats.tolist()
        # every rank reaches the same verdict from the same sums: the first signal by precedence that any rank got
        seen = [sig for sig, count in zip(lifecycle.STOP_EXIT_CODES, stop_counts) if count > 0]
        if ranks_with_data < dist.get_world_size(group):
            return None
        return {
            "loss_tokens": int(loss_tokens) // copies,
            "tokens": int(tokens) // copies,
            "stop": seen[0] if seen else None,
        }

    def train_step(self, micro_batches: List[Dict[str, Any]], totals: Dict[str, Any]) -> Dict[str, Any]:
        """One optimizer step, queued on the device. Returns its metrics: host values, and device tensors that the
        loop reads a step later (loss, grad_norm, MoE statistics; `skipped` is derived from the first two)."""
        state = self.parallel_state
        loss_sum = self.accumulate_gradients(micro_batches, totals)
        lifecycle.set_progress(self.global_step + 1, "grad-norm and loss all-reduce")
        grad_norm = clip_grad_norm_tensor(self.model, self.args.train.optimizer.max_grad_norm)
        loss_sum = self.moe_metrics.all_reduce(loss_sum, state.dp_sp_group)  # the MoE metrics' sums ride along
        loss = loss_sum / max(totals["loss_tokens"], 1)
        lr = self.lr_scheduler.get_last_lr()[0]
        # a MultiOptimizer also logs each inner optimizer's lr of this step (lr_adamw, lr_muon)
        named = getattr(self.optimizer, "named_lrs", None)
        group_lrs = {f"lr_{name}": value for name, value in named().items()} if named else {}
        self._guarded_optimizer_step(loss, grad_norm)
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": loss, "grad_norm": grad_norm, "lr": lr, **group_lrs, **self.moe_metrics.step_tensors()}

    def accumulate_gradients(self, micro_batches: List[Dict[str, Any]], totals: Dict[str, Any]) -> torch.Tensor:
        """The step's forward/backward over its micro-batches; returns this rank's summed loss (float64)."""
        state = self.parallel_state
        # FSDP/DDP average gradients over the dp x sp ranks; each rank's summed loss over the global token count
        scale = state.dp_sp_size / max(totals["loss_tokens"], 1)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.moe_metrics.start_step()
        on_device = [self._to_device(mb) for mb in micro_batches]  # all copies queued before the first forward
        for i, micro_batch in enumerate(on_device):
            if state.mode == "ddp":  # all-reduce gradients once per step, on the last micro-batch
                self.model.set_requires_gradient_sync(i == len(micro_batches) - 1)
            micro_loss = self.forward_loss_sum(micro_batch)
            (micro_loss * scale).backward()
            loss_sum += micro_loss.detach().double()
        return loss_sum

    def _guarded_optimizer_step(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """The update, unless the loss or the grad norm is not finite. A fused AdamW skips it on the device (its
        `found_inf` flag, as under GradScaler: parameters, moments and step count untouched), so nothing waits; the
        loop reports the skip (or raises) when it reads the step's metrics, before anything is saved. Other
        optimizers read the flag on the host first (a sync)."""
        finite = torch.isfinite(loss) & torch.isfinite(grad_norm.to(loss.device))
        if skips_on_found_inf(self.optimizer):
            set_found_inf(self.optimizer, (~finite).to(torch.float32))
            try:
                self.optimizer.step()
            finally:
                set_found_inf(self.optimizer, None)
        elif bool(finite):
            self.optimizer.step()

    def evaluate(self) -> Dict[str, Any]:
        return self.evaluator.evaluate(self.global_step)

    def save_checkpoint(self) -> None:
        self.checkpointer.save()

    # --------------------------------------------------------------------------------------------- loop
    def _fire(self, event: str, *extra) -> None:
        for callback in self.callbacks:
            getattr(callback, event)(self, *extra)

    def fit(self) -> None:
        """Train to the end; on an agreed stop request, save and raise `lifecycle.TrainingStopped` on every rank."""
        lifecycle.set_loop_active(True)
        try:
            self._fit()
        except BaseException:
            self.run_dir.release()  # nothing more of this run will be written
            raise
        finally:
            lifecycle.set_loop_active(False)
            self.host_group.close()
            close_loader(self.train_dataloader)  # a stop or an error leaves the epoch's iterator mid-way

    def _fit(self) -> None:
        self._fire("on_train_begin")
        pending = None  # the previous step's metrics, read once this step is queued: the device never waits
        for micro_batches, totals in self._steps():
            step = self._timed_step(micro_batches, totals)
            if pending is not None:
                self._publish(pending)
            pending = step
            save_steps = self.args.train.checkpoint.save_steps
            save = save_steps > 0 and self.global_step % save_steps == 0
            stop = totals["stop"] is not None and self.global_step < self.total_steps  # at the end: just finish
            evaluate = self.evaluator is not None and self.evaluator.due(self.global_step, self.total_steps)
            if save or stop or evaluate or self.global_step >= self.total_steps:  # read now: nothing waits behind it
                pending, step = None, pending
                self._publish(step, self.evaluate() if evaluate else {})
            if save:
                self.save_checkpoint()
            if stop:
                self._stop_after_step(totals["stop"])
        if pending is not None:  # the data ran out after it
            self._publish(pending)
        self._finish()

    def _publish(self, pending: PendingMetrics, extra: Optional[Dict[str, Any]] = None) -> None:
        """A step's metrics read on the host: a non-finite step is reported (or raised) here, then the callbacks."""
        metrics = pending.resolve()
        metrics.update(extra or {})
        if metrics["skipped"]:
            message = f"non-finite loss {metrics['loss']} or grad norm {metrics['grad_norm']} at step {metrics['step']}"
            if not self.args.train.skip_nonfinite_steps:
                raise NonFiniteError(message + " (set train.skip_nonfinite_steps to skip such steps)")
            logger.warning(message + ": step skipped")
        self._fire("on_step_end", metrics)

    def _steps(self):
        """(micro-batches, totals) of every step left to run, epoch after epoch; an epoch ends at its planned steps
        or where its data does (the same step on every rank)."""
        state = self.state
        for epoch in range(state.epoch, self.args.train.num_train_epochs):
            state.epoch = epoch
            set_epoch(self.train_dataloader, epoch, state.global_step - state.epoch_step)
            rng = torch.get_rng_state()  # a new loader iterator draws its worker seed from the global generator:
            data_iterator = iter(self.train_dataloader)  # continues mid-epoch after a resume
            torch.set_rng_state(rng)  # keep that draw out of the training stream, so a resume replays dropout exactly
            while state.epoch_step < self.epoch_steps[epoch] and state.global_step < self.total_steps:
                lifecycle.set_progress(state.global_step + 1, "loading the next batch")
                micro_batches = next(data_iterator, None)
                totals = self._step_totals(micro_batches)
                if totals is None:
                    logger.info(f"epoch {epoch} ran out of data at step {state.global_step}")
                    self.data_ran_out = True
                    break
                yield micro_batches, totals
            if state.global_step >= self.total_steps:
                return
            state.epoch_step = 0

    def _timed_step(self, micro_batches, totals) -> PendingMetrics:
        metrics, seconds = timed(self.device, lambda: self.train_step(micro_batches, totals))
        state = self.state
        state.global_step += 1
        state.epoch_step += 1
        state.consumed_tokens += totals["tokens"]
        metrics.update(
            step=state.global_step,
            epoch=state.epoch,
            tokens=totals["tokens"],
            loss_tokens=totals["loss_tokens"],
            consumed_tokens=state.consumed_tokens,
        )
        device = {k: v for k, v in metrics.items() if torch.is_tensor(v)}
        host = {k: v for k, v in metrics.items() if not torch.is_tensor(v)}
        return PendingMetrics(host, device, seconds, lambda m: self._finish_metrics(m, totals))

    def _finish_metrics(self, metrics: Dict[str, Any], totals: Dict[str, Any]) -> None:
        """The values derived from a step's metrics once they are on the host, in place."""
        metrics["skipped"] = not (math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"]))
        metrics["tokens_per_sec"] = totals["tokens"] / metrics["step_time"]
        self.moe_metrics.finish(metrics, totals["loss_tokens"])

    def _finish(self) -> None:
        """After the last step: the final checkpoint, the HF export, the callbacks' end (every rank alike)."""
        close_loader(self.train_dataloader)  # its workers are done; the final save still reads its position
        lifecycle.set_training_done()  # a stop from here on lets the final save and export finish
        if self.global_step == 0:  # the same on every rank: all raise together, and nothing is saved
            raise RuntimeError(
                f"no training step ran: data.train_path={self.args.data.train_path} did not fill one optimizer step "
                f"of train.global_batch_size={self.args.train.global_batch_size}; use more data or smaller batches"
            )
        self._save_last_step()
        if self.args.train.checkpoint.save_hf_weights:
            self.export_hf(os.path.join(self.output_dir, "hf"))
            if self.is_main:  # the export is served with the template the model was trained on
                export_chat_template(os.path.join(self.output_dir, "hf"), self.training_chat_template)
        self.on_train_end()
        self._fire("on_train_end")
        dist.barrier()

    def _stop_after_step(self, signal) -> None:
        """Every rank saw the same stop verdict in this step's all-reduce: save together and leave."""
        lifecycle.set_progress(self.global_step, "saving the checkpoint on stop")
        self._save_last_step()
        self._fire("on_train_end")
        dist.barrier()
        saved = os.path.join(self.checkpointer.root, f"global_step_{self.global_step}")
        hint = "run the same command to resume"
        if self.args.train.checkpoint.load_path != "auto":
            hint = "resume with the same command plus --train.checkpoint.load_path auto"
        raise lifecycle.TrainingStopped(signal, self.global_step, saved, hint)

    def _save_last_step(self) -> None:
        """The checkpoint of the step the loop ended at (unless it is saved already), written to the end."""
        if self.state.last_saved_step != self.global_step:
            self.save_checkpoint()
        self.checkpointer.wait()

    def export_hf(self, out_dir: str) -> None:
        """The end-of-training HF folder: the whole model, or with LoRA the merged weights or the adapter."""
        lora, tokenizer = self.args.model.lora, self.args.model.tokenizer_path
        if lora.enable:
            save_lora_model(self.model, out_dir, tokenizer, lora.export)
        else:
            save_hf_model(self.model, out_dir, tokenizer)

    def on_train_end(self) -> None:
        """Hook for subclasses, called on every rank before the callbacks' on_train_end."""
