"""Step 6: tensor parallelism inside a node, FSDP across nodes: the model split two ways (2-D).

    torchrun --nproc-per-node 4 06_tp/train.py --tp_size 2 --output_dir runs/tp

FSDP shards the state, but every rank still runs whole layers on its own rows: each keeps a whole
layer's activations, and more GPUs only mean a bigger global batch. Tensor parallelism splits each
layer's matrices over a group of --tp_size ranks (the GPUs of one node, on their fast links): each
rank computes its share of the heads and of the MLP for the group's rows, and keeps its share of
the activations. FSDP then shards over the other dimension of the mesh, across the groups, exactly
as in step 4. The data, loss and optimiser step are those of steps 2 to 4.
"""
import gc
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               loss_parallel, parallelize_module)
from tqdm import tqdm

from common import checkpoint
from common.arguments import check_arguments, training_arguments
from common.batch import describe, gradient_accumulation_steps
from common.chess_eval import Evaluation
from common.data import count_loss_tokens, loss_sum, training_data
from common.device import pick_device
from common.errors import UserError, exit_on_user_error
from common.hang import Watchdog
from common.metrics import MetricsLog
from common.model import load_model_files
from common.optim import make_optimizer, make_scheduler
from common.output_dir import OutputDir, run_settings
from common.profiling import StepProfiler
from common.process_group import init_process_group
from common.sharded_loading import load_sharded_model
from common.signals import StopFlag
from common.speed import prepare_layers
from common.tensor_parallel import check_step_arguments, tp_size_for, whole_logits_outside_training

# FSDP's strategies over the data-parallel dimension, as in step 4 (the mesh's other dimension
# takes HYBRID_SHARD's place: the node's GPUs split the layers instead of holding replicas):
#   FULL_SHARD    (ZeRO-3) free each layer's gathered weights after its forward, gather them again
#                 in backward. Least memory.
#   SHARD_GRAD_OP (ZeRO-2) keep the gathered weights from forward to backward: one all-gather less.
STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP"]
PRECISIONS = {"bf16": torch.bfloat16, "fp32": torch.float32}


