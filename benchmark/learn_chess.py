"""Does the model learn chess? One CPU run of the real step script, from ~2% legal moves to over half.

    .venv/bin/python benchmark/learn_chess.py               # the full run: about 15 minutes on 2 CPU cores
    .venv/bin/python benchmark/learn_chess.py --quick       # a few steps, seconds (the test)

It builds what it needs under --out: a Llama model of the shape below with the demo's one-token-per-move
tokenizer (random weights, seed 0), and a data folder from the games shipped in 01_download/: the
held-out evaluation games are the last --validation_games of chess_sample.parquet (the demo's own
validation games), and the training games are the rest of that sample plus chess_learn.parquet (made
by make_chess_sample.py with another seed; see its docstring), less any game that equals an
evaluation game. Then it trains with 02_singlegpu/train.py as a user would (or 03_ddp/train.py
under torchrun with --nproc 2), evaluating the legal-move rate every --eval_every steps on
--eval_games held-out prefixes (the step script's own evaluation), and writes into --out:

    legal_moves.png   the legal-move rate (and the validation loss) against the tokens seen
    legal_moves.md    the same as a table, with the command, the recipe and the wall time
    legal_moves.json  the points of the curve, the final rate, the wall time

The wall time counts everything this command does (building the model and the data, tokenizing,
training, evaluating, plotting); the shipped games are not generated again.
"""
import ast
import json
import os
import platform
import resource
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common.arguments import REPO, Parser
from common.errors import UserError, exit_on_user_error
from common.steps import load_script

SAMPLE = REPO / "01_download" / "chess_sample.parquet"
LEARN_GAMES = REPO / "01_download" / "chess_learn.parquet"
SCRIPTS = {1: REPO / "02_singlegpu" / "train.py", 2: REPO / "03_ddp" / "train.py"}

# --quick: the same path end to end, on a few games with a few steps; nothing about the rate.
QUICK = {"train_games": 300, "max_steps": 6, "eval_every": 3, "eval_games": 8, "eval_rows": 8,
         "total_batch_size": 4, "batch_size_per_device": 4, "max_seq_length": 64}


def download_module():
    return load_script("01_download/download.py")


def build_model(folder, args):
    """The demo's tokenizer and a Llama of the chosen shape, random weights from --seed."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    tokenizer = download_module().build_move_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=args.hidden_size,
                         intermediate_size=args.intermediate_size, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.heads,
                         max_position_embeddings=max(1024, args.max_seq_length), rms_norm_eps=1e-5,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def build_data(folder, args):
    """train.jsonl and validation.jsonl from the shipped games; no evaluation game is trained on."""
    games_from_parquet = download_module().games_from_parquet
    sample = games_from_parquet(SAMPLE)
    if args.validation_games >= len(sample):
        raise UserError(f"--validation_games {args.validation_games}: the sample holds only {len(sample)} games")
    validation = sample[-args.validation_games:]
    extra = games_from_parquet(args.learn_games) if args.learn_games else []
    candidates = sample[:-args.validation_games] + extra
    held_out = set(validation)
    train = [game for game in candidates if game not in held_out]
    if args.train_games:
        train = train[: args.train_games]
    folder.mkdir(parents=True, exist_ok=True)
    for name, games in (("train", train), ("validation", validation)):
        with (folder / f"{name}.jsonl").open("w", encoding="utf-8") as out:
            out.writelines(json.dumps({"text": game}) + "\n" for game in games)
    return {"train_games": len(train), "distinct_train_games": len(set(train)),
            "dropped_as_held_out": len(candidates) - len([g for g in candidates if g not in held_out]),
            "validation_games": len(validation), "train_moves": sum(len(g.split()) for g in train)}


def train_command(args, model_dir, data_dir, run_dir):
    script = SCRIPTS[args.nproc]
    if args.nproc == 1:
        launcher = [sys.executable, str(script)]
    else:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
                    str(script)]
    options = {"model": model_dir, "data_dir": data_dir, "output_dir": run_dir,
               "prepared_dir": Path(args.out) / "prepared", "total_batch_size": args.total_batch_size,
               "batch_size_per_device": args.batch_size_per_device, "max_seq_length": args.max_seq_length,
               "learning_rate": args.learning_rate, "warmup_steps": args.warmup_steps, "max_steps": args.max_steps,
               "weight_decay": args.weight_decay, "eval_every": args.eval_every, "eval_games": args.eval_games,
               "eval_rows": args.eval_rows, "seed": args.seed, "device": "cpu"}
    command = launcher + [f"--{k}={v}" for k, v in options.items() if v is not None] + ["--overwrite"]
    return command + (["--no_packing"] if args.no_packing else [])


def curve(run_dir, untrained_rate, untrained_loss):
    """(tokens seen, seconds since the run started, step, eval loss, legal-move rate) at each evaluation."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    points, seen = [(0, 0.0, 0, untrained_loss, untrained_rate)], 0
    for record in records:
        seen += record["tokens"]
        if "legal_move_rate" in record:
            points.append((seen, record["since_start_s"], record["step"], record["eval_loss"],
                           record["legal_move_rate"]))
    return points


