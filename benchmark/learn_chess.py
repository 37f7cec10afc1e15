"""Does the model learn chess? The built-in model, trained on a CPU, against its legal-move rate.

    python benchmark/learn_chess.py            # the full run: about 15 minutes on 2 CPU cores
    python benchmark/learn_chess.py --quick    # the same path in a few steps (seconds): the test

It builds under --out the demo's model (01_download/download.py --demo: the same tokenizer, shape
and seeded random weights) and a data folder from the games shipped in 01_download/. The held-out
games are the demo's own validation games, the last 200 of chess_sample.parquet; the training
games are the rest of that sample plus chess_learn.parquet (made by make_chess_sample.py with
another seed and the command in its docstring), less any game equal to a held-out one. Then it
trains with 03_ddp/train.py on 2 ranks (02_singlegpu/train.py with --nproc 1), exactly as a user
would, and the step script's own evaluation measures the legal-move rate every --eval_every steps:
the greedy next move after --eval_games held-out game prefixes, checked with python-chess.

Into --out it writes legal_moves.png (the legal-move rate and the validation loss against the
tokens seen), legal_moves.md (the same as a table, with the command, the recipe and the times) and
legal_moves.json. The wall time counts everything this command does; the games are not generated.
Measured 2026-11-24 on 2 cores: 0.5% -> 37.0% legal moves in 907 s (the target, 50%, is not reached).
"""
import ast
import json
import os
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

from common.arguments import REPO, Parser
from common.errors import UserError, exit_on_user_error
from common.steps import load_script

SAMPLE = REPO / "01_download" / "chess_sample.parquet"
LEARN_GAMES = REPO / "01_download" / "chess_learn.parquet"
VALIDATION_GAMES = 200  # the demo's: the last 200 games of the sample
SCRIPTS = {1: REPO / "02_singlegpu" / "train.py", 2: REPO / "03_ddp" / "train.py"}

# --quick: the whole path on a few games in a few steps; it says nothing about learning.
QUICK = {"train_games": 300, "max_steps": 6, "eval_every": 3, "eval_games": 8, "total_batch_size": 4,
         "batch_size_per_device": 2}


def build_model(folder, seed):
    """The built-in model, as `download.py --demo` builds it."""
    download = load_script("01_download/download.py")
    tokenizer = download.build_move_tokenizer()
    model = download.build_tiny_llama(tokenizer, seed)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def build_data(folder, learn_games, train_games):
    """train.jsonl and validation.jsonl; no held-out game is trained on."""
    download = load_script("01_download/download.py")
    sample = download.games_from_parquet(SAMPLE)
    validation = sample[-VALIDATION_GAMES:]
    held_out = set(validation)
    candidates = sample[:-VALIDATION_GAMES] + (download.games_from_parquet(learn_games) if learn_games else [])
    train = [game for game in candidates if game not in held_out]
    if train_games:
        train = train[:train_games]
    download.write_jsonl(train, folder / "train.jsonl")
    download.write_jsonl(validation, folder / "validation.jsonl")
    return {"train_games": len(train), "train_moves": sum(len(game.split()) for game in train),
            "validation_games": len(validation)}


def train_command(args, model_dir, data_dir, run_dir):
    if args.nproc == 1:
        launcher = [sys.executable, str(SCRIPTS[1])]
    else:
        launcher = [sys.executable, "-m", "common.torchrun", "--standalone", f"--nproc-per-node={args.nproc}",
                    str(SCRIPTS[2])]
    options = {"model": model_dir, "data_dir": data_dir, "output_dir": run_dir,
               "prepared_dir": Path(args.out) / "prepared", "total_batch_size": args.total_batch_size,
               "batch_size_per_device": args.batch_size_per_device, "max_seq_length": args.max_seq_length,
               "learning_rate": args.learning_rate, "max_steps": args.max_steps, "eval_every": args.eval_every,
               "eval_games": args.eval_games, "seed": args.seed, "device": "cpu"}
    # --no_packing: one game per row, from its first move, as the evaluation shows them; packed rows
    # start mid-game and run several games together (at step 100: 7% legal moves against 16%)
    return launcher + [f"--{name}={value}" for name, value in options.items()] + ["--no_packing", "--overwrite"]