def build_mesh(device_type, world_size, tp_size):
    """The ranks as a 2-D mesh: rows of tp_size consecutive ranks (torchrun numbers a node's GPUs
    consecutively, so a row is inside a node) split each layer; FSDP shards down the columns,
    across the rows (across nodes). 4 ranks at --tp_size 2: tp groups {0, 1}, {2, 3}; dp {0, 2}, {1, 3}."""
    return init_device_mesh(device_type, (world_size // tp_size, tp_size), mesh_dim_names=("dp", "tp"))


def decoder_layers(model):
    """The repeated blocks FSDP shards one by one: `model.model.layers` in Llama and the other
    Hugging Face decoders laid out like it (Mistral, Qwen2, Gemma, Phi-3, ...)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise UserError(f"{type(model).__name__} keeps no decoder layers at model.model.layers: step 4 shards "
                        "Llama-style models (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, ...)")
    return layers


def layer_plan(first):
    """How one decoder layer is split over a tensor-parallel group. Colwise: a rank keeps some output
    columns (q/k/v: its heads; gate/up: its part of the MLP) and computes them from the whole input,
    with no communication; the attention and the SiLU then run on its heads and its part alone.
    Rowwise: o and down take the matching input rows and each rank's product is a partial sum of
    the output, which a reduce-scatter adds up and splits by sequence (sequence parallelism): the
    norms and the residual stream run on 1/tp of the tokens, and an all-gather makes the sequence
    whole again before the next colwise matrices. Per layer in forward: 2 all-gathers + 2
    reduce-scatters, the same bytes as the 2 all-reduces of plain tensor parallelism, with 1/tp of
    the norms' and the residual stream's activations. The first layer cuts its whole input."""
    return {
        **({"": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                   use_local_output=False)} if first else {}),
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                        desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }


# The rest of the model: the embedding split by its hidden columns (made whole for the first
# layer), the final norm on sequence shards, lm_head by vocabulary (the loss runs on the parts).
ROOT_PLAN = {"model.embed_tokens": ColwiseParallel(output_layouts=Replicate()),
             "model.norm": SequenceParallel(),
             "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}


def parallelize_and_shard(model, mesh, strategy, mp_policy):
    """Step 6's lesson in one function. First tensor parallelism over mesh["tp"] (inside a node):
    every decoder layer split by layer_plan, then the rest by ROOT_PLAN. Then FSDP over mesh["dp"]
    (across nodes), bottom-up as in step 4: each layer one unit, gathered just before it runs and
    freed after, then the root. FSDP shards the tensor-parallel shards: each rank keeps 1/world_size."""
    tp_mesh = mesh["tp"]  # one object for every layer: a compiled layer checks its inputs' mesh by identity
    for number, layer in enumerate(decoder_layers(model)):
        parallelize_module(layer, tp_mesh, layer_plan(first=number == 0))
    parallelize_module(model, tp_mesh, ROOT_PLAN)
    whole_logits_outside_training(model.lm_head)
    options = dict(mesh=mesh["dp"], mp_policy=mp_policy)
    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=strategy != "SHARD_GRAD_OP", **options)
    fully_shard(model, **options)


def parse_arguments(argv=None):
    parser = training_arguments(__doc__.split("\n\n")[0])
    parser.add("tp_size", type=int, default=None,
               help="ranks that split each layer (default: the GPUs of one node, 2 on the CPU, lowered to what the "
                    "model's heads and MLP divide by)")
    parser.add("sharding_strategy", choices=STRATEGIES, default="FULL_SHARD", help="see the table above")
    parser.add("precision", choices=list(PRECISIONS), default=None,
               help="compute dtype of the layers (default: bf16 on GPU, fp32 on CPU); weights and AdamW stay fp32")
    parser.add("accumulate_unsharded", action="store_true",
               help="with gradient accumulation: keep the gathered weights and full gradients on every rank between "
                    "micro-batches and communicate once per optimiser step (like DDP's no_sync): faster, more memory")
    args = parser.parse_args(argv)
    if args.tp_size is not None and args.tp_size < 1:
        raise UserError(f"--tp_size must be at least 1 (got {args.tp_size})")
    check_step_arguments(args)
    return args


def train_step(model, optimizer, micro_batches, args, device, dp_mesh):
    """One optimiser step on this rank's micro-batches; returns the step's tokens, summed loss and
    gradient norm. The plan check (tools/check_plan.py) runs steps 4 to 6's on fake tensors.
    A tensor-parallel group shares its micro-batches: the sums run over the data-parallel ranks, dp_mesh."""
    # Every token of the global batch weighs the same: divide each micro-batch's summed
    # loss by the token count of the whole global batch (all ranks), not by its own.
    step_tokens = sum(count_loss_tokens(batch) for batch in micro_batches).to(device)
    dist.all_reduce(step_tokens, group=dp_mesh.get_group())

    step_loss = torch.zeros((), device=device)
    for i, batch in enumerate(micro_batches):
        # FSDP reduce-scatters after each micro-batch, so gradients stay sharded; like DDP's no_sync,
        # --accumulate_unsharded keeps full gradients (and gathered weights) and communicates once.
        if args.accumulate_unsharded:
            last = i == len(micro_batches) - 1
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last)
        with loss_parallel():  # each rank's part of the logits; the softmax's sums are added over the group
            loss = loss_sum(model, batch).to_local()  # the group's loss, the same on each of its ranks
            # FSDP averages gradients over the data-parallel ranks; × their count turns that average into the sum.
            (loss * dp_mesh.size() / step_tokens).backward()
        step_loss += loss.detach()
    dist.all_reduce(step_loss, group=dp_mesh.get_group())

    # The parameters are DTensor shards; the norm comes back as a DTensor of the full norm.
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm).full_tensor().to(device)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return step_tokens, step_loss, grad_norm


def main():
    args = parse_arguments()
    check_arguments(args)
    # torchrun starts one process per GPU and tells each who it is.
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])  # this process's GPU on its node
    device = pick_device(args.device, local_rank)
    init_process_group(device, args.collective_timeout)
    is_main = rank == 0  # only rank 0 logs and saves
    output = OutputDir(args, is_main)  # one run at a time per output directory, which every node must see
    output_dir = output.run_dir  # what goes where: common/run_dir.py
    watchdog = Watchdog(output_dir.hang, args.collective_timeout, "loading")  # a hang ends the job, and says where
    torch.manual_seed(args.seed)

    # Model: fp32 weights, sharded. FSDP itself runs the layers in bf16 and reduces the gradients
    # in fp32 (MixedPrecisionPolicy); the sharded weights and AdamW's state stay fp32. Never cast
    # the model to bf16 before sharding: AdamW would then keep bf16 state.
    config, tokenizer, notation = load_model_files(args)  # and how the games are written: common/notation.py
    # Whole heads and equal parts of the MLP on every rank of a group (default: the GPUs of one node).
    tp_size = tp_size_for(args, config, world_size, int(os.environ["LOCAL_WORLD_SIZE"]), device.type == "cuda")
    dp_size = world_size // tp_size  # the ranks that see different rows: the global batch is split dp_size ways
    accumulation = gradient_accumulation_steps(args.total_batch_size, args.batch_size_per_device, dp_size,
                                               ranks="data-parallel groups")
    precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    mesh = build_mesh(device.type, world_size, tp_size)
    dp_rank, dp_group = mesh["dp"].get_local_rank(), mesh["dp"].get_group()
    mp_policy = MixedPrecisionPolicy(param_dtype=PRECISIONS[precision], reduce_dtype=torch.float32)

    def prepare_model(model):  # before sharding, so that FSDP's hooks stay outside the recomputation
        prepare_layers(model, args)  # --gradient_checkpointing, --compile: common/speed.py
        return model
    model = load_sharded_model(args.model, config, rank, device, prepare=prepare_model,
                               shard=lambda model: parallelize_and_shard(model, mesh, args.sharding_strategy,
                                                                         mp_policy),
                               trust_remote_code=args.trust_remote_code)
    if args.accumulate_unsharded and accumulation > 1:  # gather each layer once per optimiser step,
        model.set_reshard_after_forward(False)  # keep it until the last micro-batch's backward

    optimizer = make_optimizer(model, args)  # after sharding: it must see the sharded parameters
    scheduler = make_scheduler(optimizer, args)

    # Data: every optimiser step gets one global batch, of which each data-parallel rank takes its share,
    # the same for every rank of its tensor-parallel group. Each evaluates its share, then the sums are added up.
    with watchdog.unwatched("preparing the data"):  # hours for a big data set, and no collective in it
        train_rows, sampler = training_data(args, tokenizer, notation, dp_rank, dp_size)
        evaluation = Evaluation(args, tokenizer, notation, dp_rank, dp_size, ranks="data-parallel groups")

    # Every input is checked; only now does the run write (and --overwrite delete the old run).
    note = output.start(run_settings(args, "sharded", config, train_rows, precision=precision))
    if is_main:
        tqdm.write(describe(args.total_batch_size, args.batch_size_per_device, dp_size, accumulation,
                            devices="data-parallel groups")
                   + f", {args.sharding_strategy}; mesh {dp_size} × {tp_size}: tensor parallel over {tp_size} ranks")

    # Checkpoints: no rank holds the whole model, so every rank writes its own shards
    # (torch.distributed.checkpoint). The files don't depend on the mesh: a run saved on 2 × 2
    # ranks resumes on 1 × 4 or 4 × 1, each rank reading the pieces of its new shards. Rank 0 adds the config
    # and tokenizer, so that tools/export.py can turn a checkpoint into a Hugging Face model.
    def save_checkpoint(step):
        path = output_dir.checkpoint(step)
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        with checkpoint.sharded_save(path, state, is_main):  # refused at once if the disk is too full; all ranks fail
            dcp.save(state, checkpoint_id=path)
            if is_main:  # dcp.save has returned on every rank: all shards are on disk
                train = checkpoint.train_state(step, scheduler, {"untrained": untrained})
                torch.save(train, path / checkpoint.TRAIN_STATE)
                model.config.save_pretrained(path)
                tokenizer.save_pretrained(path)

    def load_checkpoint(path):
        nonlocal start_step, untrained
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        checkpoint.load_sharded(state, path)  # each rank reads what its shards need
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        train = checkpoint.load_file(path / checkpoint.TRAIN_STATE)
        scheduler.load_state_dict(train["scheduler"])
        checkpoint.restore_rng(train)
        start_step, untrained = train["step"], train["untrained"]

    start_step, untrained = 0, None
    if output.resume and (resumed_from := checkpoint.load_newest(output_dir, load_checkpoint)) and is_main:
        tqdm.write(f"resuming from {resumed_from}" + (f"\n{note}" if note else ""))
    # From here on SIGTERM (preemption, time limit), Slurm's USR2 warning and Ctrl-C make the run save
    # a checkpoint at the end of the step and stop (common/signals.py); the loader's workers leave it to the rank.
    stop = StopFlag(device)
    batches = sampler.batches(train_rows, start_step, tokenizer.pad_token_id, device, args.data_workers)

    def evaluate(stop_requested=None):
        """Validation loss and legal-move rate; None if every rank was asked to stop meanwhile."""
        model.eval()  # the logits made whole (whole_logits_outside_training)
        sums = evaluation.sums(model, device, stop_requested)
        model.train()
        if sums is None:
            return None
        dist.all_reduce(sums, group=dp_group)
        return evaluation.figures(sums)

    if untrained is None:
        watchdog.phase("untrained evaluation")
        untrained = evaluate()
        if is_main:
            tqdm.write(f"untrained model: {untrained}")
    metrics = MetricsLog(output_dir, is_main, args, model, world_size, accumulation, device, resumed_at=start_step)
    profiler = StepProfiler(args.profile_steps, output_dir.profile, start_step, device)
    if metrics.evaluation_missing():  # a stop came between the resumed step and its evaluation
        watchdog.phase("evaluation", start_step)
        metrics.add_evaluation(evaluate())
    progress = tqdm(range(start_step, args.max_steps), desc="train", initial=start_step, total=args.max_steps,
                    mininterval=1.0, disable=not is_main)
    for step in progress:
        watchdog.phase("training", step + 1)
        timer = metrics.timer()
        with timer.waiting_for_data():
            micro_batches = [{k: v.to(device, non_blocking=True) for k, v in next(batches).items()}
                             for _ in range(accumulation)]
        step_tokens, step_loss, grad_norm = train_step(model, optimizer, micro_batches, args, device, mesh["dp"])
        scheduler.step()

        # The step's one wait for the GPU: its figures, and whether any rank was asked to stop.
        tokens, loss_total, grad_norm, stopping = torch.stack([step_tokens, step_loss, grad_norm,
                                                               stop.any_rank()]).tolist()
        checkpoint.stop_if_not_finite(loss_total, step + 1, output_dir, model)  # the same verdict on every rank
        record = metrics.step_record(step + 1, tokens, loss_total, grad_norm, scheduler.get_last_lr()[0], timer)
        if not stopping and metrics.evaluates_at(step + 1):
            watchdog.phase("evaluation", step + 1)
            figures = evaluate(stop.requested)
            stopping = figures is None
            if figures:
                record.update(figures)
                if is_main:
                    tqdm.write(f"step {step + 1}: eval_loss={record['eval_loss']:.4f} "
                               f"legal_move_rate={record['legal_move_rate']:.3f}")
        save_now = (args.save_every and (step + 1) % args.save_every == 0) or step + 1 == args.max_steps or stopping
        if save_now:
            watchdog.phase("checkpoint", step + 1)
            record["checkpoint_save_s"] = timer.seconds(save_checkpoint, step + 1)
        metrics.write(record)
        profiler.step()
        if save_now and is_main:  # only now, with its step on record, does the checkpoint count
            checkpoint.mark_complete(output_dir, step + 1, args.keep_checkpoints)
        progress.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
        if stopping:
            metrics.close()
            watchdog.done()
            stop.say_saved(step + 1, output_dir)
            model = None  # as at the end of main
            gc.collect()
            dist.destroy_process_group()
            return
    watchdog.phase("final model")

    # The final model in Hugging Face format. Each rank holds only shards of shards, so gather the
    # full weights (to CPU, on rank 0 only; the other ranks get an empty dict) and let rank 0 write
    # them: a plain model, whole tensors, that loads anywhere.
    full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    peaks = [None] * world_size
    dist.all_gather_object(peaks, metrics.peak_memory())
    if is_main:
        with checkpoint.written_whole(output_dir.final) as final:  # beside final/, then moved in: never half-written
            model.save_pretrained(final, state_dict=full_state, safe_serialization=True)
            tokenizer.save_pretrained(final)
    metrics.finish("06_tp", untrained, peaks)
    # Free the sharded model while the process group is alive: freed the other way round, at exit,
    # a gloo group can deadlock or abort in its destructor (pytorch/pytorch#56297). FSDP modules
    # sit in reference cycles, so dropping the name is not enough: the garbage collector frees them.
    model = None
    gc.collect()
    watchdog.done()
    dist.destroy_process_group()


if __name__ == "__main__":
    exit_on_user_error(main, needs_torchrun=True)