def untrained_figures(output):
    """The step script prints `untrained model: {...}` before the first step."""
    for line in output.splitlines():
        if line.startswith("untrained model: "):
            figures = ast.literal_eval(line.split(": ", 1)[1])  # {'eval_loss': ..., 'legal_move_rate': ...}
            return figures["legal_move_rate"], figures["eval_loss"]
    raise UserError("the training output has no `untrained model:` line: did the step script change?")


def plot(points, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tokens = [p[0] / 1e6 for p in points]
    figure, rate_axis = plt.subplots(figsize=(7, 4.2))
    rate_axis.plot(tokens, [100 * p[4] for p in points], "o-", color="tab:blue", label="legal moves (%)")
    rate_axis.axhline(50, color="tab:blue", linestyle=":", linewidth=1)
    rate_axis.set_xlabel("tokens seen (millions)")
    rate_axis.set_ylabel("legal greedy moves on held-out positions (%)", color="tab:blue")
    rate_axis.set_ylim(0, 100)
    loss_axis = rate_axis.twinx()
    loss_axis.plot(tokens, [p[3] for p in points], "s--", color="tab:orange", markersize=3, label="validation loss")
    loss_axis.set_ylabel("validation loss", color="tab:orange")
    rate_axis.set_title(title, fontsize=9)
    rate_axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def table(points, recipe, command, wall_s, cpu_s, final_rate, load):
    lines = [f"Legal greedy moves on held-out positions: {100 * points[0][4]:.1f}% untrained, "
             f"{100 * final_rate:.1f}% after {points[-1][0]:,} tokens; wall time {wall_s:.0f} s "
             f"(everything the command does; CPU time {cpu_s:.0f} s), load average before/after {load}.",
             "",
             f"Command: `{command}`", "", f"Recipe: {recipe}", "",
             "| step | tokens seen | time (s) | validation loss | legal moves |",
             "|---:|---:|---:|---:|---:|"]
    for seen, seconds, step, loss, rate in points:
        lines.append(f"| {step} | {seen:,} | {seconds:.0f} | {loss:.3f} | {100 * rate:.1f}% |")
    return "\n".join(lines) + "\n"


def load_average():
    return "/".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"


def parse_arguments(argv=None):
    parser = Parser(__doc__.split("\n\n")[0])
    parser.add("out", default=str(REPO / "runs" / "learn_chess"), help="model, data, run and results go here")
    parser.add("quick", action="store_true", help="a few steps on a few games (seconds); says nothing about learning")
    parser.add("nproc", type=int, choices=[1, 2], default=1,
               help="1: 02_singlegpu/train.py; 2: 03_ddp/train.py under torchrun with 2 ranks")
    parser.add("threads", type=int, default=None,
               help="OMP_NUM_THREADS per process (default: the usable cores / --nproc)")
    parser.add("learn_games", default=str(LEARN_GAMES), help="extra training games ('' for the sample only)")
    parser.add("train_games", type=int, default=0, help="use only the first N training games (0: all)")
    parser.add("validation_games", type=int, default=200, help="held-out games: the last N of the sample")
    parser.add("hidden_size", type=int, default=256)
    parser.add("intermediate_size", type=int, default=688)
    parser.add("layers", type=int, default=4)
    parser.add("heads", type=int, default=4)
    parser.add("total_batch_size", type=int, default=16)
    parser.add("batch_size_per_device", type=int, default=None,
               help="rows per forward pass (default: --total_batch_size / --nproc, no accumulation)")
    parser.add("max_seq_length", type=int, default=256)
    parser.add("no_packing", action="store_true")
    parser.add("learning_rate", type=float, default=3e-3)
    parser.add("warmup_steps", type=int, default=None)
    parser.add("weight_decay", type=float, default=0.0)
    parser.add("max_steps", type=int, default=1000)
    parser.add("eval_every", type=int, default=100)
    parser.add("eval_games", type=int, default=200)
    parser.add("eval_rows", type=int, default=16)
    parser.add("seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
        args.nproc = 1
    if args.batch_size_per_device is None:
        args.batch_size_per_device = max(1, args.total_batch_size // args.nproc)
    return args


def main():
    args = parse_arguments()
    began, load_before = time.time(), load_average()
    out = Path(args.out)
    if args.learn_games and not Path(args.learn_games).is_file():
        raise UserError(f"{args.learn_games} does not exist: it ships with the repo (or make it with the command in "
                        "01_download/make_chess_sample.py's docstring), or pass --learn_games ''")
    model_dir, data_dir, run_dir = out / "model", out / "data", out / "run"
    shutil.rmtree(model_dir, ignore_errors=True)
    parameters = build_model(model_dir, args)
    data = build_data(data_dir, args)
    print(f"model: {parameters / 1e6:.2f}M parameters ({args.layers} layers, hidden {args.hidden_size}) in "
          f"{model_dir}\ndata: {data['train_games']:,} training games ({data['train_moves']:,} moves; "
          f"{data['dropped_as_held_out']} dropped as equal to a held-out game), {data['validation_games']} held-out "
          f"games in {data_dir}", flush=True)

    command = train_command(args, model_dir, data_dir, run_dir)
    threads = args.threads or max(1, len(os.sched_getaffinity(0)) // args.nproc)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    print("$ " + shlex.join(command), flush=True)
    lines = []
    with subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          bufsize=1) as training, (out / "train.log").open("w") as log:
        for line in training.stdout:  # the evaluations as they come; the progress bar only into train.log
            log.write(line)
            lines.append(line.rstrip("\n"))
            if line.startswith(("step ", "untrained", "prepared")):
                print("  " + line.rstrip(), flush=True)
    output = "\n".join(lines)
    if training.returncode != 0:
        raise UserError(f"training failed ({training.returncode}); the last lines (all in {out / 'train.log'}):\n"
                        + "\n".join(lines[-15:]))

    points = curve(run_dir, *untrained_figures(output))
    final_rate, last_step = points[-1][4], points[-1][2]
    if last_step != args.max_steps:
        print(f"warning: the run stopped at step {last_step} of {args.max_steps}", flush=True)
    wall_s = time.time() - began
    # CPU seconds of this command and every process it ran, all cores together: on a shared machine,
    # where the wall time says more about the neighbours, this says what the run itself cost
    cpu_s = sum(usage.ru_utime + usage.ru_stime for usage in map(resource.getrusage, (resource.RUSAGE_SELF,
                                                                                     resource.RUSAGE_CHILDREN)))
    load = f"{load_before} / {load_average()}"
    recipe = (f"{parameters / 1e6:.2f}M-parameter Llama ({args.layers} layers, hidden {args.hidden_size}, MLP "
              f"{args.intermediate_size}, {args.heads} heads); {data['train_games']:,} training games "
              f"({data['train_moves']:,} moves), {data['validation_games']} held-out, {args.eval_games} prefixes "
              f"evaluated; {args.max_steps} steps of {args.total_batch_size} rows x {args.max_seq_length} tokens"
              f"{' (unpacked)' if args.no_packing else ''}, lr {args.learning_rate:g}; {args.nproc} process"
              f"{'es' if args.nproc > 1 else ''} x {threads} threads; {platform.processor() or platform.machine()}")
    invocation = shlex.join([Path(sys.executable).name, *sys.argv])
    out.mkdir(parents=True, exist_ok=True)
    plot(points, out / "legal_moves.png",
         f"{parameters / 1e6:.1f}M Llama, {data['train_games']:,} games, {last_step} steps: "
         f"{100 * final_rate:.0f}% legal after {wall_s / 60:.1f} min")
    (out / "legal_moves.md").write_text(table(points, recipe, invocation, wall_s, cpu_s, final_rate, load))
    (out / "legal_moves.json").write_text(json.dumps(
        {"legal_move_rate": final_rate, "legal_move_rate_untrained": points[0][4], "wall_s": round(wall_s, 1),
         "cpu_s": round(cpu_s, 1),
         "load_average": load, "recipe": recipe, "data": data, "command": invocation,
         "points": [dict(zip(("tokens", "seconds", "step", "eval_loss", "legal_move_rate"), p)) for p in points]},
        indent=1) + "\n")
    print(f"\nlegal moves: {100 * points[0][4]:.1f}% untrained -> {100 * final_rate:.1f}% after {points[-1][0]:,} "
          f"tokens\nwall time: {wall_s:.0f} s (CPU time {cpu_s:.0f} s; load average {load})\n"
          f"plot: {out / 'legal_moves.png'}\ntable: {out / 'legal_moves.md'}", flush=True)


if __name__ == "__main__":
    exit_on_user_error(main)