def untrained_figures(output):
    """The step script prints `untrained model: {'eval_loss': ..., 'legal_move_rate': ...}` first."""
    for line in output.splitlines():
        if line.startswith("untrained model: "):
            figures = ast.literal_eval(line.split(": ", 1)[1])
            return figures["legal_move_rate"], figures["eval_loss"]
    raise UserError("the training output has no `untrained model:` line: did the step script change?")


def curve(run_dir, untrained_rate, untrained_loss):
    """(tokens seen, seconds since training started, step, validation loss, legal-move rate) at each evaluation."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    points, seen = [(0, 0.0, 0, untrained_loss, untrained_rate)], 0
    for record in records:
        seen += record["tokens"]
        if "legal_move_rate" in record:
            points.append((seen, record["since_start_s"], record["step"], record["eval_loss"],
                           record["legal_move_rate"]))
    return points


def plot(points, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tokens = [p[0] / 1e6 for p in points]
    figure, rate_axis = plt.subplots(figsize=(7, 4.2))
    rate_axis.plot(tokens, [100 * p[4] for p in points], "o-", color="tab:blue")
    rate_axis.axhline(50, color="tab:blue", linestyle=":", linewidth=1)
    rate_axis.set_xlabel("tokens seen (millions)")
    rate_axis.set_ylabel("legal greedy moves, held-out positions (%)", color="tab:blue")
    rate_axis.set_ylim(0, 100)
    loss_axis = rate_axis.twinx()
    loss_axis.plot(tokens, [p[3] for p in points], "s--", color="tab:orange", markersize=3)
    loss_axis.set_ylabel("validation loss", color="tab:orange")
    rate_axis.set_title(title, fontsize=9)
    rate_axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def table(points, summary):
    lines = [summary, "", "| step | tokens seen | training time (s) | validation loss | legal moves |",
             "|---:|---:|---:|---:|---:|"]
    lines += [f"| {step} | {seen:,} | {seconds:.0f} | {loss:.3f} | {100 * rate:.1f}% |"
              for seen, seconds, step, loss, rate in points]
    return "\n".join(lines) + "\n"


def load_average():
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def parse_arguments(argv=None):
    parser = Parser(__doc__.split("\n\n")[0])
    parser.add("out", default=str(REPO / "runs" / "learn_chess"), help="model, data, run and results go here")
    parser.add("quick", action="store_true", help="a few steps on a few games (seconds); says nothing about learning")
    parser.add("nproc", type=int, choices=[1, 2], default=2,
               help="2: 03_ddp/train.py on 2 ranks; 1: 02_singlegpu/train.py")
    parser.add("learn_games", default=str(LEARN_GAMES), help="games added to the sample's ('' for none)")
    parser.add("train_games", type=int, default=0, help="train on the first N games only (0: all)")
    parser.add("total_batch_size", type=int, default=16, help="rows per optimiser step")
    parser.add("batch_size_per_device", type=int, default=1,
               help="rows per forward pass; a pass pads its rows to the longest game, so fewer rows waste less")
    parser.add("max_seq_length", type=int, default=256, help="tokens per row: a longer game is cut")
    parser.add("learning_rate", type=float, default=3e-3, help="peak learning rate (cosine decay to 10%%)")
    parser.add("max_steps", type=int, default=2200)
    parser.add("eval_every", type=int, default=200)
    parser.add("eval_games", type=int, default=200, help="held-out game prefixes for the legal-move rate")
    parser.add("seed", type=int, default=0, help="the model's initialisation and the data order")
    args = parser.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    if args.learn_games and not Path(args.learn_games).is_file():
        raise UserError(f"{args.learn_games} does not exist: it ships with the repo (make it again with the command "
                        "in 01_download/make_chess_sample.py's docstring), or pass --learn_games ''")
    return args


def main():
    args = parse_arguments()
    began, load_before = time.time(), load_average()
    out = Path(args.out)
    model_dir, data_dir, run_dir = out / "model", out / "data", out / "run"
    parameters = build_model(model_dir, args.seed)
    data = build_data(data_dir, args.learn_games, args.train_games)
    print(f"model: the built-in {parameters / 1e6:.2f}M-parameter Llama in {model_dir}\n"
          f"data: {data['train_games']:,} training games ({data['train_moves']:,} moves), "
          f"{data['validation_games']} held-out games in {data_dir}", flush=True)

    command = train_command(args, model_dir, data_dir, run_dir)
    threads = max(1, len(os.sched_getaffinity(0)) // args.nproc)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    print("$ " + shlex.join(command), flush=True)
    lines = []
    with subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          bufsize=1) as training, (out / "train.log").open("w") as log:
        for line in training.stdout:  # the evaluations as they come; everything into train.log
            log.write(line)
            lines.append(line.rstrip("\n"))
            if line.startswith(("step ", "untrained", "prepared")):
                print("  " + line.rstrip(), flush=True)
    if training.returncode != 0:
        raise UserError(f"training failed (exit status {training.returncode}); its last lines (all in "
                        f"{out / 'train.log'}):\n" + "\n".join(lines[-15:]))

    points = curve(run_dir, *untrained_figures("\n".join(lines)))
    final_rate = points[-1][4]
    wall_s = time.time() - began
    # CPU seconds of this command and all it ran: on a shared machine the wall time also
    # says how busy the neighbours were
    cpu_s = sum(usage.ru_utime + usage.ru_stime
                for usage in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))
    load = f"{load_before} before, {load_average()} after"
    invocation = shlex.join(["python", os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]])
    summary = (f"`{invocation}`: the built-in {parameters / 1e6:.2f}M-parameter model; {data['train_games']:,} "
               f"training games ({data['train_moves']:,} moves); {args.max_steps} steps of {args.total_batch_size} "
               f"games (rows of up to {args.max_seq_length} tokens), peak learning rate {args.learning_rate:g}; "
               f"{args.nproc} process{'es' if args.nproc > 1 else ''} x {threads} thread{'s' if threads > 1 else ''}. "
               f"Legal greedy moves on {args.eval_games} held-out positions: {100 * points[0][4]:.1f}% untrained, "
               f"{100 * final_rate:.1f}% after {points[-1][0]:,} tokens. Wall time {wall_s:.0f} s for everything "
               f"(CPU time {cpu_s:.0f} s); load average {load}.")
    plot(points, out / "legal_moves.png", f"built-in {parameters / 1e6:.1f}M model, {data['train_games']:,} games: "
         f"{100 * final_rate:.0f}% legal after {wall_s / 60:.1f} min on the CPU")
    (out / "legal_moves.md").write_text(table(points, summary))
    (out / "legal_moves.json").write_text(json.dumps(
        {"legal_move_rate": final_rate, "legal_move_rate_untrained": points[0][4], "wall_s": round(wall_s, 1),
         "cpu_s": round(cpu_s, 1), "load_average": load, "command": invocation, "data": data,
         "points": [dict(zip(("tokens", "seconds", "step", "eval_loss", "legal_move_rate"), p)) for p in points]},
        indent=1) + "\n")
    print(f"\nlegal moves: {100 * points[0][4]:.1f}% untrained -> {100 * final_rate:.1f}% after {points[-1][0]:,} "
          f"tokens\nwall time: {wall_s:.0f} s (CPU time {cpu_s:.0f} s; load average {load})\n"
          f"plot: {out / 'legal_moves.png'}\ntable: {out / 'legal_moves.md'}", flush=True)


if __name__ == "__main__":
    exit_on_user_error(main)
